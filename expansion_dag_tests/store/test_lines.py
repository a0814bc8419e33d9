"""A store line is checked whole on read: each way a line can be damaged is named, stores written
before the checksum read as they did, and the writer leaves nothing a crash could hide."""

import errno
import json
import os
import stat

import pydantic_core
import pytest

from expansion_dag.store import CompletionStore
from expansion_dag.store import BAD_LINE_REASONS, decode_line, encode_line

RECORD = {"key": "k1", "status": "ok", "content": "tab\there, a newline\nthere, ça 🙂", "tokens": [1, 2]}


def test_a_line_round_trips_and_each_damage_is_named():
    line = encode_line("k1", "ok", pydantic_core.to_json(RECORD))
    assert line.count(b"\n") == 1 and line.startswith(b"k1\tok\t")
    key, status, payload = decode_line(line)
    assert (key, status, json.loads(payload)) == ("k1", b"ok", RECORD)
    key_and_status, check, body = line.split(b"\t", 3)[:2], line.split(b"\t")[2], line.split(b"\t", 3)[3]
    # As stores wrote it before checksums: still whole.
    assert decode_line(b"\t".join([*key_and_status, body])) == (key, status, payload)
    damaged = {
        line[:-1]: "unfinished",
        b"k1 ok\n": "fields",
        line.replace(check, b"twelve:cafe", 1): "prefix",
        line.replace(b"[1,2]", b"[1]", 1): "length",
        line.replace(b"[1,2]", b"[1,3]", 1): "checksum",
        line.replace(b"k1\tok", b"k2\tok", 1): "checksum",  # the key and status are checked too
        b'k1\tok\t{"key": "k1", "con\n': "json",  # a line without a checksum, cut inside its JSON
        # Checksummed as it is, yet its JSON cut: no writer of this store wrote it (a bug, a forgery).
        encode_line("k1", "ok", pydantic_core.to_json(RECORD)[:-9]): "json",
    }
    assert {bad: decode_line(bad) for bad in damaged} == damaged
    assert set(damaged.values()) == set(BAD_LINE_REASONS)  # every reason a scan may count


def old_line(record):
    """A line as the store wrote it before checksums."""
    return b"%s\t%s\t%s\n" % (record["key"].encode(), record["status"].encode(), pydantic_core.to_json(record))


def test_a_store_written_before_checksums_reads_as_it_did(tmp_path):
    folder = tmp_path / "shard-00"
    folder.mkdir()
    old = [{"key": k, "status": "ok", "prompt_id": k, "completion_tokens": n} for k, n in (("a", 10), ("b", 20))]
    segment = folder / "seg-20261201T000000000000-1-aa-000001.jsonl"
    segment.write_bytes(old_line(old[0]) + b'c\tok\t{"key":"c","completion_t\n' + old_line(old[1]))
    # Its digest, as the store wrote it then (another version): rebuilt under today's rule.
    segment.with_name(segment.name + ".digest").write_bytes(b"%d 0ld0ld00\n" % segment.stat().st_size)
    store = CompletionStore(tmp_path)
    with store.writer("shard-00") as writer:
        writer.append({"key": "c", "status": "ok", "prompt_id": "c", "completion_tokens": 30})
    scan = store.scan()
    assert scan.done == {"a", "b", "c"} and scan.duplicates == 0
    assert scan.bad_lines == {"json": 1}  # the old line cut inside its JSON, counted as before
    assert [r["completion_tokens"] for r in store.latest_records()] == [10, 20, 30]
    assert [r["completion_tokens"] for r in store.latest_records(digest=True)] == [10, 20, 30]
    (part_a, part_b), _ = store.parts()
    assert [r["key"] for r in part_a.records()] == ["a", "b"] and [r["key"] for r in part_b.records()] == ["c"]


def test_a_line_being_written_is_not_bad_until_its_writer_is_gone(tmp_path):
    store = CompletionStore(tmp_path)
    writer = store.writer("shard-00")
    writer.append({"key": "a", "status": "ok"})
    with open(writer.path, "ab") as fh:  # the first bytes of the next line, its writer alive
        fh.write(encode_line("b", "ok", b'{"key":"b","status":"ok"}')[:9])
    assert store.scan().bad_lines == {}
    assert list(tmp_path.glob("*/*.quarantine")) == []
    writer.close()  # its writer gone, the line will never be finished
    assert store.scan().bad_lines == {"unfinished": 1}
    (quarantine,) = tmp_path.glob("*/*.quarantine")
    assert json.loads(quarantine.read_text())["reason"] == "unfinished"


def test_a_failed_write_leaves_its_segment_and_the_next_line_opens_another(monkeypatch, tmp_path):
    store = CompletionStore(tmp_path)
    real_write, failed = os.write, []

    def write(fd, data):
        if not failed:  # half a line, then a full disk
            failed.append(real_write(fd, bytes(data[: len(data) // 2])))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    with store.writer("shard-00") as writer:
        writer.append({"key": "a", "status": "ok"})
        first = writer.path
        monkeypatch.setattr(os, "write", write)
        with pytest.raises(OSError, match="could not be written to .*shard-00.*free space there"):
            writer.append({"key": "b", "status": "ok"})
        writer.append({"key": "b", "status": "ok"})
        assert writer.path != first  # never appended after the torn line
    scan = store.scan()
    assert scan.done == {"a", "b"} and scan.bad_lines == {"unfinished": 1}


def test_a_segment_and_its_folder_are_synced_as_they_are_created(monkeypatch, tmp_path):
    synced, real_fsync = [], os.fsync

    def fsync(fd):
        info = os.fstat(fd)
        synced.append((stat.S_ISDIR(info.st_mode), info.st_ino))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    store = CompletionStore(tmp_path / "completions")
    (tmp_path / "completions").mkdir()
    with store.writer("shard-00", fsync_interval_s=3600) as writer:
        writer.append({"key": "a", "status": "ok"})
        # The new shard folder's name (in the root) and the segment's name (in the shard folder).
        segment = writer.path
        assert synced == [(True, (tmp_path / "completions").stat().st_ino), (True, segment.parent.stat().st_ino)]
    assert synced[-1] == (False, segment.stat().st_ino)  # the segment itself, when closed
