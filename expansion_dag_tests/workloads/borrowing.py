"""Simulated workloads that a benchmark measures and a test runs small: the servers, the prompts, and
the readings of the servers' own record, so that both send the same work and judge it alike.

Borrowing on bounded queues (issue 33): four shards, each with a server of its own whose queue holds
two requests beyond its slots (a 503 "The request queue is full." past them). Shard 0 has a handful
of prompts and ends at once; the other three borrow its server, and each other's at their ends.
Answers take about 0.1 s, so a client's time between two requests is small beside them, as on GPUs.
``bench/bench_borrowing.py`` measures how often a full queue refuses; a test asserts, on one run,
what no machine's speed changes (``expansion_dag_tests/generation/test_outcomes.py``).
"""

from __future__ import annotations

import collections
import re
from collections.abc import Mapping
from typing import Any

from expansion_dag.sim import SimServerConfig

#: Each shard's prompts: shard 0 ends at once, the other three borrow its server.
BORROWING_SHARDS = (5, 150, 150, 150)
#: Each shard's own server: 8 slots, 2 more queued at most, answers of about 40 tokens in 0.1 s.
BORROWING_SERVER = SimServerConfig(
    port=0, max_running_requests=8, max_queued_requests=2, ttft_s=0.001, token_latency_s=0.002,
    output_median_tokens=40, keep_timeline=True,
)  # fmt: skip
_OWNER = re.compile(r" of s(\d+)\.$")


def borrowing_prompt(shard: int, index: int) -> tuple[str, str]:
    """Prompt ``index`` of ``shard``: its id and its text, which names its shard (:func:`shard_of`)."""
    return f"s{shard}-p{index:04d}", f"Tell me fact number {index} of s{shard}."


def shard_of(instruction: str | None) -> int | None:
    """The shard whose prompt a request of the timeline was (None: refused before it was read)."""
    found = instruction and _OWNER.search(instruction)
    return int(found.group(1)) if found else None


def most_borrowed_at_once(timeline: Mapping[str, Any], server: int) -> int:
    """The most requests of other shards than ``server``'s own that the server held at once."""
    edges = []
    for r in timeline["requests"]:
        shard = shard_of(r["instruction"])
        if shard is not None and shard != server:
            edges += [(r["arrived"], 1), (r["ended"], -1)]
    most = held = 0
    for _, step in sorted(edges):  # an end before an arrival at the same instant
        held += step
        most = max(most, held)
    return most


def refusals_by_phase(timeline: Mapping[str, Any], server: int) -> dict[str, int]:
    """The server's 503s by when they came: before its own shard's first request, while its shard
    sent, or after its shard's last request (the server borrowed at the end)."""
    own = [r["arrived"] for r in timeline["requests"] if shard_of(r["instruction"]) == server]
    first, last = min(own, default=float("inf")), max(own, default=float("-inf"))
    when: collections.Counter[str] = collections.Counter()
    for r in timeline["requests"]:
        if r["status"] == 503:
            when["before its shard" if r["arrived"] < first else "after its shard" if r["arrived"] > last
                 else "while its shard sent"] += 1  # fmt: skip
    return dict(when)
