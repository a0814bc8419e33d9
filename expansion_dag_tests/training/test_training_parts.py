"""The training set in parts (issue 38): each segment of the store is built once, a rebuild builds only
the parts whose records are new, a changed setting rebuilds all and says why, and the set is the one
a single pass over the same records gives."""

import json
import multiprocessing
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor

import pyarrow.parquet as pq
import pytest

from expansion_dag.core import FAILED, as_upath, load_tokenizer
from expansion_dag.store import BuildClaim, CompletionStore
from expansion_dag.training import (
    PART_DONE,
    BuildTrace,
    Manifest,
    build_parts,
    build_training_set,
    build_training_set_in_parts,
    part_names,
)
from expansion_dag_tests.helpers import LEASE_TIMEOUT_S, default_training, one_mode
from expansion_dag_tests.store.test_lease import Said
from expansion_dag_tests.training.test_training_set import MODEL, record
from expansion_dag_tests.training.test_training_set_ids import stopped_loop

FORMATS = ("parquet", "specforge-pretokenized", "specforge-conversations")


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer()


def night(store, shard, records):
    """One run of a shard: its records in a segment of their own."""
    with store.writer(shard, identities=[MODEL]) as writer:
        for rec in records:
            writer.append(rec)


def in_parts(store, qwen3, out_dir, parts_dir, *, workers=1, trace=None, owner=None, **config):
    parts, failures = store.parts()
    return build_training_set_in_parts(
        parts, failures, qwen3, default_training(formats=FORMATS, **config), out_dir, parts_dir=parts_dir,
        identities=one_mode(MODEL), trace=trace, workers=workers, owner=owner,
    )


def in_one_pass(store, qwen3, out_dir, trace=None):
    return build_training_set(
        store.latest_records(), qwen3, default_training(formats=FORMATS), out_dir, identities=one_mode(MODEL),
        trace=trace,
    )


def rows(out_dir):
    manifest = Manifest.read(out_dir)
    return [row for f in manifest.files for row in pq.read_table(out_dir / f["name"]).to_pylist()]


def counts(manifest):
    """What a set says of its rows and its left-out records, whatever files hold them."""
    keep = ("samples", "tokens", "assistant_tokens", "by_source", "left_out", "histogram", "output_tokens",
            "output_tokens_in_set", "ids_from", "tokens_per_sample", "modes")
    return {name: getattr(manifest, name) for name in keep}


def assert_same_set(parts_dir_set, one_pass_set):
    assert rows(parts_dir_set) == rows(one_pass_set)
    for name in ("pretokenized.jsonl", "conversations.jsonl"):
        assert (parts_dir_set / name).read_bytes() == (one_pass_set / name).read_bytes()
    assert counts(Manifest.read(parts_dir_set)) == counts(Manifest.read(one_pass_set))


def segments_files(parts_dir, name):
    """``name`` in each part of a segment (the failure records' part left out), sorted."""
    return sorted(f for f in parts_dir.glob(f"*/{name}")
                  if json.loads((f.parent / PART_DONE).read_text())["name"] != "failures")


def test_a_second_night_builds_only_its_own_parts_and_the_set_is_the_one_pass_set(qwen3, tmp_path):
    store = CompletionStore(tmp_path / "completions")
    night(store, "shard-00", [record(i) for i in range(0, 6)])
    night(store, "shard-01", [record(i) for i in range(6, 12)])
    first = in_parts(store, qwen3, tmp_path / "set", tmp_path / "parts")
    assert first.parts == {"parts": 2, "built": 2, "reused": 0, "rebuilt_all_because": "no earlier build in parts"}
    assert first.samples == 12

    # The next night: a new segment per shard; one of its prompts answered again (a duplicate) and
    # one failure of a prompt a night before had answered: neither counts twice.
    night(store, "shard-00", [record(i) for i in range(12, 16)] + [record(3)])
    night(store, "shard-01", [record(i) for i in range(16, 20)] + [record(7, status=FAILED, error="rejected")])
    trace, one_pass_trace = BuildTrace(), BuildTrace()
    second = in_parts(store, qwen3, tmp_path / "set", tmp_path / "parts", trace=trace)
    assert second.parts == {"parts": 4, "built": 2, "reused": 2, "rebuilt_all_because": None}
    assert second.samples == 20 and second.left_out["failed"] == 0
    in_one_pass(store, qwen3, tmp_path / "one-pass", one_pass_trace)
    assert_same_set(tmp_path / "set", tmp_path / "one-pass")
    # The checks and the nightly table read the same trace as a single pass fills.
    assert trace == one_pass_trace
    # Nothing new: every part is taken as it is, and the set is the same.
    again = in_parts(store, qwen3, tmp_path / "set", tmp_path / "parts")
    assert again.parts["built"] == 0 and again.parts["reused"] == 4
    assert_same_set(tmp_path / "set", tmp_path / "one-pass")


def test_a_failure_stays_counted_until_a_later_night_answers_it(qwen3, tmp_path):
    store = CompletionStore(tmp_path / "completions")
    night(store, "shard-00", [record(1), record(2, status=FAILED, error="rejected")])
    assert in_parts(store, qwen3, tmp_path / "set", tmp_path / "parts").left_out["failed"] == 1
    night(store, "shard-00", [record(2)])
    manifest = in_parts(store, qwen3, tmp_path / "set", tmp_path / "parts")
    assert (manifest.samples, manifest.left_out["failed"], manifest.parts["built"]) == (2, 0, 1)


def test_a_stopped_loops_text_is_a_row_of_the_set_in_parts_until_a_later_night_answers_it(qwen3, tmp_path):
    store = CompletionStore(tmp_path / "completions")
    loop, _ = stopped_loop(qwen3, 3, "First, add the two numbers: 7 + 5 = 12. " + "Wait, let me reconsider the problem from the start. " * 12)
    night(store, "shard-00", [record(1), record(2), loop])
    manifest = in_parts(store, qwen3, tmp_path / "set", tmp_path / "parts")
    in_one_pass(store, qwen3, tmp_path / "one-pass")
    assert (manifest.samples, manifest.loop_rows) == (3, {"exact": 1})
    assert_same_set(tmp_path / "set", tmp_path / "one-pass")
    # Asked again and answered whole: the whole answer is the row, the cut one gone.
    night(store, "shard-00", [record(3)])
    manifest = in_parts(store, qwen3, tmp_path / "set", tmp_path / "parts")
    in_one_pass(store, qwen3, tmp_path / "one-pass")
    assert (manifest.samples, manifest.loop_rows, manifest.parts["built"]) == (3, {}, 1)
    assert_same_set(tmp_path / "set", tmp_path / "one-pass")
    # loop_prefix: drop leaves it out, counted as degenerate, in parts as in one pass.
    dropped = CompletionStore(tmp_path / "dropped")
    night(dropped, "shard-00", [record(1), loop])
    manifest = in_parts(dropped, qwen3, tmp_path / "dropped-set", tmp_path / "dropped-parts", loop_prefix="drop")
    assert (manifest.samples, manifest.loop_rows, manifest.left_out["degenerate"]) == (1, {}, 1)


def test_a_changed_setting_rebuilds_every_part_and_the_manifest_says_which(qwen3, tmp_path):
    store = CompletionStore(tmp_path / "completions")
    night(store, "shard-00", [record(i) for i in range(4)])
    night(store, "shard-01", [record(i) for i in range(4, 8)])
    in_parts(store, qwen3, tmp_path / "set", tmp_path / "parts")
    manifest = in_parts(store, qwen3, tmp_path / "set", tmp_path / "parts", train_newline_after_end_of_turn=True)
    assert manifest.parts["built"] == 2 and manifest.parts["reused"] == 0
    assert manifest.parts["rebuilt_all_because"] == "changed since the last build: config.train_newline_after_end_of_turn"
    assert all(row["loss_mask"][-1] == 1 for row in rows(tmp_path / "set"))
    # The parts of the old setting are gone: only this build's are kept.
    assert len(segments_files(tmp_path / "parts", PART_DONE)) == 2
    assert json.loads((tmp_path / "parts" / "build.json").read_text())["config"]["train_newline_after_end_of_turn"]


def test_parts_built_in_processes_side_by_side_give_the_same_set(qwen3, tmp_path):
    store = CompletionStore(tmp_path / "completions")
    for shard in range(3):
        night(store, f"shard-{shard:02d}", [record(i) for i in range(shard * 5, shard * 5 + 5)])
    manifest = in_parts(store, qwen3, tmp_path / "set", tmp_path / "parts", workers=2)
    assert manifest.parts["built"] == 3 and manifest.samples == 15
    in_one_pass(store, qwen3, tmp_path / "one-pass")
    assert_same_set(tmp_path / "set", tmp_path / "one-pass")


def test_a_damaged_part_is_built_again_and_the_others_are_kept(qwen3, tmp_path):
    store = CompletionStore(tmp_path / "completions")
    night(store, "shard-00", [record(i) for i in range(4)])
    night(store, "shard-01", [record(i) for i in range(4, 8)])
    in_parts(store, qwen3, tmp_path / "set", tmp_path / "parts")
    # A part's record torn (a disk that filled, a download cut short): never read as built.
    [torn, *_] = segments_files(tmp_path / "parts", PART_DONE)
    torn.write_text(torn.read_text()[:20])
    manifest = in_parts(store, qwen3, tmp_path / "set", tmp_path / "parts")
    assert manifest.parts == {"parts": 2, "built": 1, "reused": 1, "rebuilt_all_because": None}
    in_one_pass(store, qwen3, tmp_path / "one-pass")
    assert_same_set(tmp_path / "set", tmp_path / "one-pass")


@pytest.mark.parametrize("lost", ["part-00000.parquet", "pretokenized.jsonl"])
def test_a_part_whose_record_survived_a_crash_but_not_its_data_is_built_again(qwen3, tmp_path, lost):
    store = CompletionStore(tmp_path / "completions")
    night(store, "shard-00", [record(i) for i in range(4)])
    night(store, "shard-01", [record(i) for i in range(4, 8)])
    in_parts(store, qwen3, tmp_path / "set", tmp_path / "parts")
    # What a machine crash leaves of a file whose data was still in the page cache: its name, no bytes.
    [emptied, *_] = segments_files(tmp_path / "parts", lost)
    emptied.write_bytes(b"")
    assert (emptied.parent / PART_DONE).exists()
    manifest = in_parts(store, qwen3, tmp_path / "set", tmp_path / "parts")
    assert manifest.parts == {"parts": 2, "built": 1, "reused": 1, "rebuilt_all_because": None}
    assert emptied.stat().st_size > 0
    in_one_pass(store, qwen3, tmp_path / "one-pass")
    assert_same_set(tmp_path / "set", tmp_path / "one-pass")


#: A build of the store at argv[1] into the folders argv[2] (the set) and argv[3] (its parts).
BUILD = """
import sys
from expansion_dag.core import load_tokenizer
from expansion_dag.store import CompletionStore
from expansion_dag_tests.training.test_training_parts import in_parts
try:
    in_parts(CompletionStore(sys.argv[1]), load_tokenizer(), sys.argv[2], sys.argv[3])
except OSError as exc:
    sys.exit(str(exc))
"""


@pytest.mark.parametrize("full, what", [("parts", "a part of the training set"), ("set", "the training set")])
def test_a_full_disk_is_named_with_its_fix(qwen3, tmp_path, full, what):
    store = CompletionStore(tmp_path / "completions")
    night(store, "shard-00", [record(i) for i in range(12)])
    in_parts(store, qwen3, tmp_path / "set", tmp_path / "parts")  # the parts, where the set's disk is full
    disk = tmp_path / "disk"
    disk.mkdir()
    folders = {"set": tmp_path / "new-set", "parts": tmp_path / "parts", full: disk / full}
    # A real filesystem of 8 KiB, a tmpfs in a mount namespace of the build's own (root or not).
    mounted = 'mount -t tmpfs -o size=8k tmpfs "$0" && exec "$@"'
    result = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mounted, str(disk), sys.executable, "-c",
         BUILD, str(tmp_path / "completions"), str(folders["set"]), str(folders["parts"])],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    said = result.stderr.strip().splitlines()[-1]
    where = disk / full if full == "parts" else disk
    assert said.startswith(f"[Errno 28] {what} could not be written to {where} (") and "No space left on device" in said
    assert "free space there or make it writable, then run again" in said


def shard_parts(root, shard, parts_dir):
    """What a Dagster run of one shard's ``training_set_parts`` does: that shard's parts alone."""
    parts, _ = CompletionStore(root).parts([shard])
    return build_parts(
        parts, load_tokenizer(), default_training(formats=FORMATS), parts_dir=parts_dir, identities=one_mode(MODEL)
    )


def test_parts_built_by_each_shard_in_a_process_of_its_own_are_taken_by_the_set(qwen3, tmp_path):
    store = CompletionStore(tmp_path / "completions")
    shards = [f"shard-{shard:02d}" for shard in range(3)]
    for i, shard in enumerate(shards):
        night(store, shard, [record(n) for n in range(i * 5, i * 5 + 5)])
    # One process a shard, as runs in pods of their own; shard-02 twice at once (a retried run).
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=4, mp_context=context) as pool:
        runs = [*shards, "shard-02"]
        built = list(pool.map(shard_parts, [tmp_path / "completions"] * 4, runs, [tmp_path / "parts"] * 4))
    assert [run["parts"] for run in built] == [1, 1, 1, 1]
    # The set takes every part as it is, and is the set one pass gives.
    manifest = in_parts(store, qwen3, tmp_path / "set", tmp_path / "parts")
    assert manifest.parts == {"parts": 3, "built": 0, "reused": 3, "rebuilt_all_because": None}
    in_one_pass(store, qwen3, tmp_path / "one-pass")
    assert_same_set(tmp_path / "set", tmp_path / "one-pass")
    assert sorted(p.name for p in (tmp_path / "parts").iterdir() if p.name.startswith(".")) == []


def test_the_set_never_removes_a_part_another_live_builder_is_writing(qwen3, tmp_path):
    """Builder A, on another host sharing the root, is writing a part when B assembles the set."""
    root = as_upath(str(tmp_path))
    store = CompletionStore(tmp_path / "completions")
    night(store, "shard-00", [record(i) for i in range(4)])
    with BuildClaim(root, timeout_s=LEASE_TIMEOUT_S, run_id="a", log=Said(), local_dir=tmp_path / "host-a") as a:
        staging = tmp_path / "parts" / f".{'0' * 24}.tmp-{a.id}"
        staging.mkdir(parents=True)
        (staging / "part-00000.parquet").write_bytes(b"the first file of a part being written")
        with BuildClaim(root, timeout_s=LEASE_TIMEOUT_S, run_id="b", log=Said(), local_dir=tmp_path / "host-b") as b:
            in_parts(store, qwen3, tmp_path / "set", tmp_path / "parts", owner=b)
        assert staging.exists()
    # A's claim is gone (its run ended, or was killed and timed out): the next build removes its folder.
    with BuildClaim(root, timeout_s=LEASE_TIMEOUT_S, run_id="c", log=Said(), local_dir=tmp_path / "host-b") as c:
        in_parts(store, qwen3, tmp_path / "set", tmp_path / "parts", owner=c)
    assert not staging.exists()


def test_a_part_of_a_segment_the_set_did_not_see_is_kept_and_a_part_of_another_build_is_not(qwen3, tmp_path):
    store = CompletionStore(tmp_path / "completions")
    night(store, "shard-00", [record(i) for i in range(4)])
    night(store, "shard-01", [record(i) for i in range(4, 8)])
    parts, failures = store.parts()
    config = default_training(formats=FORMATS)
    # shard-01's run builds its part after the set's build listed the store: the set sees shard-00 only.
    build_parts(parts[1:], qwen3, config, parts_dir=tmp_path / "parts", identities=one_mode(MODEL))
    build_training_set_in_parts(parts[:1], failures, qwen3, config, tmp_path / "set", parts_dir=tmp_path / "parts",
                                identities=one_mode(MODEL))
    newer = part_names(parts[1:], qwen3, config, one_mode(MODEL))[0]
    assert (tmp_path / "parts" / newer / PART_DONE).exists()
    # A changed setting makes another build: the parts of the earlier one are no build's now.
    in_parts(store, qwen3, tmp_path / "set", tmp_path / "parts", train_newline_after_end_of_turn=True)
    changed = default_training(formats=FORMATS, train_newline_after_end_of_turn=True)
    left = {p.name for p in (tmp_path / "parts").iterdir()} - {*part_names(parts, qwen3, changed, one_mode(MODEL)), "build.json"}
    assert [json.loads((tmp_path / "parts" / name / PART_DONE).read_text())["name"] for name in left] == ["failures"]
