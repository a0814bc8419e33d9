"""The simulated server over real sockets, as a client of a real SGLang server would meet it."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import socket
import time

import httpx
import pytest

from expansion_dag.core import count_tokens
from expansion_dag.sim import READY_LINE
from expansion_dag_tests.helpers import wait_for

POEM = [{"role": "user", "content": "Write a short poem about the sea."}]


def loads(client, url):
    return client.get(f"{url}/v1/loads").json()["loads"][0]


def in_background(fn, *args, **kwargs):
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    future = pool.submit(fn, *args, **kwargs)
    pool.shutdown(wait=False)
    return future


# startup and probing


def test_startup_refuses_then_warms_up_then_is_ready(start_fleet, fast, client, capsys):
    started = time.monotonic()
    fleet = start_fleet(fast(startup_delay_s=0.4, warmup_s=0.4), wait_ready=False)
    url = fleet.urls[0]
    with pytest.raises(httpx.ConnectError):
        client.get(f"{url}/health")
    wait_for(lambda: _connects(client, url))
    assert client.get(f"{url}/health").status_code == 503
    assert client.get(f"{url}/health_generate").status_code == 503
    # The scheduler's handshake says "ready" before the HTTP server starts: not a readiness signal.
    assert client.get(f"{url}/server_info").json()["status"] == "ready"
    models = client.get(f"{url}/v1/models")  # answers during warmup: not a readiness signal
    assert models.status_code == 200 and models.json()["data"][0]["max_model_len"] == 8192
    ready = wait_for(lambda: client.get(f"{url}/health").status_code == 200)
    # Not before its start-up delay and warm-up: timers never fire early, so no machine's speed fails this.
    assert ready and time.monotonic() - started >= 0.8
    health = client.get(f"{url}/health")
    assert (health.status_code, health.content) == (200, b"")
    assert client.get(f"{url}/ready").status_code == 200
    assert READY_LINE in capsys.readouterr().out


def _connects(client, url):
    try:
        client.get(f"{url}/v1/models")
    except httpx.ConnectError:
        return False
    return True


def test_probe_endpoints_have_the_sglang_shapes(start_fleet, fast, client):
    fleet = start_fleet(
        fast(max_running_requests=24, context_length=4096, served_model_name="qwen", reasoning_parser="qwen3")
    )
    url = fleet.urls[0]
    models = client.get(f"{url}/v1/models").json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert {k: card[k] for k in ("id", "object", "owned_by", "parent", "max_model_len")} == {
        "id": "qwen",
        "object": "model",
        "owned_by": "sglang",
        "parent": None,
        "max_model_len": 4096,
    }
    info = client.get(f"{url}/server_info").json()
    assert client.get(f"{url}/get_server_info").json().keys() == info.keys()
    assert info["simulator"] is True and info["status"] == "ready" and info["version"] == "0.5.23"
    assert (
        info["model_path"],
        info["context_length"],
        info["max_running_requests"],
        info["tp_size"],
        info["dp_size"],
    ) == ("Qwen/Qwen3-8B", 4096, 24, 1, 1)
    assert info["max_total_num_tokens"] == 24 * 4096 and info["max_req_input_len"] == 4096 - 1 - 5
    state = info["internal_states"][0]
    assert state["effective_max_running_requests_per_dp"] == 24
    assert {"last_gen_throughput", "memory_usage"} <= state.keys()
    model_info = client.get(f"{url}/model_info").json()
    assert client.get(f"{url}/get_model_info").json() == model_info
    assert (model_info["served_model_name"], model_info["reasoning_parser"], model_info["is_generation"]) == (
        "qwen",
        "qwen3",
        True,
    )
    load = loads(client, url)
    assert (load["num_running_reqs"], load["num_waiting_reqs"], load["max_running_requests"]) == (0, 0, 24)


def test_unknown_paths_and_methods(start_fleet, fast, client):
    url = start_fleet(fast()).urls[0]
    missing = client.get(f"{url}/nope")
    assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})
    assert client.get(f"{url}/metrics").status_code == 404  # as without --enable-metrics
    assert client.post(f"{url}/health").status_code == 405
    assert client.get(f"{url}/v1/chat/completions").status_code == 405


def test_sglang_api_key_guards_everything_but_health(start_fleet, fast, client, chat):
    url = start_fleet(fast(api_key="sekrit")).urls[0]
    for response in (
        client.get(f"{url}/v1/models"),
        client.get(f"{url}/server_info"),
        client.get(f"{url}/sim/stats"),
        client.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}),
        chat(url),
    ):
        assert (response.status_code, response.json()) == (401, {"error": "Unauthorized"})
    assert client.get(f"{url}/health").status_code == 200
    assert client.get(f"{url}/ready").status_code == 200
    authorized = {"Authorization": "Bearer sekrit"}
    assert client.get(f"{url}/v1/models", headers=authorized).status_code == 200
    answer = client.post(f"{url}/v1/chat/completions", json={"messages": POEM}, headers=authorized)
    assert answer.status_code == 200


# chat completions


def test_response_has_the_sglang_shape_and_counts(start_fleet, fast, chat, prompt_tokens, tokenizer):
    url = start_fleet(fast()).urls[0]
    body = chat(
        url, POEM, max_tokens=500, rid="req-1", chat_template_kwargs={"enable_thinking": False}
    ).json()
    assert body.keys() == {"id", "object", "created", "model", "choices", "usage", "metadata"}
    assert (body["id"], body["object"], body["model"]) == ("req-1", "chat.completion", "m")
    choice = body["choices"][0]
    assert choice.keys() == {"index", "message", "logprobs", "finish_reason", "matched_stop"}
    assert choice["message"].keys() == {"role", "content", "reasoning_content"}
    assert (choice["index"], choice["message"]["role"], choice["logprobs"]) == (0, "assistant", None)
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", tokenizer.eos_token_id)
    usage = body["usage"]
    assert usage["prompt_tokens"] == prompt_tokens(POEM, {"enable_thinking": False})
    assert usage["completion_tokens"] == count_tokens(tokenizer, [choice["message"]["content"]])[0]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert (usage["reasoning_tokens"], usage["completion_tokens_details"]) == (0, None)


@pytest.mark.parametrize(
    "messages",
    [
        POEM,
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three prime numbers, please."},
        ],
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Explain recursion with an example in Python. " * 20},
        ],
    ],
)
@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": False}])
def test_prompt_tokens_are_the_chat_template_count(start_fleet, fast, chat, prompt_tokens, messages, kwargs):
    url = start_fleet(fast()).urls[0]
    usage = chat(url, messages, max_tokens=5, chat_template_kwargs=kwargs).json()["usage"]
    assert usage["prompt_tokens"] == prompt_tokens(messages, kwargs)


def test_completion_tokens_are_the_qwen3_count_of_the_text(start_fleet, fast, chat, tokenizer):
    url = start_fleet(fast(output_sigma=1.0)).urls[0]
    answers = [
        chat(
            url,
            [{"role": "user", "content": f"question number {i}"}],
            chat_template_kwargs={"enable_thinking": False},
        ).json()
        for i in range(15)
    ]
    texts = [a["choices"][0]["message"]["content"] for a in answers]
    assert count_tokens(tokenizer, texts) == [a["usage"]["completion_tokens"] for a in answers]


def test_output_max_tokens_ends_long_answers_before_the_cap(start_fleet, fast, chat):
    url = start_fleet(fast(output_median_tokens=300, output_sigma=0.0, output_max_tokens=120)).urls[0]
    answer = chat(url, POEM, max_tokens=1000, chat_template_kwargs={"enable_thinking": False}).json()
    assert (answer["choices"][0]["finish_reason"], answer["usage"]["completion_tokens"]) == ("stop", 120)


def test_max_tokens_cuts_with_finish_reason_length(start_fleet, fast, chat, tokenizer):
    url = start_fleet(fast(output_median_tokens=300, output_sigma=0.0)).urls[0]
    thinking_off = {"enable_thinking": False}
    cut = chat(url, POEM, max_tokens=25, chat_template_kwargs=thinking_off).json()
    choice = cut["choices"][0]
    assert (choice["finish_reason"], choice["matched_stop"], cut["usage"]["completion_tokens"]) == (
        "length",
        None,
        25,
    )
    assert count_tokens(tokenizer, [choice["message"]["content"]]) == [25]
    # max_completion_tokens wins over max_tokens
    both = chat(url, POEM, max_tokens=25, max_completion_tokens=7, chat_template_kwargs=thinking_off).json()
    assert both["usage"]["completion_tokens"] == 7
    whole = chat(url, POEM, max_tokens=1000, chat_template_kwargs=thinking_off).json()
    assert (whole["choices"][0]["finish_reason"], whole["usage"]["completion_tokens"]) == ("stop", 300)
    assert whole["choices"][0]["message"]["content"].startswith(choice["message"]["content"])


def test_without_max_tokens_generation_runs_until_the_context_is_nearly_full(
    start_fleet, fast, chat, prompt_tokens
):
    url = start_fleet(fast(context_length=256, output_median_tokens=10_000, output_sigma=0.0)).urls[0]
    body = chat(url, POEM, chat_template_kwargs={"enable_thinking": False}).json()
    assert body["choices"][0]["finish_reason"] == "length"
    # SGLang's scheduler caps the output at max_req_len - prompt - 1, max_req_len = context - 1.
    assert body["usage"]["completion_tokens"] == 256 - 2 - prompt_tokens(POEM, {"enable_thinking": False})
    assert body["usage"]["total_tokens"] == 254


def test_context_errors_have_the_exact_sglang_texts(start_fleet, fast, chat, prompt_tokens):
    url = start_fleet(fast(context_length=64)).urls[0]
    p = prompt_tokens(POEM)

    def error(message):
        return {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": 400}

    too_large = chat(url, POEM, max_tokens=65)
    assert (too_large.status_code, too_large.json()) == (
        400,
        error("max_completion_tokens is too large: 65.This model supports at most 64 completion tokens."),
    )
    over = chat(url, POEM, max_tokens=64 - p + 1)
    assert (over.status_code, over.json()) == (
        400,
        error(
            "Requested token count exceeds the model's maximum context length of 64 tokens. "
            f"You requested a total of 65 tokens: {p} tokens from the input messages and {64 - p + 1} tokens "
            "for the completion. Please reduce the number of tokens in the input messages or the completion "
            "to fit within the limit."
        ),
    )
    long_prompt = [{"role": "user", "content": "tell me more " * 30}]
    n = prompt_tokens(long_prompt)
    too_long = chat(url, long_prompt, max_tokens=1)
    assert (too_long.status_code, too_long.json()) == (
        400,
        error(f"The input ({n} tokens) is longer than the model's context length (64 tokens)."),
    )
    exactly_full = chat(url, POEM, max_tokens=64 - p)  # prompt + max_tokens == context is allowed
    assert exactly_full.status_code == 200


def test_prompts_over_max_req_input_len_get_the_scheduler_text(start_fleet, fast, client, chat, prompt_tokens):
    # A KV cache of 100 tokens: max_req_len = min(512 - 1, 100 - 1) = 99, max_req_input_len = 94.
    url = start_fleet(
        fast(context_length=512, max_total_tokens=100, output_median_tokens=10_000, output_sigma=0.0)
    ).urls[0]
    assert client.get(f"{url}/server_info").json()["max_req_input_len"] == 94
    long_prompt = [{"role": "user", "content": "tell me more " * 30}]
    n = prompt_tokens(long_prompt)
    assert 94 <= n < 512
    rejected = chat(url, long_prompt, max_tokens=1)
    assert (rejected.status_code, rejected.json()["message"]) == (
        400,
        f"Input length ({n} tokens) exceeds the maximum allowed length (94 tokens). "
        "Use a shorter input or enable --allow-auto-truncate.",
    )
    # Within the context but not within the KV cache: the scheduler cuts the output at
    # max_req_len - prompt - 1 without a word.
    p = prompt_tokens(POEM, {"enable_thinking": False})
    cut = chat(url, POEM, max_tokens=200, chat_template_kwargs={"enable_thinking": False}).json()
    assert (cut["choices"][0]["finish_reason"], cut["usage"]["completion_tokens"]) == ("length", 99 - p - 1)


def test_request_validation_errors(start_fleet, fast, client, chat):
    url = start_fleet(fast()).urls[0]
    not_json = client.post(
        f"{url}/v1/chat/completions", content=b'{"messages": []}', headers={"content-type": "text/plain"}
    )
    assert not_json.status_code == 400
    assert "Unsupported Media Type: Only 'application/json' is allowed" in not_json.json()["message"]
    broken = client.post(
        f"{url}/v1/chat/completions", content=b"{", headers={"content-type": "application/json"}
    )
    assert broken.status_code == 400 and "JSON decode error" in broken.json()["message"]
    assert chat(url, []).json()["message"] == "Messages cannot be empty."
    assert chat(url, POEM, n=2).json()["message"] == "The simulator supports only n=1."
    assert chat(url, POEM, max_tokens=-1).status_code == 400


def test_same_request_same_answer_across_restarts(start_fleet, fast, chat):
    first = start_fleet(fast(output_sigma=1.0)).urls[0]
    second = start_fleet(fast(output_sigma=1.0)).urls[0]
    other_seed = start_fleet(fast(output_sigma=1.0, seed=42)).urls[0]
    message = lambda url, **kw: chat(url, POEM, **kw).json()["choices"][0]["message"]  # noqa: E731
    assert message(first) == message(first) == message(second)
    assert message(other_seed) != message(first)
    assert message(first, seed=3) != message(first)


def test_reasoning_parser_splits_thinking_from_the_answer(start_fleet, fast, chat, tokenizer):
    url = start_fleet(fast(reasoning_parser="qwen3", output_median_tokens=100, output_sigma=0.0)).urls[0]
    body = chat(url, POEM).json()
    message, usage = body["choices"][0]["message"], body["usage"]
    assert message["reasoning_content"] and message["content"]
    assert "<think>" not in message["content"]
    raw = f"<think>\n{message['reasoning_content']}\n</think>\n\n{message['content']}"
    assert count_tokens(tokenizer, [raw]) == [usage["completion_tokens"]]
    assert usage["reasoning_tokens"] == count_tokens(tokenizer, [raw.split("</think>")[0] + "</think>"])[0]

    inside = chat(url, POEM, max_tokens=10).json()["choices"][0]
    assert (inside["message"]["content"], inside["finish_reason"]) == ("", "length")
    assert inside["message"]["reasoning_content"]

    no_thinking = chat(url, POEM, chat_template_kwargs={"enable_thinking": False}).json()["choices"][0][
        "message"
    ]
    assert no_thinking["reasoning_content"] is None and "<think>" not in no_thinking["content"]

    unseparated = chat(url, POEM, separate_reasoning=False).json()["choices"][0]["message"]
    assert unseparated["reasoning_content"] is None and unseparated["content"] == raw


def test_without_reasoning_parser_thinking_stays_in_content(start_fleet, fast, chat):
    url = start_fleet(fast()).urls[0]
    message = chat(url, POEM).json()["choices"][0]["message"]
    assert message["content"].startswith("<think>\n") and message["reasoning_content"] is None


# slots, queue, disconnects, stats


def paced(fast, *, slots, token_latency_s):
    """A server whose answers run to ``max_tokens`` at a fixed pace, keeping its request timeline."""
    return fast(
        max_running_requests=slots,
        ttft_s=0.0,
        token_latency_s=token_latency_s,
        output_median_tokens=1000,
        output_sigma=0.0,
        keep_timeline=True,
    )


def test_slots_run_and_the_rest_wait_in_fifo_order(start_fleet, fast, client, chat):
    # Requests of 1 s: the five arrive within it on any machine (each is sent once the last is seen).
    fleet = start_fleet(paced(fast, slots=2, token_latency_s=0.01))
    url = fleet.urls[0]

    futures = []
    for i in range(5):
        futures.append(in_background(chat, url, [{"role": "user", "content": f"job {i}"}], max_tokens=100))
        wait_for(
            lambda arrived=i + 1: fleet.stats(0)["num_running"] + fleet.stats(0)["num_waiting"] == arrived
        )
    load = loads(client, url)
    assert (load["num_running_reqs"], load["num_waiting_reqs"], load["queues"]["waiting"]) == (2, 3, 3)
    assert load["utilization"] == 1.0 and load["num_used_tokens"] > 0
    assert [future.result(timeout=30).status_code for future in futures] == [200] * 5
    stats = fleet.stats(0)
    requests = sorted(stats["timeline"]["requests"], key=lambda r: r["arrived"])
    # First come, first served: of requests of equal length, they end in the order they arrived.
    assert [r["instruction"] for r in sorted(requests, key=lambda r: r["ended"])] == [f"job {i}" for i in range(5)]
    assert (stats["completed"], stats["chat_requests_by_status"], stats["num_running"]) == (5, {"200": 5}, 0)
    # Both slots were busy until the fourth answer; the fifth ran alone (the tail a benchmark reports).
    ends = sorted(r["ended"] for r in requests)
    assert ends[2] <= stats["last_full_at_monotonic_s"] <= ends[3]
    # What each request held a slot for, at most, by the server's own record: from its arrival or,
    # for the three that waited, from the answer that freed their slot, to its own end.
    held = [r["ended"] - max(r["arrived"], ends[i - 2] if i >= 2 else r["arrived"]) for i, r in enumerate(requests)]
    # 5 requests of 1 s on 2 slots: 5 slot-seconds of work, counted while they held slots and never
    # while they waited. Timers fire late on a busy machine, never early.
    assert 5.0 <= stats["busy_slot_seconds"] <= sum(held)
    assert 1.0 <= stats["longest_request_s"] <= max(held)


def test_a_full_queue_answers_503(start_fleet, fast, chat):
    fleet = start_fleet(fast(max_running_requests=1, max_queued_requests=1, ttft_s=0.3))
    url = fleet.urls[0]
    running = in_background(chat, url, max_tokens=1)
    wait_for(lambda: fleet.stats(0)["num_running"] == 1)
    waiting = in_background(chat, url, max_tokens=1)
    wait_for(lambda: fleet.stats(0)["num_waiting"] == 1)
    full = chat(url, max_tokens=1)
    assert (full.status_code, full.json()) == (
        503,
        {
            "object": "error",
            "message": "The request queue is full.",
            "type": "503",
            "param": None,
            "code": 503,
        },
    )
    assert running.result(timeout=5).status_code == waiting.result(timeout=5).status_code == 200


def test_a_client_that_gives_up_frees_its_slot(start_fleet, fast, chat):
    fleet = start_fleet(paced(fast, slots=1, token_latency_s=0.1))
    url = fleet.urls[0]
    with httpx.Client(timeout=0.3) as impatient, pytest.raises(httpx.ReadTimeout):
        impatient.post(
            f"{url}/v1/chat/completions", json={"messages": POEM, "max_tokens": 100}
        )  # 10 s of work
    wait_for(lambda: fleet.stats(0)["aborted"] == 1)
    assert fleet.stats(0)["num_running"] == 0
    assert chat(url, max_tokens=2).status_code == 200
    # By the server's record: the slot was let go when the client left, not when its 10 s of work
    # would have ended, and the next request found it free.
    gone, served = fleet.stats(0)["timeline"]["requests"]
    assert (gone["status"], served["status"]) == ("aborted", 200)
    assert gone["ended"] <= served["arrived"]


def test_stats_report_context_pressure(start_fleet, fast, client, chat, prompt_tokens):
    url = start_fleet(fast(context_length=64)).urls[0]
    p = prompt_tokens(POEM)
    chat(url, max_tokens=10)
    chat(url, max_tokens=60)
    chat(url, max_tokens=64)
    stats = client.get(f"{url}/sim/stats").json()
    assert stats["simulator"] is True and stats["slots"] == 16
    assert (stats["max_requested_total_tokens"], stats["context_exceeded"]) == (p + 64, 2)
    assert stats["chat_requests_by_status"] == {"200": 1, "400": 2}
    assert stats["prompt_tokens_total"] == p
    assert 0 <= stats["busy_slot_seconds"] <= 16 * stats["elapsed_since_ready_s"]


def test_servers_in_one_fleet_keep_separate_state(start_fleet, fast, client, chat):
    fleet = start_fleet(fast(), fast(backend="vllm", served_model_name="m"))
    assert len(set(fleet.urls)) == 2
    chat(fleet.urls[0])
    chat(fleet.urls[0])
    assert fleet.stats(0)["completed"] == 2 and fleet.stats(1)["completed"] == 0


def test_keep_alive_and_pipelined_requests_on_one_socket(start_fleet, fast):
    url = start_fleet(fast()).urls[0]
    host, port = url.removeprefix("http://").split(":")
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(request * 3)  # pipelined
        received = b""
        while received.count(b"HTTP/1.1 200") < 3:
            received += sock.recv(4096)
        sock.sendall(request)  # the same connection is still open
        assert sock.recv(4096).startswith(b"HTTP/1.1 200 OK\r\n")
    assert received.count(b"content-length: 0\r\n") == 3
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 400 ")
        assert sock.recv(4096) == b""  # and the connection is closed


# vLLM


def test_vllm_backend_differences(start_fleet, fast, client, chat, prompt_tokens):
    url = start_fleet(
        fast(backend="vllm", served_model_name="m", context_length=64, output_median_tokens=1000, output_sigma=0.0)
    ).urls[0]
    p = prompt_tokens(POEM)
    for path in ("/server_info", "/get_server_info", "/model_info", "/v1/loads", "/get_load"):
        assert client.get(f"{url}{path}").status_code == 404
    card = client.get(f"{url}/v1/models").json()["data"][0]
    assert (card["id"], card["root"], card["max_model_len"], card["owned_by"]) == ("m", "Qwen/Qwen3-8B", 64, "vllm")
    assert client.get(f"{url}/version").json() == {"version": "0.33.0"}
    tokenized = client.post(f"{url}/tokenize", json={"model": "m", "messages": POEM}).json()
    assert (tokenized["count"], len(tokenized["tokens"]), tokenized["max_model_len"]) == (p, p, 64)

    truncated = chat(url, POEM, max_tokens=60)  # p + 60 > 64: vLLM stops at the edge instead of refusing
    assert truncated.status_code == 200
    assert truncated.json()["choices"][0]["finish_reason"] == "length"
    assert truncated.json()["usage"]["completion_tokens"] == 64 - p

    too_large = chat(url, POEM, max_tokens=65)
    assert (too_large.status_code, too_large.json()) == (
        400,
        {
            "error": {
                "message": "max_tokens=65 cannot be greater than max_model_len=64. "
                "Please request fewer output tokens. (parameter=max_tokens, value=65)",
                "type": "BadRequestError",
                "param": "max_tokens",
                "code": 400,
            }
        },
    )
    long_prompt = [{"role": "user", "content": "tell me more " * 30}]
    n = prompt_tokens(long_prompt)
    too_long = chat(url, long_prompt, max_tokens=1)
    assert (too_long.status_code, too_long.json()["error"]["param"]) == (400, "input_tokens")
    assert too_long.json()["error"]["message"] == (
        f"This model's maximum context length is 64 tokens. However, your prompt contains {n} input "
        "tokens, which exceeds this limit even without any output tokens. Please reduce the length of "
        f"the input prompt. (parameter=input_tokens, value={n})"
    )


def test_vllm_checks_the_model_name_and_guards_only_its_api_paths(start_fleet, fast, client, chat):
    url = start_fleet(fast(backend="vllm", api_key="sekrit", served_model_name="qwen")).urls[0]
    key = {"Authorization": "Bearer sekrit"}
    assert chat(url).status_code == 401
    assert client.get(f"{url}/version").status_code == 200  # outside /v1: not guarded
    unknown = client.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": POEM}, headers=key)
    assert (unknown.status_code, unknown.json()["error"]) == (
        404,
        {"message": "The model `m` does not exist.", "type": "NotFoundError", "param": "model", "code": 404},
    )
    served = client.post(f"{url}/v1/chat/completions", json={"model": "qwen", "messages": POEM}, headers=key)
    assert served.status_code == 200 and served.json()["model"] == "qwen"
    unnamed = client.post(f"{url}/v1/chat/completions", json={"messages": POEM, "max_tokens": 2}, headers=key)
    assert unnamed.status_code == 200


# fault injection


def test_fail_rate_answers_every_third_request_with_the_fail_status(start_fleet, fast, chat):
    url = start_fleet(fast(fail_rate=1 / 3, fail_status=503)).urls[0]
    responses = [chat(url, max_tokens=2) for _ in range(6)]
    assert [r.status_code for r in responses] == [200, 200, 503, 200, 200, 503]
    failed = responses[2].json()
    assert (failed["object"], failed["code"], failed["type"]) == ("error", 503, "503")


def test_a_server_dies_after_n_requests_and_comes_back_on_restart(start_fleet, fast, chat):
    config = fast(
        die_after_requests=2, ttft_s=0.0, token_latency_s=0.01, output_median_tokens=1000, output_sigma=0.0
    )
    fleet = start_fleet(config)
    url = fleet.urls[0]
    in_flight = in_background(chat, url, max_tokens=300)  # 3 s of work, cut short by the death
    wait_for(lambda: fleet.stats(0)["num_running"] == 1)
    assert chat(url, max_tokens=1).status_code == 200
    assert chat(url, max_tokens=1).status_code == 200  # the second completion: the server dies
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):  # the server vanished mid-answer
        in_flight.result(timeout=5)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")  # a new connection: the port is closed
    assert fleet.state(0) == "stopped"

    fleet.restart(0, config=dataclasses.replace(config, die_after_requests=None))
    assert fleet.urls[0] == url
    assert chat(url, max_tokens=1).status_code == 200
    assert fleet.stats(0)["completed"] == 1  # a fresh server


def test_kill_and_restart_one_server_through_the_fleet_api(start_fleet, fast, client, chat):
    fleet = start_fleet(fast(), fast())
    first, second = fleet.urls
    chat(first)
    fleet.kill(0)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{first}/health")
    assert client.get(f"{second}/health").status_code == 200  # the others keep serving
    assert (fleet.state(0), fleet.state(1)) == ("stopped", "ready")
    fleet.restart(0)
    assert fleet.urls == [first, second]
    assert chat(first).status_code == 200
    assert fleet.stats(0)["completed"] == 1  # a fresh server: the earlier request is forgotten


def test_hung_requests_never_answer_until_the_client_gives_up(start_fleet, fast):
    fleet = start_fleet(fast(hang_rate=1.0))
    url = fleet.urls[0]
    with httpx.Client(timeout=0.3) as impatient, pytest.raises(httpx.ReadTimeout):
        impatient.post(f"{url}/v1/chat/completions", json={"messages": POEM, "max_tokens": 1})
    wait_for(lambda: fleet.stats(0)["aborted"] == 1)
    assert (fleet.stats(0)["hung"], fleet.stats(0)["num_running"]) == (1, 0)


def test_prompt_token_skew_shifts_every_reported_count(start_fleet, fast, chat, prompt_tokens):
    url = start_fleet(fast(prompt_token_skew=7, context_length=64)).urls[0]
    p = prompt_tokens(POEM)
    assert chat(url, max_tokens=1).json()["usage"]["prompt_tokens"] == p + 7
    over = chat(url, max_tokens=64 - p)  # fits by the local count, not by the server's
    assert over.status_code == 400
    assert f"{p + 7} tokens from the input messages" in over.json()["message"]


def test_abort_rate_answers_200_with_partial_text_and_finish_reason_abort(start_fleet, fast, chat, tokenizer):
    fleet = start_fleet(fast(abort_rate=0.5, output_median_tokens=40, output_sigma=0.0))
    url = fleet.urls[0]
    off = {"enable_thinking": False}
    bodies = [chat(url, max_tokens=100, chat_template_kwargs=off).json() for _ in range(4)]
    finishes = [b["choices"][0]["finish_reason"] for b in bodies]
    assert finishes == ["stop", "abort", "stop", "abort"]
    whole, cut = bodies[0]["choices"][0], bodies[1]["choices"][0]
    assert (cut["matched_stop"], bodies[1]["usage"]["completion_tokens"]) == (None, 20)  # halfway
    assert whole["message"]["content"].startswith(cut["message"]["content"])
    assert count_tokens(tokenizer, [cut["message"]["content"]]) == [20]
    assert fleet.stats(0)["abort_finishes"] == 2
