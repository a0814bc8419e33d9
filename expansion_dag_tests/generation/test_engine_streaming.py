"""Streaming through the engine against the simulator over real HTTP: loops stopped, recorded and
measured; legitimate repetition kept; the same records as plain requests otherwise."""

import json

import httpx
import pytest

from expansion_dag.core import FAILED, IDS_LEFT_OUT, OK, OUTPUT_IDS, PROMPT_IDS, unpack
from expansion_dag.generation import MIN_ANSWERS, Server, WorkItem, generate_shard
from expansion_dag.servers import SGLANG, dialect_for, find_loop
from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag.store import CompletionStore
from expansion_dag_tests.helpers import default_engine, default_sampling, loop_thresholds, repetitive_answers, wait_for

SHARD = "shard-00"
FAST = dict(backoff_initial_s=0.01, progress_interval_s=3600)
SIM = dict(port=0, max_running_requests=8, ttft_s=0.001, token_latency_s=0.0002, output_median_tokens=60)
CAP = 3000
MODEL = SimServerConfig().model_name


def work(n):
    return [
        WorkItem(
            key=f"k{i:04d}", prompt_id=f"p{i:04d}", source="s",
            messages=[{"role": "user", "content": f"Tell me fact number {i}."}],
            prompt_tokens=16, max_tokens=CAP, expected_output_tokens=84,
        )
        for i in range(n)
    ]


def run_shard(tmp_path, sim, config, n=40, stream_interval=1):
    """``stream_interval``: what the probe would say of the server (its own, or what vLLM is asked)."""
    store = CompletionStore(tmp_path)
    with SimulatedFleet([SimServerConfig(**{**SIM, **sim})]) as fleet:
        dialect = dialect_for(sim.get("backend", "sglang"), sim.get("version"))
        server = Server(fleet.urls[0], 8, dialect, stream_interval=stream_interval)
        with store.writer(SHARD) as writer:
            report = generate_shard(
                work(n), [server], writer=writer, model=MODEL, sampling=default_sampling(), config=config
            )
        # A stream the client stopped last may still be closing as the run returns (asyncio closes a
        # socket on the loop's next pass): the server's record once nothing runs there.
        stats = wait_for(lambda: idle(fleet.stats(0)), "the server's requests to end")
    return report, [*store.records(SHARD), *store.records(SHARD, status=FAILED)], stats


def idle(stats: dict) -> dict | None:
    return stats if stats["num_running"] == stats["num_waiting"] == 0 else None


@pytest.mark.parametrize(
    ("backend", "server_interval", "interval"),
    [
        ("sglang", 1, 1),
        ("vllm", 1, 1),
        ("sglang", 32, 32),  # SGLang streams at its launch setting
        ("vllm", 1, 32),  # vLLM is asked for it in each request
    ],
)
def test_looping_answers_are_stopped_recorded_as_degenerate_and_free_their_slot(
    tmp_path, backend, server_interval, interval
):
    report, records, stats = run_shard(
        tmp_path,
        dict(backend=backend, loop_rate=0.25, stream_interval=server_interval),
        default_engine(**FAST),
        stream_interval=interval,
    )
    assert stats["last_chat_request"].get("stream_interval") == (32 if backend == "vllm" and interval > 1 else None)
    degenerate = [r for r in records if r["status"] == FAILED]
    ok = [r for r in records if r["status"] == OK]
    assert len(degenerate) == 10 and len(ok) == 30
    for record in degenerate:
        assert record["error"] == "degenerate" and record["loop_rule"] == "exact"
        assert record["loop_repeats"] >= 4 and record["loop_span"] in record["content"]
        assert record["streamed_tokens"] < CAP / 4  # stopped well before the cap
        # The tokens it cost are counted from the events and the interval: the simulator's words
        # are one token each, so the text says what the count should be.
        assert record["streamed_tokens"] == len(record["content"].split())
        assert record["streamed_chunks"] <= 1 + record["streamed_tokens"] // interval
        # Where the loop began, and the prompt, for a row of the text before it (loop_prefix).
        cut = record["loop_cut"]
        assert record["messages"][-1]["content"].startswith("Tell me fact number") and 0 < cut < len(record["content"]) / 2
        assert find_loop(record["content"][:cut], loop_thresholds()) is None
        # vLLM streams the ids with the text: a stopped answer keeps those it received; SGLang sends
        # them only once the answer is over.
        if backend == "vllm":
            assert len(unpack(record[OUTPUT_IDS])) == record["streamed_tokens"]
        else:
            assert OUTPUT_IDS not in record
    assert all(r["finish_reason"] == "stop" and r["content"] for r in ok)
    # Closing the stream aborted each loop on the server and freed its slot.
    assert stats["aborted"] == 10
    assert report.failures_by_kind == {"degenerate": 10} and report.degenerate_by_rule == {"exact": 10}
    assert report.output_tokens_by_outcome["degenerate"] == sum(r["streamed_tokens"] for r in degenerate)
    assert report.useful_token_share(drop_truncated=True) > 0.5
    assert set(report.dropped_slot_seconds(drop_truncated=True)) == {"degenerate"}
    assert not report.loop_retried  # loop_retries 0: a stopped loop is final


@pytest.mark.parametrize("sim", [dict(loop_rate=0.25), dict(looping_prompt_share=0.25)], ids=["unlucky", "looping-prompts"])
def test_a_looping_prompt_is_asked_once_more_with_another_seed_when_loop_retries_says(tmp_path, sim):
    report, records, _ = run_shard(tmp_path, sim, default_engine(**FAST, loop_retries=1))
    assert len(records) == 40  # one record a prompt: the second try's outcome
    retried = [r for r in records if "loop_retry" in r]
    assert report.loop_retried["asked"] == len(retried) >= 5
    for record in retried:
        assert record["loop_retry"]["first_rule"] == "exact" and record["loop_retry"]["first_tokens"] > 0
        assert isinstance(record["loop_retry"]["seed"], int)
    completed = [r for r in retried if r["status"] == OK]
    assert report.loop_retried["completed"] == len(completed)
    looped_again = [r for r in retried if r["status"] == FAILED]
    if "loop_rate" in sim:
        # An unlucky sample (every 4th request to arrive, retries included): another one may not be.
        # How many of the second samples loop again depends on where they arrive among the first
        # ones (a loaded machine's timing): the loops are a quarter of all requests, so some complete.
        assert len(completed) >= 1 and report.ok == 40 - len(looped_again)
        assert len(retried) + len(looped_again) == (40 + len(retried)) // 4
    else:
        # A prompt that always loops loops again: its second stop is final.
        assert completed == [] and all(r["error"] == "degenerate" for r in looped_again)
    # The first stops' tokens were spent too.
    first = sum(r["loop_retry"]["first_tokens"] for r in retried)
    assert report.output_tokens_by_outcome["degenerate"] == first + sum(r["streamed_tokens"] for r in looped_again)


def test_without_early_stopping_loops_run_to_the_cap_and_the_waste_shows(tmp_path):
    report, records, stats = run_shard(
        tmp_path, dict(loop_rate=0.25), default_engine(**FAST, stop_degenerate=False)
    )
    assert stats["last_chat_request"].get("stream") is None
    assert report.finish_reasons == {"stop": 30, "length": 10}
    assert report.output_tokens_by_outcome["length"] == 10 * CAP
    # Truncated answers are dropped by default: most of the decode was for nothing.
    assert report.useful_token_share(drop_truncated=True) < 0.2
    assert report.useful_token_share(drop_truncated=False) == 1.0
    assert set(report.dropped_slot_seconds(drop_truncated=True)) == {"length"}
    assert report.dropped_slot_seconds(drop_truncated=False) == {}


@pytest.mark.parametrize("interval", [1, 32])
def test_streamed_and_plain_runs_write_the_same_completions(tmp_path, interval):
    _, streamed, _ = run_shard(
        tmp_path / "a", dict(reasoning_parser="qwen3", stream_interval=interval), default_engine(**FAST), n=12,
        stream_interval=interval,
    )
    _, plain, _ = run_shard(tmp_path / "b", dict(reasoning_parser="qwen3"), default_engine(**FAST, stop_degenerate=False), n=12)
    fields = ("prompt_id", "content", "reasoning_content", "finish_reason", "prompt_tokens", "completion_tokens")
    assert sorted(tuple(r[f] for f in fields) for r in streamed) == sorted(tuple(r[f] for f in fields) for r in plain)


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "plain"])
def test_answers_are_recorded_with_the_ids_the_server_ran_and_sampled(tmp_path, backend, streamed):
    _, records, stats = run_shard(
        tmp_path, dict(backend=backend, reasoning_parser="qwen3", stream_interval=8),
        default_engine(**FAST, stop_degenerate=streamed), n=12, stream_interval=8,
    )
    assert len(records) == 12 and all(r["status"] == OK for r in records)
    for record in records:
        assert len(unpack(record[PROMPT_IDS])) == record["prompt_tokens"]
        assert len(unpack(record[OUTPUT_IDS])) == record["completion_tokens"]
    # Answers to different prompts are different ids.
    assert len({r[OUTPUT_IDS] for r in records}) == 12


@pytest.mark.parametrize("version", [None, "0.5.7"])
def test_a_server_that_returns_no_ids_gives_records_without_them(tmp_path, version):
    """A simulated server that ignores the request for ids, and an SGLang too old to be asked."""
    sim = dict(token_ids=False) if version is None else dict(version=version)
    _, records, stats = run_shard(tmp_path, sim, default_engine(**FAST), n=6)
    assert len(records) == 6 and all(r["status"] == OK for r in records)
    assert not any(PROMPT_IDS in r or OUTPUT_IDS in r or IDS_LEFT_OUT in r for r in records)
    assert ("return_output_ids_in_sglext" in stats["last_chat_request"]) == (version is None)


def test_a_legitimate_repetitive_answer_is_kept(tmp_path):
    table = next(a["text"] for a in repetitive_answers() if a["kind"] == "table" and len(a["text"]) > 3000)
    pieces = [table[i : i + 5] for i in range(0, len(table), 5)]

    def handler(request):
        chunks = [f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': p}}]})}\n\n" for p in pieces]
        chunks.append('data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n')
        chunks.append('data: {"choices":[],"usage":{"prompt_tokens":16,"completion_tokens":900}}\n\ndata: [DONE]\n\n')
        return httpx.Response(200, text="".join(chunks))

    store = CompletionStore(tmp_path)
    with store.writer(SHARD) as writer:
        report = generate_shard(
            work(1), [Server("http://gpu-0:30000", 1, SGLANG)], writer=writer, model="m",
            sampling=default_sampling(), config=default_engine(**FAST), transport=httpx.MockTransport(handler),
        )
    assert report.ok == 1
    assert next(iter(store.records(SHARD)))["content"] == table


@pytest.mark.parametrize("streamed", [True, False])
def test_the_flood_follows_the_canarys_first_text_not_its_whole_answer(tmp_path, streamed):
    """A reasoning answer takes minutes on a GPU: the server has shown it works at its first streamed
    text. A plain request says nothing until its answer is whole, so its canary is waited out."""
    slow = dict(token_latency_s=0.01, output_median_tokens=200, output_sigma=0.0, keep_timeline=True)
    report, records, stats = run_shard(tmp_path, slow, default_engine(**FAST, stop_degenerate=streamed), n=9)
    assert report.ok == 9 and len(records) == 9
    canary, *flood = sorted(stats["timeline"]["requests"], key=lambda r: r["arrived"])
    # 200 tokens at 10 ms: the canary answers for 2 s; streamed, the flood came at its first text.
    # (Loops are stopped on streamed answers only: ``stop_degenerate`` is what streams.)
    assert (min(r["arrived"] for r in flood) < canary["ended"]) == streamed


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "plain"])
def test_a_shard_measures_its_speed_from_its_own_answers_once_its_slots_are_full(tmp_path, streamed):
    reports = []
    with SimulatedFleet([SimServerConfig(**{**SIM, "token_latency_s": 0.002})]) as fleet:
        with CompletionStore(tmp_path).writer(SHARD) as writer:
            report = generate_shard(
                work(40), [Server(fleet.urls[0], 8, SGLANG)], writer=writer, model=MODEL, sampling=default_sampling(),
                config=default_engine(**FAST, stop_degenerate=streamed), on_progress=reports.append,
            )
    speed = reports[-1].speed  # the run's last report
    assert report.ok == 40 and speed is not None and speed.defensible
    # Every answer that ended once the 8 slots were full (the canary's first text is before them).
    assert MIN_ANSWERS <= speed.answers <= 40 and speed.servers == 1
    assert speed.tokens_per_s > 0 and 0 < speed.streams <= 8 + 2  # never more than the workers in flight
    assert reports[-1].answered_tokens == report.output_tokens
