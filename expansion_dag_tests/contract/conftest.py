"""The simulator side of the contract: one simulated server per dialect, version and setting."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from expansion_dag.core import count_prompt_tokens, load_tokenizer
from expansion_dag.sim import SimServerConfig, SimulatedFleet

API_KEY = "contract-key"
CONTEXT = 512
#: A KV cache smaller than the context, so that SGLang's max_req_input_len (394) binds first.
KV_TOKENS = 400
VLLM_NAME = "qwen3-8b"

_FAST = {"ttft_s": 0.001, "token_latency_s": 0.0001, "output_median_tokens": 40, "api_key": API_KEY}
#: name -> the simulated server the scenarios of that name talk to.
SIMULATORS = {
    "sglang": SimServerConfig(
        port=0, reasoning_parser="qwen3", context_length=CONTEXT, max_total_tokens=KV_TOKENS, **_FAST
    ),
    "sglang-abort": SimServerConfig(port=0, abort_rate=1.0, **_FAST),
    # One slot, one queue place, and answers that never come: the third request finds the queue full.
    "sglang-queue": SimServerConfig(port=0, max_running_requests=1, max_queued_requests=1, hang_rate=1.0, **_FAST),
    "sglang-0.5.7": SimServerConfig(port=0, version="0.5.7", **_FAST),
    "sglang-0.5.4": SimServerConfig(port=0, version="0.5.4", **_FAST),
    "vllm": SimServerConfig(
        port=0, backend="vllm", reasoning_parser="qwen3", served_model_name=VLLM_NAME, context_length=CONTEXT, **_FAST
    ),
    "vllm-plain": SimServerConfig(
        port=0, backend="vllm", served_model_name=VLLM_NAME, context_length=CONTEXT, **_FAST
    ),
    # Launched with a tool-call parser, and calling a tool whenever a request offers one.
    "sglang-tools": SimServerConfig(port=0, tool_call_parser="qwen25", tool_call_share=1.0, **_FAST),
    "vllm-tools": SimServerConfig(
        port=0,
        backend="vllm",
        served_model_name=VLLM_NAME,
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
        tool_call_share=1.0,
        **_FAST,
    ),
}


class Provider:
    """What the scenarios ask of the servers that give the responses: a keyed client, the URL of
    each named server, the context and KV cache they run with, and prompts of chosen sizes
    (counted by the bundled Qwen3 tokenizer, the servers' own)."""

    def __init__(self, client: httpx.Client, context: int, kv_tokens: int) -> None:
        self.client = client
        self.context = context
        self.kv_tokens = kv_tokens
        self._tokenizer = load_tokenizer()

    def url(self, name: str) -> str:
        raise NotImplementedError

    def prompt_tokens(self, messages: list[dict], thinking: bool = True) -> int:
        kwargs = None if thinking else {"enable_thinking": False}
        return count_prompt_tokens(self._tokenizer, [messages], kwargs)[0]

    def messages_of(self, tokens: int) -> list[dict]:
        """A conversation of exactly ``tokens`` prompt tokens (each added word is one token)."""
        words = 0
        while True:
            messages = [{"role": "user", "content": "sea " * words}]
            count = self.prompt_tokens(messages)
            if count == tokens:
                return messages
            if count > tokens:
                raise AssertionError(f"no conversation of exactly {tokens} tokens (jumped to {count})")
            words += max(1, (tokens - count) // 2)


class Simulators(Provider):
    """The running simulated servers, one per name of ``SIMULATORS``."""

    def __init__(self, fleet: SimulatedFleet, client: httpx.Client) -> None:
        super().__init__(client, CONTEXT, KV_TOKENS)
        self.fleet = fleet
        self._urls = dict(zip(SIMULATORS, fleet.urls, strict=True))

    def url(self, name: str) -> str:
        return self._urls[name]

    def stats(self, name: str) -> dict:
        return self.fleet.stats(list(SIMULATORS).index(name))


@pytest.fixture(scope="session")
def simulators() -> Iterator[Simulators]:
    with (
        SimulatedFleet(list(SIMULATORS.values())) as fleet,
        httpx.Client(timeout=10, headers={"Authorization": f"Bearer {API_KEY}"}) as client,
    ):
        yield Simulators(fleet, client)
