"""Every answer is checked before it becomes final: the model it names, the context it had, its time
and its size. Each fault comes from a small server of this file's own, over real HTTP on 127.0.0.1,
one fault each (a prompt naming ``[fault:<name>]`` gets it while ``faulty`` is set): an answer it
spoils is that server's fault, never a row and never final, and a re-run on a sound server asks it
again. The model's own outcomes (stop, length) stay final.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.server
import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from expansion_dag.core import OversizedError, ShardAborted, is_final
from expansion_dag.defs.assets import CHECK_CONTEXT_REJECTIONS, stored_checks
from expansion_dag.defs.resources import GenerationSettings
from expansion_dag.generation import Server, WorkItem, generate_shard, shard_figures
from expansion_dag.generation import WeightsWatch
from expansion_dag.servers import (
    PROBE_MESSAGES,
    SGLANG,
    VLLM,
    AnswerIdentity,
    ChatStream,
    ServerInfo,
    probe_weights,
)
from expansion_dag.store import CompletionStore
from expansion_dag_tests.helpers import default_engine, default_sampling
from expansion_dag_tests.ports import free_ports

MODEL = "m"
CONTEXT = 8192
#: The prompt tokens the ``capped`` fault counts beyond what leaves room for the retry (see there).
OVERFLOW = (
    "Requested token count exceeds the model's maximum context length of {c} tokens. You requested a total "
    "of {m} tokens: {x} tokens from the input messages and {y} tokens for the completion. Please reduce the "
    "number of tokens in the input messages or the completion to fit within the limit."
)
#: How long a fault that never ends keeps at it: a test whose client did not stop it fails, not hangs.
FOREVER_S = 120.0


class FaultServer(http.server.ThreadingHTTPServer):
    """A chat endpoint, SGLang- or vLLM-shaped, answering each prompt well unless it names a fault."""

    daemon_threads = True

    def __init__(self, port: int):
        super().__init__(("127.0.0.1", port), _Handler)
        self.faulty = True
        #: Seconds between an answer's first text and the rest: a speed the client can measure.
        self.pause = 0.0
        self.closing = threading.Event()
        #: What the weights answer the weights' probe, and how often it was asked.
        self.probe_answer = "A keeper counts the ships"
        self.probes = 0


def chunk(content: str | None = None, *, finish: str | None = None, model: str = MODEL) -> dict[str, Any]:
    delta = {} if content is None else {"content": content}
    return {"object": "chat.completion.chunk", "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def unique_text(n: int) -> str:
    """Text that never repeats (no loop to stop): ``n`` hex digests."""
    return " ".join(hashlib.sha256(str(i).encode()).hexdigest() for i in range(n))


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FaultServer

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = request["messages"][-1]["content"]
        found = re.search(r"\[fault:([a-z0-9-]+)\]", prompt) if self.server.faulty else None
        fault = found.group(1) if found else None
        try:
            if prompt == PROBE_MESSAGES[0]["content"]:
                self.server.probes += 1
                self.answer(request, self.server.probe_answer)
            elif fault is None:
                self.answer(request, f"An answer to: {prompt}")
            else:
                getattr(self, "fault_" + fault.replace("-", "_"))(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client stopped reading: what the tests want of it

    # --- well-formed answers ---------------------------------------------------------------------

    def answer(self, request: dict[str, Any], text: str, *, finish: str = "stop", tokens: int | None = None,
               model: str = MODEL, metadata: dict[str, Any] | None = None) -> None:
        usage = {"prompt_tokens": 12, "completion_tokens": tokens if tokens is not None else len(text.split()) + 1}
        if not request.get("stream"):
            body = {"object": "chat.completion", "model": model, "usage": usage,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": finish}],
                    **({"metadata": metadata} if metadata else {})}
            self.send_json(200, body)
            return
        self.start_stream()
        head, _, rest = text.partition(" ")
        self.event(chunk(head, model=model))
        if self.server.pause:
            time.sleep(self.server.pause)
        self.event(chunk(" " + rest, model=model))
        self.event(chunk(finish=finish, model=model))
        self.event({"object": "chat.completion.chunk", "model": model, "choices": [], "usage": usage})
        self.wfile.write(b"data: [DONE]\n\n")

    def send_json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def start_stream(self) -> None:
        # No Content-Length: the body ends when this HTTP/1.0 server closes the connection.
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

    def event(self, document: dict[str, Any]) -> None:
        self.wfile.write(b"data: " + json.dumps(document).encode() + b"\n\n")
        self.wfile.flush()

    def keep_alives(self) -> None:
        """SSE comments, as a proxy sends to keep a connection open, and nothing else."""
        until = time.monotonic() + FOREVER_S
        while time.monotonic() < until and not self.server.closing.wait(0.05):
            self.wfile.write(b": keep-alive\n\n")
            self.wfile.flush()

    # --- one fault each ----------------------------------------------------------------------------

    def fault_silent(self, request: dict[str, Any]) -> None:
        """Accepts the request and says nothing."""
        self.server.closing.wait(FOREVER_S)

    def fault_keepalive(self, request: dict[str, Any]) -> None:
        """A 200 and keep-alives, never a token."""
        self.start_stream()
        self.keep_alives()

    def fault_trickle(self, request: dict[str, Any]) -> None:
        """The first text, then keep-alives only."""
        self.start_stream()
        self.event(chunk("Well"))
        self.keep_alives()

    def fault_endless(self, request: dict[str, Any]) -> None:
        """Text that never repeats and never ends, whatever max_tokens said."""
        self.start_stream()
        until, i = time.monotonic() + FOREVER_S, 0
        while time.monotonic() < until:
            self.event(chunk(hashlib.sha256(str(i).encode()).hexdigest() + " "))
            i += 1

    def fault_usage_lie(self, request: dict[str, Any]) -> None:
        """A finished answer of 2,000 digests (130 kB) whose usage claims 10 tokens."""
        self.answer(request, unique_text(2000), tokens=10)

    def fault_other_model(self, request: dict[str, Any]) -> None:
        """A router's share of the traffic answered by another model, which names itself (vLLM)."""
        self.answer(request, "An answer of another model.", model="evil/other-model")

    def fault_other_weights(self, request: dict[str, Any]) -> None:
        """Another SGLang's weights: it echoes the request's model, its metadata names its weights."""
        self.answer(request, "An answer of other weights.", model=request["model"], metadata={"weight_version": "v2"})

    def fault_context_3100(self, request: dict[str, Any]) -> None:
        """A server launched with a smaller context than the one probed behind it."""
        y = request["max_tokens"]
        message = OVERFLOW.format(c=3100, m=3090 + y, x=3090, y=y)
        self.send_json(400, {"object": "error", "message": message, "type": "BadRequestError", "code": 400})

    def fault_capped(self, request: dict[str, Any]) -> None:
        """The probed context, but 40 more prompt tokens than the client counted: the retry's smaller
        max_tokens (its own numbers, less the margin: 34) is all it writes."""
        prompt, y = CONTEXT - 50, request["max_tokens"]
        if prompt + y > CONTEXT:
            message = OVERFLOW.format(c=CONTEXT, m=prompt + y, x=prompt, y=y)
            self.send_json(400, {"object": "error", "message": message, "type": "BadRequestError", "code": 400})
        else:
            self.answer(request, "A start cut short by the server's cap", finish="length", tokens=y)


@pytest.fixture
def fault_server() -> Iterator[tuple[FaultServer, str]]:
    [port] = free_ports(1)
    server = FaultServer(port)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        server.closing.set()
        server.shutdown()
        server.server_close()


def work(n: int, faults: dict[int, str], *, max_tokens: int = 64) -> list[WorkItem]:
    """``n`` prompts, prompt ``i`` naming ``faults[i]``; prompt ``i`` is expected ``10 + i`` tokens
    long, so the canary (the shortest) is prompt 0, and the others go longest first."""
    return [
        WorkItem(key=f"k{i:03d}", prompt_id=f"p{i:03d}", source="s",
                 messages=[{"role": "user", "content": f"Question {i}." + (f" [fault:{faults[i]}]" if i in faults else "")}],
                 prompt_tokens=8, max_tokens=max_tokens, expected_output_tokens=10 + i)
        for i in range(n)
    ]


def engine(**changes: Any):
    return default_engine(**{"backoff_initial_s": 0.01, "progress_interval_s": 3600, "stop_degenerate": True,
                             "breaker_window": 1000, **changes})


def run(store: CompletionStore, items: list[WorkItem], server: Server, **changes: Any):
    with store.writer("shard-00") as writer:
        return generate_shard(items, [server], writer=writer, model=MODEL, sampling=default_sampling(),
                              config=engine(**changes))


def failure_of(store: CompletionStore, prompt_id: str) -> dict[str, Any]:
    return next(f for f in store.latest_failures("shard-00") if f["prompt_id"] == prompt_id)


def rerun_on_a_sound_server(server: FaultServer, store: CompletionStore, items: list[WorkItem], target: Server,
                            **changes: Any) -> None:
    """The server's faults are never final: a re-run asks those prompts again, and only those."""
    server.faulty = False
    done = store.scan("shard-00").done
    todo = [i for i in items if i.key not in done]
    assert todo
    report = run(store, todo, target, **changes)
    assert report.ok == len(todo)
    final = store.scan("shard-00")
    assert final.done == {i.key for i in items} and final.duplicates == 0


# --- 1. the context a 400 states -----------------------------------------------------------------


def test_a_400_over_another_context_than_the_probed_one_stops_the_shard_and_fails_the_blocking_check(
    tmp_path, fault_server
):
    server, url = fault_server
    store = CompletionStore(tmp_path)
    items = work(12, {5: "context-3100", 9: "context-3100"})
    target = Server(url, 2, context_length=CONTEXT)
    with pytest.raises(ShardAborted, match="context of 3100 tokens, but it was probed at 8192") as aborted:
        run(store, items, target)
    assert aborted.value.report.retries_by_kind["context_length"] == 0  # no retry with the wrong numbers
    failure = failure_of(store, "p009")  # the first sent of the two: longest first
    assert (failure["error"], failure["outcome"]) == ("context_mismatch", "server") and not is_final(failure, ())
    keys = {i.key for i in items}
    figures = shard_figures(store.latest_records(shards=["shard-00"]), keys, lambda r: True)
    [check] = [c for c in stored_checks(figures, GenerationSettings()) if c.check_name == CHECK_CONTEXT_REJECTIONS]
    assert not check.passed
    rerun_on_a_sound_server(server, store, items, target)


def test_an_answer_cut_by_the_cap_the_server_forced_is_not_final_and_a_rerun_asks_it_again(tmp_path, fault_server):
    server, url = fault_server
    store = CompletionStore(tmp_path)
    items = work(8, {4: "capped"})
    target = Server(url, 2, context_length=CONTEXT)
    report = run(store, items, target, margin=16, min_output_tokens=16)
    assert report.context_retries == 1 and report.aborted is None
    failure = failure_of(store, "p004")
    assert (failure["error"], failure["outcome"], failure["max_tokens"]) == ("context_capped", "request", 34)
    assert not is_final(failure, ()) and store.scan("shard-00").done == {i.key for i in items} - {"k004"}
    figures = shard_figures(store.latest_records(shards=["shard-00"]), {i.key for i in items}, lambda r: True)
    assert figures.context_length_failures == 1 and figures.truncated == 0  # not an answer at its budget
    rerun_on_a_sound_server(server, store, items, target)


# --- 2. the model an answer names ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("dialect", "fault", "streamed"),
    [(VLLM, "other-model", True), (VLLM, "other-model", False), (SGLANG, "other-weights", False)],
    ids=["vllm-streamed", "vllm-plain", "sglang-plain"],
)
def test_an_answer_of_another_model_is_the_servers_bad_response_never_a_row(
    tmp_path, fault_server, dialect, fault, streamed
):
    server, url = fault_server
    store = CompletionStore(tmp_path)
    faulty = {3, 6, 9, 11}
    items = work(12, dict.fromkeys(faulty, fault))
    info = ServerInfo(url=url, backend=dialect.backend, model=MODEL, model_path=MODEL, context_length=CONTEXT, slots=2,
                      slots_source="server", max_req_input_len=None, version=None, simulator=False, dialect=dialect)
    target = Server(url, 2, dialect=dialect, identity=info.identity)
    report = run(store, items, target, stop_degenerate=streamed)
    assert report.failures_by_kind == {"other_model": len(faulty)} and report.aborted is None
    assert store.scan("shard-00").failed == {f"k{i:03d}" for i in faulty}
    failure = failure_of(store, "p003")
    assert failure["outcome"] == "server"
    assert ("evil/other-model" if dialect is VLLM else "weights \"v2\", not 'default'") in failure["message"]
    rerun_on_a_sound_server(server, store, items, target, stop_degenerate=streamed)


@pytest.mark.parametrize("switched", [False, True], ids=["same-weights", "other-weights"])
def test_a_long_run_asks_the_weights_probe_again_and_stops_when_the_weights_changed(
    tmp_path, fault_server, switched
):
    server, url = fault_server
    server.pause = 0.05  # four answers a worker: the run lasts several probe intervals
    info = ServerInfo(url=url, backend="sglang", model=MODEL, model_path=MODEL, context_length=CONTEXT, slots=2,
                      slots_source="server", max_req_input_len=None, version="0.5.23", simulator=False,
                      dialect=SGLANG)
    expected = asyncio.run(probe_weights(info, None))  # the run's start
    if switched:  # a fine-tune copied over the model's folder, the server restarted under the same name
        server.probe_answer = "Lanterns turn over the sea"
    watch = WeightsWatch(url, expected, lambda: probe_weights(info, None), every_s=0.05)
    store = CompletionStore(tmp_path)
    items = work(16, {})
    with store.writer("shard-00") as writer:
        run_shard = lambda: generate_shard(items, [Server(url, 2)], writer=writer, model=MODEL,  # noqa: E731
                                           sampling=default_sampling(), config=engine(), weights=watch)
        if switched:
            with pytest.raises(ShardAborted, match="the weights probe, asked again, answers otherwise"):
                run_shard()
        else:
            assert run_shard().ok == len(items)
    assert server.probes >= 2  # the start's, and at least one while the run went


def test_what_an_answer_must_say_of_itself_is_each_servers_own():
    common = dict(url="u", model="served", model_path="p", context_length=CONTEXT, slots=1, slots_source="server",
                  max_req_input_len=None, version=None, simulator=False)
    # SGLang echoes the request's model: only its weights' version says anything ("default": unset).
    assert ServerInfo(backend="sglang", dialect=SGLANG, **common).identity == AnswerIdentity(weight_version="default")
    sglang = ServerInfo(backend="sglang", dialect=SGLANG, weight_version="v1", **common)
    assert sglang.identity == AnswerIdentity(weight_version="v1")
    assert ServerInfo(backend="vllm", dialect=VLLM, **common).identity == AnswerIdentity(model="served")


# --- 3. its time ---------------------------------------------------------------------------------


#: Deadlines of a few seconds against reads that may each take an hour: only a deadline ends these.
#: A plain canary's (its first text is its whole answer): 0.5 s + 4 x 64 tokens at 256 tokens/s.
SHORT_DEADLINES = dict(first_output_timeout_s=0.5, deadline_slack=4.0, floor_stream_rate=256.0,
                       request_timeout_s=3600.0, max_attempts=5)


@pytest.mark.parametrize("fault", ["silent", "keepalive"])
@pytest.mark.parametrize(("streamed", "said"), [(True, "no text within 0.5 s"),
                                                 (False, "no end of the answer within 1.5 s")], ids=["streamed", "plain"])
def test_a_server_that_says_nothing_fails_the_canary_at_its_first_text_deadline(
    tmp_path, fault_server, fault, streamed, said
):
    server, url = fault_server
    store = CompletionStore(tmp_path)
    items = work(6, {0: fault})
    started = time.monotonic()
    with pytest.raises(ShardAborted, match=rf"canary request to .* failed \(deadline: {said}"):
        run(store, items, Server(url, 2), stop_degenerate=streamed, **SHORT_DEADLINES)
    assert time.monotonic() - started < 600  # far under the 5 h the per-read timeouts alone would take
    failure = failure_of(store, "p000")
    assert (failure["error"], failure["outcome"], failure["attempts"]) == ("deadline", "server", 1)
    rerun_on_a_sound_server(server, store, items, Server(url, 2), stop_degenerate=streamed)


def test_a_server_that_trickles_from_its_first_request_fails_each_at_the_floor_speeds_deadline(
    tmp_path, fault_server
):
    server, url = fault_server
    store = CompletionStore(tmp_path)
    items = work(6, dict.fromkeys(range(6), "trickle"))  # no answer ever: its speed is never measured
    started = time.monotonic()
    report = run(store, items, Server(url, 2), **SHORT_DEADLINES)
    assert time.monotonic() - started < 600  # not the 2 minutes each fault keeps up its keep-alives
    # The canary passed at its first text; each request then ended at the floor speed's deadline.
    assert report.failures_by_kind == {"deadline": 6} and report.ok == 0 and report.aborted is None
    failure = failure_of(store, "p003")
    assert (failure["outcome"], failure["attempts"]) == ("server", 1)
    assert "no end of the answer within 1.5 s" in failure["message"]
    rerun_on_a_sound_server(server, store, items, Server(url, 2))


def test_a_stream_of_keep_alives_after_its_first_text_fails_at_its_deadline_and_the_rest_are_answered(
    tmp_path, fault_server
):
    server, url = fault_server
    server.pause = 0.02  # each answer decodes for a while: a speed to measure
    store = CompletionStore(tmp_path)
    items = work(16, {1: "trickle"})  # sent last, once the speed of the 14 before it is known
    # Its deadline: 2 s, plus 4 x 64 tokens at the measured speed (about 200 tokens/s here): a
    # second or two, against an hour of keep-alives, each of which resets the per-read timeout.
    config = dict(first_output_timeout_s=2.0, deadline_slack=4.0, request_timeout_s=3600.0)
    report = run(store, items, Server(url, 2), **config)
    assert report.failures_by_kind == {"deadline": 1} and report.ok == 15 and report.aborted is None
    failure = failure_of(store, "p001")
    assert (failure["outcome"], failure["attempts"]) == ("server", 1)
    assert "no end of the answer within" in failure["message"]
    rerun_on_a_sound_server(server, store, items, Server(url, 2), **config)


# --- 4. its size ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "streamed", "max_tokens", "named"),
    [
        ("endless", True, 64, "the stream's text passed 20,480 characters"),
        ("usage-lie", True, 4096, "says 10 tokens for"),
        ("usage-lie", False, 4096, "says 10 tokens for"),
    ],
    ids=["endless-stream", "usage-lie-streamed", "usage-lie-plain"],
)
def test_an_answer_past_what_its_tokens_allow_is_the_servers_fault(
    tmp_path, fault_server, fault, streamed, max_tokens, named
):
    server, url = fault_server
    store = CompletionStore(tmp_path)
    items = work(8, {3: fault, 6: fault}, max_tokens=max_tokens)
    report = run(store, items, Server(url, 2), stop_degenerate=streamed)
    assert report.failures_by_kind == {"oversized": 2} and report.aborted is None
    failure = failure_of(store, "p003")
    assert failure["outcome"] == "server" and named in failure["message"]
    rerun_on_a_sound_server(server, store, items, Server(url, 2), stop_degenerate=streamed)


def test_an_event_without_a_newline_is_read_whole_and_stopped_past_its_bytes():
    piece = b"x" * 65536
    stream = ChatStream(SGLANG, stream_interval=1, max_tokens=8192)
    # A long event in many reads is put together once its newline comes.
    event = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"y" * 1_000_000 + b'"}}]}'
    for i in range(0, len(event), 4096):
        assert stream.feed(event[i:i + 4096]) is None
    stream.feed(b"\n\n")
    assert stream.content == "y" * 1_000_000
    # One that never ends is stopped once past the bytes the request allows (64 tokens: 8.4 MB).
    stream = ChatStream(SGLANG, stream_interval=1, max_tokens=64)
    fed = 0
    with pytest.raises(OversizedError, match="the stream passed 8,470,528 bytes"):
        stream.feed(b"data: {")
        for _ in range(40 * 16):  # 40 MB
            stream.feed(piece)
            fed += len(piece)
    assert fed < 9_000_000
