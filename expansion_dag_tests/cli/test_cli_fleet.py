"""A run's fleet is its own (docs/operations.md, who owns the fleet): no other command stops it, no
stranger's process passes for it, a server launched otherwise than the configuration says is not
used, and deleting the storage root mid-run orphans nothing. From the CLI, real processes."""

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import dagster as dg
import httpx
import pytest
import yaml

from expansion_dag.core import fleet_state_dir, pid_alive
from expansion_dag.servers import ServerRecord
from expansion_dag_tests.cli.test_cli import (
    EXPANSION_DAG,
    clean_env,
    fleet_records,
    generating,
    launched_pids,
    slow_simulators,
    write_config,
)
from expansion_dag_tests.helpers import wait_for
from expansion_dag_tests.ports import free_port

#: The simulator as fleet.launch.command launches it, answering at once.
FAST = ("{python} -m expansion_dag.sim --model-path {model_path} --host {host} --port {port} "
        "--context-length {context_length} --max-running-requests 16 --token-latency-ms 1 --output-median-tokens 40")


def fast_simulators(tmp_path: Path, port: int, **sections) -> Path:
    document = {
        "fleet": {"launch": {"command": FAST, "base_port": port}},
        "storage": {"root": str(tmp_path / "storage"), "local_dir": str(tmp_path / "local")},
        "generation": {"backoff_initial_s": 0.01},
    }
    for name, values in sections.items():
        document[name] = {**document.get(name, {}), **values}
    return write_config(tmp_path / "fast.yaml", document)


def expansion_dag(tmp_path: Path, *args: str, timeout: float = 540) -> subprocess.CompletedProcess:
    return subprocess.run([EXPANSION_DAG, *args], cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                          timeout=timeout)


def start_run(tmp_path: Path, config: Path) -> subprocess.Popen:
    # Its own process group: a test that fails midway kills it and its shards' processes at once.
    return subprocess.Popen([EXPANSION_DAG, "run", "--config", str(config)], cwd=tmp_path, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def kill(run: subprocess.Popen, tmp_path: Path) -> None:
    """What a failed test left running: the run, its shards' processes, and the servers it launched."""
    if run.poll() is None:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    for pid in launched_pids(tmp_path):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def until_generating(tmp_path: Path, run: subprocess.Popen) -> list[int]:
    """Wait until ``run`` launched its two servers and generates on them; their pids."""
    wait_for(lambda: run.poll() is not None or (len(launched_pids(tmp_path)) == 2 and generating(tmp_path)),
             "the run generating", timeout_s=300)
    assert run.poll() is None, run.stdout.read()
    return launched_pids(tmp_path)


def interrupted(run: subprocess.Popen) -> str:
    run.send_signal(signal.SIGINT)
    output, _ = run.communicate(timeout=180)
    assert run.returncode == 128 + signal.SIGINT, output[-3000:]
    return output


@pytest.mark.timeout(900)  # a run, a plan and a second run, one after the other
def test_a_plan_and_a_second_run_leave_a_running_runs_fleet_alone_and_the_wait_ends_at_its_deadline(tmp_path):
    port = free_port(2)
    # 300 ms a token: the first run is still generating long after the others are done.
    config = slow_simulators(tmp_path, port, extra="--token-latency-ms 300")
    second = yaml.safe_load(config.read_text())
    second["storage"]["shard_busy_wait_s"] = 45  # longer than the 15 s between progress lines
    second = write_config(tmp_path / "second.yaml", second)
    first = start_run(tmp_path, config)
    try:
        pids = until_generating(tmp_path, first)
        planned = expansion_dag(tmp_path, "plan", "--config", str(config))
        assert planned.returncode == 0, planned.stdout[-3000:] + planned.stderr[-3000:]
        assert re.search(r"^plan: \d+ prompts to send \(\d+ already answered\)", planned.stdout, re.M), planned.stdout
        assert "stopped" not in planned.stdout and "left the server(s)" not in planned.stdout
        waited = expansion_dag(tmp_path, "run", "--config", str(second))
        out = waited.stdout
        assert waited.returncode == 1, out[-3000:] + waited.stderr[-3000:]
        # It waited for the first run's leases, said so in its progress line, and gave up at its deadline.
        assert any(re.match(r"progress: .*shard-0[01] waiting for run .*; gives up at \d\d:\d\d:\d\d UTC "
                            r"\(storage.shard_busy_wait_s\)", line) for line in out.splitlines()), out[-3000:]
        assert out.count("gave up waiting after 45 s (storage.shard_busy_wait_s)") == 2
        assert "stopped" not in out and "left the server(s)" not in out  # it launched none
        # Neither touched the first run's servers, which it still generates on.
        assert launched_pids(tmp_path) == pids and all(pid_alive(pid) for pid in pids)
        assert first.poll() is None
        output = interrupted(first)
    finally:
        kill(first, tmp_path)
    assert "stopped 2 launched server(s)" in output and "ConnectError" not in output
    assert not [pid for pid in pids if pid_alive(pid)]


def forged_record(tmp_path: Path, port: int, pid: int) -> Path:
    """A record naming ``pid`` as a launched server, as a pid reused since (after a reboot) reads:
    the process it names started at another time than the server did."""
    state = Path(fleet_state_dir(str(tmp_path / "storage"), str(tmp_path / "local")))
    state.mkdir(parents=True, exist_ok=True)
    record = ServerRecord(port=port, gpu=0, pid=pid, started="another-boot/12345", host=socket.gethostname(),
                          argv=["python", "-m", "expansion_dag.sim"], owner="an-earlier-run", launched_at=0.0)
    record.write(state / f"server-{port}.json")
    return state / f"server-{port}.json"


@pytest.fixture
def stranger():
    """``setsid sleep 900``: a process of this machine that no command of the project launched."""
    process = subprocess.Popen(["sleep", "900"], start_new_session=True)
    yield process
    process.kill()
    process.wait()


def test_a_record_naming_another_process_is_never_trusted_nor_signalled(tmp_path, stranger):
    port = free_port(2)
    config = fast_simulators(tmp_path, port)
    forged_record(tmp_path, port, stranger.pid)
    stopped = expansion_dag(tmp_path, "fleet", "stop", "--config", str(config))
    assert stopped.returncode == 0 and "stopped 0 server(s)" in stopped.stdout
    assert f"names pid {stranger.pid}, which is not the server launched then" in stopped.stdout
    assert pid_alive(stranger.pid)
    forged_record(tmp_path, port, stranger.pid)  # forgotten by the stop: written again for the run
    run = expansion_dag(tmp_path, "run", "--config", str(config))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # Said, then left alone: the run launched its own server on the port and stopped it.
    assert f"names pid {stranger.pid}, which is not the server launched then" in run.stderr
    assert "that process is left alone" in run.stderr
    assert "stopped 2 launched server(s)" in run.stdout
    assert pid_alive(stranger.pid)


@pytest.mark.timeout(900)  # two runs
def test_a_kept_server_launched_with_another_model_and_context_is_restarted_by_the_next_run(tmp_path):
    port = free_port(2)
    kept = fast_simulators(tmp_path, port, model={"path": "org/model-8b"})
    first = expansion_dag(tmp_path, "run", "--config", str(kept), "--keep-fleet")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "stopped" not in first.stdout
    old = launched_pids(tmp_path)
    assert all(pid_alive(pid) for pid in old)
    changed = fast_simulators(tmp_path, port, model={"path": "org/model-0.6b"},
                              fleet={"launch": {"command": FAST, "base_port": port, "context_length": 4096}})
    second = expansion_dag(tmp_path, "run", "--config", str(changed))
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert second.stderr.count(
        "restarted: it was launched otherwise than this configuration says (--context-length 8192 (running) / "
        "4096 (configured); --model-path org/model-8b (running) / org/model-0.6b (configured))") == 2
    assert not [pid for pid in old if pid_alive(pid)]
    # Every answer of the second run is the new model's, at the new context length.
    with dg.DagsterInstance.from_config(str(tmp_path / ".dagster_home")) as instance:
        event = instance.get_latest_materialization_event(dg.AssetKey("budgeted_prompts"))
        assert event.asset_materialization.metadata["context_length"].value == 4096
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("completions"), asset_partitions=["shard-00"]), limit=1
        ).records
        effective = records[0].asset_materialization.metadata["effective_config"].value
    assert effective["fleet"]["model_path"] == "org/model-0.6b" and effective["fleet"]["context_length"] == 4096
    # It launched the new servers, so it stopped them.
    assert "stopped 2 launched server(s)" in second.stdout and fleet_records(tmp_path) == []


def test_a_storage_root_removed_mid_run_is_named_at_once_and_its_servers_are_stopped(tmp_path):
    port = free_port(2)
    config = slow_simulators(tmp_path, port)
    run = start_run(tmp_path, config)
    root = tmp_path / "storage"
    try:
        pids = until_generating(tmp_path, run)
        # Both shards writing (a shard that starts after the removal makes a new root of its own).
        wait_for(lambda: all(any(p.stat().st_size for p in (root / "completions" / shard).glob("*.jsonl"))
                             for shard in ("shard-00", "shard-01")), "both shards writing", timeout_s=300)
        # As `rm -rf storage` does, again if a writer made a folder in between.
        wait_for(lambda: (shutil.rmtree(root, ignore_errors=True), not root.exists())[1], "the root removed")
        output, _ = run.communicate(timeout=300)
    finally:
        kill(run, tmp_path)
    assert run.returncode == 1, output[-3000:]
    assert f"the storage root {root} was removed while this run wrote into it, so this run stopped sending" in output
    assert f"the storage root {root} was removed during the run: what it wrote went with it" in output
    assert "is kept" not in output
    # Its servers' records were outside the root: the run found them and stopped them.
    assert "stopped 2 launched server(s)" in output
    assert not [pid for pid in pids if pid_alive(pid)]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health")
    # Nothing was written after the removal.
    assert not os.path.exists(root) or not list(root.rglob("*.jsonl"))
