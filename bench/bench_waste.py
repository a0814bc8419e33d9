"""Waste and tail benchmark (issue 14): early stopping of loops, streaming's client CPU, learned order.

Every figure is a SIMULATOR figure (``expansion_dag.sim``), never a GPU one. The reference fleet is
8 servers x 72 slots at about 3.4 requests/s fleet-wide with answers of ~2,710 tokens on average:
at 0.8 utilization that is ~135 s a request, ~0.05 s an output token per slot. Time is scaled
down by ``--time-factor`` (token latency and TTFT divided by it).

Part A (real HTTP, one process): the engine (``ShardRun``, as the Dagster asset builds it) against
simulated SGLang servers started as a separate process, so the CPU measured here is the client's
alone. 3% of answers loop until the cap (``--loop-rate``). Phases on the same prompts:
``stream+stop`` (streaming at ``--stream-interval`` tokens an event, loops stopped by the
detector), ``stream+stop, a wake-up an event`` (the same on asyncio's own event loop, without the
client's coalesced wake-ups, ``client_tick_s: 0``), ``stream+stop, every token`` (the servers'
default interval of 1, for the CPU it costs) and ``plain`` (no streaming, every answer runs to
its end). The answers that are not loops are lognormal (median ``ANSWER_MEDIAN``, sigma
``ANSWER_SIGMA``): 0.4% of them are longer than the cap and cut there, in every phase, which no
stopping rule can save; ``--natural-max-tokens`` under the cap ends them first, so that loops are
the only answers cut. Reported: slot-seconds on answers the training set drops (by reason),
the useful token share, client CPU per request, and what that CPU means at the reference rate.
The fleet here is ``--servers`` x 72 slots, fewer than 8, so that the simulator and the client
fit on a small machine; the rate per slot is the reference one times the time factor.

Part B (policy model, no HTTP): the makespan on the reference fleet (8 x 72, unscaled time) of a
workload whose answer lengths depend on the source and the prompt length, drawn by the
simulator's own output model (``OutputModel`` with per-source medians and a prompt exponent).
The engine's dispatch (one queue per shard, idle servers taking from the longest queue, the
canary ignored) is modelled with zero client overhead and its own ordering code
(``AnswerLengths``, ``expected_output_tokens``, the re-order schedule), with no typed priors:

- ``learned (earlier night)``: estimates from an earlier night's answers (other prompts, same
  sources), refined as answers return;
- ``learned (in run only)``: an empty store, estimates from the run's own answers;
- ``no learning``: no priors, no learning (prompt id order);
- ``plain loop``: 72 workers per server with fixed round-robin shares in dataset order;
- ``clairvoyant longest-first``: the true lengths, longest first, on one fleet-wide queue.

    .venv/bin/python bench/bench_waste.py           # ~5 min on 2 shared cores
    .venv/bin/python bench/bench_waste.py --quick   # a smoke run, ~1 min
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import copy
import heapq
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from expansion_dag.answer_lengths import AnswerLengths
from expansion_dag import event_loop
from expansion_dag.degeneration import find_loop
from expansion_dag.engine import (
    FIRST_REORDER,
    EngineConfig,
    SamplingSettings,
    Server,
    ShardRun,
    WorkItem,
    expected_output_tokens,
)
from expansion_dag.server_api import DEFAULT_STREAM_INTERVAL
from expansion_dag.sim.config import DEFAULT_REASONING_SHARE
from expansion_dag.sim.generation import OutputModel
from expansion_dag.store import CompletionStore
from expansion_dag.tokenizer import DEFAULT_TOKENIZER
from hostinfo import cpu_model_and_memory_gib  # noqa: E402  (bench/ is on sys.path when run as a script)

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
HOST = "127.0.0.1"
MODEL = "Qwen/Qwen3-8B"
CONTEXT = 8192
SLOTS = 72
REFERENCE_SERVERS = 8
REFERENCE_RATE = 3.4  # requests/s, fleet-wide
REFERENCE_TOKEN_LATENCY_S = 0.05
REFERENCE_TTFT_S = 0.2
#: Lognormal answers with a mean of ~2,710 tokens: median 2,450, sigma 0.45.
ANSWER_MEDIAN = 2450
ANSWER_SIGMA = 0.45

#: Part B's sources: (name, share, answer median, prompt median tokens). Mean answer ~2,700 tokens.
SOURCES = (
    ("chat", 0.35, 800, 60),
    ("code", 0.20, 2000, 300),
    ("math", 0.25, 3800, 120),
    ("proofs", 0.10, 6000, 200),
    ("summaries", 0.10, 650, 2500),
)
SOURCE_SIGMA = 0.5
PROMPT_EXPONENT = 0.15
PROMPT_SIGMA = 0.6


# --------------------------------------------------------------------------------------------
# Part A: early stopping and streaming over real HTTP


def start_simulator(args: argparse.Namespace, port: int, stream_interval: int) -> tuple[subprocess.Popen, list[str]]:
    ports = list(range(port, port + args.servers))
    command = [
        sys.executable, "-m", "expansion_dag.sim", "--host", HOST, "--ports", f"{ports[0]}-{ports[-1]}",
        "--max-running-requests", str(SLOTS), "--context-length", str(CONTEXT),
        "--stream-interval", str(stream_interval),
        "--ttft-ms", str(REFERENCE_TTFT_S * 1000 / args.time_factor),
        "--token-latency-ms", str(REFERENCE_TOKEN_LATENCY_S * 1000 / args.time_factor),
        "--output-median-tokens", str(ANSWER_MEDIAN), "--output-sigma", str(ANSWER_SIGMA),
        "--reasoning-parser", "qwen3", "--loop-rate", str(args.loop_rate), "--log-level", "warning",
    ]  # fmt: skip
    if args.natural_max_tokens is not None:
        command += ["--output-max-tokens", str(args.natural_max_tokens)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    urls = [f"http://{HOST}:{p}" for p in ports]
    deadline = time.monotonic() + 120
    with httpx.Client(timeout=2.0) as client:
        for url in urls:
            while True:
                if process.poll() is not None or time.monotonic() > deadline:
                    process.kill()
                    raise RuntimeError(f"simulator did not start: {' '.join(command)}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{url}/health").status_code == 200:
                        break
                time.sleep(0.2)
    return process, urls


def part_a_items(n: int, servers: int) -> list[list[WorkItem]]:
    sampling = SamplingSettings(max_output_tokens=CONTEXT)
    shards: list[list[WorkItem]] = [[] for _ in range(servers)]
    for i in range(n):
        prompt_id = f"a{i:06d}"
        text = f"Question {i}: explain, step by step and in detail, topic number {i} of the syllabus."
        shards[i % servers].append(
            WorkItem(key=sampling.key(prompt_id, MODEL), prompt_id=prompt_id, source="reasoning",
                     messages=[{"role": "user", "content": text}], prompt_tokens=40,
                     max_tokens=CONTEXT - 64, expected_output_tokens=ANSWER_MEDIAN)
        )
    return shards


async def run_phase(
    shards: list[list[WorkItem]], urls: list[str], store_root: Path, stop: bool, stream_interval: int, tick_s: float
) -> dict[str, Any]:
    config = EngineConfig(stop_degenerate=stop, canary=False, client_tick_s=tick_s)
    store = CompletionStore(store_root)
    sampling = SamplingSettings(max_output_tokens=CONTEXT)

    async def one(i: int):
        with store.writer(f"shard-{i:02d}") as writer:
            server = Server(urls[i], SLOTS, stream_interval=stream_interval)
            run = ShardRun(shards[i], [server], writer=writer, model=MODEL, sampling=sampling, config=config)
            return await run.run()

    cpu, wall = time.process_time(), time.perf_counter()
    reports = await asyncio.gather(*(one(i) for i in range(len(urls))))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    requests = sum(r.done for r in reports)
    dropped: collections.Counter = collections.Counter()
    generated = kept = 0
    for r in reports:
        dropped.update(r.dropped_slot_seconds(drop_truncated=True))
        generated += r.generated_output_tokens
        kept += r.kept_output_tokens(drop_truncated=True)
    all_slot_s = sum(sum(r.slot_seconds_by_outcome.values()) for r in reports)
    # Which truncated answers were loops (plain phase: they ran to the cap): the detector's verdict
    # on the whole text; the others were long answers cut at the cap, which stopping cannot save.
    thresholds = EngineConfig().loop_thresholds()
    assert thresholds is not None
    truncated = collections.Counter()
    for shard in store.shards():
        for record in store.records(shard):
            if record["finish_reason"] == "length":
                text = (record.get("reasoning_content") or "") + (record.get("content") or "")
                kind = "loop" if find_loop(text[-thresholds.window_chars :], thresholds) else "long answer"
                truncated[kind, "slot_s"] += record["latency_s"]
                truncated[kind, "tokens"] += record["completion_tokens"]
                truncated[kind, "answers"] += 1
    loops_s = truncated["loop", "slot_s"] + dropped.get("degenerate", 0.0)
    natural_tokens = truncated["long answer", "tokens"]
    return {
        "requests": requests,
        "outcomes": dict(sum((r.finish_reasons + r.failures_by_kind for r in reports), collections.Counter())),
        "makespan_s": round(wall, 2),
        "slot_seconds_total": round(all_slot_s, 1),
        "dropped_slot_seconds": {k: round(v, 1) for k, v in dropped.items()},
        "dropped_slot_seconds_total": round(sum(dropped.values()), 1),
        "generated_output_tokens": generated,
        "kept_output_tokens": kept,
        "useful_token_share": round(kept / generated, 4) if generated else 1.0,
        "dropped_slot_seconds_loops": round(loops_s, 1),
        "dropped_slot_seconds_long_answers_cut": round(truncated["long answer", "slot_s"], 1),
        "long_answers_cut": truncated["long answer", "answers"],
        "useful_token_share_without_long_answers_cut": round(kept / (generated - natural_tokens), 4),
        "client_cpu_s": round(cpu, 2),
        "client_cpu_ms_per_request": round(1000 * cpu / requests, 2) if requests else 0.0,
    }


def part_a(args: argparse.Namespace) -> dict[str, Any]:
    """The phases on the same prompts, each against simulators launched with its stream interval,
    each on the event loop ``generate_shard`` runs it on (``EngineConfig.client_tick_s``)."""
    shards = part_a_items(args.requests, args.servers)
    tick = EngineConfig().client_tick_s if args.client_tick_s is None else args.client_tick_s
    phases = [
        ("stream+stop", True, args.stream_interval, tick),
        ("stream+stop, a wake-up an event", True, args.stream_interval, 0.0),
        ("plain", False, 1, tick),
    ]
    if args.stream_interval > 1:
        phases.insert(2, ("stream+stop, every token", True, 1, tick))
    results = {}
    for n, (name, stop, interval, tick_s) in enumerate(phases):
        process, urls = start_simulator(args, args.base_port + n * args.servers, interval)
        try:
            store_root = RESULTS_DIR / f".waste-store-{os.getpid()}-{n}"
            # The engine's own loop, as generate_shard runs a shard (tick 0: asyncio's own).
            results[name] = event_loop.run(run_phase(shards, urls, store_root, stop, interval, tick_s), tick_s=tick_s)
            results[name]["stream_interval"] = interval if stop else None
            results[name]["client_tick_s"] = tick_s
            shutil.rmtree(store_root, ignore_errors=True)
        finally:
            process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
            if process.poll() is None:
                process.kill()
    stream, plain = results["stream+stop"], results["plain"]
    fall = 1 - stream["dropped_slot_seconds_total"] / plain["dropped_slot_seconds_total"]
    loops_fall = 1 - stream["dropped_slot_seconds_loops"] / plain["dropped_slot_seconds_loops"]
    cpu_ratio = stream["client_cpu_ms_per_request"] / plain["client_cpu_ms_per_request"]
    every_wake_up = results["stream+stop, a wake-up an event"]["client_cpu_ms_per_request"]
    # One core's worth at the reference rate: unscaled, a request costs the same client CPU.
    reference_core_share = REFERENCE_RATE * stream["client_cpu_ms_per_request"] / 1000
    return {
        "phases": results,
        "dropped_slot_seconds_fall": round(fall, 4),
        "dropped_slot_seconds_fall_loops_only": round(loops_fall, 4),
        "cpu_ratio_stream_over_plain": round(cpu_ratio, 3),
        "cpu_ratio_stream_a_wake_up_an_event_over_plain": round(every_wake_up / plain["client_cpu_ms_per_request"], 3),
        "reference_rate_core_share_streaming": round(reference_core_share, 4),
    }


# --------------------------------------------------------------------------------------------
# Part B: the learned order, a policy model on the reference fleet


def part_b_workload(n: int, seed: int, output_model: OutputModel) -> tuple[list[WorkItem], dict[str, float]]:
    """``n`` prompts in dataset order, no typed priors; their true durations (for the model only)."""
    rng = random.Random(seed)
    names = [s[0] for s in SOURCES]
    weights = [s[1] for s in SOURCES]
    prompt_medians = {s[0]: s[3] for s in SOURCES}
    items, duration = [], {}
    for i in range(n):
        source = rng.choices(names, weights)[0]
        prompt_tokens = max(8, min(6000, round(rng.lognormvariate(math.log(prompt_medians[source]), PROMPT_SIGMA))))
        prompt_id = f"s{seed}-{i:06d}"
        max_tokens = CONTEXT - prompt_tokens - 16
        answer = output_model.generate(f"<{source}> {prompt_id}", request_seed=None, cap=max_tokens, thinking=False,
                                       split_reasoning=False, prompt_tokens=prompt_tokens)
        item = WorkItem(key=prompt_id, prompt_id=prompt_id, source=source, messages=(), prompt_tokens=prompt_tokens,
                        max_tokens=max_tokens, expected_output_tokens=0)  # no typed priors
        items.append(item)
        duration[prompt_id] = REFERENCE_TTFT_S + answer.completion_tokens * REFERENCE_TOKEN_LATENCY_S
    return items, duration


def makespan_engine(items: list[WorkItem], duration: dict[str, float], servers: int, learned: AnswerLengths | None,
                    learn: bool) -> dict[str, float]:
    """The engine's dispatch: shards dealt round-robin (the budget balances equal priors by count),
    one queue per shard ordered by its own ``AnswerLengths`` (re-ordered at 16, 32, 64... returns),
    a slot whose shard has nothing queued takes from the longest queue (spill)."""
    shards = [items[s::servers] for s in range(servers)]
    models = [_copy(learned) for _ in range(servers)]
    queues = [collections.deque(sorted(w, key=lambda it, m=models[s]: (-expected_output_tokens(it, m), it.prompt_id)))
              for s, w in enumerate(shards)]
    returned = [0] * servers
    next_reorder = [FIRST_REORDER] * servers
    events: list[tuple[float, int, int, str | None]] = [(0.0, s, j, None) for s in range(servers) for j in range(SLOTS)]
    heapq.heapify(events)
    by_key = {it.prompt_id: it for it in items}
    makespan = drained_at = 0.0
    while events:
        t, server, slot, finished = heapq.heappop(events)
        if finished is not None:
            makespan = max(makespan, t)
            owner_s, prompt_id = finished.split("|")
            owner, item = int(owner_s), by_key[prompt_id]
            if learn:  # the shard that sent it learns from it, as ShardRun does
                models[owner].observe(item.source, item.prompt_tokens, _tokens(duration[prompt_id]))
                returned[owner] += 1
                if returned[owner] >= next_reorder[owner]:
                    next_reorder[owner] *= 2
                    m = models[owner]
                    queues[owner] = collections.deque(
                        sorted(queues[owner], key=lambda it: (-expected_output_tokens(it, m), it.prompt_id))
                    )
        source = server if queues[server] else max(range(servers), key=lambda k: len(queues[k]))
        if not queues[source]:
            drained_at = drained_at or t
            continue
        item = queues[source].popleft()
        heapq.heappush(events, (t + duration[item.prompt_id], server, slot, f"{source}|{item.prompt_id}"))
    return {"makespan_s": makespan, "queue_empty_at_s": drained_at}


def _tokens(duration_s: float) -> int:
    return round((duration_s - REFERENCE_TTFT_S) / REFERENCE_TOKEN_LATENCY_S)


def _copy(lengths: AnswerLengths | None) -> AnswerLengths:
    return copy.deepcopy(lengths) if lengths is not None else AnswerLengths()


def makespan_plain(items: list[WorkItem], duration: dict[str, float], servers: int) -> dict[str, float]:
    sums = [0.0] * (servers * SLOTS)
    for i, item in enumerate(items):
        sums[(i % servers) * SLOTS + (i // servers) % SLOTS] += duration[item.prompt_id]
    return {"makespan_s": max(sums), "queue_empty_at_s": 0.0}


def makespan_clairvoyant(items: list[WorkItem], duration: dict[str, float], servers: int) -> dict[str, float]:
    free = [0.0] * (servers * SLOTS)
    end = last_start = 0.0
    for item in sorted(items, key=lambda it: -duration[it.prompt_id]):
        start = heapq.heappop(free)
        last_start = start
        end = max(end, start + duration[item.prompt_id])
        heapq.heappush(free, start + duration[item.prompt_id])
    return {"makespan_s": end, "queue_empty_at_s": last_start}


def part_b(n: int) -> dict[str, Any]:
    output_model = OutputModel(
        tokenizer_spec=DEFAULT_TOKENIZER, max_length=CONTEXT, median_tokens=ANSWER_MEDIAN, sigma=SOURCE_SIGMA,
        reasoning_share=DEFAULT_REASONING_SHARE, seed=0,
        median_by_marker=tuple((f"<{name}>", median) for name, _, median, _ in SOURCES), prompt_exponent=PROMPT_EXPONENT,
    )
    items, duration = part_b_workload(n, seed=2, output_model=output_model)
    night, night_duration = part_b_workload(n, seed=1, output_model=output_model)
    earlier = AnswerLengths()
    for item in night:
        earlier.observe(item.source, item.prompt_tokens, _tokens(night_duration[item.prompt_id]))
    servers = REFERENCE_SERVERS
    bound = makespan_clairvoyant(items, duration, servers)
    policies = {
        "learned (earlier night)": makespan_engine(items, duration, servers, earlier, learn=True),
        "learned (in run only)": makespan_engine(items, duration, servers, None, learn=True),
        "no learning (no priors)": makespan_engine(items, duration, servers, None, learn=False),
        "plain loop": makespan_plain(items, duration, servers),
        "clairvoyant longest-first": bound,
    }
    work = sum(duration.values())
    tokens = [_tokens(d) for d in duration.values()]
    return {
        "requests": len(items),
        "mean_answer_tokens": round(statistics.fmean(tokens)),
        "p99_answer_tokens": sorted(tokens)[int(0.99 * len(tokens))],
        "lower_bound_s": round(max(work / (servers * SLOTS), max(duration.values())), 1),
        "policies": {
            name: {
                "makespan_s": round(r["makespan_s"], 1),
                "vs_clairvoyant": round(r["makespan_s"] / bound["makespan_s"], 4),
                "utilization": round(work / (servers * SLOTS * r["makespan_s"]), 4),
                # The tail: from the moment the queue is empty to the last answer.
                "tail_s": round(r["makespan_s"] - r["queue_empty_at_s"], 1) if r["queue_empty_at_s"] else None,
            }
            for name, r in policies.items()
        },
    }


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run")
    p.add_argument("--servers", type=int, default=1, help="part A: simulated servers of 72 slots")
    p.add_argument("--requests", type=int, default=432, help="part A: requests per phase")
    p.add_argument("--time-factor", type=float, default=8.0, help="part A: simulated time runs this much faster")
    p.add_argument("--loop-rate", type=float, default=0.03)
    p.add_argument("--natural-max-tokens", type=int, default=None,
                   help="part A: the longest answer that is not a loop (the simulator's --output-max-tokens); "
                        f"under the cap ({CONTEXT - 64}), only loops are cut: the workload of loops alone")  # fmt: skip
    p.add_argument("--model-requests", type=int, nargs="+", default=[19_543, 4_000],
                   help="part B: requests on 8 x 72 slots, one run per value (fewer: a bigger tail)")
    p.add_argument("--stream-interval", type=int, default=DEFAULT_STREAM_INTERVAL,
                   help="part A: tokens per streamed event (a phase at 1 runs beside it)")
    p.add_argument("--client-tick-s", type=float, default=None,
                   help="part A: the engine's client_tick_s (default: its default); a phase without it runs beside")
    p.add_argument("--base-port", type=int, default=32500)
    p.add_argument("--skip-a", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.time_factor, args.model_requests = 144, 20.0, [3000]
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    cpu, memory = cpu_model_and_memory_gib()
    result: dict[str, Any] = {
        "label": "SIMULATOR figures (expansion_dag.sim), not GPU figures",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": memory, "python": platform.python_version()},
        "args": vars(args),
    }
    if not args.skip_a:
        started = time.perf_counter()
        result["part_a"] = part_a(args)
        result["part_a"]["wall_s"] = round(time.perf_counter() - started, 1)
    started = time.perf_counter()
    result["part_b"] = [part_b(n) for n in args.model_requests]
    result["part_b_wall_s"] = round(time.perf_counter() - started, 1)
    out = RESULTS_DIR / f"waste-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
