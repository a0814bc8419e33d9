"""Borrowing on bounded queues (issue 33): the share of attempts a full queue refuses (SIMULATOR).

The simulator's borrowing workload (``expansion_dag_tests.workloads.borrowing``): four shards, each in its own
process as Dagster runs them, one simulated SGLang server each (8 slots, queues bounded at 2: a
request beyond them is answered 503 "The request queue is full."), the servers in a process of their
own. Shard 0 has 5 prompts and ends at once; the other three have 150 each and borrow its server, and
each other's at their ends. Answers take about 0.1 s, so a worker's time between two requests is
small beside them, as on GPUs. Every figure is a SIMULATOR figure, never a GPU one.

How often a bounded queue refuses depends on how fast the clients act on what ``/v1/loads``
says, and so on the machine: it is measured here, not asserted in a test. What does not depend on
the machine is asserted by ``expansion_dag_tests/generation/test_outcomes.py`` on one run of the same
workload: no prompt fails from a 503, every 503 is counted as backpressure, and the borrowers
together never hold more of a server than its slots (from the simulator's own timeline).

    .venv/bin/python bench/bench_borrowing.py --runs 10            # ~1 min on 2 cores
    .venv/bin/python bench/bench_borrowing.py --runs 10 --busy 2   # beside 2 spinning processes

``--stagger-s`` starts shard ``i`` that many seconds after shard ``i - 1`` (issue 36): the early
shards see the late ones' servers idle before their owners start. ``--owner-wait-s`` is how long a
borrower gives an owner to show itself (``EngineConfig.owner_wait_s``); 0 borrows a server as soon
as it looks idle, the rule before issue 36.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import multiprocessing
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import header, write_result  # (bench/ is on sys.path when run as a script)

from expansion_dag.config import GenerationConfig, engine_config, sampling_settings
from expansion_dag.generation import EngineConfig, Server, WorkItem, generate_shard
from expansion_dag.sim import FleetProcess
from expansion_dag_tests.workloads.borrowing import (
    BORROWING_SERVER,
    BORROWING_SHARDS,
    borrowing_prompt,
    most_borrowed_at_once,
    refusals_by_phase,
)
from expansion_dag.store import CompletionStore

SLOTS = BORROWING_SERVER.max_running_requests
MODEL = BORROWING_SERVER.model_name
SAMPLING = sampling_settings(GenerationConfig())
#: Shard 0 is done within ``owner_wait_s``: its server is lent soon after, as a done shard's is.
ENGINE = engine_config(GenerationConfig(), backoff_initial_s=0.01,
                       progress_interval_s=3600, spill_poll_s=0.2, max_attempts=2, owner_wait_s=0.5)  # fmt: skip


def work(shard: int) -> list[WorkItem]:
    return [WorkItem(key=SAMPLING.key(prompt_id, MODEL), prompt_id=prompt_id, source="s", prompt_tokens=16,
                     messages=[{"role": "user", "content": text}], max_tokens=3000, expected_output_tokens=40 + i % 7)
            for i, (prompt_id, text) in enumerate(borrowing_prompt(shard, i) for i in range(BORROWING_SHARDS[shard]))]  # fmt: skip


def _shard(root: Path, index: int, urls: list[str], stagger_s: float, config: EngineConfig) -> dict[str, Any]:
    """One shard in its own process: its own server, and every other one to borrow while idle."""
    servers = [Server(url, SLOTS) for url in urls]
    time.sleep(index * stagger_s)  # shards launched one after another
    with CompletionStore(root).writer(f"shard-{index:02d}") as writer:
        report = generate_shard(work(index), [servers[index]], writer=writer, model=MODEL,
                                sampling=SAMPLING, config=config, helpers=servers, fleet_urls=urls)  # fmt: skip
    borrowed = {url: stats.requests for url, stats in report.helpers.items()}
    return {"ok": report.ok, "failed": report.failed, "attempts": report.attempts,
            "backpressure": report.backpressure, "aborted": report.aborted, "borrowed": borrowed}  # fmt: skip


def one_run(root: Path, stagger_s: float = 0.0, config: EngineConfig = ENGINE) -> dict[str, Any]:
    n = len(BORROWING_SHARDS)
    # The shards' processes are all up before any shard starts: they start together, as a backfill
    # of four partitions does.
    with concurrent.futures.ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork")) as pool:
        list(pool.map(time.sleep, [0.2] * n))
        with FleetProcess([BORROWING_SERVER] * n) as fleet:
            urls = fleet.urls
            shards = list(pool.map(_shard, [root] * n, range(n), [urls] * n, [stagger_s] * n, [config] * n))
            stats = fleet.wait_idle()
    attempts = sum(s["attempts"] for s in shards)
    refused = sum(s["chat_requests_by_status"].get("503", 0) for s in stats)
    return {
        "prompts": sum(BORROWING_SHARDS),
        "ok": sum(s["ok"] for s in shards),
        "prompts_failed": sum(s["failed"] for s in shards),
        "attempts": attempts,
        "refused_503": refused,
        "refused_share": refused / attempts,
        "backpressure_counted": sum(s["backpressure"] for s in shards),
        "borrowed_from_shard_0_server": sum(s["borrowed"].get(urls[0], 0) for s in shards[1:]),
        "servers": [
            {"slots": s["slots"], "idle_reported_max": max((idle for _, idle in s["timeline"]["loads"]), default=None),
             "borrowed_in_flight_max": most_borrowed_at_once(s["timeline"], i),
             "refused_503": s["chat_requests_by_status"].get("503", 0), "refused": refusals_by_phase(s["timeline"], i)}
            for i, s in enumerate(stats)
        ],  # fmt: skip
        "shards": shards,
    }


@contextlib.contextmanager
def busy(processes: int):
    """``processes`` spinning interpreters beside the run, as other work on a shared machine."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--busy", type=int, default=0, help="spinning processes beside the runs")
    parser.add_argument("--json", type=Path, help="write the result here instead of bench/results/")
    parser.add_argument("--stagger-s", type=float, default=0.0, help="seconds between two shards' starts")
    parser.add_argument("--owner-wait-s", type=float, default=ENGINE.owner_wait_s,
                        help="how long a borrower waits for a server's own shard to show itself")
    args = parser.parse_args()
    config = dataclasses.replace(ENGINE, owner_wait_s=args.owner_wait_s)
    document = header("borrowing", simulator=True)
    runs = []
    with busy(args.busy), tempfile.TemporaryDirectory() as tmp:
        for n in range(args.runs):
            runs.append(one_run(Path(tmp) / f"run-{n}", args.stagger_s, config))
            r = runs[-1]
            print(f"run {n + 1}/{args.runs}: {r['refused_503']} of {r['attempts']} attempts refused "
                  f"({100 * r['refused_share']:.2f}%), {r['prompts_failed']} prompts failed", flush=True)  # fmt: skip
    shares = sorted(r["refused_share"] for r in runs)
    document.update(busy_processes=args.busy, stagger_s=args.stagger_s, owner_wait_s=args.owner_wait_s, runs=runs, summary={
        "runs": len(runs),
        "refused_share_mean": sum(shares) / len(shares),
        "refused_share_median": shares[len(shares) // 2],
        "refused_share_max": shares[-1],
        "prompts_failed": sum(r["prompts_failed"] for r in runs),
    })  # fmt: skip
    path = write_result("borrowing", document, path=args.json)
    print(f"summary: {document['summary']}\nwritten to {path}")


if __name__ == "__main__":
    main()
