"""A model's answer is never a server's fault: the outcome taxonomy, and the engine that acts on it,
against simulated servers over real HTTP whose looping prompts loop every time they are asked and
whose queues are bounded."""

import collections
import random
import threading

import pytest

from expansion_dag import core
from expansion_dag.core import (
    FAILED,
    OK,
    AuthError,
    BadResponseError,
    ConnectError,
    ContextLengthError,
    QueueFullError,
    RejectedError,
    UnfinishedError,
)
from expansion_dag.generation import (
    OWNER_NOT_STARTED,
    Server,
    WorkItem,
    claim_share,
    generate_shard,
    spearman,
)
from expansion_dag.servers import DegenerateError, Loop, error_from_status
from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag.store import CompletionStore
from expansion_dag_tests.helpers import default_sampling, default_engine, wait_for
from expansion_dag_tests.workloads.borrowing import (
    BORROWING_SERVER,
    BORROWING_SHARDS,
    borrowing_prompt,
    most_borrowed_at_once,
)

MODEL = SimServerConfig().model_name
SAMPLING = default_sampling()
FAST = dict(backoff_initial_s=0.01, progress_interval_s=3600,
            spill_poll_s=0.05, owner_wait_s=0)  # the idle helpers here have no shard of their own to wait for
SIM = dict(port=0, max_running_requests=4, ttft_s=0.001, token_latency_s=0.0003, output_median_tokens=40)


def work(n, shard="s0", prefix="Tell me fact"):
    items = []
    for i in range(n):
        prompt_id = f"{shard}-p{i:04d}"
        items.append(WorkItem(
            key=SAMPLING.key(prompt_id, MODEL), prompt_id=prompt_id, source="s",
            messages=[{"role": "user", "content": f"{prefix} number {i} of {shard}."}],
            prompt_tokens=16, max_tokens=3000, expected_output_tokens=40 + i % 7,
        ))
    return items


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (None, "content"),
        (DegenerateError("loop", content="x", reasoning=None, loop=Loop("x", 4, 4), chunks=1, tokens=4), "content"),
        (ConnectError("refused"), "server"),
        (error_from_status(500, "boom"), "server"),
        (UnfinishedError("cut", finish_reason="abort"), "server"),
        (BadResponseError("not json"), "server"),
        (AuthError("no key", status=401), "server"),
        (ContextLengthError("too long", status=400), "request"),
        (RejectedError("bad input", status=400), "request"),
        (error_from_status(503, '{"message": "The request queue is full."}'), "backpressure"),
        (error_from_status(429, "slow down"), "backpressure"),
    ],
)
def test_each_outcome_says_whose_it_is(error, outcome):
    assert core.of_error(error) == outcome


def test_a_503_without_the_queue_words_is_the_servers_fault():
    assert not isinstance(error_from_status(503, '{"message": "shutting down"}'), QueueFullError)


@pytest.mark.parametrize(
    ("record", "retry", "final"),
    [
        ({"status": OK, "finish_reason": "length"}, (), True),
        ({"status": FAILED, "error": "degenerate", "outcome": "content"}, (), True),
        ({"status": FAILED, "error": "degenerate", "outcome": "content"}, ("degenerate",), False),
        # Written before records carried their outcome: the kind says it.
        ({"status": FAILED, "error": "degenerate"}, (), True),
        ({"status": FAILED, "error": "connect", "outcome": "server"}, (), False),
        ({"status": FAILED, "error": "context_length", "outcome": "request"}, (), False),
        ({"status": FAILED, "error": "queue_full", "outcome": "backpressure"}, (), False),
    ],
)
def test_a_rerun_leaves_final_answers_alone_unless_asked(record, retry, final):
    assert core.is_final(record, retry) is final


def test_loops_never_open_the_breaker_and_server_faults_do():
    breaker = core.Breaker(window=4, fraction=0.75)
    loop = DegenerateError("loop", content="ab" * 600, reasoning=None, loop=Loop("ab", 600, 1200), chunks=5, tokens=600)
    assert [breaker.record(loop) for _ in range(8)] == [None] * 8
    reasons = [breaker.record(ConnectError("refused")) for _ in range(4)]
    assert reasons[-1] and "4 of the last 4 requests failed with connect" in reasons[-1]


@pytest.mark.parametrize(("idle", "borrowers"), [(0, 3), (1, 3), (5, 3), (72, 7), (7, 7), (100, 1)])
def test_borrowers_never_claim_more_than_a_server_has_idle(idle, borrowers):
    for turn in range(borrowers + 1):
        shares = [claim_share(idle, borrowers, rank, turn) for rank in range(borrowers)]
        assert sum(shares) == idle
        assert max(shares) - min(shares) <= 1
    # What a split leaves over goes round: over the turns, every borrower gets some.
    if 0 < idle < borrowers:
        assert all(any(claim_share(idle, borrowers, r, t) for t in range(borrowers)) for r in range(borrowers))


def records_by_key(store, shard):
    found = collections.defaultdict(list)
    for line in store.latest_records([shard]):
        found[line["key"]].append(line)
    return found


def test_a_fleet_whose_answers_all_loop_runs_to_the_end_and_asks_each_prompt_once(tmp_path):
    """Every answer loops, the canary's first: the server works, the shard goes on, nothing is retried."""
    store = CompletionStore(tmp_path)
    with SimulatedFleet([SimServerConfig(**SIM, looping_prompt_share=1.0)]) as fleet:
        with store.writer("shard-00") as writer:
            report = generate_shard(work(30), [Server(fleet.urls[0], 4)], writer=writer, model=MODEL,
                                    sampling=SAMPLING, config=default_engine(**FAST, breaker_window=8))
        loops = fleet.stats(0)["loops"]
    assert report.aborted is None
    assert report.failures_by_kind == {"degenerate": 30} and loops == 30 == report.attempts
    failures = list(store.records("shard-00", status=FAILED))
    assert len({f["key"] for f in failures}) == 30
    assert all(f["outcome"] == "content" and core.is_final(f, ()) for f in failures)


def test_a_loop_on_a_borrowed_server_is_recorded_there_and_the_server_stays_in_use(tmp_path):
    store = CompletionStore(tmp_path)
    sims = [SimServerConfig(**SIM, looping_prompt_share=0.3), SimServerConfig(**SIM, looping_prompt_share=0.3)]
    with SimulatedFleet(sims) as fleet:
        own, idle = (Server(url, 4) for url in fleet.urls)
        with store.writer("shard-00") as writer:
            report = generate_shard(work(120), [own], writer=writer, model=MODEL, sampling=SAMPLING,
                                    config=default_engine(**FAST), helpers=[idle])
        loops = sum(fleet.stats(i)["loops"] for i in range(2))
    failures = [r for r in store.records("shard-00", status=FAILED)]
    on_idle = [f for f in failures if f["server"] == idle.url]
    assert on_idle, "no loop happened on the borrowed server: the test proves nothing"
    # Each looping prompt was asked once, wherever it looped; the idle server kept being used.
    assert loops == len(failures) == report.failures_by_kind["degenerate"]
    assert report.helpers[idle.url].requests > len(on_idle)
    assert report.ok + report.failed == 120


def test_shards_borrowing_bounded_queues_lose_no_prompt_and_never_hold_more_than_a_server_has(tmp_path):
    """The simulator's borrowing workload, one run: four shards, one server each, each queue bounded
    at two; shard 0 ends first and the other three borrow its slots at once (``bench_borrowing.py``
    runs the shards together, in a process each). How many attempts a full queue refuses depends on the machine's
    speed: the benchmark measures it. What must hold on any machine is asserted here, from the
    simulator's own record."""
    store = CompletionStore(tmp_path)
    reports = {}

    def shard(index, urls):
        servers = [Server(url, BORROWING_SERVER.max_running_requests) for url in urls]
        prompts = [borrowing_prompt(index, i) for i in range(BORROWING_SHARDS[index])]
        items = [WorkItem(key=SAMPLING.key(prompt_id, MODEL), prompt_id=prompt_id, source="s", prompt_tokens=16,
                          messages=[{"role": "user", "content": text}], max_tokens=3000, expected_output_tokens=40)
                 for prompt_id, text in prompts]  # fmt: skip
        with store.writer(f"shard-{index:02d}") as writer:
            reports[index] = generate_shard(items, [servers[index]], writer=writer, model=MODEL, sampling=SAMPLING,
                                            config=default_engine(**FAST), helpers=servers, fleet_urls=urls)

    with SimulatedFleet([BORROWING_SERVER] * len(BORROWING_SHARDS)) as fleet:
        urls = fleet.urls
        shard(0, urls)  # done before the others start: they all find its server idle at once
        others = [threading.Thread(target=shard, args=(i, urls)) for i in range(1, len(BORROWING_SHARDS))]
        for thread in others:
            thread.start()
        for thread in others:
            thread.join()
        stats = [fleet.stats(i) for i in range(len(BORROWING_SHARDS))]
    assert [reports[i].ok for i in range(len(BORROWING_SHARDS))] == list(BORROWING_SHARDS)
    assert sum(reports[i].helpers[urls[0]].requests for i in (1, 2, 3)) > 30, "shard 0's server was not borrowed"
    # Every refusal the servers made was waited out as backpressure, never spent as a failure.
    refused = sum(s["chat_requests_by_status"].get("503", 0) for s in stats)
    assert refused == sum(report.backpressure for report in reports.values())
    # Together the borrowers may fill a server, never make it queue: they never hold more of it at
    # once than the slots its /v1/loads reports (all of them idle, for shard 0's server).
    assert max(idle for _, idle in stats[0]["timeline"]["loads"]) == stats[0]["slots"] > 0
    held = [most_borrowed_at_once(s["timeline"], i) for i, s in enumerate(stats)]
    assert held[0] > 0 and all(most <= s["slots"] for most, s in zip(held, stats)), held


def test_a_shard_does_not_borrow_a_server_before_its_own_shard_has_started(tmp_path):
    """Shards start apart: the owner of server 1 starts only once shard 0 has read server 1 idle
    eight times (the event, not a delay). Server 1's queue is bounded so that the owner's first
    flood (slots + headroom) just fits: a slot borrowed before it started would refuse one of them."""
    sim = SimServerConfig(**{**SIM, "token_latency_s": 0.002}, max_queued_requests=2, keep_timeline=True)
    config = default_engine(**{**FAST, "owner_wait_s": 600})  # only a hang waits so long for an owner
    store = CompletionStore(tmp_path)
    reports = {}

    def shard(index, size, urls):
        servers = [Server(url, 4) for url in urls]
        with store.writer(f"shard-{index:02d}") as writer:
            reports[index] = generate_shard(work(size, shard=f"s{index}"), [servers[index]], writer=writer, model=MODEL,
                                            sampling=SAMPLING, config=config, helpers=servers, fleet_urls=urls)

    with SimulatedFleet([sim, sim]) as fleet:
        borrower = threading.Thread(target=shard, args=(0, 300, fleet.urls))
        borrower.start()
        wait_for(lambda: len(fleet.stats(1)["timeline"]["loads"]) >= 8, "shard 0 reading server 1's load")
        owner = threading.Thread(target=shard, args=(1, 40, fleet.urls))
        owner.start()
        owner.join()
        borrower.join()
        timeline = fleet.stats(1)["timeline"]
    assert reports[0].ok == 300 and reports[1].ok == 40
    mine = [r for r in timeline["requests"] if r["instruction"] and r["instruction"].endswith(" of s1.")]
    borrowed = [r for r in timeline["requests"] if r["instruction"] and r["instruction"].endswith(" of s0.")]
    owner_first = min(r["arrived"] for r in mine)
    # Shard 0 saw server 1 idle, again and again, before its owner came, and did not borrow it.
    assert sum(t < owner_first and idle == 4 for t, idle in timeline["loads"]) >= 8
    assert all(r["arrived"] > owner_first for r in borrowed)
    assert reports[0].helpers[fleet.urls[1]].borrowing[OWNER_NOT_STARTED] >= 8
    # The owner's first requests (and every other) were taken, none refused by a full queue.
    assert len(mine) == 40 and {r["status"] for r in mine} == {200}
    assert all(r["status"] != 503 for r in timeline["requests"]) and reports[1].backpressure == 0


def test_a_rerun_with_retry_outcomes_asks_only_the_loops_again(tmp_path):
    store = CompletionStore(tmp_path)
    items = work(40)
    with SimulatedFleet([SimServerConfig(**SIM, looping_prompt_share=0.2)]) as fleet:
        with store.writer("shard-00") as writer:
            generate_shard(items, [Server(fleet.urls[0], 4)], writer=writer, model=MODEL, sampling=SAMPLING,
                           config=default_engine(**FAST))
        first_loops = fleet.stats(0)["loops"]
        latest = list(store.latest_records())
        again = {r["key"] for r in latest if not core.is_final(r, ("degenerate",))}
        assert again == {r["key"] for r in latest if r["status"] == FAILED} and len(again) == first_loops > 0
        assert not [r for r in latest if not core.is_final(r, ())]
        with store.writer("shard-00") as writer:
            report = generate_shard([i for i in items if i.key in again], [Server(fleet.urls[0], 4)], writer=writer,
                                    model=MODEL, sampling=SAMPLING, config=default_engine(**FAST))
        assert fleet.stats(0)["loops"] == 2 * first_loops  # the same prompts loop again, as a real model's do
    assert report.failures_by_kind == {"degenerate": first_loops}


def test_the_order_learns_what_the_words_of_a_prompt_say_about_its_length(tmp_path):
    """Lengths follow the instruction's words, in one source and one prompt-length bucket, where
    the source's mean alone ranks nothing: the later answers are ranked by what the earlier taught."""
    sim = SimServerConfig(**{**SIM, "output_median_tokens": 120, "token_latency_s": 0.00002}, output_sigma=0.2,
                          output_word_sigma=1.0)
    vocabulary = [f"w{i}x" for i in range(120)]
    rng = random.Random(1)
    store = CompletionStore(tmp_path)
    items = [
        WorkItem(key=f"k{i:04d}", prompt_id=f"p{i:04d}", source="s",
                 messages=[{"role": "user", "content": " ".join(rng.sample(vocabulary, 8))}],
                 prompt_tokens=20, max_tokens=3000, expected_output_tokens=120)
        for i in range(600)
    ]
    with SimulatedFleet([sim]) as fleet, store.writer("shard-00") as writer:
        # One request at a time: each answer is expected knowing every answer before it.
        report = generate_shard(items, [Server(fleet.urls[0], 1)], writer=writer, model=MODEL, sampling=SAMPLING,
                                config=default_engine(**FAST, min_headroom=0, headroom_fraction=0.0, canary=False, stop_degenerate=False))
    # The queue sends the longest expected first, so the later half is the shorter-expected half: a
    # narrower range than the whole. The typed prior alone ranks nothing here (one source, one bucket).
    late = report.answers[300:]
    assert spearman([a[0] for a in late], [a[1] for a in late]) > 0.4
    assert all(r["length_features"] for r in store.records("shard-00"))
