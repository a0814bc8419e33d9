"""A server's answer of an unexpected shape is that request's failure, the server's fault.

Every field the client reads, plain and streamed, in each dialect, given a value of the wrong type:
a ``BadResponseError`` (outcome ``server``), never another exception. End to end, over real HTTP, a
small server of this file's own answers some prompts with such shapes: the shard goes on, each of
those prompts gets a failure record naming the server's fault, none is lost, and a re-run asks them
again and completes them, no prompt answered twice.
"""

from __future__ import annotations

import copy
import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from expansion_dag.core import BadResponseError
from expansion_dag.generation import Server, WorkItem, generate_shard
from expansion_dag.servers import SGLANG, VLLM, parse_chat_completion, parse_chat_stream
from expansion_dag.store import CompletionStore
from expansion_dag_tests.helpers import default_sampling, default_engine
from expansion_dag_tests.ports import free_ports

class _Missing:
    """Removes a field; its repr is fixed so that xdist's workers collect the same test ids."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()


def plain_body(dialect) -> dict[str, Any]:
    """A complete answer as the dialect's server sends it, token ids included."""
    body: dict[str, Any] = {
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": "Four.", dialect.reasoning_fields[0]: "Two and two.",
                        "tool_calls": [{"id": "c1", "type": "function",
                                        "function": {"name": "add", "arguments": "{\"a\": 2}"}}]},
            "finish_reason": "stop",
        }],
        "usage": {"prompt_tokens": 12, "completion_tokens": 7},
    }
    if dialect is SGLANG:
        body["sglext"] = {"input_ids": [1, 2, 3], "output_ids": [[4, 5]]}
    else:
        body["prompt_token_ids"] = [1, 2, 3]
        body["choices"][0]["token_ids"] = [4, 5]
    return body


def put(document: Any, path: tuple, value: Any) -> Any:
    """A copy of ``document`` with ``value`` at ``path`` (``MISSING`` removes the field)."""
    changed = copy.deepcopy(document)
    node = changed
    for step in path[:-1]:
        node = node[step]
    if value is MISSING:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return changed


#: (where, value, what the error must name). Each path is a field the client reads.
PLAIN_FAULTS = [
    (("choices",), MISSING, "not a chat completion"),
    (("choices",), [], "not a chat completion"),
    (("choices",), "abc", "not a chat completion"),
    (("choices", 0), "abc", "not a chat completion"),
    (("choices", 0, "message"), None, "not a chat completion"),
    (("choices", 0, "message", "content"), 5, "content is a int, not text"),
    (("choices", 0, "message", "content"), [{"type": "text", "text": "Four."}], "content is a list, not text"),
    (("choices", 0, "message", "content"), {"text": "Four."}, "content is a dict, not text"),
    (("choices", 0, "message", "REASONING"), ["Two."], "reasoning is a list, not text"),
    (("choices", 0, "message", "tool_calls"), "abc", "not a chat completion"),
    (("choices", 0, "message", "tool_calls"), [5], "not a chat completion"),
    (("choices", 0, "message", "tool_calls", 0, "function"), "add", "not a chat completion"),
    (("choices", 0, "message", "tool_calls", 0, "function", "name"), 5, "not a chat completion"),
    (("choices", 0, "finish_reason"), ["stop"], "finish_reason is a list, not text"),
    (("choices", 0, "finish_reason"), {"type": "stop"}, "finish_reason is a dict, not text"),
    (("choices", 0, "finish_reason"), 3, "finish_reason is a int, not text"),
    (("choices", 0, "finish_reason"), "banana", "finish_reason 'banana' is none a server sends"),
    (("usage",), MISSING, "not a chat completion"),
    (("usage",), None, "not a chat completion"),
    (("usage",), [7], "not a chat completion"),
    (("usage", "completion_tokens"), MISSING, "not a chat completion"),
    (("usage", "completion_tokens"), "7", "usage.completion_tokens is \"7\" (a str), not a token count"),
    (("usage", "completion_tokens"), 7.5, "not a token count"),
    (("usage", "completion_tokens"), -1, "not a token count"),
    (("usage", "completion_tokens"), True, "not a token count"),
    (("usage", "completion_tokens"), None, "not a token count"),
    (("usage", "prompt_tokens"), "12", "usage.prompt_tokens"),
    (("usage", "prompt_tokens"), 1.5, "usage.prompt_tokens"),
    (("IDS_PROMPT",), "abc", "not a chat completion"),
    (("IDS_PROMPT",), [1, "a"], "not a chat completion"),
    (("IDS_PROMPT",), [-1], "not a chat completion"),
    (("IDS_OUTPUT",), [1.5], "not a chat completion"),
    (("IDS_OUTPUT",), "abc", "not a chat completion"),
]


def resolve(path: tuple, dialect) -> tuple:
    """The dialect's own place for a field named generically in the tables."""
    names = {
        "REASONING": dialect.reasoning_fields[0],
        "IDS_PROMPT": ("sglext", "input_ids") if dialect is SGLANG else ("prompt_token_ids",),
        "IDS_OUTPUT": ("sglext", "output_ids", 0) if dialect is SGLANG else ("choices", 0, "token_ids"),
    }
    resolved: list[Any] = []
    for step in path:
        found = names.get(step, step) if isinstance(step, str) else step
        resolved.extend(found if isinstance(found, tuple) else (found,))
    return tuple(resolved)


@pytest.mark.parametrize("dialect", [SGLANG, VLLM], ids=["sglang", "vllm"])
def test_the_well_formed_answers_of_these_tables_read_whole(dialect):
    answer = parse_chat_completion(plain_body(dialect), dialect)
    assert (answer.content, answer.reasoning, answer.completion_tokens) == ("Four.", "Two and two.", 7)
    assert list(answer.output_ids) == [4, 5] and answer.tool_calls[0]["function"]["name"] == "add"
    streamed = parse_chat_stream(stream_lines(stream_chunks(dialect)), dialect)
    assert (streamed.content, streamed.reasoning, streamed.completion_tokens) == ("Four.", "Two and two.", 7)
    assert list(streamed.output_ids) == [4, 5] and streamed.tool_calls[0]["function"]["arguments"] == '{"a": 2}'


@pytest.mark.parametrize("dialect", [SGLANG, VLLM], ids=["sglang", "vllm"])
@pytest.mark.parametrize(("path", "value", "named"), PLAIN_FAULTS, ids=[f"{'.'.join(map(str, p))}={v!r}" for p, v, _ in PLAIN_FAULTS])
def test_a_plain_answer_with_a_field_of_the_wrong_type_is_the_servers_bad_response(dialect, path, value, named):
    with pytest.raises(BadResponseError) as raised:
        parse_chat_completion(put(plain_body(dialect), resolve(path, dialect), value), dialect)
    assert raised.value.outcome == "server" and raised.value.status == 200
    assert named in raised.value.message


def stream_chunks(dialect) -> list[Any]:
    """A complete streamed answer as the dialect's server sends it, chunk by chunk."""
    reasoning = dialect.reasoning_fields[0]
    chunks: list[Any] = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", reasoning: "Two and two."}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "Four."}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": "}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "2}"}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    if dialect is SGLANG:
        chunks.append({"choices": [], "sglext": {"input_ids": [1, 2, 3], "output_ids": [[4, 5]]}})
    else:
        chunks[0]["prompt_token_ids"] = [1, 2, 3]
        chunks[1]["choices"][0]["token_ids"] = [4, 5]
    chunks.append({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 7}})
    return chunks


def stream_lines(chunks: list[Any]) -> list[bytes]:
    return [b"data: " + json.dumps(c).encode() for c in chunks] + [b"data: [DONE]"]


#: (chunk, path in it, value, what the error must name), as ``PLAIN_FAULTS``; chunk -1 is the usage.
STREAM_FAULTS = [
    (1, ("choices", 0, "delta", "content"), 5, "delta.content is a int, not text"),
    (1, ("choices", 0, "delta", "content"), ["Four."], "delta.content is a list, not text"),
    (1, ("choices", 0, "delta", "content"), {"text": "Four."}, "delta.content is a dict, not text"),
    (0, ("choices", 0, "delta", "REASONING"), ["Two."], "reasoning is a list, not text"),
    (0, ("choices", 0, "delta", "REASONING"), 7, "reasoning is a int, not text"),
    (1, ("choices", 0, "delta"), "Four.", "not a chat completion chunk"),
    (1, ("choices",), "abc", "not a chat completion chunk"),
    (1, ("choices",), {"index": 0}, "not a chat completion chunk"),
    (4, ("choices", 0, "finish_reason"), ["stop"], "finish_reason is a list, not text"),
    (4, ("choices", 0, "finish_reason"), {"type": "stop"}, "finish_reason is a dict, not text"),
    (4, ("choices", 0, "finish_reason"), 3, "finish_reason is a int, not text"),
    (4, ("choices", 0, "finish_reason"), "banana", "finish_reason 'banana' is none a server sends"),
    (2, ("choices", 0, "delta", "tool_calls"), "abc", "not a chat completion chunk"),
    (2, ("choices", 0, "delta", "tool_calls"), [5], "not a chat completion chunk"),
    (2, ("choices", 0, "delta", "tool_calls", 0, "function"), "add", "not a chat completion chunk"),
    (2, ("choices", 0, "delta", "tool_calls", 0, "function", "name"), 5, "not a chat completion chunk"),
    (3, ("choices", 0, "delta", "tool_calls", 0, "function", "arguments"), ["2}"], "not a chat completion chunk"),
    (-1, ("usage",), MISSING, "without a usage chunk"),
    (-1, ("usage", "completion_tokens"), MISSING, "without a usage chunk"),
    (-1, ("usage", "completion_tokens"), "7", "usage.completion_tokens"),
    (-1, ("usage", "completion_tokens"), 7.5, "not a token count"),
    (-1, ("usage", "completion_tokens"), -1, "not a token count"),
    (-1, ("usage", "completion_tokens"), True, "not a token count"),
    (-1, ("usage", "prompt_tokens"), "12", "usage.prompt_tokens"),
    (-1, (), [1, 2], "not a chat completion chunk"),
]
#: Token ids, where each dialect streams them: (chunk of SGLANG, of VLLM, path, value).
STREAM_ID_FAULTS = [
    ((-2, ("sglext", "output_ids"), "abc"), (1, ("choices", 0, "token_ids"), "abc")),
    ((-2, ("sglext", "output_ids", 0), [1.5]), (1, ("choices", 0, "token_ids"), [1.5])),
    ((-2, ("sglext", "input_ids"), [1, "a"]), (0, ("prompt_token_ids",), [1, "a"])),
    ((-2, ("sglext",), "abc"), (0, ("prompt_token_ids",), [-1])),
]


def faulty_stream(dialect, chunk: int, path: tuple, value: Any) -> list[bytes]:
    chunks = stream_chunks(dialect)
    if path:
        chunks[chunk] = put(chunks[chunk], resolve(path, dialect), value)
    else:
        chunks[chunk] = value
    return stream_lines(chunks)


@pytest.mark.parametrize("dialect", [SGLANG, VLLM], ids=["sglang", "vllm"])
@pytest.mark.parametrize(("chunk", "path", "value", "named"), STREAM_FAULTS,
                         ids=[f"{c}:{'.'.join(map(str, p))}={v!r}" for c, p, v, _ in STREAM_FAULTS])
def test_a_streamed_answer_with_a_field_of_the_wrong_type_is_the_servers_bad_response(dialect, chunk, path, value, named):
    with pytest.raises(BadResponseError) as raised:
        parse_chat_stream(faulty_stream(dialect, chunk, path, value), dialect)
    assert raised.value.outcome == "server" and raised.value.status == 200
    assert named in raised.value.message


@pytest.mark.parametrize(("sglang", "vllm"), STREAM_ID_FAULTS, ids=[str(s[2]) for s, _ in STREAM_ID_FAULTS])
def test_streamed_token_ids_that_are_not_ids_are_the_servers_bad_response(sglang, vllm):
    for dialect, (chunk, path, value) in ((SGLANG, sglang), (VLLM, vllm)):
        with pytest.raises(BadResponseError) as raised:
            parse_chat_stream(faulty_stream(dialect, chunk, path, value), dialect)
        assert raised.value.outcome == "server"


# --- end to end, over real HTTP ------------------------------------------------------------------

#: What the server below answers to a prompt that names a fault, plain and streamed: the body of
#: ``plain_body`` or the chunks of ``stream_chunks`` with one field changed.
E2E_FAULTS = {
    "content-list": (("choices", 0, "message", "content"), [{"type": "text", "text": "x"}],
                     1, ("choices", 0, "delta", "content"), ["x"]),
    "finish-unhashable": (("choices", 0, "finish_reason"), ["stop"], 4, ("choices", 0, "finish_reason"), {"a": 1}),
    "usage-text": (("usage", "completion_tokens"), "7", -1, ("usage", "completion_tokens"), "7"),
    "ids-not-ints": (("IDS_OUTPUT",), ["a"], -2, ("sglext", "output_ids", 0), ["a"]),
}


class ShapeServer(http.server.ThreadingHTTPServer):
    """An SGLang-like chat endpoint: answers a prompt naming a fault (``[fault:<name>]``) in that
    shape while ``faulty`` is set, and every other prompt well."""

    daemon_threads = True
    faulty = True


class _Handler(http.server.BaseHTTPRequestHandler):
    server: ShapeServer

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = request["messages"][-1]["content"]
        fault = next((name for name in E2E_FAULTS if f"[fault:{name}]" in prompt), None) if self.server.faulty else None
        if request.get("stream"):
            chunks = stream_chunks(SGLANG)
            if fault is not None:
                _, _, chunk, path, value = E2E_FAULTS[fault]
                chunks[chunk] = put(chunks[chunk], resolve(path, SGLANG), value)
            body = b"".join(line + b"\n\n" for line in stream_lines(chunks))
            content_type = "text/event-stream"
        else:
            document = plain_body(SGLANG)
            if fault is not None:
                path, value, *_ = E2E_FAULTS[fault]
                document = put(document, resolve(path, SGLANG), value)
            body, content_type = json.dumps(document).encode(), "application/json"
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def shape_server() -> Iterator[tuple[ShapeServer, str]]:
    [port] = free_ports(1)
    server = ShapeServer(("127.0.0.1", port), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        server.shutdown()
        server.server_close()


def work(faults_every: int) -> list[WorkItem]:
    """24 prompts, every ``faults_every``-th naming a fault in turn; those are expected longer, so
    that the canary (the shortest) is answered well."""
    names = list(E2E_FAULTS)
    items = []
    for i in range(24):
        faulty = i % faults_every == faults_every - 1
        fault = f" [fault:{names[(i // faults_every) % len(names)]}]" if faulty else ""
        items.append(WorkItem(
            key=f"k{i:03d}", prompt_id=f"p{i:03d}", source="s",
            messages=[{"role": "user", "content": f"Question {i}.{fault}"}],
            prompt_tokens=8, max_tokens=64, expected_output_tokens=50 if faulty else 8,
        ))
    return items


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "plain"])
def test_a_server_answering_wrong_shapes_fails_those_requests_only_and_a_rerun_completes_them(
    tmp_path, shape_server, streamed
):
    server, url = shape_server
    store = CompletionStore(tmp_path)
    items = work(faults_every=3)  # a third answered in a wrong shape
    config = default_engine(backoff_initial_s=0.01, progress_interval_s=3600, stop_degenerate=streamed,
                          breaker_window=1000)

    def run(todo: list[WorkItem]):
        with store.writer("shard-00") as writer:
            return generate_shard(todo, [Server(url, 4, dialect=SGLANG)], writer=writer, model="m",
                                  sampling=default_sampling(), config=config)

    report = run(items)
    faulty = {i.key for i in items if "[fault:" in i.messages[-1]["content"]}
    scan = store.scan("shard-00")
    # Every prompt ended as a record: the worker that read each bad answer lived on.
    assert scan.done == {i.key for i in items} - faulty and scan.failed == faulty
    assert report.failures_by_kind == {"bad_response": len(faulty)} and report.aborted is None
    failures = store.latest_failures("shard-00")
    assert {f["outcome"] for f in failures} == {"server"} and {f["error"] for f in failures} == {"bad_response"}

    # The server's fault is never final: a re-run asks those prompts again, and only those.
    server.faulty = False
    rerun = run([i for i in items if i.key not in scan.done])
    assert rerun.ok == len(faulty)
    final = store.scan("shard-00")
    assert final.done == {i.key for i in items} and not final.failed and final.duplicates == 0
