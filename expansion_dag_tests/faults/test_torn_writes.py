"""Torn writes (issue 45, item 2): a line torn or garbled on disk never hides a good answer.

Each fault is injected where it happens (the bytes of a segment, ``os.write``); each test asserts
what a user would count: no prompt lost, no answer asked twice that was kept, the training set
takes the good answer, and the store's counts say what was quarantined and why.
"""

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from expansion_dag.core import load_tokenizer
from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag.store import CompletionStore
from expansion_dag.training import Manifest, build_training_set_in_parts
from expansion_dag_tests.faults.store_faults import SHARD, SIM, asked, in_folder, requests_so_far, run_shard
from expansion_dag_tests.generation.test_engine_faults import work
from expansion_dag_tests.helpers import default_training, one_mode
from expansion_dag_tests.training.test_training_set import MODEL, record

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer()


def write(store, records):
    """One run of the shard: its records in a segment of its own; the segment's path."""
    with store.writer(SHARD, identities=[MODEL]) as writer:
        for rec in records:
            writer.append(rec)
        return writer.path


def garble(path, key, old, new):
    """Replace ``old`` by ``new`` (same length) inside the line of ``key``: a newline-terminated line
    whose bytes are not what was written, as a bad sector or a stray write leaves it."""
    assert len(old) == len(new)
    lines = path.read_bytes().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith(key.encode()))
    assert old in lines[at]
    lines[at] = lines[at].replace(old, new, 1)
    path.write_bytes(b"".join(lines))


def built_rows(store, tokenizer, tmp_path):
    parts, failures = store.parts()
    out = tmp_path / "set"
    manifest = build_training_set_in_parts(
        parts, failures, tokenizer, default_training(formats=("parquet",)), out, parts_dir=tmp_path / "parts",
        identities=one_mode(MODEL),
    )
    return manifest, [row for f in Manifest.read(out).files for row in pq.read_table(out / f["name"]).to_pylist()]


def test_a_garbled_line_is_due_again_and_the_build_takes_the_answer_sent_again(qwen3, tmp_path):
    store = CompletionStore(tmp_path / "completions")
    first = write(store, [record(1), record(2)])
    key = record(1)["key"]
    # Cut inside the JSON (it no longer parses), the newline kept: the reproduction.
    garble(first, key, b'"finish_reason":"stop"', b'"finish_reason":"st\x00\x00\x00')
    assert store.scan(SHARD).done == {record(2)["key"]}, "a garbled answer must not count as done"
    second = write(store, [record(1, content="It is 2, asked again.")])
    assert second != first
    scan = store.scan(SHARD)
    assert scan.done == {key, record(2)["key"]} and scan.duplicates == 0
    manifest, rows = built_rows(store, qwen3, tmp_path)
    assert sorted(r["id"] for r in rows) == ["p0001", "p0002"]
    assert manifest.samples == 2
    decoded = qwen3.decode([i for r in rows if r["id"] == "p0001" for i in r["input_ids"]])
    assert "asked again" in decoded


def test_a_garbled_line_whose_json_still_parses_is_caught_by_its_checksum(qwen3, tmp_path):
    store = CompletionStore(tmp_path / "completions")
    first = write(store, [record(1, content="It is 2.")])
    key = record(1)["key"]
    garble(first, key, b"It is 2.", b"It is 3.")  # valid JSON, the wrong answer
    scan = store.scan(SHARD)
    assert scan.done == set() and scan.torn_lines == 1
    assert list(store.latest_records()) == []
    (bad,) = quarantined(store)
    assert (bad["key"], bad["status"], bad["reason"]) == (key, "ok", "checksum")
    assert bad["segment"] == f"{SHARD}/{first.name}"
    assert "It is 3." in bad["line"]
    write(store, [record(1, content="It is 2.")])
    manifest, rows = built_rows(store, qwen3, tmp_path)
    assert [r["id"] for r in rows] == ["p0001"]
    assert "It is 3" not in qwen3.decode(rows[0]["input_ids"])


def test_a_short_write_is_continued_until_the_line_is_whole(monkeypatch, tmp_path):
    root = tmp_path / "store"
    real_write, short = os.write, []

    def write(fd, data):
        if in_folder(fd, root) and len(data) > 1:  # the disk takes half of what it is given
            short.append(len(data))
            return real_write(fd, bytes(data[: len(data) // 2]))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    store, items = CompletionStore(root), work(40)
    with SimulatedFleet([SimServerConfig(**SIM)]) as fleet:
        report = run_shard(store, items, fleet.urls[0])
    monkeypatch.undo()
    assert report.ok == 40 and len(short) > 2 * 40  # every line took several writes
    scan = store.scan(SHARD)
    assert scan.done == {i.key for i in items} and not scan.bad_lines and scan.duplicates == 0
    assert all(r["content"] for r in store.records(SHARD))


def cut_write(root, at, then):
    """``os.write`` as a disk that takes half of the store's ``at``-th line, then fails as ``then`` does."""
    real_write, lines = os.write, []

    def write(fd, data):
        if in_folder(fd, Path(root)):
            lines.append(fd)
            if len(lines) == at:
                real_write(fd, bytes(data[: len(data) // 2]))
                then()
        return real_write(fd, data)

    return write


def full_disk():
    raise OSError(errno.ENOSPC, "No space left on device")


def resume(store, items, fleet):
    """The run after a fault: it sends what has no whole line. Every prompt ends answered once, and
    only those were asked again, once each; the bad lines stay counted, never read as answers.
    The keys asked again."""
    after = store.scan(SHARD)
    since = requests_so_far(fleet)
    run_shard(store, [i for i in items if i.key not in after.done], fleet.urls[0])
    again = asked(fleet, since)
    final = store.scan(SHARD)
    assert final.done == {i.key for i in items} and final.duplicates == 0
    assert set(again) == {i.key for i in items} - after.done and set(again.values()) == {1}
    assert final.bad_lines == after.bad_lines
    return again


def test_a_write_that_fails_midline_fails_the_run_naming_the_fix_and_the_rerun_sends_only_the_rest(
    monkeypatch, tmp_path
):
    root, items = tmp_path / "store", work(60)
    store = CompletionStore(root)
    with SimulatedFleet([SimServerConfig(**SIM)]) as fleet:
        monkeypatch.setattr(os, "write", cut_write(root, 15, full_disk))
        with pytest.raises(OSError, match=f"{root / SHARD}.*No space left.*free space there.*run again"):
            run_shard(store, items, fleet.urls[0])
        monkeypatch.undo()
        after = store.scan(SHARD)
        assert len(after.done) == 14 and after.bad_lines == {"unfinished": 1}
        again = resume(store, items, fleet)
    (torn,) = quarantined(store)
    assert torn["reason"] == "unfinished" and torn["key"] in again  # the torn line's prompt asked again


def child(root: str, url: str, n: int, kill_at: int) -> None:
    """A shard run that is SIGKILLed halfway through writing its ``kill_at``-th line."""
    os.write = cut_write(root, kill_at, lambda: os.kill(os.getpid(), signal.SIGKILL))
    run_shard(CompletionStore(root), work(n), url)


def test_a_run_killed_mid_write_loses_only_what_it_had_not_written(tmp_path):
    root, items = tmp_path / "store", work(60)
    with SimulatedFleet([SimServerConfig(**SIM)]) as fleet:
        code = f"from {__name__} import child; child({str(root)!r}, {fleet.urls[0]!r}, 60, 20)"
        killed = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                capture_output=True, text=True, timeout=120)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        store = CompletionStore(root)
        after = store.scan(SHARD)
        # The 19 lines written before it whole; the queued answers and the line cut short lost.
        assert len(after.done) == 19 and after.bad_lines == {"unfinished": 1}
        again = resume(store, items, fleet)
    (torn,) = quarantined(store)
    assert torn["key"] in again and torn["offset"] > 0


def quarantined(store):
    return [json.loads(line) for path in sorted((store.root / SHARD).glob("*.quarantine"))
            for line in path.read_text().splitlines()]
