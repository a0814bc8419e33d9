"""Streamed answers on a real SGLang server: a stopped stream frees its slot, as its /v1/loads shows.

Closing the stream is how the client stops a degenerate answer (``servers.send_chat`` leaves
its ``client.stream`` block with the body unread, and the connection closes). How SGLang learns
of it, read in the installed server's source (sglang 0.5.23, ``.venv-sglang``): the stream's
generator is cancelled when the client goes, the cancellation reaches
``TokenizerManager.generate_request`` (``srt/managers/tokenizer_manager.py``), whose
``except BaseException`` calls ``_release_req_states_on_failure``: the request, dispatched to the
scheduler, is aborted there at once (the response's background ``create_abort_task``, an abort
2 s after the stream ends, is only a fallback). The scheduler then finishes it as aborted and
frees its KV cache and its slot.

Then proved here against the server's own ``/v1/loads`` (``num_running_reqs``,
``num_used_tokens``: SLOTS running, then none, and no KV cache in use; on CI within a second of
the last close, a figure the test records rather than bounds) and its counters (each request aborted, none generated to its end, the tokens it
generated about what the client read), and SLOTS fresh requests answered at once.

SGLang's stream interval is a launch flag (``--stream-interval``, which it reports): the first
token comes alone, then one event per interval tokens; the client counts a stopped answer's
tokens by that rule (``ChatStream.streamed_tokens``). Outputs that pile up while SGLang's handler
is held up go out as one event (``TokenizerManager._wait_one_response`` merges its ``out_list``),
as a loaded CPU makes happen: the count is exact on an idle machine, never more than was read.
"""

from __future__ import annotations

import time

import pytest

from expansion_dag.servers import SGLANG
from expansion_dag_tests.real_engine.conftest import CONTEXT_LENGTH, SLOTS, STREAM_INTERVAL
from expansion_dag_tests.real_engine.support import (
    FREE_TIMEOUT_S,
    LOOP_MESSAGES,
    LOOP_TEXT,
    LOOP_THRESHOLDS,
    SglangServer,
    answer_at_once,
    looping_request,
    stop_looping_streams,
)


def wait_until_free(server: SglangServer) -> dict:
    """Poll /v1/loads until nothing runs or waits and no KV cache is in use: that load."""
    deadline = time.monotonic() + FREE_TIMEOUT_S
    while True:
        load = server.load()
        if load["num_running_reqs"] == load["num_waiting_reqs"] == load["num_used_tokens"] == 0:
            return load
        if time.monotonic() > deadline:
            pytest.fail(f"SGLang's slots were not free {FREE_TIMEOUT_S:.0f} s after the streams closed: {load}")
        time.sleep(0.02)


def test_a_stopped_stream_frees_its_slot_at_once(sglang_server: SglangServer, figures):
    server = sglang_server
    server.wait_idle()
    max_tokens = CONTEXT_LENGTH - len(server.tokenize(LOOP_MESSAGES)) - 8  # near the context: a loop would run long
    request = looping_request(server, LOOP_MESSAGES, max_tokens, SGLANG)
    assert "stream_interval" not in request.body()  # SGLang's chat API has no such field: its launch flag says
    before = server.metrics()

    started = time.monotonic()
    stopped, closed_at, running_at_once = stop_looping_streams(
        server, request, SGLANG, LOOP_THRESHOLDS, count=SLOTS, stream_interval=STREAM_INTERVAL
    )
    wait_until_free(server)
    freed_s = time.monotonic() - closed_at  # from the last close to the load that said so
    time.sleep(1.0)  # long enough for many more decode steps, were any still running
    settled = server.metrics()

    tokens = "sglang:generation_tokens_total"
    generated_tokens = settled.get(tokens, 0) - before.get(tokens, 0)
    client_tokens = [e.tokens for e in stopped]
    measured = figures["sglang"]["stopped_stream"] = {
        "requests": SLOTS,
        "max_tokens_each": max_tokens,
        "running_at_once": running_at_once,
        "tokens_asked": max_tokens * SLOTS,
        "tokens_generated": int(generated_tokens),
        "tokens_seen_by_client": sum(client_tokens),
        "tokens_read_by_client": sum(len(e.content) // len(LOOP_TEXT) for e in stopped),
        "s_streams_to_stop": round(closed_at - started, 2),
        "s_last_close_to_slots_free": round(freed_s, 3),
        "aborted": server.aborted(before, settled),
        "generated_to_their_end": server.generated(before, settled),
    }
    assert running_at_once == SLOTS, measured
    for e in stopped:  # the client saw the loop it was made to write, and stopped early
        assert e.loop.span == LOOP_TEXT and 0 < e.tokens < max_tokens // 4
        # Counted from the events by the stream interval SGLang runs with: no event between the
        # first and the last carries fewer tokens, so never more than the client read (the same
        # unless SGLang merged events: ``measured``).
        assert e.tokens <= len(e.content) // len(LOOP_TEXT), measured
    # Each request was aborted and none ran to its cap; the engine decoded at least what the clients
    # read. How much more, and how soon the slots were free, depend on the machine's speed: they are
    # figures (``measured``), not bounds (CI: 140 of 916 tokens generated, 132 read, 1.0 s to stop).
    assert measured["aborted"] == SLOTS and measured["generated_to_their_end"] == 0, measured
    assert measured["tokens_read_by_client"] <= generated_tokens, measured
    assert server.queue() == (0, 0)

    # The slots are free: SLOTS fresh requests are all admitted and answered.
    answers, fresh_s = answer_at_once(server, LOOP_MESSAGES, 8, SGLANG, count=SLOTS)
    measured["s_fresh_requests_after_free"] = round(fresh_s, 2)
    assert [a.completion_tokens for a in answers] == [8] * SLOTS
