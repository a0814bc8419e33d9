"""The generation engine against httpx.MockTransport: dispatch, retries, breaker, records."""

import asyncio
import collections
import contextlib
import dataclasses
import json

import httpx
import pytest

from expansion_dag.core import CANARY_PROMPTS, ShardAborted, is_final
from expansion_dag.generation import Server, WorkItem, generate_shard
from expansion_dag.servers import VLLM, dialect_for
from expansion_dag.store import CompletionStore
from expansion_dag_tests.helpers import default_sampling, default_engine

URL = "http://gpu-0:30000"
# These handlers answer plain JSON bodies; streamed requests are tested in test_engine_streaming.py.
FAST = dict(
    backoff_initial_s=0.001, progress_interval_s=3600, stop_degenerate=False,
    owner_wait_s=0,  # the idle helpers here have no shard of their own to wait for
)
OVERFLOW = (
    "Requested token count exceeds the model's maximum context length of {c} tokens. You requested a total "
    "of {m} tokens: {x} tokens from the input messages and {y} tokens for the completion. Please reduce the "
    "number of tokens in the input messages or the completion to fit within the limit."
)


def items(n, *, max_tokens=100):
    return [
        WorkItem(
            key=f"k{i:03d}",
            prompt_id=f"p{i:03d}",
            source="src-a" if i % 2 else "src-b",
            messages=[{"role": "user", "content": f"question {i}"}],
            prompt_tokens=10 + i,
            max_tokens=max_tokens,
            expected_output_tokens=10 + i,
        )
        for i in range(n)
    ]


def completion(content="fine", finish="stop", prompt_tokens=None, completion_tokens=5, reasoning=None):
    return {
        "id": "x",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "reasoning_content": reasoning},
                "finish_reason": finish,
            }
        ],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
    }


def prompt_number(request):
    return int(json.loads(request.content)["messages"][0]["content"].split()[-1])


def run(tmp_path, work, handler, *, slots=4, config=None, dialect=None, **kw):
    store = CompletionStore(tmp_path)
    with store.writer("shard-00") as writer:
        report = generate_shard(
            work,
            [Server(URL, slots) if dialect is None else Server(URL, slots, dialect)],
            writer=writer,
            model="m",
            sampling=kw.pop("sampling", default_sampling()),
            config=config or default_engine(**FAST),
            transport=httpx.MockTransport(handler),
            **kw,
        )
    return report, store


def test_every_prompt_ends_as_one_completion_with_what_a_user_needs(tmp_path):
    def handler(request):
        n = prompt_number(request)
        return httpx.Response(200, json=completion(f"answer {n}", prompt_tokens=10 + n, reasoning="hmm"))

    report, store = run(tmp_path, items(20), handler)
    records = list(store.records("shard-00"))
    assert sorted(r["prompt_id"] for r in records) == [f"p{i:03d}" for i in range(20)]
    record = next(r for r in records if r["prompt_id"] == "p003")
    assert record["content"] == "answer 3"
    assert record["reasoning_content"] == "hmm"
    assert record["finish_reason"] == "stop"
    assert record["prompt_tokens"] == record["local_prompt_tokens"] == 13
    assert record["completion_tokens"] == 5
    assert record["max_tokens"] == 100
    assert record["server"] == URL
    assert record["attempts"] == 1
    assert record["latency_s"] >= 0
    assert report.ok == 20 and report.failed == 0
    assert report.drifted_completions == 0


class Concurrency:
    """Requests a handler is answering at once (``now``) and the most it ever answered (``peak``).

    After the first (the canary, which the engine sends alone), each request is held until ``fill``
    of them have been in at once: whether the engine's workers overlap is then the engine's doing,
    not the machine's (a worker that a busy CPU lets run late would otherwise find the others
    answered). Should the engine never send ``fill`` at once, the requests go on after a deadline
    only that reaches, and ``peak`` says how many it sent.
    """

    def __init__(self, fill: int):
        self.fill = fill
        self.filled = asyncio.Event()
        self.answered = 0
        self.now = 0
        self.peak = 0

    async def answer(self):
        self.now += 1
        self.peak = max(self.peak, self.now)
        if self.now >= self.fill:
            self.filled.set()
        if self.answered:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.filled.wait(), 10.0)
        await asyncio.sleep(0.01)  # hold the request so that others overlap it
        self.now -= 1
        self.answered += 1
        return httpx.Response(200, json=completion())


def test_in_flight_requests_fill_the_slots_plus_headroom_and_never_more(tmp_path):
    in_flight = Concurrency(fill=8 + 2)

    async def handler(request):
        return await in_flight.answer()

    config = default_engine(**FAST, min_headroom=2)
    run(tmp_path, items(60), handler, slots=8, config=config)
    assert in_flight.peak == 8 + 2


def test_the_canary_is_the_shortest_expected_answer_then_the_longest_start_first(tmp_path):
    started = []

    def handler(request):
        started.append(prompt_number(request))
        return httpx.Response(200, json=completion())

    run(tmp_path, items(12), handler, slots=1, config=default_engine(**FAST, min_headroom=0, headroom_fraction=0))
    assert started == [0, *range(11, 0, -1)]


def loads(*, slots, running, waiting):
    rank = {"max_running_requests": slots, "num_running_reqs": running, "num_waiting_reqs": waiting}
    return httpx.Response(200, json={"loads": [rank]})


def test_queued_prompts_go_to_a_server_reporting_idle_slots_never_to_one_with_a_queue(tmp_path):
    idle, busy = "http://gpu-1:30000", "http://gpu-2:30000"
    chats = collections.Counter()

    async def handler(request):
        server = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if request.url.path == "/v1/loads":
            return loads(slots=4, running=0, waiting=0) if server == idle else loads(slots=4, running=4, waiting=2)
        chats[server] += 1
        await asyncio.sleep(0.005)
        return httpx.Response(200, json=completion())

    config = default_engine(**FAST, spill_poll_s=0.02)
    helpers = [Server(idle, 4), Server(busy, 4)]
    report, store = run(tmp_path, items(300), handler, slots=4, config=config, helpers=helpers)
    records = list(store.records("shard-00"))
    assert sorted(r["prompt_id"] for r in records) == [f"p{i:03d}" for i in range(300)]
    assert chats[busy] == 0
    assert chats[idle] > 0
    assert sum(r["server"] == idle for r in records) == report.helpers[idle].requests == chats[idle]
    assert report.ok == 300


def test_a_borrower_leaves_a_reserve_of_a_server_its_owner_is_using(tmp_path):
    """An owner's workers between two requests read as idle slots; borrowers leave some to it."""
    helper = "http://gpu-1:30000"
    owners = 8  # requests of the helper's own shard, always running
    ours = Concurrency(fill=16 - owners - 1)

    async def handler(request):
        if request.url.path == "/v1/loads":
            return loads(slots=16, running=owners + ours.now, waiting=0)
        if request.url.host != "gpu-1":
            await asyncio.sleep(0.01)
            return httpx.Response(200, json=completion())
        return await ours.answer()

    config = default_engine(**FAST, spill_poll_s=0.01)
    report, _ = run(tmp_path, items(400), handler, slots=1, config=config, helpers=[Server(helper, 16)])
    # 16 slots, 8 of them the owner's: 8 read idle, 1 of them left for the owner's next request.
    assert ours.peak == 16 - owners - 1
    assert report.ok == 400 and report.helpers[helper].requests > 0


def test_an_older_sglang_is_borrowed_through_get_load_with_its_probed_slots(tmp_path):
    old = "http://gpu-1:30000"  # SGLang 0.5.7: /get_load counts requests, it has no /v1/loads
    chats = collections.Counter()

    async def handler(request):
        if request.url.path == "/get_load":
            return httpx.Response(200, json=[{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}])
        if request.url.path == "/v1/loads":
            return httpx.Response(404, json={"detail": "Not Found"})
        chats[request.url.host] += 1
        await asyncio.sleep(0.005)
        return httpx.Response(200, json=completion())

    helpers = [Server(old, 4, dialect_for("sglang", "0.5.7"))]
    report, _ = run(tmp_path, items(300), handler, config=default_engine(**FAST, spill_poll_s=0.02), helpers=helpers)
    assert chats["gpu-1"] > 0
    assert report.helpers[old].requests == chats["gpu-1"] and report.ok == 300


def test_a_server_that_cannot_say_its_load_is_never_borrowed(tmp_path):
    vllm = "http://gpu-1:8000"
    asked = collections.Counter()

    def handler(request):
        asked[request.url.host] += 1
        return httpx.Response(200, json=completion())

    config = default_engine(**FAST, spill_poll_s=0.001)
    report, _ = run(tmp_path, items(100), handler, config=config, helpers=[Server(vllm, 64, VLLM)])
    assert asked["gpu-1"] == 0 and report.ok == 100
    assert vllm not in report.helpers


def test_a_helper_that_fails_costs_nothing_its_prompts_go_home(tmp_path):
    helper = "http://gpu-1:30000"
    chats = collections.Counter()

    async def handler(request):
        if request.url.path == "/v1/loads":
            return loads(slots=8, running=0, waiting=0)
        chats[request.url.host] += 1
        if request.url.host == "gpu-1":
            raise httpx.ConnectError("connection refused")
        await asyncio.sleep(0.005)
        return httpx.Response(200, json=completion())

    config = default_engine(**FAST, spill_poll_s=0.02, breaker_window=4)
    report, store = run(tmp_path, items(200), handler, slots=4, config=config, helpers=[Server(helper, 8)])
    assert 0 < chats["gpu-1"] <= 8, "a failing helper is tried once per idle slot, then not again"
    assert report.ok == 200 and report.failed == 0 and report.aborted is None
    records = list(store.records("shard-00"))
    assert sorted(r["prompt_id"] for r in records) == [f"p{i:03d}" for i in range(200)]
    assert {r["server"] for r in records} == {URL}
    assert {r["attempts"] for r in records} == {1}


def test_transient_errors_are_retried_and_attempts_recorded(tmp_path):
    calls = {}

    def handler(request):
        n = prompt_number(request)
        calls[n] = calls.get(n, 0) + 1
        if calls[n] < 3:
            return httpx.Response(503, json={"object": "error", "message": "The request queue is full.", "code": 503})
        return httpx.Response(200, json=completion())

    report, store = run(tmp_path, items(3), handler)
    assert report.ok == 3
    assert {r["attempts"] for r in store.records("shard-00")} == {3}


def test_retries_are_bounded_and_the_failure_is_a_record(tmp_path):
    calls = 0

    def handler(request):
        nonlocal calls
        calls += 1
        return httpx.Response(502, text="bad gateway")

    config = default_engine(**FAST, max_attempts=3, canary=False, breaker_window=100)
    report, store = run(tmp_path, items(2), handler, config=config)
    assert calls == 6
    failures = list(store.records("shard-00", status="failed"))
    assert len(failures) == 2
    assert failures[0]["attempts"] == 3
    assert failures[0]["http_status"] == 502
    assert failures[0]["message"] == "bad gateway"
    assert failures[0]["error"] == "transient"
    assert report.failures_by_kind == {"transient": 2}


def test_an_aborted_answer_is_retried_and_never_kept_as_a_completion(tmp_path):
    calls = collections.Counter()

    def handler(request):
        n = prompt_number(request)
        calls[n] += 1
        # SGLang answers an aborted request 200 with partial text; prompt 2 is aborted every time.
        if n == 2 or calls[n] == 1:
            return httpx.Response(200, json=completion("cut off mid", finish="abort"))
        return httpx.Response(200, json=completion("the whole answer"))

    config = default_engine(**FAST, max_attempts=3, canary=False)
    report, store = run(tmp_path, items(4), handler, config=config)
    records = {r["prompt_id"]: r for r in store.records("shard-00")}
    assert sorted(records) == ["p000", "p001", "p003"]
    assert {r["content"] for r in records.values()} == {"the whole answer"}
    assert {r["attempts"] for r in records.values()} == {2}
    [failure] = store.records("shard-00", status="failed")
    assert (failure["prompt_id"], failure["error"], failure["attempts"]) == ("p002", "finish_abort", 3)
    assert "'abort'" in failure["message"]
    assert report.failures_by_kind == {"finish_abort": 1} and "abort" not in report.finish_reasons
    assert report.retries_by_kind == {"finish_abort": 3 * 1 + 2}  # one each for three prompts, two for p002


def test_vllm_reasoning_is_kept(tmp_path):
    def handler(request):
        body = completion("Paris.")
        body["choices"][0]["message"] = {"role": "assistant", "content": "Paris.", "reasoning": "The capital..."}
        return httpx.Response(200, json=body)

    _, store = run(tmp_path, items(2), handler, dialect=VLLM)
    assert {r["reasoning_content"] for r in store.records("shard-00")} == {"The capital..."}


def run_one_refused(tmp_path, n, refused, status, body):
    """``n`` prompts, all answered but prompt number ``refused``, which gets ``status`` and ``body``:
    the run's report and store, and how many requests the server saw."""
    calls = 0

    def handler(request):
        nonlocal calls
        calls += 1
        if prompt_number(request) == refused:
            return httpx.Response(status, json=body)
        return httpx.Response(200, json=completion())

    report, store = run(tmp_path, items(n), handler)
    return report, store, calls


def test_the_schedulers_input_limit_is_a_context_length_failure_not_retried(tmp_path):
    message = "Input length (8190 tokens) exceeds the maximum allowed length (8186 tokens). Use a shorter input"
    body = {"object": "error", "message": message, "type": "BadRequestError", "code": 400}
    report, store, calls = run_one_refused(tmp_path, 5, 3, 400, body)
    assert calls == 5
    [failure] = store.records("shard-00", status="failed")
    assert (failure["prompt_id"], failure["error"], failure["attempts"]) == ("p003", "context_length", 1)
    assert report.failures_by_kind == {"context_length": 1}


def test_other_client_errors_are_not_retried(tmp_path):
    body = {"object": "error", "message": "bad stop sequence", "code": 422}
    _, store, calls = run_one_refused(tmp_path, 6, 4, 422, body)
    assert calls == 6
    [failure] = store.records("shard-00", status="failed")
    assert (failure["prompt_id"], failure["http_status"], failure["message"]) == ("p004", 422, "bad stop sequence")
    assert failure["attempts"] == 1


def test_context_length_400_is_retried_once_with_the_servers_own_count(tmp_path):
    sent = []

    def handler(request):
        body = json.loads(request.content)
        sent.append(body["max_tokens"])
        # The server counts 40 more prompt tokens than the client did.
        server_prompt = 10 + prompt_number(request) + 40
        if server_prompt + body["max_tokens"] > 200:
            message = OVERFLOW.format(c=200, m=server_prompt + body["max_tokens"], x=server_prompt, y=body["max_tokens"])
            return httpx.Response(400, json={"object": "error", "message": message, "type": "BadRequestError", "code": 400})
        return httpx.Response(200, json=completion(prompt_tokens=server_prompt))

    work = [items(1, max_tokens=200 - 10 - 16)[0]]
    report, store = run(tmp_path, work, handler, config=default_engine(**FAST, margin=16, min_output_tokens=16))
    assert sent == [174, 200 - 50 - 16]
    [record] = store.records("shard-00")
    assert record["max_tokens"] == 134
    assert report.context_retries == 1
    assert report.prompt_token_drift == {40: 1}


def test_the_8192_incident_ends_after_a_few_canary_requests_with_the_servers_words(tmp_path):
    """A refused request may be one bad prompt: the canary tries another, and stops when each is refused."""
    calls = 0

    def handler(request):
        nonlocal calls
        calls += 1
        message = "max_completion_tokens is too large: 8192.This model supports at most 8191 completion tokens."
        return httpx.Response(400, json={"object": "error", "message": message, "type": "BadRequestError", "code": 400})

    with pytest.raises(ShardAborted, match="canary request to http://gpu-0:30000 failed .*too large: 8192") as info:
        run(tmp_path, items(500), handler, slots=72)
    assert calls == CANARY_PROMPTS == 3
    assert info.value.report.failed == CANARY_PROMPTS


def test_the_breaker_stops_a_shard_whose_requests_start_failing_the_same_way(tmp_path):
    calls = 0

    def handler(request):
        nonlocal calls
        calls += 1
        if calls == 1:
            return httpx.Response(200, json=completion())
        return httpx.Response(401, json={"error": "Unauthorized"})

    config = default_engine(**FAST, breaker_window=10)
    with pytest.raises(ShardAborted, match="circuit breaker: .* unauthorized HTTP 401: Unauthorized"):
        run(tmp_path, items(1000), handler, slots=4, config=config)
    assert calls < 30


def test_a_few_failures_among_many_successes_do_not_trip_the_breaker(tmp_path):
    def handler(request):
        if prompt_number(request) % 25 == 1:
            return httpx.Response(400, json={"object": "error", "message": "invalid", "code": 400})
        return httpx.Response(200, json=completion())

    report, _ = run(tmp_path, items(200), handler, config=default_engine(**FAST, breaker_window=10))
    assert report.failed == 8 and report.ok == 192


def test_a_malformed_200_is_a_failure_record_not_a_crash(tmp_path):
    report, store = run(tmp_path, items(1), lambda r: httpx.Response(200, json={"oops": True}), config=default_engine(**FAST, canary=False))
    [failure] = store.records("shard-00", status="failed")
    assert failure["error"] == "bad_response"


def test_requests_carry_the_sampling_settings_and_the_api_key(tmp_path):
    seen = []

    def handler(request):
        seen.append((json.loads(request.content), request.headers.get("authorization")))
        return httpx.Response(200, json=completion())

    sampling = default_sampling(temperature=0.3, seed=7, chat_template_kwargs_json='{"enable_thinking": false}')
    run(tmp_path, items(1), handler, sampling=sampling, api_key="secret")
    body, auth = seen[0]
    assert auth == "Bearer secret"
    assert body["temperature"] == 0.3 and body["seed"] == 7
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["model"] == "m"


def test_progress_reports_done_rate_in_flight_and_eta(tmp_path):
    seen = []

    async def handler(request):
        await asyncio.sleep(0.02)
        return httpx.Response(200, json=completion())

    config = default_engine(**{**FAST, "progress_interval_s": 0.01})
    run(tmp_path, items(30), handler, slots=2, config=config, on_progress=seen.append)
    assert seen, "no progress line"
    line = str(seen[-1])
    assert "/30 done" in line and "output tok/s" in line and URL in line and "ETA" in line
    assert "retries [none]" in line


def test_a_shard_quicker_than_its_progress_interval_still_reports_its_final_figures(tmp_path):
    seen = []

    async def handler(request):
        return httpx.Response(200, json=completion())

    config = default_engine(**{**FAST, "progress_interval_s": 3600.0})
    run(tmp_path, items(5), handler, slots=2, config=config, on_progress=seen.append)
    assert [(p.done, p.total, p.failed) for p in seen] == [(5, 5, 0)]


def test_progress_sums_the_retries_by_kind(tmp_path):
    seen = []
    calls = collections.Counter()

    async def handler(request):
        n = prompt_number(request)
        calls[n] += 1
        await asyncio.sleep(0.01)
        if calls[n] == 1 and n % 3 == 0:
            return httpx.Response(502, text="Bad Gateway")
        return httpx.Response(200, json=completion())

    config = default_engine(**{**FAST, "progress_interval_s": 0.005})
    report, _ = run(tmp_path, items(30), handler, slots=2, config=config, on_progress=seen.append)
    assert report.retries_by_kind == {"transient": 10}
    assert any("retries [transient " in str(p) for p in seen)


QUEUE_FULL = {"object": "error", "message": "The request queue is full.", "type": "503", "code": 503}


def test_a_full_queue_slows_the_sender_and_never_uses_up_a_prompts_attempts(tmp_path):
    calls = collections.Counter()

    def handler(request):
        n = prompt_number(request)
        calls[n] += 1
        if calls[n] <= 3:
            return httpx.Response(503, json=QUEUE_FULL)
        return httpx.Response(200, json=completion())

    # One attempt a prompt: a queue-full answer is backpressure, not a failed attempt.
    report, store = run(tmp_path, items(6), handler, config=default_engine(**{**FAST, "max_attempts": 1}))
    assert report.ok == 6 and report.failed == 0
    assert report.backpressure == report.retries_by_kind["queue_full"] == 18
    assert report.attempts == 24
    assert {r["attempts"] for r in store.records("shard-00")} == {4}


def test_a_queue_that_stays_full_past_the_wait_is_a_failure_a_rerun_asks_again(tmp_path):
    def handler(request):
        return httpx.Response(503, json=QUEUE_FULL)

    config = default_engine(**{**FAST, "canary": False, "breaker_window": 100})
    config = dataclasses.replace(config, retry=dataclasses.replace(config.retry, backpressure_wait_s=0.01))
    report, store = run(tmp_path, items(3), handler, config=config)
    assert report.failed == 3 and report.failures_by_kind == {"queue_full": 3}
    failures = list(store.records("shard-00", status="failed"))
    assert {(f["error"], f["outcome"], f["http_status"]) for f in failures} == {("queue_full", "backpressure", 503)}
    assert not any(is_final(f, ()) for f in failures)


def test_completion_identity_follows_model_and_sampling():
    base = default_sampling()
    assert base.key("p1", "model-a") == default_sampling().key("p1", "model-a")
    assert base.key("p1", "model-a") != base.key("p1", "model-b")
    assert base.key("p1", "model-a") != default_sampling(temperature=0.1).key("p1", "model-a")
    assert base.key("p1", "model-a") != default_sampling(chat_template_kwargs_json='{"enable_thinking": false}').key("p1", "model-a")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": 3.0}, "temperature must be within"),
        ({"top_p": 0.0}, "top_p must be within"),
        ({"max_output_tokens": 0}, "max_output_tokens must be positive"),
        ({"chat_template_kwargs_json": "[1]"}, "must be a JSON object"),
    ],
)
def test_invalid_sampling_settings_say_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        default_sampling(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_attempts": 0}, "max_attempts must be at least 1"),
        ({"breaker_failure_fraction": 0.0}, "breaker_failure_fraction must be within"),
        ({"spill_poll_s": 0}, "spill_poll_s must be positive"),
    ],
)
def test_invalid_engine_settings_say_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        default_engine(**kwargs)
