"""Fault injection through the simulator: whatever happens, every prompt ends as exactly one
completion or one failure record, nothing duplicated and nothing lost."""

import collections
import contextlib
import threading

import httpx
import pytest

from expansion_dag.core import ShardAborted
from expansion_dag.generation import Server, WorkItem, generate_shard
from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag.store import CompletionStore
from expansion_dag_tests.helpers import default_sampling, default_engine, wait_for
from expansion_dag_tests.ports import free_ports

SHARD = "shard-00"
FAST = dict(backoff_initial_s=0.01, progress_interval_s=3600,
            owner_wait_s=0)  # the idle helpers here have no shard of their own to wait for
SIM = dict(port=0, max_running_requests=8, ttft_s=0.001, token_latency_s=0.0002, output_median_tokens=60)


def work(n):
    return [
        WorkItem(
            key=f"k{i:04d}", prompt_id=f"p{i:04d}", source="s",
            messages=[{"role": "user", "content": f"Tell me fact number {i}."}],
            prompt_tokens=16, max_tokens=400, expected_output_tokens=84,
        )
        for i in range(n)
    ]


def run_until_settled(store, items, url, *, config, runs=5):
    """Re-run the shard as a user would after a failure: only what has no completion is sent."""
    reports = []
    for _ in range(runs):
        done = store.scan(SHARD).done
        todo = [i for i in items if i.key not in done]
        if not todo:
            break
        with store.writer(SHARD) as writer:
            try:
                reports.append(generate_shard(todo, [Server(url, 8)], writer=writer, model="m",
                                              sampling=default_sampling(), config=config))
            except ShardAborted as exc:
                reports.append(exc)
    return reports


def assert_each_prompt_once(store, items):
    scan = store.scan(SHARD)
    keys = {i.key for i in items}
    assert scan.duplicates == 0
    assert scan.torn_lines == 0
    assert scan.done | scan.failed == keys
    assert not scan.done & scan.failed
    assert len(list(store.records(SHARD))) == len(scan.done)


def test_a_server_that_dies_mid_shard_stops_the_shard_and_a_rerun_finishes_it(tmp_path):
    store = CompletionStore(tmp_path)
    items = work(120)
    config = default_engine(**FAST, max_attempts=3, breaker_window=8)
    with SimulatedFleet([SimServerConfig(**SIM, die_after_requests=40)]) as fleet:
        url = fleet.urls[0]
        with store.writer(SHARD) as writer, pytest.raises(ShardAborted, match="circuit breaker: .* connect"):
            generate_shard(items, [Server(url, 8)], writer=writer, model="m", sampling=default_sampling(), config=config)
        done_before = store.scan(SHARD).done
        assert 30 <= len(done_before) <= 48
        fleet.restart(0, config=SimServerConfig(**SIM))
        run_until_settled(store, items, url, config=config)
    assert_each_prompt_once(store, items)
    assert store.scan(SHARD).done == {i.key for i in items}


def test_a_server_answering_503_to_a_third_of_requests_still_gets_everything_done(tmp_path):
    store = CompletionStore(tmp_path)
    items = work(90)
    with SimulatedFleet([SimServerConfig(**SIM, fail_rate=1 / 3)]) as fleet:
        run_until_settled(store, items, fleet.urls[0], config=default_engine(**FAST, max_attempts=6))
        stats = fleet.stats(0)
    assert_each_prompt_once(store, items)
    assert store.scan(SHARD).done == {i.key for i in items}
    assert stats["chat_requests_by_status"]["503"] >= 30
    assert max(r["attempts"] for r in store.records(SHARD)) >= 2


def test_a_server_that_hangs_past_the_timeout_is_retried_and_nothing_is_lost(tmp_path):
    store = CompletionStore(tmp_path)
    items = work(40)
    config = default_engine(**FAST, request_timeout_s=0.5, max_attempts=4, canary=False, breaker_window=40)
    with SimulatedFleet([SimServerConfig(**SIM, hang_rate=0.2)]) as fleet:
        run_until_settled(store, items, fleet.urls[0], config=config, runs=2)
        stats = fleet.stats(0)
    assert stats["hung"] >= 5
    assert_each_prompt_once(store, items)
    timed_out = [r for r in store.records(SHARD) if r["attempts"] > 1]
    assert timed_out, "no request needed a retry after a hang"


def test_a_shard_borrows_an_idle_server_skips_a_dead_one_and_sends_every_prompt_once(tmp_path):
    store = CompletionStore(tmp_path)
    items = work(200)
    config = default_engine(**FAST, spill_poll_s=0.05)
    with SimulatedFleet([SimServerConfig(**SIM), SimServerConfig(**SIM)]) as fleet:
        own, idle = fleet.urls
        dead = f"http://127.0.0.1:{free_ports(1)[0]}"
        with store.writer(SHARD) as writer:
            report = generate_shard(items, [Server(own, 8)], writer=writer, model="m", sampling=default_sampling(),
                                    config=config, helpers=[Server(idle, 8), Server(dead, 8)])
        served = [fleet.stats(i)["chat_requests_by_status"].get("200", 0) for i in (0, 1)]
    assert_each_prompt_once(store, items)
    assert store.scan(SHARD).done == {i.key for i in items}
    by_server = collections.Counter(r["server"] for r in store.records(SHARD))
    assert set(by_server) == {own, idle}
    assert [by_server[own], by_server[idle]] == served
    assert report.helpers[idle].requests == by_server[idle] and report.helpers[dead].requests == 0


def test_a_borrowed_server_that_dies_mid_request_costs_the_shard_nothing(tmp_path):
    store = CompletionStore(tmp_path)
    items = work(200)
    config = default_engine(**FAST, spill_poll_s=0.05, breaker_window=4)
    with SimulatedFleet([SimServerConfig(**SIM), SimServerConfig(**SIM, die_after_requests=5)]) as fleet:
        own, helper = fleet.urls
        with store.writer(SHARD) as writer:
            report = generate_shard(items, [Server(own, 8)], writer=writer, model="m", sampling=default_sampling(),
                                    config=config, helpers=[Server(helper, 8)])
        assert fleet.state(1) == "stopped", "the borrowed server did not die"
    assert report.aborted is None and report.failed == 0
    assert_each_prompt_once(store, items)
    assert store.scan(SHARD).done == {i.key for i in items}
    assert 0 < sum(r["server"] == helper for r in store.records(SHARD)) <= 5


def test_polling_busy_servers_for_idle_slots_keeps_one_connection_to_each(tmp_path):
    store = CompletionStore(tmp_path)
    busy = dict(port=0, max_running_requests=1, ttft_s=0.001, token_latency_s=0.01, output_median_tokens=10_000)
    config = default_engine(**FAST, spill_poll_s=0.05)
    with SimulatedFleet([SimServerConfig(**{**SIM, "token_latency_s": 0.004}), SimServerConfig(**busy),
                         SimServerConfig(**busy)]) as fleet:
        own, *helpers = fleet.urls
        # Each helper's one slot taken for longer than the shard can take on any machine (a minute):
        # every poll finds it full, so nothing is lent.
        hogs = [threading.Thread(target=_occupy, args=(url,)) for url in helpers]
        for hog in hogs:
            hog.start()
        for i in (1, 2):
            wait_for(lambda: fleet.stats(i)["num_running"] == 1, "the hog's request admitted")
        with store.writer(SHARD) as writer:
            report = generate_shard(work(40), [Server(own, 8)], writer=writer, model="m", sampling=default_sampling(),
                                    config=config, helpers=[Server(url, 1) for url in helpers])
        stats = [fleet.stats(i) for i in (1, 2)]
    for hog in hogs:  # the fleet has stopped: their requests are cut
        hog.join()
    assert report.ok == 40 and sum(h.requests for h in report.helpers.values()) == 0
    for s in stats:
        assert s["load_reads"] >= 5, "the shard ended before it polled"
        # The hog's connection and the poller's, kept: not one per poll. A poll that outlives its read
        # timeout on a loaded machine closes its connection (CI: 3), so a reopen is allowed, a habit is not.
        assert 2 * (s["connections_opened"] - 1) <= s["load_reads"]


def _occupy(url):
    """Hold the server's one slot until the server goes away."""
    body = {"model": "m", "messages": [{"role": "user", "content": "Take your time."}], "max_tokens": 6000}
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
