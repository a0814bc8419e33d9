"""The completion store keeps every finished completion once, whatever a crash left behind."""

import os

import pytest

from expansion_dag.core import FAILED, OK, Identity, completion_key
from expansion_dag.store import DIGEST_FIELDS, CompletionStore, MixedStoreError, decode_line, encode_line
from expansion_dag_tests.helpers import wait_for


def ok(key, **extra):
    return {"key": key, "status": OK, "prompt_id": key, "content": f"answer {key}", **extra}


def failed(key, message="boom"):
    return {"key": key, "status": FAILED, "prompt_id": key, "message": message}


def write(store, shard, *records):
    """One writer's run on ``shard``: ``records`` appended in order, then the writer closed."""
    with store.writer(shard) as w:
        for record in records:
            w.append(record)


def test_completions_survive_and_are_read_back_once(tmp_path):
    store = CompletionStore(tmp_path)
    write(store, "shard-00", ok("a"), ok("b"))
    write(store, "shard-00", ok("a"))  # a resumed run that raced: same key again
    scan = store.scan("shard-00")
    assert scan.done == {"a", "b"}
    assert scan.duplicates == 1
    assert [r["key"] for r in store.records("shard-00")] == ["a", "b"]


def test_a_torn_last_line_is_ignored_not_fatal(tmp_path):
    store = CompletionStore(tmp_path)
    with store.writer("shard-00") as w:
        w.append(ok("a"))
        path = w.path
    with open(path, "ab") as fh:  # what a SIGKILL in the middle of a write leaves
        fh.write(b'b\tok\t{"key": "b", "content": "half an ans')
    scan = store.scan("shard-00")
    assert scan.done == {"a"}
    assert scan.torn_lines == 1
    assert [r["key"] for r in store.records("shard-00")] == ["a"]


def test_a_line_cut_inside_its_json_but_ending_in_newline_is_skipped(tmp_path):
    store = CompletionStore(tmp_path)
    folder = tmp_path / "shard-00"
    folder.mkdir()
    (folder / "seg-0.jsonl").write_bytes(b'a\tok\t{"key": "a"\n' + b'b\tok\t{"key": "b"}\n')
    assert [r["key"] for r in store.records("shard-00")] == ["b"]


def test_failures_are_retryable_until_a_completion_exists(tmp_path):
    store = CompletionStore(tmp_path)
    write(store, "shard-00", failed("a", "first"), failed("a", "second"), failed("b"))
    assert store.scan("shard-00").failed == {"a", "b"}
    assert {r["message"] for r in store.latest_failures("shard-00") if r["key"] == "a"} == {"second"}
    write(store, "shard-00", ok("a"))
    scan = store.scan("shard-00")
    assert scan.done == {"a"}
    assert scan.failed == {"b"}


def test_sorted_iteration_spans_shards_and_is_stable(tmp_path):
    store = CompletionStore(tmp_path)
    write(store, "shard-01", ok("c"), ok("a"))
    write(store, "shard-00", ok("b"), failed("d"))
    assert sorted(r["key"] for r in store.latest_records() if r["status"] == "ok") == ["a", "b", "c"]
    assert store.done_keys() == {"a", "b", "c"}


def test_one_pass_in_file_order_gives_each_key_once_and_failures_last(tmp_path):
    store = CompletionStore(tmp_path)
    with store.writer("shard-00") as w:
        w.append(ok("c"))
        w.append(failed("a", "first"))
        w.append(failed("d", "first"))
        w.append(ok("a"))  # a retry that succeeded: the failure no longer counts
        w.append(failed("d", "second"))
        w.append(failed("c"))  # after its completion: an ok record is final
    with store.writer("shard-01") as w:
        w.append(ok("b"))
        w.append(ok("c"))  # the same key completed in another shard: a duplicate
        path = w.path
    with open(path, "ab") as fh:
        fh.write(b'e\tok\t{"key": "e", "content": "torn')
    records = list(store.latest_records())
    assert [(r["key"], r["status"]) for r in records] == [("c", OK), ("a", OK), ("b", OK), ("d", FAILED)]
    assert records[-1]["message"] == "second"


def cut_to_digest(record):
    return {f: record[f] for f in DIGEST_FIELDS if f in record}


def test_digests_give_the_same_records_cut_to_what_the_checks_and_learning_read(tmp_path):
    store = CompletionStore(tmp_path)
    with store.writer("shard-00") as w:
        w.append(ok("a", source="math", finish_reason="stop", completion_tokens=900, local_prompt_tokens=40,
                    prompt_tokens=41, reasoning_content="think " * 50, messages=[{"role": "user", "content": "q"}]))
        w.append(failed("b") | {"error": "degenerate", "content": "loop " * 100})
        w.append(failed("c"))
        w.append(ok("c", finish_reason="length"))
    with store.writer("shard-01") as w:
        w.append(ok("a"))  # a duplicate in another shard
        path = w.path
    with open(path, "ab") as fh:
        fh.write(b'e\tok\t{"key": "e", "content": "torn')
    full = list(store.latest_records())
    for _ in range(2):  # built, then read back from the digest files
        assert list(store.latest_records(digest=True)) == [cut_to_digest(r) for r in full]
    assert "content" not in str(list(store.latest_records(digest=True)))
    assert sorted(p.name.split(".", 1)[1] for p in (tmp_path / "shard-00").iterdir()) == ["jsonl", "jsonl.digest"]
    assert store.shards() == ["shard-00", "shard-01"]


def test_a_digest_is_read_instead_of_the_segment_and_extended_as_the_segment_grows(tmp_path):
    store = CompletionStore(tmp_path)
    with store.writer("shard-00") as w:
        w.append(ok("a", completion_tokens=100))
        assert [r["completion_tokens"] for r in store.latest_records(digest=True)] == [100]
        # The digest, not the segment's JSON, is read: a digest that says otherwise (whole) is believed.
        digest = w.path.with_name(w.path.name + ".digest")
        head, line = digest.read_bytes().split(b"\n", 1)
        key, status, payload = decode_line(line)
        digest.write_bytes(head + b"\n" + encode_line(key, status.decode(), payload.replace(b":100", b":999")))
        w.append(ok("b", completion_tokens=200))
        with open(w.path, "ab") as fh:  # a line still being written is left for the next read
            fh.write(b'c\tok\t{"key":"c","completion_tokens":3')
        assert [r["completion_tokens"] for r in store.latest_records(digest=True)] == [999, 200]
        with open(w.path, "ab") as fh:
            fh.write(b"00}\n")
        assert [r["completion_tokens"] for r in store.latest_records(digest=True)] == [999, 200, 300]
        # The covered bytes change under the digest (same length, as a bad sector leaves them): the
        # digest is rebuilt from the segment, where the changed line no longer matches its checksum.
        w.path.write_bytes(w.path.read_bytes().replace(b":100", b":101"))
        assert [r["completion_tokens"] for r in store.latest_records(digest=True)] == [200, 300]
        # A digest that covers more than its segment holds is not this segment's: rebuilt from it.
        w.path.write_bytes(w.path.read_bytes().split(b"\n")[0] + b"\n")  # its first line alone
    assert list(store.latest_records(digest=True)) == []
    assert store.scan("shard-00").bad_lines == {"checksum": 1}


def test_a_settled_segment_checked_once_is_checked_again_once_written(tmp_path):
    store = CompletionStore(tmp_path)
    with store.writer("shard-00") as w:
        w.append(ok("a", completion_tokens=100))
        w.append(ok("b", completion_tokens=200))
        path = w.path
    hour_ago = os.stat(path).st_mtime - 3600
    os.utime(path, (hour_ago, hour_ago))  # a segment of an earlier night: its check stands while it is unchanged
    for _ in range(2):
        assert [r["completion_tokens"] for r in store.latest_records(digest=True)] == [100, 200]
    path.write_bytes(path.read_bytes().replace(b":100", b":101"))  # garbled in place, same length
    assert [r["completion_tokens"] for r in store.latest_records(digest=True)] == [200]


def test_a_damaged_digest_is_rebuilt_from_its_segment(tmp_path):
    store = CompletionStore(tmp_path)
    with store.writer("shard-00") as w:
        w.append(ok("a", completion_tokens=100))
        w.append(ok("b", completion_tokens=200))
        path = w.path
    list(store.latest_records(digest=True))
    digest = path.with_name(path.name + ".digest")
    digest.write_bytes(digest.read_bytes()[:-10])  # its last line cut short
    assert [r["completion_tokens"] for r in store.latest_records(digest=True)] == [100, 200]
    assert digest.read_bytes().endswith(b"}\n")


def test_a_digest_that_cannot_be_written_is_computed_in_memory(tmp_path):
    store = CompletionStore(tmp_path)
    with store.writer("shard-00") as w:
        w.append(ok("a", completion_tokens=100))
        path = w.path
    path.with_name(path.name + ".digest").mkdir()  # stands where the digest file would go
    assert list(store.latest_records(digest=True)) == [cut_to_digest(ok("a", completion_tokens=100))]


def test_a_writer_that_wrote_nothing_leaves_no_file(tmp_path):
    store = CompletionStore(tmp_path)
    with store.writer("shard-00"):
        pass
    assert os.listdir(tmp_path) == []  # not even its folder: the first line makes it


def test_identity_changes_with_settings_and_prompt():
    assert completion_key("p1", "settings-a") == completion_key("p1", "settings-a")
    assert completion_key("p1", "settings-a") != completion_key("p1", "settings-b")
    assert completion_key("p1", "settings-a") != completion_key("p2", "settings-a")


def test_one_scan_finds_completions_whichever_shard_wrote_them(tmp_path):
    store = CompletionStore(tmp_path)
    write(store, "shard-00", ok("a"), failed("b"), failed("c"))
    write(store, "shard-03", ok("b"), ok("a"))  # a shard of an earlier, larger layout
    scan = store.scan()
    assert scan.done == {"a", "b"} == store.done_keys()
    assert scan.failed == {"c"}
    assert scan.duplicates == 1
    assert store.scan("shard-00").done == {"a"}


REAL = Identity(model="Qwen/Qwen3-8B", simulated=False, fingerprint="f-real", settings={"temperature": 0.7})
SIM = Identity(model="Qwen/Qwen3-8B (simulator)", simulated=True, fingerprint="f-sim")


def test_a_store_never_takes_simulated_and_real_completions(tmp_path):
    store = CompletionStore(tmp_path / "completions")
    with store.writer("shard-00", identities=[SIM]) as w:
        w.append(ok(SIM.key("p1")))
    with store.writer("shard-01", identities=[SIM]):  # the same kind again: fine
        pass
    with pytest.raises(MixedStoreError) as refused:
        store.writer("shard-00", identities=[REAL])
    message = str(refused.value)
    assert str(tmp_path / "completions") in message
    assert "holds simulated completions (Qwen/Qwen3-8B (simulator))" in message
    assert "EXPANSION_STORAGE" in message
    assert len(os.listdir(tmp_path / "completions" / "shard-00")) == 1  # nothing written for the refused run
    # And the other way round.
    real_store = CompletionStore(tmp_path / "real")
    real_store.registry.register(REAL)
    with pytest.raises(MixedStoreError, match="holds real completions"):
        real_store.writer("shard-00", identities=[SIM])


def test_the_identity_registry_names_who_wrote_the_store_and_is_not_a_shard(tmp_path):
    store = CompletionStore(tmp_path)
    store.registry.register(REAL)
    store.registry.register(REAL)
    other = Identity(model="Qwen/Qwen3-8B", simulated=False, fingerprint="f-cold", settings={"temperature": 0.1})
    with store.writer("shard-00", identities=[other]) as w:
        w.append(ok(other.key("p1"), prompt_id="p1"))
    assert store.registry.known() == {"f-real": REAL, "f-cold": other}
    assert store.registry.known()["f-cold"].settings == {"temperature": 0.1}
    assert store.shards() == ["shard-00"]
    [record] = store.latest_records()
    assert other.owns(record) and not REAL.owns(record)


# A remote root (fsspec's in-memory filesystem here; S3 in test_object_storage.py): objects
# cannot be appended to, so a writer spools segments on local disk and uploads them whole.


def remote_root(tmp_path):
    """A fresh in-memory root per test (that filesystem is shared by the whole process)."""
    return f"memory://{tmp_path.name}/completions"


def spooled(store):
    return sorted(store.spool.glob("*/seg-*.jsonl"))


def test_a_remote_writer_uploads_each_sealed_segment_and_leaves_no_spool(tmp_path):
    store = CompletionStore(remote_root(tmp_path), local_dir=tmp_path / "machine-a", segment_records=2)
    write(store, "shard-00", *map(ok, "abcde"), failed("f"))
    assert spooled(store) == []
    objects = store.root.fs.ls((store.root / "shard-00").path)
    assert len(objects) == 3  # 2 + 2 + 2 lines
    # Another machine (no spool, no cache) reads the same completions.
    elsewhere = CompletionStore(remote_root(tmp_path), local_dir=tmp_path / "machine-b")
    assert elsewhere.shards() == ["shard-00"]
    assert elsewhere.scan("shard-00").done == set("abcde")
    assert [r["key"] for r in elsewhere.records("shard-00")] == list("abcde")
    assert [r["key"] for r in elsewhere.latest_failures("shard-00")] == ["f"]


def test_a_quiet_writer_uploads_its_segment_once_the_interval_has_passed(tmp_path):
    store = CompletionStore(remote_root(tmp_path), local_dir=tmp_path / "a", segment_interval_s=0.2)
    elsewhere = CompletionStore(remote_root(tmp_path), local_dir=tmp_path / "b")
    with store.writer("shard-00") as w:
        w.append(ok("a"))
        wait_for(lambda: elsewhere.scan("shard-00").done == {"a"}, "the upload while the writer was open")


def test_spool_recovery_uploads_what_dead_writers_left_and_never_a_live_segment(tmp_path):
    store = CompletionStore(remote_root(tmp_path), local_dir=tmp_path / "machine")
    live = store.writer("shard-01")
    live.append(ok("live"))
    # What a SIGKILLed writer leaves: an unlocked spool segment ending in a torn line.
    dead = store.spool / "shard-00" / "seg-20250101T000000-1-dead.jsonl"
    dead.parent.mkdir(parents=True)
    dead.write_bytes(b'a\tok\t{"key":"a","status":"ok"}\n' + b'b\tok\t{"key":"b","con')

    later = CompletionStore(remote_root(tmp_path), local_dir=tmp_path / "machine")
    assert later.shards() == ["shard-00"]
    scan = later.scan("shard-00")
    assert (scan.done, scan.torn_lines) == ({"a"}, 1)
    assert spooled(later) == [live.path]  # the live writer's segment stays with its writer
    live.close()
    assert CompletionStore(remote_root(tmp_path), local_dir=tmp_path / "elsewhere").done_keys() == {"a", "live"}
