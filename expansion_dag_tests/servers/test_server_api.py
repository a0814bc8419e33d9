"""What the client reads from SGLang (0.5.4 to 0.5.23) and vLLM 0.33: answers, errors, loads, probes.

Bodies and texts are the servers' own, as their source writes them (see docs/CONTRACTS.md).
"""

import asyncio
import dataclasses
import json

import httpx
import pytest
import stamina.instrumentation

from expansion_dag import core, servers
from expansion_dag.servers import SGLANG, SGLANG_MIN_VERSION, VLLM, dialect_for
from expansion_dag_tests.helpers import default_sampling, mock_client

SGLANG_OVERFLOW = (
    "Requested token count exceeds the model's maximum context length of 8192 tokens. You requested a total "
    "of 8227 tokens: 35 tokens from the input messages and 8192 tokens for the completion. Please reduce the "
    "number of tokens in the input messages or the completion to fit within the limit."
)
SCHEDULER_INPUT_LIMIT = (
    "Input length (8190 tokens) exceeds the maximum allowed length (8186 tokens). "
    "Use a shorter input or enable --allow-auto-truncate."
)


def sglang_error(message: str, status: int = 400) -> str:
    return json.dumps({"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": status})


def vllm_error(message: str, status: int = 400) -> str:
    return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}})


def chat_body(message: dict, finish: str = "stop", prompt_tokens: int | None = 12, completion_tokens: int = 5) -> dict:
    return {
        "id": "x",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
    }


# --- dialects -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "server_info", "loads"),
    [
        ("0.5.23", "/server_info", "/v1/loads"),
        ("0.5.8", "/server_info", "/v1/loads"),
        ("0.5.7", "/server_info", "/get_load"),
        ("0.5.6", "/server_info", "/get_load"),
        ("0.5.5", "/get_server_info", "/get_load"),
        ("0.5.4", "/get_server_info", "/get_load"),
        ("0.5.10rc1", "/server_info", "/v1/loads"),
        (None, "/server_info", "/v1/loads"),
    ],
)
def test_each_sglang_version_is_read_at_the_paths_it_serves(version, server_info, loads):
    dialect = dialect_for("sglang", version)
    assert (dialect.server_info_path, dialect.loads_path) == (server_info, loads)


def test_an_sglang_below_the_floor_is_refused_naming_its_version_and_the_floor():
    with pytest.raises(core.FleetError, match=rf"sglang 0\.5\.3 is older than {SGLANG_MIN_VERSION}"):
        dialect_for("sglang", "0.5.3")


@pytest.mark.parametrize(
    ("version", "row"),
    [
        ("0.5.20", "sglang"),
        ("0.5.20rc1", "sglang-0.5.8"),
        ("0.5.10rc1", "sglang-0.5.8"),
        ("0.5.8rc0", "sglang-0.5.6"),
        ("0.5.8.post1", "sglang-0.5.8"),
        ("v0.5.23", "sglang"),
        ("0.5.23+cu124", "sglang"),
        ("0.0.0.dev0", "sglang"),  # a source build without version metadata says nothing
        ("main", "sglang"),
    ],
)
def test_a_version_is_read_as_pep_440_orders_it_a_release_candidate_before_its_release(version, row):
    """A row's features are not assumed in the release candidates before it: an 0.5.20rc1 is not
    asked for token ids, which arrived in 0.5.20."""
    assert dialect_for("sglang", version).name == row


def test_a_release_candidate_of_the_floor_is_below_it():
    with pytest.raises(core.FleetError, match=rf"sglang 0\.5\.4rc1 is older than {SGLANG_MIN_VERSION}"):
        dialect_for("sglang", "0.5.4rc1")


def test_vllm_has_no_loads_and_an_unknown_backend_is_named():
    assert dialect_for("vllm", "0.33.0") is VLLM and not VLLM.has_loads
    with pytest.raises(core.FleetError, match="unknown server backend 'tgi'"):
        dialect_for("tgi")


# --- answers --------------------------------------------------------------------------------------


def test_an_sglang_answer_is_read_with_its_reasoning_and_usage():
    body = chat_body({"content": "Paris.", "reasoning_content": "The capital..."}, prompt_tokens=20, completion_tokens=9)
    assert servers.parse_chat_completion(body, SGLANG) == servers.Answer(
        content="Paris.", reasoning="The capital...", finish_reason="stop", prompt_tokens=20, completion_tokens=9
    )


def test_vllm_reasoning_is_read_from_message_reasoning():
    body = chat_body({"content": "Paris.", "reasoning": "The capital..."})
    assert servers.parse_chat_completion(body, VLLM).reasoning == "The capital..."
    older = chat_body({"content": "Paris.", "reasoning_content": "Before the rename"})
    assert servers.parse_chat_completion(older, VLLM).reasoning == "Before the rename"


def test_empty_content_and_no_reasoning_parser_read_as_empty_text_and_none():
    answer = servers.parse_chat_completion(chat_body({"content": None, "reasoning_content": None}), SGLANG)
    assert (answer.content, answer.reasoning) == ("", None)


@pytest.mark.parametrize("body", [{"oops": True}, {"choices": []}, [], None, chat_body({"role": "assistant"})])
def test_a_body_that_is_not_a_chat_completion_is_a_bad_response(body):
    with pytest.raises(core.BadResponseError, match="not a chat completion"):
        servers.parse_chat_completion(body, SGLANG)


@pytest.mark.parametrize("finish", ["stop", "length", "tool_calls"])
def test_stop_length_and_tool_calls_are_complete_answers(finish):
    answer = servers.parse_chat_completion(chat_body({"content": "x"}, finish=finish), SGLANG)
    assert servers.finish_error(answer) is None


@pytest.mark.parametrize("finish", ["abort", "content_filter", None])
def test_any_other_finish_is_a_retryable_error_that_names_it(finish):
    answer = servers.parse_chat_completion(chat_body({"content": "partial"}, finish=finish), SGLANG)
    error = servers.finish_error(answer)
    assert isinstance(error, core.TransientError) and error.retryable
    assert error.kind == f"finish_{finish or 'unknown'}"
    assert "partial text is never kept" in error.message


# --- errors ---------------------------------------------------------------------------------------


def test_context_overflow_message_is_parsed_into_its_numbers():
    assert servers.parse_context_error(SGLANG_OVERFLOW) == core.ContextOverflow(
        context_length=8192, requested_total=8227, prompt_tokens=35, completion_tokens=8192
    )
    assert servers.parse_context_error("The request queue is full.") is None


def test_sglang_overflow_400_becomes_a_context_error_with_numbers():
    error = servers.error_from_status(400, sglang_error(SGLANG_OVERFLOW))
    assert isinstance(error, core.ContextLengthError) and not error.retryable
    assert error.overflow.prompt_tokens == 35
    assert error.status == 400


def test_the_schedulers_input_limit_is_a_context_error_with_its_numbers():
    error = servers.error_from_status(400, sglang_error(SCHEDULER_INPUT_LIMIT))
    assert isinstance(error, core.ContextLengthError) and error.kind == "context_length"
    assert error.input_too_long == core.InputTooLong(input_tokens=8190, max_input_tokens=8186)
    assert error.overflow is None  # a smaller max_tokens would not help


@pytest.mark.parametrize(
    ("body", "numbers"),
    [
        (sglang_error("The input (9000 tokens) is longer than the model's context length (8192 tokens)."), (9000, 8192)),
        (sglang_error("max_completion_tokens is too large: 9000.This model supports at most 8192 completion tokens."), None),
        (vllm_error("max_tokens=9000 cannot be greater than max_model_len=8192. Please request fewer output tokens."), None),
        (
            vllm_error(
                "This model's maximum context length is 8192 tokens. However, your prompt contains at least 8193 "
                "input tokens, which exceeds this limit even without any output tokens."
            ),
            (8193, 8192),
        ),
        (vllm_error("Input length (9000) exceeds model's maximum context length (8192)."), (9000, 8192)),
        (vllm_error("The decoder prompt (length 9000) is longer than the maximum model length of 8192. x"), None),
    ],
)
def test_every_context_text_of_both_servers_is_a_context_error(body, numbers):
    error = servers.error_from_status(400, body)
    assert isinstance(error, core.ContextLengthError)
    got = error.input_too_long and (error.input_too_long.input_tokens, error.input_too_long.max_input_tokens)
    assert got == numbers


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504])
def test_retryable_statuses_are_transient_and_keep_the_servers_words(status):
    error = servers.error_from_status(status, sglang_error("The request queue is full.", status))
    assert isinstance(error, core.TransientError) and error.retryable
    assert error.message == "The request queue is full."


def test_401_is_an_auth_error_not_retried():
    error = servers.error_from_status(401, json.dumps({"error": "Unauthorized"}))
    assert isinstance(error, core.AuthError) and not error.retryable
    assert (error.kind, error.message) == ("unauthorized", "Unauthorized")


@pytest.mark.parametrize("status", [400, 403, 404, 422])
def test_other_client_errors_are_rejected_and_keep_the_server_message(status):
    error = servers.error_from_status(status, vllm_error("bad stop sequence", status))
    assert type(error) is core.RejectedError and not error.retryable
    assert (error.message, error.status) == ("bad stop sequence", status)


def test_a_non_json_error_body_is_quoted_raw():
    assert servers.error_from_status(502, "<html>bad gateway</html>").message == "<html>bad gateway</html>"


# --- loads ----------------------------------------------------------------------------------------


def test_v1_loads_give_idle_slots_summed_over_ranks():
    body = {
        "loads": [
            {"dp_rank": 0, "max_running_requests": 8, "num_running_reqs": 3, "num_waiting_reqs": 0},
            {"dp_rank": 1, "max_running_requests": 8, "num_running_reqs": 8, "num_waiting_reqs": 2},
        ]
    }
    assert servers.parse_idle_slots(body, SGLANG) == 5 - 2


def test_get_load_counts_requests_only_so_the_probed_slots_are_needed():
    # 0.5.4 to 0.5.7: num_reqs counts the running batch and the waiting queue.
    body = [{"dp_rank": 0, "num_reqs": 6, "num_waiting_reqs": 1, "num_tokens": 900}]
    old = dialect_for("sglang", "0.5.7")
    assert servers.parse_idle_slots(body, old, slots=16) == 10
    assert servers.parse_idle_slots(body, old) is None


@pytest.mark.parametrize("body", [{"loads": []}, {"detail": "Not Found"}, {"loads": [{"dp_rank": 0}]}, None])
def test_loads_that_say_nothing_are_unknown_not_an_error(body):
    assert servers.parse_idle_slots(body, SGLANG) is None


# --- probing --------------------------------------------------------------------------------------

MODELS = {"object": "list", "data": [{"id": "org/m", "object": "model", "root": "org/m", "max_model_len": 8192}]}


def server_info(version, **extra):
    return {"model_path": "org/m", "context_length": None, "max_running_requests": None, "version": version,
            "max_req_input_len": 8186, **extra}


def facts_from(routes: dict[str, object], backend="sglang") -> servers.ServerFacts:
    def handler(request):
        if request.url.path not in routes:
            return httpx.Response(404, json={"detail": "Not Found"})
        return httpx.Response(200, json=routes[request.url.path])

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        return servers.read_server_facts(client, "http://gpu-0:30000", backend)


def test_a_current_sglang_reports_slots_per_rank_and_its_input_limit():
    states = [{"effective_max_running_requests_per_dp": 48}, {"effective_max_running_requests_per_dp": 48}]
    facts = facts_from({"/v1/models": MODELS, "/server_info": server_info("0.5.23", internal_states=states)})
    assert (facts.context_length, facts.slots, facts.max_req_input_len) == (8192, 96, 8186)
    assert (facts.version, facts.dialect) == ("0.5.23", SGLANG)


def test_an_sglang_older_than_0_5_6_is_read_from_get_server_info():
    # 0.5.4's internal_states are its server args: no effective slots, the launch flag may be set.
    info = server_info("0.5.4", max_running_requests=32, internal_states=[{"max_running_requests": 32}])
    facts = facts_from({"/v1/models": MODELS, "/get_server_info": info})
    assert facts.dialect.name == "sglang-0.5.4" and facts.dialect.loads_path == "/get_load"
    assert (facts.slots, facts.max_req_input_len) == (32, 8186)


def test_an_sglang_below_the_floor_fails_the_probe_naming_server_and_version():
    with pytest.raises(core.FleetError, match=r"http://gpu-0:30000: sglang 0\.4\.10 is older than 0\.5\.4"):
        facts_from({"/v1/models": MODELS, "/get_server_info": server_info("0.4.10")})


def test_a_server_with_neither_description_is_not_taken_for_sglang():
    with pytest.raises(core.FleetError, match="none of /server_info, /get_server_info is served"):
        facts_from({"/v1/models": MODELS})


def test_vllm_reports_no_slots_and_its_version_from_version():
    facts = facts_from({"/v1/models": MODELS, "/version": {"version": "0.33.0"}}, backend="vllm")
    assert (facts.slots, facts.max_req_input_len, facts.version, facts.dialect) == (None, None, "0.33.0", VLLM)


def test_a_context_length_that_disagrees_between_the_two_answers_is_refused():
    info = server_info("0.5.23", context_length=4096)
    with pytest.raises(core.FleetMismatchError, match="max_model_len 8192 but /server_info says context_length 4096"):
        facts_from({"/v1/models": MODELS, "/server_info": info})


# --- generation -----------------------------------------------------------------------------------

FAST = servers.RetryPolicy(
    attempts=4, wait_initial_s=0.001, wait_max_s=0.002, wait_jitter_s=0.0, context_retry=True, margin=16,
    min_output_tokens=16, backpressure_wait_s=600.0,
)


def exchange(handler, policy=FAST):
    """One prompt through ``generate``; returns the exchange and the kinds that caused retries."""
    retries = []

    async def main():
        async with mock_client(handler) as client:
            request = servers.chat_request("m", [], 100, default_sampling())
            return await servers.generate(
                client, "http://gpu-0:30000", request, SGLANG, policy, on_retry=retries.append, stream_interval=1
            )

    return asyncio.run(main()), retries


def test_an_abort_is_retried_and_a_later_complete_answer_is_kept():
    answers = iter([("abort", "par"), ("abort", "part"), ("stop", "the whole answer")])

    def handler(request):
        finish, text = next(answers)
        return httpx.Response(200, json=chat_body({"content": text}, finish=finish))

    result, retries = exchange(handler)
    assert result.answer.content == "the whole answer" and result.error is None
    assert (result.attempts, retries) == (3, ["finish_abort", "finish_abort"])


def test_an_abort_that_persists_is_an_error_naming_it_after_bounded_attempts():
    calls = 0

    def handler(request):
        nonlocal calls
        calls += 1
        return httpx.Response(200, json=chat_body({"content": "partial"}, finish="abort"))

    result, retries = exchange(handler)
    assert result.answer is None and result.error.kind == "finish_abort"
    assert calls == result.attempts == FAST.attempts
    assert retries == ["finish_abort"] * (FAST.attempts - 1)


def test_the_scheduler_input_limit_is_not_retried():
    result, retries = exchange(lambda r: httpx.Response(400, text=sglang_error(SCHEDULER_INPUT_LIMIT)))
    assert (result.error.kind, result.attempts, retries) == ("context_length", 1, [])


def queue_full(request):
    return httpx.Response(503, text=sglang_error("The request queue is full.", 503))


def test_a_full_queue_is_waited_out_slower_each_time_without_using_an_attempt():
    answers = iter([queue_full] * 4 + [lambda r: httpx.Response(200, json=chat_body({"content": "at last"}))])
    policy = dataclasses.replace(FAST, attempts=1, wait_initial_s=0.001, wait_max_s=0.004)
    waits = []
    hooks = stamina.instrumentation.get_on_retry_hooks()
    stamina.instrumentation.set_on_retry_hooks([lambda details: waits.append(details.wait_for)])
    try:
        result, retries = exchange(lambda r: next(answers)(r), policy)
    finally:
        stamina.instrumentation.set_on_retry_hooks(hooks)
    assert result.answer.content == "at last" and result.attempts == 5  # one attempt allowed, five sent
    assert retries == ["queue_full"] * 4
    assert waits == pytest.approx([0.001, 0.002, 0.004, 0.004])  # doubling, up to wait_max_s


def test_a_borrowed_servers_full_queue_is_the_prompts_error_at_once():
    result, retries = exchange(queue_full, dataclasses.replace(FAST, backpressure_wait_s=0.0))
    assert (result.error.kind, result.attempts, retries) == ("queue_full", 1, [])


def test_the_request_carries_the_sampling_settings_sglang_and_vllm_both_read():
    sampling = default_sampling(temperature=0.3, seed=7, stop=("###",), chat_template_kwargs_json='{"enable_thinking": false}')
    request = servers.chat_request("m", [{"role": "user", "content": "hi"}], 64, sampling)
    assert request.body() == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "temperature": 0.3,
        "top_p": 0.8, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.0, "seed": 7, "stop": ["###"],
        "chat_template_kwargs": {"enable_thinking": False},
    }
