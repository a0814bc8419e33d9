"""The servers' contract, checked both ways: against the recorded fixtures and against the simulator.

Every fixture under ``fixtures/`` is a response a real server gives (read from its PyPI wheel, see
fixtures/README.md). For each one the suite runs two providers:

- ``fixture``: the recorded response itself;
- ``simulator``: the same request sent to a simulated server of that dialect and version.

For both, the client (``expansion_dag.servers``) must read the response as the server means
it. For the simulator, its response must also have the fixture's shape (keys and JSON types,
recursively; extra keys only from :data:`SIM_ONLY_KEYS`) and its error texts must match the
server's own format strings. A simulator that drifts from the real server fails here.
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Callable

import httpx
import pytest

from expansion_dag.core import AuthError, ContextLengthError, QueueFullError, RejectedError
from expansion_dag.servers import (
    dialect_for,
    error_from_status,
    finish_error,
    parse_chat_completion,
    parse_idle_slots,
    parse_server_facts,
)
from expansion_dag.sim import VllmDialect
from expansion_dag_tests.contract.conftest import VLLM_NAME, Provider, Simulators
from expansion_dag_tests.contract.shapes import Fixture, all_fixtures, load_fixture, shape_differences
from expansion_dag_tests.helpers import WEATHER_TOOL, wait_for

#: Keys only the simulator sends, each a path into one response: nothing else may be added.
SIM_ONLY_KEYS = frozenset({"$.simulator"})

POEM = [{"role": "user", "content": "Write a short poem about the sea."}]
THINKING_OFF = {"enable_thinking": False}
WEATHER = [{"role": "user", "content": "What is the weather in Paris for the next three days?"}]
TOOLS = [WEATHER_TOOL]


# --- the simulator's side: one request per fixture --------------------------------------------


def _chat(sims: Provider, server: str, messages=POEM, **fields) -> httpx.Response:
    model = VLLM_NAME if server.startswith("vllm") else "Qwen/Qwen3-8B"
    return sims.client.post(
        f"{sims.url(server)}/v1/chat/completions", json={"model": model, "messages": messages, **fields}
    )


def _get(server: str, path: str) -> Callable[[Provider], httpx.Response]:
    return lambda sims: sims.client.get(f"{sims.url(server)}{path}")


def _queue_full(sims: Simulators) -> httpx.Response:
    """The third request to one slot and one queue place, while the first two hang."""
    url = f"{sims.url('sglang-queue')}/v1/chat/completions"
    body = {"model": "m", "messages": POEM, "max_tokens": 1}
    with httpx.Client(timeout=0.5, headers=sims.client.headers) as impatient:
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
        hanging = [pool.submit(impatient.post, url, json=body) for _ in range(2)]
        try:
            wait_for(lambda: (s := sims.stats("sglang-queue"))["num_running"] + s["num_waiting"] == 2)
            return sims.client.post(url, json=body)
        finally:
            for future in hanging:
                with pytest.raises(httpx.ReadTimeout):
                    future.result()
            pool.shutdown()
            wait_for(lambda: (s := sims.stats("sglang-queue"))["num_running"] + s["num_waiting"] == 0)


def _over_max_req_input_len(s: Provider) -> int:
    """A prompt at or over SGLang's scheduler limit, ``min(context - 1, kv - 1) - 5``, but under the context."""
    return min(s.context, s.kv_tokens) - 4


#: fixture id -> how the simulator (or a real server, real_engine/test_sglang_contract.py) is made
#: to give the same response; the sizes are those of the provider's context and KV cache.
SCENARIOS: dict[str, Callable[[Provider], httpx.Response]] = {
    "sglang/models": _get("sglang", "/v1/models"),
    "sglang/server_info": _get("sglang", "/server_info"),
    "sglang/get_server_info_0.5.4": _get("sglang-0.5.4", "/get_server_info"),
    "sglang/loads": _get("sglang", "/v1/loads"),
    "sglang/get_load_0.5.7": _get("sglang-0.5.7", "/get_load"),
    "sglang/get_load_0.5.4": _get("sglang-0.5.4", "/get_load"),
    "sglang/chat_completion": lambda s: _chat(
        s, "sglang", chat_template_kwargs=THINKING_OFF, max_tokens=s.context // 8
    ),
    "sglang/chat_completion_reasoning": lambda s: _chat(s, "sglang", max_tokens=400),
    "sglang/chat_completion_token_ids": lambda s: _chat(
        s, "sglang", chat_template_kwargs=THINKING_OFF, max_tokens=s.context // 8,
        return_input_ids_in_sglext=True, return_output_ids_in_sglext=True,
    ),
    "sglang/chat_completion_abort": lambda s: _chat(s, "sglang-abort", chat_template_kwargs=THINKING_OFF),
    "sglang/error_over_context": lambda s: _chat(s, "sglang", max_tokens=s.context - s.prompt_tokens(POEM) + 1),
    "sglang/error_input_longer_than_context": lambda s: _chat(s, "sglang", s.messages_of(s.context + 20), max_tokens=1),
    "sglang/error_max_completion_tokens_too_large": lambda s: _chat(s, "sglang", max_tokens=s.context + 1),
    "sglang/error_input_over_max_req_input_len": lambda s: _chat(
        s, "sglang", s.messages_of(_over_max_req_input_len(s)), max_tokens=1
    ),
    "sglang/error_queue_full": _queue_full,
    "sglang/error_unauthorized": lambda s: httpx.get(f"{s.url('sglang')}/v1/models"),
    "sglang/chat_completion_tool_calls": lambda s: _chat(
        s, "sglang-tools", WEATHER, chat_template_kwargs=THINKING_OFF, tools=TOOLS, tool_choice="auto"
    ),
    "vllm/models": _get("vllm", "/v1/models"),
    "vllm/version": _get("vllm", "/version"),
    "vllm/chat_completion": lambda s: _chat(s, "vllm-plain", chat_template_kwargs=THINKING_OFF, max_tokens=400),
    "vllm/chat_completion_reasoning": lambda s: _chat(s, "vllm", max_tokens=400),
    "vllm/chat_completion_token_ids": lambda s: _chat(
        s, "vllm-plain", chat_template_kwargs=THINKING_OFF, max_tokens=400, return_token_ids=True
    ),
    "vllm/chat_completion_truncated": lambda s: _chat(s, "vllm-plain", s.messages_of(s.context - 12), max_tokens=400),
    "vllm/error_max_tokens_too_large": lambda s: _chat(s, "vllm", max_tokens=s.context + 1),
    "vllm/error_prompt_too_long": lambda s: _chat(s, "vllm", s.messages_of(s.context + 20), max_tokens=1),
    "vllm/error_prompt_fills_context": lambda s: _chat(s, "vllm", s.messages_of(s.context), max_tokens=1),
    "vllm/error_model_not_found": lambda s: s.client.post(
        f"{s.url('vllm')}/v1/chat/completions", json={"model": "gpt-4", "messages": POEM}
    ),
    "vllm/error_unauthorized": lambda s: httpx.get(f"{s.url('vllm')}/v1/models"),
    "vllm/chat_completion_tool_calls": lambda s: _chat(
        s, "vllm-tools", WEATHER, chat_template_kwargs=THINKING_OFF, tools=TOOLS, tool_choice="auto"
    ),
    # No tool_choice: vLLM takes tools alone as "auto" (check_tool_usage), which needs a parser.
    "vllm/error_auto_tool_choice_without_parser": lambda s: _chat(s, "vllm-plain", WEATHER, tools=TOOLS),
}

#: The provider's own figures, which its responses must carry where a fixture has a number.
EXPECTED_NUMBERS: dict[str, Callable[[Provider], dict[str, int]]] = {
    "sglang/error_over_context": lambda s: {
        "context": s.context,
        "input_tokens": (p := s.prompt_tokens(POEM)),
        "max_tokens": s.context - p + 1,
        "total": s.context + 1,
    },
    "sglang/error_input_longer_than_context": lambda s: {"input_tokens": s.context + 20, "context": s.context},
    "sglang/error_max_completion_tokens_too_large": lambda s: {"max_tokens": s.context + 1, "context": s.context},
    "sglang/error_input_over_max_req_input_len": lambda s: {
        "input_tokens": _over_max_req_input_len(s),
        "max_req_input_len": min(s.context - 1, s.kv_tokens - 1) - 5,
    },
    "vllm/error_max_tokens_too_large": lambda s: {"max_tokens": s.context + 1, "context": s.context},
    "vllm/error_prompt_too_long": lambda s: {"input_tokens": s.context + 20, "context": s.context},
    "vllm/error_prompt_fills_context": lambda s: {"max_tokens": 0},
}

FIXTURES = all_fixtures()
#: Texts the client parses that no chat request to that server produces (see each fixture's note).
CLIENT_ONLY = {f.id for f in FIXTURES if f.message and f.message.get("reached_by_chat") is False}


def test_every_fixture_has_a_scenario_and_nothing_else_does():
    assert set(SCENARIOS) == {f.id for f in FIXTURES} - CLIENT_ONLY


# --- the client's side: what expansion_dag.servers must read from each response -------------------


def check_models(fixture, body, version, sims):
    facts = parse_server_facts(body, None, dialect_for(fixture.backend, version))
    card = body["data"][0]
    assert (facts.model, facts.context_length) == (card["id"], card["max_model_len"])


def check_version(fixture, body, version, sims):
    assert body["version"] == version
    assert dialect_for("vllm", body["version"]).reasoning_fields[0] == "reasoning"


def check_server_info(fixture, body, version, sims):
    dialect = dialect_for("sglang", body["version"])
    assert dialect.server_info_path == fixture.request_path
    # The same server's /v1/models: the recorded one, or the provider's own.
    if sims is None:
        models = load_fixture("sglang", "models").body
    else:
        models = sims.client.get(f"{sims.url(_server_of(fixture, version))}/v1/models").json()
    facts = parse_server_facts(models, body, dialect)
    effective = [s.get("effective_max_running_requests_per_dp") for s in body["internal_states"]]
    # From 0.5.8 the scheduler's own figure; before, only the launch flag (null on auto) says.
    slots = sum(effective) if all(effective) else body["max_running_requests"]
    assert (facts.slots, facts.max_req_input_len, facts.version, facts.tool_call_parser) == (
        slots,
        body["max_req_input_len"],
        body["version"],
        body["tool_call_parser"],
    )
    assert facts.context_length == models["data"][0]["max_model_len"]


def check_loads(fixture, body, version, sims):
    dialect = dialect_for("sglang", body["version"])
    assert dialect.loads_path == fixture.request_path
    expected = sum(r["max_running_requests"] - r["num_running_reqs"] - r["num_waiting_reqs"] for r in body["loads"])
    assert parse_idle_slots(body, dialect) == expected


def check_get_load(fixture, body, version, sims):
    dialect = dialect_for("sglang", version)
    assert dialect.loads_path == fixture.request_path
    assert parse_idle_slots(body, dialect, slots=48) == 48 - sum(rank["num_reqs"] for rank in body)


def check_chat(fixture, body, version, sims):
    answer = parse_chat_completion(body, dialect_for(fixture.backend, version))
    message = body["choices"][0]["message"]
    reasoning = message["reasoning" if fixture.backend == "vllm" else "reasoning_content"]
    assert (answer.content, answer.reasoning, answer.finish_reason) == (
        message["content"] or "",
        reasoning,
        body["choices"][0]["finish_reason"],
    )
    assert (answer.prompt_tokens, answer.completion_tokens) == (
        body["usage"]["prompt_tokens"],
        body["usage"]["completion_tokens"],
    )
    if fixture.name.endswith("_reasoning"):
        assert answer.reasoning, "the thinking is lost"
    if fixture.name.endswith("_abort"):
        error = finish_error(answer)
        assert error is not None and error.kind == "finish_abort"
    else:
        assert finish_error(answer) is None


def check_tool_calls(fixture, body, version, sims):
    """A parsed call comes back as the client keeps it: OpenAI form, arguments as JSON text, and
    ``tool_calls`` a finished answer."""
    check_chat(fixture, body, version, sims)
    answer = parse_chat_completion(body, dialect_for(fixture.backend, version))
    sent = body["choices"][0]["message"]["tool_calls"]
    assert answer.finish_reason == "tool_calls"
    assert answer.tool_calls == [{"id": c["id"], "type": "function", "function": c["function"]} for c in sent]
    assert all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in answer.tool_calls)
    if sims is not None:  # the simulator calls a tool of the request
        assert {c["function"]["name"] for c in answer.tool_calls} <= {t["function"]["name"] for t in TOOLS}


def check_token_ids(fixture, body, version, sims):
    """The ids the server ran and sampled, as many as its usage counts."""
    check_chat(fixture, body, version, sims)
    answer = parse_chat_completion(body, dialect_for(fixture.backend, version))
    assert answer.prompt_ids is not None and answer.output_ids is not None, "the ids are lost"
    assert (len(answer.prompt_ids), len(answer.output_ids)) == (
        body["usage"]["prompt_tokens"],
        body["usage"]["completion_tokens"],
    )


def check_truncated(fixture, body, version, sims):
    check_chat(fixture, body, version, sims)
    usage = body["usage"]
    assert body["choices"][0]["finish_reason"] == "length"
    context = sims.context if sims else 8192
    assert usage["prompt_tokens"] + usage["completion_tokens"] == context


def error_text(body: dict) -> str:
    """The text of an error body: vLLM nests it, SGLang does not, the 401 of both is one string."""
    error = body.get("error")
    return error["message"] if isinstance(error, dict) else body.get("message", error)


def check_error(fixture, body, version, sims):
    """The client's class and numbers for an error must be the ones the server's text carries."""
    error = error_from_status(fixture.status, json.dumps(body))
    values = {}
    if fixture.message:
        message = error_text(body)
        match = fixture.message_pattern().fullmatch(message)
        assert match, f"{message!r} is not the server's text"
        values = match.groupdict()
    expected = CLIENT_EXPECTATIONS[fixture.id]
    assert isinstance(error, expected), f"{type(error).__name__}, want {expected}"
    if "total" in values:  # SGLang's prompt + max_tokens overflow: a retry uses these numbers
        o = error.overflow
        assert (o.context_length, o.requested_total, o.prompt_tokens, o.completion_tokens) == (
            int(values["context"]),
            int(values["total"]),
            int(values["input_tokens"]),
            int(values["max_tokens"]),
        )
    elif "input_tokens" in values and fixture.id not in CLIENT_ONLY:  # a prompt over a limit: never sendable
        limit = values.get("max_req_input_len", values.get("context"))
        too_long = error.input_too_long
        assert (too_long.input_tokens, too_long.max_input_tokens) == (int(values["input_tokens"]), int(limit))


CLIENT_EXPECTATIONS: dict[str, type | tuple[type, ...]] = {
    "sglang/error_over_context": ContextLengthError,
    "sglang/error_input_longer_than_context": ContextLengthError,
    "sglang/error_max_completion_tokens_too_large": ContextLengthError,
    "sglang/error_input_over_max_req_input_len": ContextLengthError,
    "sglang/error_queue_full": QueueFullError,  # backpressure: waited out, no attempt used
    "sglang/error_unauthorized": AuthError,
    "vllm/error_max_tokens_too_large": ContextLengthError,
    "vllm/error_prompt_too_long": ContextLengthError,
    "vllm/error_input_length_exceeds": ContextLengthError,
    "vllm/error_prompt_longer_than_max_model_len": ContextLengthError,
    # A prompt of exactly the context: never retried, whichever of the two it is read as.
    "vllm/error_prompt_fills_context": (ContextLengthError, RejectedError),
    "vllm/error_model_not_found": RejectedError,
    "vllm/error_unauthorized": AuthError,
    # The request's own trouble: servers.tool_choice_for sends "none" to such a server.
    "vllm/error_auto_tool_choice_without_parser": RejectedError,
}

CLIENT_CHECKS = {
    "models": check_models,
    "version": check_version,
    "server_info": check_server_info,
    "get_server_info_0.5.4": check_server_info,
    "loads": check_loads,
    "get_load_0.5.7": check_get_load,
    "get_load_0.5.4": check_get_load,
    "chat_completion": check_chat,
    "chat_completion_reasoning": check_chat,
    "chat_completion_abort": check_chat,
    "chat_completion_truncated": check_truncated,
    "chat_completion_token_ids": check_token_ids,
    "chat_completion_tool_calls": check_tool_calls,
}


def _check(fixture: Fixture) -> Callable:
    return check_error if fixture.name.startswith("error_") else CLIENT_CHECKS[fixture.name]


def _server_of(fixture: Fixture, version: str) -> str:
    if fixture.backend == "vllm":
        return "vllm"
    return "sglang" if version == "0.5.23" else f"sglang-{version}"


# --- the suite: every fixture, two providers ---------------------------------------------------


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda f: f.id)
def test_the_client_reads_the_real_response(fixture: Fixture):
    if fixture.message:  # the recorded body is the format filled with the recorded values
        assert error_text(fixture.body) == fixture.message["format"].format(**fixture.message["values"])
    _check(fixture)(fixture, fixture.body, fixture.version, None)


def check_response(
    fixture: Fixture, response: httpx.Response, provider: Provider, extra_allowed: frozenset[str]
) -> None:
    """A provider's response has the fixture's status, shape and error text (with the provider's
    own numbers), and the client reads it as the server means it."""
    assert response.status_code == fixture.status, response.text
    body = response.json()
    assert shape_differences(fixture.body, body, nullable=fixture.nullable, extra_allowed=extra_allowed) == []
    if fixture.name == "error_unauthorized":
        assert body == fixture.body
    if fixture.message:
        message = error_text(body)
        match = fixture.message_pattern().fullmatch(message)
        assert match, f"{message!r} does not follow the server's format {fixture.message['format']!r}"
        wanted = EXPECTED_NUMBERS.get(fixture.id, lambda _: {})(provider)
        assert {k: int(match[k]) for k in wanted} == wanted
    version = body.get("version") if isinstance(body, dict) and "version" in body else fixture.version
    _check(fixture)(fixture, body, version, provider)


@pytest.mark.parametrize("fixture", [f for f in FIXTURES if f.id not in CLIENT_ONLY], ids=lambda f: f.id)
def test_the_simulator_gives_the_real_response_and_the_client_reads_it(fixture: Fixture, simulators):
    check_response(fixture, SCENARIOS[fixture.id](simulators), simulators, SIM_ONLY_KEYS)


# --- the checker itself --------------------------------------------------------------------------


def test_the_shape_comparison_reports_each_kind_of_drift():
    real = {"a": 1, "b": [{"c": "x", "d": None}], "e": 0.5, "f": True}
    assert shape_differences(real, {"a": 2, "b": [{"c": "y", "d": None}], "e": 1.5, "f": False}) == []
    drifted = {"a": "1", "b": [{"c": "x", "d": 3}, {"d": None}], "e": 1, "f": True, "g": 0}
    assert sorted(shape_differences(real, drifted)) == sorted(
        [
            "$: 'g' is not in the real server's response",
            "$.a: string where the real server sends integer",
            "$.b[]: no 'c'",
            "$.b[].d: integer where the real server sends null",
            "$.e: integer where the real server sends number",
        ]
    )
    assert shape_differences(real, {**drifted, "a": 1, "e": 0.1}, nullable=frozenset({"$.b[].d"}),
                             extra_allowed=frozenset({"$.g"})) == ["$.b[]: no 'c'"]


def test_a_simulator_whose_shape_drifts_fails_the_suite(monkeypatch, simulators):
    """Bring back the old vLLM field name in the simulator: the comparison must say so."""
    original = VllmDialect.completion_body

    def drifted(self, job, eos_token_id):
        body = original(self, job, eos_token_id)
        message = body["choices"][0]["message"]
        message["reasoning_content"] = message.pop("reasoning")
        return body

    monkeypatch.setattr(VllmDialect, "completion_body", drifted)
    fixture = load_fixture("vllm", "chat_completion_reasoning")
    body = SCENARIOS[fixture.id](simulators).json()
    assert sorted(shape_differences(fixture.body, body, nullable=fixture.nullable, extra_allowed=SIM_ONLY_KEYS)) == [
        "$.choices[].message: 'reasoning_content' is not in the real server's response",
        "$.choices[].message: no 'reasoning'",
    ]
