"""Every asset on object storage: S3 (moto's server on 127.0.0.1, the ``bucket`` fixture of conftest.py) as
the storage root."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import datasets
import pyarrow.parquet as pq
import pytest
import s3fs

from expansion_dag.core import FAILED, OK, as_upath, upload
from expansion_dag.defs import SHARD_KEYS
from expansion_dag.defs.assets import budgeted_prompts, completions, shard_prompts, training_set, training_set_parts
from expansion_dag.defs.resources import StorageResource
from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag.store import CompletionStore
from expansion_dag.training import Manifest, data_files
from expansion_dag_tests.defs.assets.test_completions import prompts_asset, small_frame
from expansion_dag_tests.helpers import prompts_answered, resources


def ok(key):
    return {"key": key, "status": OK, "prompt_id": key, "content": f"answer {key}"}


def objects(root: str) -> list[str]:
    fs = s3fs.S3FileSystem(use_listings_cache=False)
    return sorted(p.removeprefix(root.removeprefix("s3://") + "/") for p in fs.find(root))


def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_completion_store_round_trips_through_s3(bucket, tmp_path):
    root = f"s3://{bucket}/completions"
    store = CompletionStore(root, local_dir=tmp_path / "a", segment_records=3)
    with store.writer("shard-00") as w:
        for key in "abcd":
            w.append(ok(key))
        w.append({"key": "e", "status": FAILED, "prompt_id": "e", "message": "boom"})
    with store.writer("shard-01") as w:
        w.append(ok("a"))  # the same key in another shard: kept once
    assert [o.split("/")[0] for o in objects(root)] == ["shard-00", "shard-00", "shard-01"]
    assert all(o.split("/")[1].startswith("seg-") for o in objects(root))

    elsewhere = CompletionStore(root, local_dir=tmp_path / "b")
    assert elsewhere.shards() == ["shard-00", "shard-01"]
    assert elsewhere.scan("shard-00").failed == {"e"}
    assert sorted(r["key"] for r in elsewhere.latest_records() if r["status"] == "ok") == list("abcd")
    assert [r["message"] for r in elsewhere.latest_failures("shard-00")] == ["boom"]


CHILD = """
import sys, time
from expansion_dag.store.completions import CompletionStore
store = CompletionStore(sys.argv[1], local_dir=sys.argv[2], segment_records=5, segment_interval_s=3600)
writer = store.writer("shard-00")
for i in range(8):
    writer.append({"key": f"k{i}", "status": "ok", "prompt_id": f"k{i}"})
print(writer.path, flush=True)
time.sleep(600)
"""


def test_a_killed_writer_loses_nothing_its_machine_still_holds(bucket, tmp_path):
    root = f"s3://{bucket}/completions"
    machine = tmp_path / "machine"
    child = subprocess.Popen([sys.executable, "-c", CHILD, root, str(machine)], stdout=subprocess.PIPE, text=True)
    try:
        live_segment = Path(child.stdout.readline().strip())
        # The first segment (5 lines) is sealed and uploaded; the last 3 lines are only spooled.
        elsewhere = CompletionStore(root, local_dir=tmp_path / "elsewhere")
        wait_for(lambda: elsewhere.scan("shard-00").done == {f"k{i}" for i in range(5)})
        # A store on the same machine leaves the live writer's segment alone.
        assert CompletionStore(root, local_dir=machine).scan("shard-00").done == {f"k{i}" for i in range(5)}
        assert live_segment.exists()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    with open(live_segment, "ab") as fh:  # a write the machine cut short
        fh.write(b'k8\tok\t{"key":"k8","cont')

    # Another machine does not have the spool: only uploaded lines exist for it.
    assert CompletionStore(root, local_dir=tmp_path / "third").scan("shard-00").done == {f"k{i}" for i in range(5)}
    # The next store on the killed writer's machine uploads its spool first.
    scan = CompletionStore(root, local_dir=machine).scan("shard-00")
    assert scan.done == {f"k{i}" for i in range(8)}
    assert scan.torn_lines == 1
    assert not list(machine.rglob("spool/*/seg-*.jsonl"))
    assert CompletionStore(root, local_dir=tmp_path / "fourth").scan("shard-00").done == scan.done


def test_a_failed_upload_fails_the_writer_and_keeps_the_spool_for_the_next_run(bucket, tmp_path):
    root = f"s3://{bucket}-missing/completions"
    store = CompletionStore(root, local_dir=tmp_path)
    writer = store.writer("shard-00")
    writer.append(ok("a"))
    with pytest.raises(OSError, match="could not be uploaded"):
        writer.close()
    assert len(list(store.spool.glob("shard-00/seg-*.jsonl"))) == 1
    s3fs.S3FileSystem().mkdir(f"{bucket}-missing")
    assert CompletionStore(root, local_dir=tmp_path).done_keys() == {"a"}


def test_the_whole_pipeline_runs_on_s3(bucket, tmp_path, instance, monkeypatch):
    root = f"s3://{bucket}/expansion"
    frame = small_frame()
    fast = dict(port=0, max_running_requests=4, ttft_s=0.0, token_latency_s=0.0001, output_median_tokens=60)
    with SimulatedFleet([SimServerConfig(**fast)] * len(SHARD_KEYS)) as fleet:
        res = resources(fleet.urls, root)
        res["storage"] = StorageResource(root=root, local_dir=str(tmp_path / "local"), segment_records=4)
        assets = [prompts_asset(frame), budgeted_prompts, shard_prompts, completions, training_set_parts, training_set]
        prepare = dg.materialize(assets, resources=res, instance=instance, selection=["prompts", "budgeted_prompts"])
        assert prepare.success
        for key in SHARD_KEYS:
            assert dg.materialize(
                assets, resources=res, instance=instance, partition_key=key, selection=["shard_prompts", "completions"]
            ).success
        # Each shard's parts built in a run of its own, on a pod's empty disk of its own.
        built = {}
        for key in SHARD_KEYS:
            pod = StorageResource(root=root, local_dir=str(tmp_path / f"pod-{key}"), segment_records=4)
            run = dg.materialize(assets, resources={**res, "storage": pod}, instance=instance, partition_key=key,
                                 selection=["training_set_parts"])
            [materialization] = run.asset_materializations_for_node("training_set_parts")
            built[key] = {name: materialization.metadata[name].value for name in ("parts", "built", "reused")}
        result = dg.materialize(assets, resources=res, instance=instance, selection=["training_set"])
        sent = sum(prompts_answered(fleet.stats(i)) for i in range(len(SHARD_KEYS)))
    assert result.success
    assert all(e.passed for e in result.get_asset_check_evaluations())

    stored = objects(root)
    assert {"assets/prompts.parquet", "assets/budgeted_prompts.parquet", "set_aside/budgeted_prompts.parquet",
            "training_set.json"} <= set(stored)
    # The set is a version, and the pointer names it; no lease nor builder's claim is left.
    version = json.loads((as_upath(root) / "training_set.json").read_text())["path"]
    assert {f"{version}/manifest.json", f"{version}/README.md", f"{version}/conversations.jsonl"} <= set(stored)
    assert not [o for o in stored if o.startswith("leases/")]
    assert {f"assets/shard_prompts/{key}.parquet" for key in SHARD_KEYS} <= set(stored)
    assert {f"blocking_checks/{key}.json" for key in SHARD_KEYS} <= set(stored)  # what the set read
    assert sum(o.startswith("completions/") for o in stored) > len(SHARD_KEYS)  # rolled segments
    # No partial download (nor staged digest) left: both are hidden files named after their segment.
    assert not list((tmp_path / "local").rglob(".seg-*"))
    # Digests sit beside the local copies only: the object store holds segments and nothing derived.
    assert list((tmp_path / "local").rglob("seg-*.jsonl.digest"))
    assert not [o for o in stored if o.endswith(".digest")]
    assert not Path("s3:").exists()  # nothing took the URL for a local path

    # Every prompt was sent once and completed once.
    store = res["storage"].completion_store()
    completed = sorted(r["prompt_id"] for r in store.latest_records() if r["status"] == "ok")
    assert completed == frame["prompt_id"].to_list()
    assert sent == frame.height

    # The training set loads from S3 with the datasets library, every kept prompt once. (Its
    # offline switch, set for the whole suite to keep the hub away, refuses every remote URL.)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    out_dir = res["storage"].path("training_set")
    manifest = Manifest.read(out_dir)
    files = data_files(out_dir)
    assert all(f.startswith(f"{root}/{version}/part-") for f in files)
    rows = datasets.load_dataset(
        "parquet", data_files=files, split="train", cache_dir=str(tmp_path / "hf"),
        storage_options={"endpoint_url": os.environ["AWS_ENDPOINT_URL"]},
    )
    assert rows.num_rows == manifest.samples == frame.height - sum(manifest.left_out.values())
    assert sorted(rows["id"]) == sorted(set(rows["id"]))
    assert set(rows["id"]) <= set(completed)
    table = pq.read_table(files[0].removeprefix("s3://"), filesystem=s3fs.S3FileSystem())
    assert table.schema.names[:3] == ["id", "source", "input_ids"]

    # The shards' runs built every part, each its shard's alone (a pod downloads no other shard's
    # part); the set took them as they were. The parts are kept in the object store: a build from a
    # run pod's empty disk takes every one of them as it is, and tokenizes nothing again.
    assert "training_set_parts/build.json" in stored
    assert all(b["built"] == b["parts"] > 1 and b["reused"] == 0 for b in built.values())
    for key in SHARD_KEYS:
        assert len(list((tmp_path / f"pod-{key}").rglob("part.json"))) == built[key]["parts"]
    assert manifest.parts["built"] == 0
    assert manifest.parts["reused"] == manifest.parts["parts"] == sum(b["parts"] for b in built.values())
    res["storage"] = StorageResource(root=root, local_dir=str(tmp_path / "another-pod"), segment_records=4)
    assert dg.materialize(assets, resources=res, instance=instance, selection=["training_set"]).success
    again = Manifest.read(out_dir)
    assert (again.parts["built"], again.parts["reused"]) == (0, manifest.parts["parts"])
    assert again.files == manifest.files


def test_a_folder_upload_replaces_the_old_copy_with_its_marker_last(bucket, tmp_path, monkeypatch):
    target = as_upath(f"s3://{bucket}/training_set")
    for name, files in (("old", ["part-00000.parquet", "part-00001.parquet", "manifest.json"]),
                        ("new", ["part-00000.parquet", "manifest.json"])):
        (tmp_path / name).mkdir()
        for file in files:
            (tmp_path / name / file).write_text(name)
    upload(tmp_path / "old", target, last="manifest.json")
    steps = []
    fs = target.fs
    put_file, rm_file = fs.put_file, fs.rm_file
    monkeypatch.setattr(fs, "put_file", lambda lpath, rpath: (steps.append(("put", rpath)), put_file(lpath, rpath)))
    monkeypatch.setattr(fs, "rm_file", lambda path: (steps.append(("rm", path)), rm_file(path)))
    upload(tmp_path / "new", target, last="manifest.json")
    folder = target.path
    # No moment shows the old manifest beside new parts, nor a manifest before its parts.
    assert steps == [("rm", f"{folder}/manifest.json"), ("put", f"{folder}/part-00000.parquet"),
                     ("put", f"{folder}/manifest.json"), ("rm", f"{folder}/part-00001.parquet")]
    assert objects(str(target)) == ["manifest.json", "part-00000.parquet"]
    assert (target / "part-00000.parquet").read_text() == "new"
