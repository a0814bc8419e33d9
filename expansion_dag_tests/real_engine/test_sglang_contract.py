"""The SGLang contract fixtures, checked against the real server where it can give them.

The contract suite (``contract/test_contract.py``) holds SGLang 0.5.23's responses as read from
its source, and checks the simulator against them. Here the same scenarios go to the real server
of these tests (context 256, a KV cache of ``SGLANG_KV_TOKENS``), and the same checks run on its
answers: the status, the shape (keys and JSON types, recursively), an error's text in the
server's own format with the server's own numbers, and the client reading it as the server means
it. Where a fixture records a subset (``/server_info`` has some 550 keys), the server's other
keys are allowed; everywhere else the shape must be the same both ways.

A fixture this server cannot give is listed in ``SOURCE_ONLY`` with why: it stays proven by
source alone.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator

import httpx
import pytest

from expansion_dag_tests.contract.conftest import Provider
from expansion_dag_tests.contract.shapes import all_fixtures, load_fixture
from expansion_dag_tests.contract.test_contract import SCENARIOS, THINKING_OFF, _chat, check_response
from expansion_dag_tests.real_engine.support import SGLANG_KV_TOKENS, SglangServer

#: SGLang fixtures no request to this server can give, and why.
SOURCE_ONLY = {
    "sglang/chat_completion_reasoning": "needs a model that writes </think>: a random one does not",
    "sglang/error_queue_full": "needs --max-queued-requests, which the fleet's servers do not get",
    "sglang/chat_completion_tool_calls": "needs a model that writes <tool_call> and --tool-call-parser: a random one does not",
    "sglang/get_server_info_0.5.4": "another SGLang release",
    "sglang/get_load_0.5.4": "another SGLang release",
    "sglang/get_load_0.5.7": "another SGLang release",
}
ABORTED_RID = "contract-abort"


class RealSglang(Provider):
    """The real server as the scenarios' provider: every SGLang 0.5.23 scenario's server is it."""

    def __init__(self, server: SglangServer, client: httpx.Client) -> None:
        super().__init__(client, server.context_length, SGLANG_KV_TOKENS)
        self.server = server

    def url(self, name: str) -> str:
        return self.server.url


def _aborted_by_rid(s: RealSglang) -> httpx.Response:
    """A long answer, aborted by its ``rid`` once it runs (``/abort_request``): the abort fixture."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(_chat, s, "sglang", chat_template_kwargs=THINKING_OFF, max_tokens=s.context // 2,
                             rid=ABORTED_RID, ignore_eos=True)
        deadline = time.monotonic() + 30
        while s.server.running() == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        s.client.post(s.url("sglang") + "/abort_request", json={"rid": ABORTED_RID}).raise_for_status()
        return answer.result()


#: fixture id -> how the real server is made to give that response.
REAL_SCENARIOS = {
    **{id: scenario for id, scenario in SCENARIOS.items() if id.startswith("sglang/") and id not in SOURCE_ONLY},
    "sglang/chat_completion_abort": _aborted_by_rid,
}


def key_paths(body: object, path: str = "$") -> Iterator[str]:
    """Every object key's path in a body, as the shape comparison writes them."""
    if isinstance(body, dict):
        for key, value in body.items():
            yield f"{path}.{key}"
            yield from key_paths(value, f"{path}.{key}")
    elif isinstance(body, list):
        for item in body:
            yield from key_paths(item, f"{path}[]")


@pytest.fixture(scope="module")
def real_sglang(sglang_server: SglangServer) -> Iterator[RealSglang]:
    with httpx.Client(timeout=60, headers=sglang_server.headers()) as client:
        yield RealSglang(sglang_server, client)


def test_every_sglang_fixture_is_checked_here_or_said_why_not():
    sglang = {f.id for f in all_fixtures() if f.backend == "sglang"}
    assert set(REAL_SCENARIOS) | set(SOURCE_ONLY) == sglang
    assert not set(REAL_SCENARIOS) & set(SOURCE_ONLY)


@pytest.mark.parametrize("fixture_id", sorted(REAL_SCENARIOS))
def test_the_real_server_gives_the_recorded_response_and_the_client_reads_it(fixture_id, real_sglang):
    fixture = load_fixture(*fixture_id.split("/"))
    response = REAL_SCENARIOS[fixture_id](real_sglang)
    subset = fixture.name == "server_info"  # a recorded subset of the server's arguments
    check_response(fixture, response, real_sglang, frozenset(key_paths(response.json())) if subset else frozenset())
