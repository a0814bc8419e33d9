"""Publishing the training set under faults: a build killed in the middle of publishing (on S3
between two uploads, held there by ``S3Proxy``; on a local root as it is about to write the
manifest), with a reader before, during and after; and an object store holding another builder's
upload under way. A reader always gets one complete version, the previous one until the next
build publishes, and nothing another live builder writes is removed."""

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from expansion_dag.core import as_upath, load_tokenizer
from expansion_dag.defs.resources import StorageResource
from expansion_dag.store import BuildClaim, CompletionStore
from expansion_dag.training import PART_DONE, VERSIONS, build_training_set_in_parts, part_names
from expansion_dag_tests.faults.s3_proxy import proxy  # noqa: F401 (a fixture)
from expansion_dag_tests.helpers import LEASE_TIMEOUT_S, default_training, one_mode, wait_for
from expansion_dag_tests.store.test_lease import Said
from expansion_dag_tests.store.test_object_storage import objects
from expansion_dag_tests.training.test_publish import ids_of, published, read_set
from expansion_dag_tests.training.test_training_parts import FORMATS, night
from expansion_dag_tests.training.test_training_set import MODEL, record

ROOT = Path(__file__).parents[2]
PARTS_FOLDER = "training_set_parts"  # under the storage root, as the training_set asset keeps it

#: A build that publishes the records 0..n-1 as a new version of the set, in a process of its own
#: on the machine whose local folder is argv[3]. On a local root it stops as it is about to write
#: the version's manifest (its last file), says so, and waits to be killed there.
PUBLISHER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from expansion_dag.core import as_upath, load_tokenizer
from expansion_dag.store import BuildClaim
from expansion_dag_tests.helpers import LEASE_TIMEOUT_S
from expansion_dag_tests.store.test_lease import Said
from expansion_dag_tests.training.test_publish import published

def stop_before_the_manifest(event, args):
    if event == "open" and isinstance(args[0], str) and args[0].endswith("/manifest.json") and "w" in str(args[1]):
        print("stopped before the manifest", flush=True)
        time.sleep(3600)

root, machine, n = as_upath(sys.argv[2]), sys.argv[3], int(sys.argv[4])
tokenizer = load_tokenizer()
if root.protocol == "":
    sys.addaudithook(stop_before_the_manifest)
with BuildClaim(root, timeout_s=LEASE_TIMEOUT_S, run_id="run-killed", log=Said(), local_dir=machine) as claim:
    published(root, tokenizer, range(n), Path(machine), claim=claim)
"""


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer()


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_build_killed_mid_publish_leaves_readers_the_whole_previous_version(kind, request, qwen3, tmp_path):
    proxy = request.getfixturevalue("proxy") if kind == "s3" else None
    root = as_upath(f"s3://{request.getfixturevalue('bucket')}/storage" if proxy else str(tmp_path / "storage"))
    machine = tmp_path / "machine"
    with BuildClaim(root, timeout_s=LEASE_TIMEOUT_S, run_id="run-1", log=Said(), local_dir=machine) as claim:
        first = published(root, qwen3, range(4), tmp_path, claim=claim)
    before = (ids_of(range(4)), 4)
    assert read_set(root / "training_set") == before
    if proxy:
        # The next build's upload of its second Parquet file is held, and the build killed there.
        proxy.hold(lambda method, path: method == "PUT" and f"/{VERSIONS}/" in path and path.endswith("part-00001.parquet"))

    build = subprocess.Popen([sys.executable, "-c", PUBLISHER, str(ROOT), str(root), str(machine), "7"],
                             stdout=subprocess.PIPE, text=True)
    try:
        if proxy:
            wait_for(proxy.holding.is_set, "the build to upload its second Parquet file")
            # Part of the new version is in the object store, its manifest is not.
            [half] = {o.split("/")[1] for o in objects(str(root)) if o.startswith(f"{VERSIONS}/")} - {first.name}
            uploaded = objects(str(root / VERSIONS / half))
            assert "part-00000.parquet" in uploaded and "manifest.json" not in uploaded
        else:
            assert build.stdout.readline().strip() == "stopped before the manifest"
            # What a trainer reads at the set's stable path: the previous version's files, all of them.
            link = tmp_path / "storage" / "training_set"
            assert sorted(p.name for p in link.glob("part-*.parquet")) == [f"part-{i:05d}.parquet" for i in range(2)]
            assert len((link / "conversations.jsonl").read_text().splitlines()) == 4
        assert read_set(root / "training_set") == before  # during
    finally:
        build.send_signal(signal.SIGKILL)
        build.wait(timeout=30)
    assert read_set(root / "training_set") == before  # after

    # The next build on that machine publishes whole, and removes what the killed one left.
    with BuildClaim(root, timeout_s=LEASE_TIMEOUT_S, run_id="run-3", log=Said(), local_dir=machine) as claim:
        third = published(root, qwen3, range(9), tmp_path, claim=claim)
    assert read_set(root / "training_set") == (ids_of(range(9)), 9)
    names = ({p.name for p in (tmp_path / "storage" / VERSIONS).iterdir()} if kind == "local"
             else {o.split("/")[1] for o in objects(str(root)) if o.startswith(f"{VERSIONS}/")})
    assert names == {first.name, third.name}


def test_an_object_store_keeps_the_parts_another_builder_is_uploading(bucket, qwen3, tmp_path):
    root = f"s3://{bucket}/storage"
    store = CompletionStore(tmp_path / "completions")
    night(store, "shard-00", [record(i) for i in range(4)])
    night(store, "shard-01", [record(i) for i in range(4, 8)])
    parts, failures = store.parts()
    config = default_training(formats=FORMATS)
    [mine, other] = part_names(parts, qwen3, config, one_mode(MODEL))
    remote = as_upath(root) / PARTS_FOLDER
    # Another builder's uploads under way: its part of a segment this build does not see, and half
    # of a part this build needs too (its part.json comes last).
    for key in ("f" * 24, other):
        (remote / key / "part-00000.parquet").write_bytes(b"the first file of a part being uploaded")
    storage = StorageResource(root=root, local_dir=str(tmp_path / "host-b"))
    with (storage.build_claim(run_id="run", log=Said()) as claim,
          storage.kept_parts(PARTS_FOLDER, last=PART_DONE, claim=claim) as parts_dir):
        build_training_set_in_parts(parts, failures, qwen3, config, tmp_path / "set", parts_dir=parts_dir,
                                    identities=one_mode(MODEL), owner=claim)
    stored = objects(str(remote))
    assert f"{'f' * 24}/part-00000.parquet" in stored  # left to its builder
    assert {f"{mine}/{PART_DONE}", f"{other}/{PART_DONE}"} <= set(stored)  # both whole now
