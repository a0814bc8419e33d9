"""A real trained model's loops, stopped by the client: SmolLM2-135M-Instruct on a real vLLM server.

What only a trained model shows: left to itself, it loops on these prompts (greedy decoding, so
a machine's runs all write the same answer). Each answer is streamed through the project's own
client (``send_chat``, as the engine sends it) with the default loop thresholds, and a loop must be
stopped well before its cap with the rule that saw it named. On the machine that recorded them
(``greedy`` in ``data/real_model_answers.jsonl.gz``, read in full to 1,200 or 1,500 tokens) every
one loops: a ``#define`` line, a function or an enum said again and again, and a recurrence
counting on past ``a(28)`` from about token 375. Another machine's CPU kernels change greedy
answers (CI's wrote a C header that ended), so the test holds what any machine must show: no
answer runs to the cap, and most are loops stopped early.

The server is the suite's real-model vLLM (``real_vllm_server``: the folder CI builds,
``.models/smollm2-135m-instruct``; see ``docs/development.md``).
"""

from __future__ import annotations

import asyncio
import pytest

from expansion_dag.servers import LOOP_RULES, VLLM, Answer, DegenerateError, chat_request, send_chat
from expansion_dag_tests.helpers import loop_thresholds
from expansion_dag_tests.real_engine.support import GREEDY, REQUEST_TIMEOUT_S, VllmServer, stream_client

MAX_TOKENS = 3072
#: Events of a few tokens, so that a stop comes within a few tokens of the rule seeing the loop.
STREAM_INTERVAL = 16
#: Prompts whose greedy answers loop (the recording's ids), the earliest stopped first.
LOOPING_PROMPTS = [
    "Write a C header that defines constants for the error codes of a file parser.",  # greedy#14
    "Write a python program that reads a JSON file and prints every key at every depth, with tests.",  # greedy#5
    "Write a c++ function that counts how many times each word appears in a text file and prints the ten "
    "most common.",  # greedy#0
    "Write a Java enum of the 50 US states with their abbreviations.",  # greedy#23
    "Solve the recurrence a(n) = a(n-1) + 6 with a(1) = 9 and list a(1) to a(28).",  # greedy#12: counts on
]
#: How many must loop and be stopped on any machine (all do on the recording's).
LEAST_STOPPED = 3
#: The session's server may not have started yet: its start counts against this test.
pytestmark = pytest.mark.timeout(900)


def test_the_real_model_loops_are_stopped_early_with_the_rule_named(real_vllm_server: VllmServer):
    server = real_vllm_server

    async def stream(prompt: str) -> DegenerateError | Answer:
        request = chat_request(
            str(server.model_dir), [{"role": "user", "content": prompt}], MAX_TOKENS, GREEDY,
            stream=True, stream_interval=STREAM_INTERVAL, continuous_usage=VLLM.continuous_usage,
        )  # fmt: skip
        async with stream_client(server) as client:
            try:
                # The timeout is for a hang only: a loop run to the cap ends well within it. An answer
                # run to the cap unstopped raises (finish_reason length) and fails the test.
                return await asyncio.wait_for(send_chat(client, server.url, request, VLLM, loop_thresholds(),
                                                        stream_interval=STREAM_INTERVAL), 10 * REQUEST_TIMEOUT_S)  # fmt: skip
            except DegenerateError as error:
                return error

    async def all_of_them() -> list[DegenerateError | Answer]:
        return await asyncio.gather(*(stream(prompt) for prompt in LOOPING_PROMPTS))

    outcomes = asyncio.run(all_of_them())
    stops = [error for error in outcomes if isinstance(error, DegenerateError)]
    ended = {prompt: f"{a.completion_tokens} tokens, ending {a.content[-300:]!r}"
             for prompt, a in zip(LOOPING_PROMPTS, outcomes) if isinstance(a, Answer)}  # fmt: skip
    assert len(stops) >= LEAST_STOPPED, f"too few loops stopped; these ended on their own: {ended}"
    for error in stops:
        # Which rule sees a loop first depends on the greedy answer, which a machine's CPU kernels
        # change (the counting answer repeats exactly on some): the stop names the rule that saw it.
        assert error.rule in LOOP_RULES and f"rule {error.rule}:" in error.message, error.message
        # Early: within the first third of the cap, and the loop's text is what it stopped on.
        assert error.tokens < MAX_TOKENS / 3
        # vLLM streamed as the request asked: the first token alone, then STREAM_INTERVAL an event
        # (the count is the server's own, from each event's usage).
        assert (error.tokens - 1) % STREAM_INTERVAL == 0, error.tokens
        assert error.loop.span in error.content
        if error.rule == "counter":
            assert error.loop.repeats >= loop_thresholds().counter_repeats and "a(" in error.loop.span
    server.wait_idle()  # the stops freed both slots
