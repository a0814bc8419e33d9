"""A real trained model's loops, stopped by the client: SmolLM2-135M-Instruct on a real vLLM server.

What only a trained model shows: left to itself, it loops on these prompts (greedy decoding, so
every run writes the same answer), once repeating one line exactly and once counting on past what
it was asked (``a(94) = 102, a(95) = 103, ...`` for a list that ends at ``a(28)``). Each answer is
streamed through the project's own client (``send_chat``, as the engine sends it) with the default
loop thresholds, and must be stopped well before its cap with the rule that saw it named. Both
answers were read in full, greedy, to 1,200 tokens on this engine: the first repeats one
``#define`` line from its second line on, the second counts on past ``a(28)`` from about token 375.

The server is the suite's real-model vLLM (``real_vllm_server``: the folder CI builds,
``.models/smollm2-135m-instruct``; see ``docs/development.md``).
"""

from __future__ import annotations

import asyncio
import pytest

from expansion_dag.servers import LOOP_RULES, VLLM, DegenerateError, chat_request, send_chat
from expansion_dag_tests.helpers import loop_thresholds
from expansion_dag_tests.real_engine.support import GREEDY, REQUEST_TIMEOUT_S, VllmServer, stream_client

MAX_TOKENS = 3072
#: Events of a few tokens, so that a stop comes within a few tokens of the rule seeing the loop.
STREAM_INTERVAL = 16
#: (prompt, the rule that stops its answer).
LOOPING_PROMPTS = [
    ("Write a C header that defines constants for the error codes of a file parser.", "exact"),
    ("Solve the recurrence a(n) = a(n-1) + 6 with a(1) = 9 and list a(1) to a(28).", "counter"),
]
#: The session's server may not have started yet: its start counts against this test.
pytestmark = pytest.mark.timeout(900)


def test_the_real_model_loops_are_stopped_early_with_the_rule_named(real_vllm_server: VllmServer):
    server = real_vllm_server

    async def stream(prompt: str) -> DegenerateError | None:
        request = chat_request(
            str(server.model_dir), [{"role": "user", "content": prompt}], MAX_TOKENS, GREEDY,
            stream=True, stream_interval=STREAM_INTERVAL, continuous_usage=VLLM.continuous_usage,
        )  # fmt: skip
        async with stream_client(server) as client:
            try:
                # The timeout is for a hang only: a loop run to the cap ends well within it.
                await asyncio.wait_for(send_chat(client, server.url, request, VLLM, loop_thresholds(),
                                                 stream_interval=STREAM_INTERVAL), 10 * REQUEST_TIMEOUT_S)  # fmt: skip
            except DegenerateError as error:
                return error
        return None

    async def both() -> list[DegenerateError | None]:
        return await asyncio.gather(*(stream(prompt) for prompt, _ in LOOPING_PROMPTS))

    for (prompt, rule), error in zip(LOOPING_PROMPTS, asyncio.run(both())):
        assert error is not None, f"not stopped: {prompt}"
        # Which rule sees a loop first depends on the greedy answer, which a machine's CPU kernels
        # change (this counting answer repeats exactly on some): the stop names the rule that saw it.
        assert error.rule in LOOP_RULES and f"rule {error.rule}:" in error.message, (rule, error.message)
        # Early: within the first third of the cap, and the loop's text is what it stopped on.
        assert error.tokens < MAX_TOKENS / 3
        # vLLM streamed as the request asked: the first token alone, then STREAM_INTERVAL an event
        # (the count is the server's own, from each event's usage).
        assert (error.tokens - 1) % STREAM_INTERVAL == 0, error.tokens
        assert error.loop.span in error.content
        if error.rule == "counter":
            assert error.loop.repeats >= loop_thresholds().counter_repeats and "a(" in error.loop.span
    server.wait_idle()  # the stops freed both slots
