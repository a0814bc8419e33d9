"""The shard lease under faults, each injected for real, on a local root and on S3 (moto's server
behind ``S3Proxy``, which breaks it as a test says): a renewal that raises, a renewal the store
never answers, two hosts with one host name, a store that ignores conditional writes. In each the
holder stops sending, or no lease is taken, and the error names the fix; what was written is
kept, and the next run sends only what is missing."""

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from expansion_dag.core import as_upath
from expansion_dag.store import LEASES, CompletionStore, ConditionalWritesIgnored, LeaseLost, ShardBusy, ShardLease
from expansion_dag_tests.faults.s3_proxy import proxy  # noqa: F401 (a fixture)
from expansion_dag_tests.helpers import LEASE_TIMEOUT_S, wait_for
from expansion_dag_tests.store.test_lease import SHARD, Said, held_by, killed_holder
from expansion_dag_tests.store.test_object_storage import objects

#: Long enough that a loaded machine's moto answers every renewal within its timeout (on S3 an
#: attempt gets a sixth of the lease), short enough that a fault shows within seconds.
TIMEOUT_S = 16.0


@pytest.fixture(params=["local", "s3"])
def kind(request):
    return request.param


def root_of(kind, request, tmp_path):
    if kind == "local":
        return as_upath(str(tmp_path / "storage"))
    return as_upath(f"s3://{request.getfixturevalue('bucket')}/storage")


def failure(lease: ShardLease) -> str | None:
    """What ``check`` raises, once it does."""
    try:
        lease.check()
    except LeaseLost as exc:
        return str(exc)
    return None


def test_a_renewal_that_raises_stops_the_sender_naming_the_cause_and_the_fix(kind, request, tmp_path):
    proxy = request.getfixturevalue("proxy") if kind == "s3" else None
    root = root_of(kind, request, tmp_path)
    said = Said()
    # The segment is uploaded at the writer's close only, once the credentials are renewed: a
    # loaded machine's wait for the failure may outlast the writer's upload interval.
    store = CompletionStore(root / "completions", local_dir=tmp_path / "machine", segment_interval_s=3600)
    holder = ShardLease(root, SHARD, run_id="run-broken", log=said, timeout_s=TIMEOUT_S, wait=True,
                        local_dir=tmp_path / "machine")
    with holder, store.writer(SHARD, check=holder.check) as writer:
        writer.append({"key": "a", "status": "ok", "prompt_id": "a"})
        if kind == "local":
            # The lock file beside the lease becomes a folder: opening it raises, as a broken disk would.
            lock = tmp_path / "storage" / LEASES / f".{SHARD}.json.lock"
            lock.unlink()
            lock.mkdir()
            cause = "IsADirectoryError"
        else:
            proxy.switch("refuse_writes")  # the run's credentials expired: every PUT is refused
            cause = "AccessDenied"
        said_why = wait_for(lambda: failure(holder), "the holder to stop sending")
        assert f"{SHARD}: the lease {holder.path} could not be renewed ({cause}" in said_why
        assert "so this run stopped sending. Fix: make the storage root answer this host again" in said_why
        assert "run the shard again and only what is still missing is sent" in said_why
        assert said.saying(f"could not be renewed ({cause}")
        # The next answer is kept, and stops the sender.
        with pytest.raises(LeaseLost, match="could not be renewed"):
            writer.append({"key": "b", "status": "ok", "prompt_id": "b"})
        if proxy is not None:
            proxy.switch("forward")  # credentials renewed: the writer's segment can be uploaded
    # The next run finds both answers done: nothing lost, nothing to send twice.
    assert CompletionStore(root / "completions", local_dir=tmp_path / "next").scan(SHARD).done == {"a", "b"}


LOCK_HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(3600)
"""


def test_a_renewal_the_store_never_answers_ends_in_time_and_stops_the_sender(kind, request, tmp_path):
    proxy = request.getfixturevalue("proxy") if kind == "s3" else None
    root = root_of(kind, request, tmp_path)
    said = Said()
    holder = ShardLease(root, SHARD, run_id="run-hung", log=said, timeout_s=TIMEOUT_S, wait=True,
                        local_dir=tmp_path / "machine")
    stuck = None
    holder.acquire()
    try:
        if kind == "local":
            # Another process holds the lease's lock and never lets go (a stuck NFS lock, say).
            lock = tmp_path / "storage" / LEASES / f".{SHARD}.json.lock"
            stuck = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
            assert stuck.stdout.readline().strip() == "locked"
            cause = "TimeoutError"
        else:
            proxy.switch("hang")
            cause = "ReadTimeoutError"
        said_why = wait_for(lambda: failure(holder), "the holder to stop sending")
        assert said_why.startswith(f"{SHARD}: the lease {holder.path} ")
        assert "so this run stopped sending" in said_why and "Fix: make the storage root answer this host" in said_why
        # The renewal itself gives up while the store still does not answer: it had a timeout.
        wait_for(lambda: said.saying(f"could not be renewed ({cause}"), "the renewal to time out")
        assert "could not be renewed" in failure(holder)
    finally:
        if stuck is not None:
            stuck.send_signal(signal.SIGKILL)
            stuck.wait(timeout=30)
        if proxy is not None:
            proxy.switch("forward")
        holder.release()


def test_two_hosts_with_one_host_name_never_take_over_each_others_live_lease(kind, request, tmp_path):
    """Cloned machines, or containers started with one ``--hostname``, share the host name and
    the root pid namespace's identifier: a pid of one means nothing on the other."""
    root = root_of(kind, request, tmp_path)
    if kind == "s3":
        request.getfixturevalue("proxy")
    # Host A's holder: its pid is not running on host B (here: it was killed), yet A's lease is live.
    holder = killed_holder(root, tmp_path / "host-a")
    assert (held_by(root)["host"], held_by(root)["pid"]) == (socket.gethostname(), holder.pid)
    on_b = ShardLease(root, SHARD, run_id="run-b", log=Said(), timeout_s=LEASE_TIMEOUT_S, wait=False,
                      local_dir=tmp_path / "host-b")
    with pytest.raises(ShardBusy, match=rf"being generated by run run-killed on host {socket.gethostname()}, "
                                        rf"pid {holder.pid} \(holder [0-9a-f]{{16}}\)"):
        on_b.acquire()
    assert held_by(root)["run_id"] == "run-killed"
    # On host A itself the holder is known gone, and taken over at once.
    said = Said()
    with ShardLease(root, SHARD, run_id="run-a", log=said, timeout_s=LEASE_TIMEOUT_S, wait=True,
                    local_dir=tmp_path / "host-a"):
        assert held_by(root)["run_id"] == "run-a"
    assert said.saying(f"its process (pid {holder.pid}) on this machine is gone")


def test_a_store_that_ignores_conditional_writes_gives_no_lease_and_names_the_fix(proxy, bucket, tmp_path):
    proxy.switch("ignore_conditions")
    root = as_upath(f"s3://{bucket}/storage")
    runs = [ShardLease(root, SHARD, run_id=f"run-{i}", log=Said(), timeout_s=LEASE_TIMEOUT_S, wait=True,
                       local_dir=tmp_path / f"host-{i}") for i in (1, 2)]
    for run in runs:  # neither of two runs holds the shard
        with pytest.raises(ConditionalWritesIgnored) as refused:
            run.acquire()
        why = str(refused.value)
        assert f"the object store {proxy.url} (bucket {bucket}) does not enforce conditional writes: a second " \
               "conditional create (If-None-Match: *) of the same object succeeded" in why
        assert "Fix: set storage.root to an S3 store that enforces If-None-Match and If-Match on PutObject" in why
    proxy.switch("forward")
    assert held_by(root) == {}
    assert not [path for method, path in proxy.requests if method == "PUT" and f"{SHARD}.json" in path]
    assert not list(Path(tmp_path).glob("host-*/leases/*.alive"))


def test_a_store_that_enforces_conditional_writes_is_proven_once_a_process(proxy, bucket, tmp_path):
    root = as_upath(f"s3://{bucket}/storage")
    for shard in ("shard-00", "shard-01"):
        with ShardLease(root, shard, run_id="run", log=Said(), timeout_s=LEASE_TIMEOUT_S, wait=True, local_dir=tmp_path):
            pass
    probes = [method for method, path in proxy.requests if ".conditional-writes-probe-" in path]
    assert probes == ["PUT", "PUT", "PUT", "PUT", "DELETE"]  # two creates, two replaces, the cleanup
    assert not [name for name in objects(f"s3://{bucket}/storage") if "probe" in name]
