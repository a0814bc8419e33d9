"""Fixtures for the simulator tests: real servers on 127.0.0.1 ports, real HTTP with httpx."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import httpx
import pytest

from expansion_dag.core import count_prompt_tokens, load_tokenizer
from expansion_dag.sim import SimServerConfig, SimulatedFleet

#: Fast servers: a 40-token answer takes about 5 ms.
FAST = SimServerConfig(port=0, ttft_s=0.001, token_latency_s=0.0001, output_median_tokens=40)

USER = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.fixture
def fast() -> Callable[..., SimServerConfig]:
    """A fast server config with the given fields changed."""

    def config(**changes: object) -> SimServerConfig:
        return dataclasses.replace(FAST, **changes)

    return config


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer()


@pytest.fixture
def prompt_tokens(tokenizer) -> Callable[..., int]:
    """The server-side prompt count of one conversation, from expansion_dag.core.tokenizer."""

    def count(messages=USER, chat_template_kwargs=None) -> int:
        return count_prompt_tokens(tokenizer, [messages], chat_template_kwargs)[0]

    return count


@pytest.fixture
def start_fleet() -> Iterator[Callable[..., SimulatedFleet]]:
    """Start a fleet of the given configs; every fleet started is stopped after the test."""
    fleets: list[SimulatedFleet] = []

    def start(*configs: SimServerConfig, wait_ready: bool = True) -> SimulatedFleet:
        fleet = SimulatedFleet(list(configs), wait_ready=wait_ready)
        fleet.__enter__()
        fleets.append(fleet)
        return fleet

    yield start
    for fleet in reversed(fleets):
        fleet.__exit__(None, None, None)


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10) as c:
        yield c


@pytest.fixture
def chat(client) -> Callable[..., httpx.Response]:
    """POST /v1/chat/completions with ``messages`` and any other request fields."""

    def post(url: str, messages=USER, **fields: object) -> httpx.Response:
        return client.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": messages, **fields})

    return post
