"""The completion store keeps every finished completion once, whatever a crash left behind."""

import os

from expansion_dag.store import FAILED, OK, CompletionStore, completion_key


def ok(key, **extra):
    return {"key": key, "status": OK, "prompt_id": key, "content": f"answer {key}", **extra}


def failed(key, message="boom"):
    return {"key": key, "status": FAILED, "prompt_id": key, "message": message}


def test_completions_survive_and_are_read_back_once(tmp_path):
    store = CompletionStore(tmp_path)
    with store.writer("shard-00") as w:
        w.append(ok("a"))
        w.append(ok("b"))
    with store.writer("shard-00") as w:
        w.append(ok("a"))  # a resumed run that raced: same key again
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
    with store.writer("shard-00") as w:
        w.append(failed("a", "first"))
        w.append(failed("a", "second"))
        w.append(failed("b"))
    assert store.scan("shard-00").failed == {"a", "b"}
    assert {r["message"] for r in store.latest_failures("shard-00") if r["key"] == "a"} == {"second"}
    with store.writer("shard-00") as w:
        w.append(ok("a"))
    scan = store.scan("shard-00")
    assert scan.done == {"a"}
    assert scan.failed == {"b"}


def test_sorted_iteration_spans_shards_and_is_stable(tmp_path):
    store = CompletionStore(tmp_path)
    with store.writer("shard-01") as w:
        w.append(ok("c"))
        w.append(ok("a"))
    with store.writer("shard-00") as w:
        w.append(ok("b"))
        w.append(failed("d"))
    assert [r["key"] for r in store.iter_completions_sorted()] == ["a", "b", "c"]
    assert store.done_keys() == {"a", "b", "c"}


def test_a_writer_that_wrote_nothing_leaves_no_file(tmp_path):
    store = CompletionStore(tmp_path)
    with store.writer("shard-00"):
        pass
    assert os.listdir(tmp_path / "shard-00") == []


def test_identity_changes_with_settings_and_prompt():
    assert completion_key("p1", "settings-a") == completion_key("p1", "settings-a")
    assert completion_key("p1", "settings-a") != completion_key("p1", "settings-b")
    assert completion_key("p1", "settings-a") != completion_key("p2", "settings-a")
