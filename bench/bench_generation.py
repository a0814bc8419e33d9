"""Generation benchmark: fleet utilization and client CPU, this project vs a plain httpx loop.

Everything here runs against the SGLang SIMULATOR (``expansion_dag.sim``), started in a process of
its own (``FleetProcess``) so that the CPU measured in this process is the client's alone. Every figure printed is a
simulator figure: the time model is scaled down (milliseconds per output token) so that tens of
thousands of requests fit in a few minutes on a small machine.

Two clients send the same prompts, with the same request bodies, to the same servers, one after
the other (the simulator is idle between them):

- ``engine``: this project. The prompts are split into one shard per server, balanced on expected
  tokens with :func:`expansion_dag.prompts.budget.assign_shards`, as the budget asset does; each shard runs
  as an :class:`expansion_dag.generation.engine.ShardRun` (one keep-alive connection per worker) with its own
  completion-store writer, exactly what :func:`expansion_dag.generation.engine.generate_shard` builds for the Dagster asset. The
  eight runs share one event loop in this one process, which is the "one process feeds N servers"
  claim under test.
- ``baseline``: a plain asyncio + httpx loop. One ``AsyncClient`` with ``servers * slots`` pooled
  connections, ``slots`` workers per server, each worker with a fixed share of the prompts dealt
  round-robin in dataset order, results appended to a JSONL file.

The workload is a mix of sources with their own prompt lengths and output-length distributions
(lognormal, long-tailed). The simulator draws an output length per prompt deterministically from
the prompt's text; the benchmark shapes each source's distribution by choosing which prompt texts
it uses (rejection sampling on the simulator's own draw). Neither client is told any prompt's
length: the engine gets ``expected_output_tokens = min(max_tokens, source median)``, the same
prior as ``expansion_dag.prompts.budget`` (which balances shards on ``prompt_tokens`` plus it), and the
baseline gets nothing.

Utilization is measured by the simulator: busy slot-seconds (its stats' deltas) over
``slots * makespan``, summed over the servers. Client CPU is ``time.process_time()`` of this
process over the phase.

    .venv/bin/python bench/bench_generation.py            # the full run: ~12 min on 2 idle cores
    .venv/bin/python bench/bench_generation.py --quick    # a smoke run: ~20 s

The full run's time is mostly the baseline's own CPU: about 30 ms per request on this machine,
so 20,000 requests keep one core busy for 10 minutes; ``--requests`` scales it.

Results are printed as a table and written as JSON under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import heapq
import json
import math
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

import httpx
import polars as pl
from harness import RESULTS_DIR, header, machine_cpu_s, process_cpu_s, write_result  # (bench/ is on sys.path)

from expansion_dag.config import DEFAULT_STREAM_INTERVAL, GenerationConfig, engine_config, sampling_settings
from expansion_dag.core import (
    DEFAULT_TOKENIZER,
    SamplingSettings,
    completion_key,
    count_tokens,
    load_tokenizer,
    render_prompts,
)
from expansion_dag.generation import PromptQueue, Server, ShardRun, WorkItem
from expansion_dag.prompts import assign_shards, shard_keys
from expansion_dag.sim import DEFAULT_REASONING_SHARE, FleetProcess, OutputModel, SimServerConfig
from expansion_dag.store import CompletionStore

MODEL = "Qwen/Qwen3-8B"
#: Tokens kept free below the context when budgeting, as BudgetConfig.margin.
MARGIN = 16
MIN_OUTPUT_TOKENS = 256


# --------------------------------------------------------------------------------------------
# The workload


@dataclasses.dataclass(frozen=True)
class Source:
    """One prompt source: its share of the prompts, prompt lengths and answer lengths (tokens)."""

    name: str
    share: float
    prompt_median: int
    prompt_sigma: float
    prompt_min: int
    prompt_max: int
    output_median: int
    output_sigma: float


#: A mix shaped like an instruction-expansion run: most prompts are short chat turns, a quarter
#: are reasoning problems whose answers are long and sometimes hit the cap, some are code, and a
#: few are long documents with short answers.
# fmt: off
SOURCES = (
    #      name            share  prompt: median sigma  min   max   output: median sigma
    Source("chat",           0.40,          120,   0.8,   8, 2000,           300,  0.8),
    Source("code",           0.20,          400,   0.7,  30, 3000,           600,  0.8),
    Source("long_context",   0.15,         2500,   0.4, 800, 6000,           250,  0.6),
    Source("math_reasoning", 0.25,          150,   0.6,  20, 1500,          1500,  0.8),
)
# fmt: on
#: The simulator's own lognormal: wider than every source's, so rejection sampling can carve each
#: source's distribution out of it.
SIM_OUTPUT_MEDIAN = 500
SIM_OUTPUT_SIGMA = 1.3

_WORDS = [
    "please",
    "explain",
    "describe",
    "write",
    "compare",
    "summarize",
    "the",
    "following",
    "text",
    "code",
    "function",
    "problem",
    "answer",
    "question",
    "data",
    "model",
    "system",
    "user",
    "value",
    "result",
    "step",
    "first",
    "second",
    "list",
    "table",
    "reason",
    "example",
    "short",
    "long",
    "detail",
    "method",
    "class",
    "test",
    "error",
    "input",
    "output",
    "number",
    "string",
    "file",
    "line",
    "process",
    "time",
    "memory",
    "network",
    "server",
    "request",
    "response",
    "table",
    "chart",
    "report",
    "history",
    "science",
    "math",
    "proof",
    "theorem",
    "integer",
    "prime",
    "sum",
    "product",
    "triangle",
    "circle",
    "angle",
    "area",
    "volume",
    "rate",
    "speed",
    "price",
    "market",
    "plan",
    "team",
    "project",
    "design",
    "build",
    "check",
    "review",
    "change",
    "update",
    "version",
    "release",
    "support",
    "issue",
    "bug",
    "fix",
    "feature",
    "option",
]


@dataclasses.dataclass(frozen=True)
class Prompt:
    item: WorkItem
    #: What the simulator will answer, in tokens: for the report only, never given to a client.
    sim_output_tokens: int


def _log_density_ratio_bound(target_mu: float, target_sigma: float, mu: float, sigma: float) -> float:
    """max over x of N(x; target) / N(x; proposal), on a grid (the proposal is the wider one)."""
    best = 0.0
    for k in range(-4000, 4001):
        x = mu + k * 8 * sigma / 4000
        best = max(best, _log_ratio(x, target_mu, target_sigma, mu, sigma))
    return best


def _log_ratio(x: float, target_mu: float, target_sigma: float, mu: float, sigma: float) -> float:
    return (
        math.log(sigma / target_sigma) - (x - target_mu) ** 2 / (2 * target_sigma**2) + (x - mu) ** 2 / (2 * sigma**2)
    )


class _WordStream:
    """A long fixed text of prompt words, sliced by word index, with the token count of any slice.

    Each word is counted with its leading space, which is how the Qwen pre-tokenizer splits a run
    of words, so a slice's token count is a difference of prefix sums (checked against the real
    tokenizer on a sample in :func:`build_workload`).
    """

    def __init__(self, rng: random.Random, tokenizer, n_words: int):
        words = [rng.choice(_WORDS) for _ in range(n_words)]
        self.text = " ".join(words)
        per_word = {w: n for w, n in zip(_WORDS, count_tokens(tokenizer, [" " + w for w in _WORDS]))}
        self.offsets = [0]
        self.tokens = [0]
        for w in words:
            self.offsets.append(self.offsets[-1] + len(w) + 1)
            self.tokens.append(self.tokens[-1] + per_word[w])
        self.n_words = n_words

    def slice(self, start: int, count: int) -> tuple[str, int]:
        """(``count`` words from ``start`` joined by spaces, their token count after a space)."""
        return self.text[self.offsets[start] : self.offsets[start + count] - 1], self.tokens[
            start + count
        ] - self.tokens[start]


def build_workload(n: int, *, seed: int, context_length: int, max_output_tokens: int, sim_seed: int) -> list[Prompt]:
    """``n`` prompts in dataset order (sources interleaved at random), each budgeted like the project."""
    tokenizer = load_tokenizer(DEFAULT_TOKENIZER)
    model = OutputModel(
        tokenizer_spec=DEFAULT_TOKENIZER,
        max_length=context_length,
        median_tokens=SIM_OUTPUT_MEDIAN,
        sigma=SIM_OUTPUT_SIGMA,
        reasoning_share=DEFAULT_REASONING_SHARE,
        seed=sim_seed,
    )
    # A one-message chat renders as prefix + content + suffix; checked against the template below.
    marker = "\x00MARK\x00"
    prefix, suffix = render_prompts(tokenizer, [[{"role": "user", "content": marker}]])[0].split(marker)
    rng = random.Random(seed)
    longest = max(s.prompt_max for s in SOURCES)
    stream = _WordStream(rng, tokenizer, max(4 * longest, 200_000))
    counts = [round(s.share * n) for s in SOURCES]
    counts[0] += n - sum(counts)
    order = [s for s, c in zip(SOURCES, counts) for _ in range(c)]
    rng.shuffle(order)
    mu, sigma = math.log(SIM_OUTPUT_MEDIAN), SIM_OUTPUT_SIGMA
    bounds = {s.name: _log_density_ratio_bound(math.log(s.output_median), s.output_sigma, mu, sigma) for s in SOURCES}
    headers: list[str] = []
    contents: list[str] = []
    body_tokens: list[int] = []
    for i, source in enumerate(order):
        length = int(
            min(
                source.prompt_max,
                max(source.prompt_min, rng.lognormvariate(math.log(source.prompt_median), source.prompt_sigma)),
            )
        )
        body, tokens = stream.slice(rng.randrange(stream.n_words - length), length)
        target_mu = math.log(source.output_median)
        # Rejection sampling on the simulator's own draw: retitle the prompt until its answer
        # length is accepted, so each source gets its own lognormal out of the simulator's one.
        for attempt in range(100_000):
            header = f"[{source.name} {i} v{attempt}]"
            content = f"{header} {body}"
            drawn = model.generate(
                prefix + content + suffix, request_seed=None, cap=context_length, thinking=False, split_reasoning=False
            ).completion_tokens
            log_accept = _log_ratio(math.log(drawn), target_mu, source.output_sigma, mu, sigma) - bounds[source.name]
            if math.log(rng.random() or 1e-300) < log_accept:
                break
        headers.append(header)
        contents.append(content)
        body_tokens.append(tokens)
    conversations = [[{"role": "user", "content": c}] for c in contents]
    rendered = render_prompts(tokenizer, conversations)
    assert rendered == [prefix + c + suffix for c in contents], "chat template is not prefix + content + suffix"
    prompt_tokens = [
        h + b for h, b in zip(count_tokens(tokenizer, [prefix + h + suffix for h in headers]), body_tokens)
    ]
    sample = rng.sample(range(len(rendered)), min(200, len(rendered)))
    exact = count_tokens(tokenizer, [rendered[i] for i in sample])
    assert exact == [prompt_tokens[i] for i in sample], "prompt token counts disagree with the tokenizer"
    sampling = sampling_settings(GenerationConfig(), max_output_tokens=max_output_tokens)
    fingerprint = sampling.fingerprint(f"{MODEL} (simulator)")
    prompts: list[Prompt] = []
    for source, conversation, text, p_tokens in zip(order, conversations, rendered, prompt_tokens):
        max_tokens = min(max_output_tokens, context_length - p_tokens - MARGIN)
        if max_tokens < MIN_OUTPUT_TOKENS:
            continue  # set aside, as the budget asset does
        # The honest prior: the source's median answer length, as a pilot sample would estimate it.
        expected_output = min(max_tokens, source.output_median)
        prompt_id = f"{source.name}-{len(prompts):06d}"
        answer = model.generate(text, request_seed=None, cap=max_tokens, thinking=True, split_reasoning=True)
        item = WorkItem(key=completion_key(prompt_id, fingerprint), prompt_id=prompt_id, source=source.name,
                        messages=conversation, prompt_tokens=p_tokens, max_tokens=max_tokens,
                        expected_output_tokens=expected_output)  # fmt: skip
        prompts.append(Prompt(item, answer.completion_tokens))
    return prompts


def workload_summary(prompts: list[Prompt], ttft_s: float, token_latency_s: float, slots_total: int) -> dict[str, Any]:
    """What the prompts will cost on the simulator (known to the benchmark, not to the clients)."""

    def dist(values: list[float]) -> dict[str, float]:
        ordered = sorted(values)

        def pick(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

        return {
            "mean": round(statistics.fmean(ordered), 1),
            "p50": pick(0.5),
            "p90": pick(0.9),
            "p99": pick(0.99),
            "max": ordered[-1],
        }

    by_source: dict[str, Any] = {}
    for source in SOURCES:
        chosen = [p for p in prompts if p.item.source == source.name]
        if not chosen:
            continue
        by_source[source.name] = {
            "prompts": len(chosen),
            "prior_output_median": source.output_median,
            "prompt_tokens": dist([p.item.prompt_tokens for p in chosen]),
            "output_tokens": dist([p.sim_output_tokens for p in chosen]),
            "truncated_at_max_tokens": sum(p.sim_output_tokens >= p.item.max_tokens for p in chosen),
        }
    durations = [ttft_s + p.sim_output_tokens * token_latency_s for p in prompts]
    lower_bound = max(sum(durations) / slots_total, max(durations))
    # How much the engine's ordering key knows: rank correlation of expected_output_tokens with the
    # simulator's actual request time (1.0 would be perfect knowledge, 0 none).
    ranks = pl.DataFrame({"expected": [p.item.expected_output_tokens for p in prompts], "actual": durations}).select(
        pl.corr("expected", "actual", method="spearman")
    )
    return {
        "prompts": len(prompts),
        "output_tokens_total": sum(p.sim_output_tokens for p in prompts),
        "request_seconds": dist([round(d, 3) for d in durations]),
        "slot_seconds_total": round(sum(durations), 1),
        "makespan_lower_bound_s": round(lower_bound, 2),
        "spearman_expected_output_vs_request_time": round(float(ranks.item()), 3),
        "by_source": by_source,
    }


def prior_order(items: list[WorkItem]) -> list[WorkItem]:
    """ShardRun's order before any answer returns: its queue's, on the budget's priors alone."""
    queue = PromptQueue(items)
    return [queue.take() for _ in range(len(queue))]


def policy_model(
    shards: list[list[WorkItem]], items: list[WorkItem], duration: dict[str, float], servers: int, slots: int
) -> dict[str, Any]:
    """Makespan and utilization each client's dispatch policy allows with zero client overhead.

    Computed from the simulator's time model and the answers the benchmark knows, so the measured
    figures can be split into what the policy costs and what the client (CPU, latency) adds.
    """
    total = sum(duration[i.key] for i in items)

    def engine(spill: bool) -> list[float]:
        """Each server runs its shard in ShardRun's order after the canary (the shortest expected
        answer, alone); with ``spill``, a slot whose shard has nothing queued takes the next prompt
        of the shard with the most queued (the poll delay is ignored)."""
        queues = [collections.deque(prior_order(w)) for w in shards]
        free: list[tuple[float, int]] = []
        for server, queue in enumerate(queues):
            start = duration[queue.pop().key] if queue else 0.0
            free += [(start, server)] * slots
        heapq.heapify(free)
        ends = [0.0] * servers
        while free:
            t, server = heapq.heappop(free)
            queue = queues[server]
            if not queue and spill:
                queue = max(queues, key=len)
            if not queue:
                ends[server] = max(ends[server], t)
                continue
            done = t + duration[queue.popleft().key]
            heapq.heappush(free, (done, server))
        return ends

    engine_ends = engine(spill=True)
    static_ends = engine(spill=False)
    worker_sums = [0.0] * (servers * slots)
    for i, item in enumerate(items):
        worker_sums[(i % servers) * slots + (i // servers) % slots] += duration[item.key]
    baseline_ends = [max(worker_sums[s * slots : (s + 1) * slots]) for s in range(servers)]
    # For reference only, not what the project does: the same order fed to all servers from one
    # queue, which removes the cost of static per-server shards.
    shared = prior_order(items)
    free = [0.0] * (servers * slots)
    shared_end = 0.0
    for item in shared:
        t = heapq.heappop(free) + duration[item.key]
        shared_end = max(shared_end, t)
        heapq.heappush(free, t)
    out: dict[str, Any] = {}
    for name, ends in (
        ("engine", engine_ends),
        ("engine_without_spill", static_ends),
        ("baseline", baseline_ends),
        ("one_fleet_queue_reference", [shared_end]),
    ):
        makespan = max(ends)
        out[name] = {
            "makespan_s": round(makespan, 2),
            "utilization": round(total / (servers * slots * makespan), 4),
            "server_finish_s": [round(e, 2) for e in ends],
        }
    return out


def assign(prompts: list[Prompt], n_shards: int) -> list[list[WorkItem]]:
    """Shards balanced on expected tokens, by the project's own greedy assignment."""
    frame = pl.DataFrame(
        {
            "expected_tokens": [p.item.prompt_tokens + p.item.expected_output_tokens for p in prompts],
            "prompt_id": [p.item.prompt_id for p in prompts],
        }
    )
    keys = shard_keys(n_shards)
    index = {k: i for i, k in enumerate(keys)}
    shards: list[list[WorkItem]] = [[] for _ in keys]
    for prompt, key in zip(prompts, assign_shards(frame, keys)):
        shards[index[key]].append(prompt.item)
    return shards


def simulated_fleet(args: argparse.Namespace) -> FleetProcess:
    server = SimServerConfig(
        port=0, max_running_requests=args.slots, context_length=args.context_length, ttft_s=args.ttft_ms / 1000,
        token_latency_s=args.token_latency_ms / 1000, output_median_tokens=SIM_OUTPUT_MEDIAN,
        output_sigma=SIM_OUTPUT_SIGMA, reasoning_parser="qwen3", stream_interval=args.stream_interval,
        seed=args.sim_seed,
    )  # fmt: skip
    return FleetProcess([server] * args.servers)


# --------------------------------------------------------------------------------------------
# The two clients


async def run_engine(
    shards: list[list[WorkItem]],
    urls: list[str],
    slots: int,
    store_root: Path,
    sampling: SamplingSettings,
    spill: bool = True,
    stream_interval: int = DEFAULT_STREAM_INTERVAL,
) -> dict[str, Any]:
    """One ShardRun per server, each with its own writer, all on this event loop; with ``spill``,
    each may use the other servers' idle slots, as the asset does by default."""
    config = engine_config(GenerationConfig())
    store = CompletionStore(store_root)
    start = time.perf_counter()

    async def one(index: int) -> dict[str, Any]:
        server = Server(url=urls[index], slots=slots, stream_interval=stream_interval)
        with store.writer(f"shard-{index:02d}") as writer:
            helpers = (
                [Server(url=u, slots=slots, stream_interval=stream_interval) for u in urls if u != server.url]
                if spill
                else []
            )
            run = ShardRun(
                shards[index], [server], writer=writer, model=MODEL, sampling=sampling, config=config, helpers=helpers
            )
            report = await run.run()
        return {
            "url": server.url,
            "requests": report.total,
            "ok": report.ok,
            "failed": report.failed,
            "failures_by_kind": dict(report.failures_by_kind),
            "context_retries": report.context_retries,
            "finish_reasons": dict(report.finish_reasons),
            "output_tokens": report.output_tokens,
            "finished_at_s": round(time.perf_counter() - start, 3),
            "engine_reported_utilization": round(report.utilization(), 4),
            "requests_on_idle_servers": sum(h.requests for h in report.helpers.values()),
        }

    per_shard = await asyncio.gather(*(one(i) for i in range(len(urls))))
    return {
        "server_finished_at_s": [s["finished_at_s"] for s in per_shard],
        "requests": sum(s["requests"] for s in per_shard),
        "failed": sum(s["failed"] for s in per_shard),
        "output_tokens": sum(s["output_tokens"] for s in per_shard),
        "per_shard": per_shard,
    }


async def run_baseline(
    items: list[WorkItem], urls: list[str], slots: int, out: TextIO, sampling: SamplingSettings
) -> dict[str, Any]:
    """A plain asyncio + httpx loop: fixed workers with fixed round-robin shares, no ordering."""
    n = len(urls)
    shares: list[list[WorkItem]] = [[] for _ in range(n * slots)]
    for i, item in enumerate(items):
        shares[(i % n) * slots + (i // n) % slots].append(item)
    totals: dict[str, Any] = {"requests": 0, "failed": 0, "output_tokens": 0}
    errors: list[str] = []
    per_server_done = [0.0] * n
    start = time.perf_counter()
    limits = httpx.Limits(max_connections=n * slots, max_keepalive_connections=n * slots)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(1800.0, connect=10.0)) as client:

        async def worker(server: int, share: list[WorkItem]) -> None:
            url = f"{urls[server]}/v1/chat/completions"
            for item in share:
                body = {
                    "model": MODEL,
                    "messages": item.messages,
                    "max_tokens": item.max_tokens,
                    "temperature": sampling.temperature,
                    "top_p": sampling.top_p,
                    "top_k": sampling.top_k,
                    "min_p": sampling.min_p,
                    "repetition_penalty": sampling.repetition_penalty,
                }
                totals["requests"] += 1
                try:
                    response = await client.post(url, json=body)
                    response.raise_for_status()
                    answer = response.json()
                except httpx.HTTPError as exc:
                    totals["failed"] += 1
                    if len(errors) < 5:
                        cause = exc.__cause__ or exc.__context__
                        at = time.perf_counter() - start
                        errors.append(f"at {at:.1f} s: {type(exc).__name__}: {exc} (from {cause!r})")
                    out.write(json.dumps({"prompt_id": item.prompt_id, "error": str(exc)}) + "\n")
                    continue
                choice = answer["choices"][0]
                totals["output_tokens"] += answer["usage"]["completion_tokens"]
                record = {
                    "prompt_id": item.prompt_id,
                    "messages": item.messages,
                    "content": choice["message"]["content"],
                    "reasoning_content": choice["message"].get("reasoning_content"),
                    "finish_reason": choice["finish_reason"],
                    "usage": answer["usage"],
                }
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
            per_server_done[server] = max(per_server_done[server], time.perf_counter() - start)

        await asyncio.gather(*(worker(j // slots, share) for j, share in enumerate(shares)))
    totals["server_finished_at_s"] = [round(t, 3) for t in per_server_done]
    totals["first_errors"] = errors
    return totals


# --------------------------------------------------------------------------------------------
# Measuring a phase


def measure(name: str, sim: FleetProcess, make_coro) -> dict[str, Any]:
    before = sim.wait_idle()
    sim_cpu0 = process_cpu_s(sim.pid)
    busy0, total0 = machine_cpu_s()
    usage0 = os.times()
    cpu0 = time.process_time()
    t0, started_at = time.perf_counter(), time.monotonic()
    outcome = asyncio.run(make_coro())
    makespan = time.perf_counter() - t0
    ended_at = time.monotonic()  # the simulator's clock too (CLOCK_MONOTONIC)
    cpu = time.process_time() - cpu0
    usage1 = os.times()
    busy1, total1 = machine_cpu_s()
    sim_cpu = process_cpu_s(sim.pid) - sim_cpu0
    after = sim.stats()

    slots = sum(s["slots"] for s in after)
    busy = sum(a["busy_slot_seconds"] - b["busy_slot_seconds"] for a, b in zip(after, before))
    completed = sum(a["completed"] - b["completed"] for a, b in zip(after, before))
    sim_output_tokens = sum(a["completion_tokens_total"] - b["completion_tokens_total"] for a, b in zip(after, before))
    per_server_util = [
        round((a["busy_slot_seconds"] - b["busy_slot_seconds"]) / (a["slots"] * makespan), 4)
        for a, b in zip(after, before)
    ]
    requests = outcome["requests"]
    cores = os.cpu_count() or 1
    # The tail: from the end of the last moment all servers were full (the earliest of the servers'
    # last full moments) to the phase's end, against the longest single request.
    last_full = [a["last_full_at_monotonic_s"] for a in after]
    # None: some server was never full during this phase.
    fleet_full = None not in last_full and min(last_full) > started_at
    tail_s = ended_at - min(last_full) if fleet_full else None
    statuses: dict[str, int] = {}
    for a, b in zip(after, before):
        for code, count in a["chat_requests_by_status"].items():
            statuses[code] = statuses.get(code, 0) + count - b["chat_requests_by_status"].get(code, 0)
    machine_busy_s = busy1 - busy0
    finished = outcome["server_finished_at_s"]
    own = sum(a["busy_slot_seconds"] - b["busy_slot_seconds"] for a, b in zip(after, before)) / sum(
        a["slots"] * f for a, f in zip(after, finished)
    )
    return {
        "client": name,
        "requests": requests,
        "failed": outcome["failed"],
        "sim_completed": completed,
        "sim_answers_by_status": statuses,
        "sim_aborted_by_client": sum(a["aborted"] - b["aborted"] for a, b in zip(after, before)),
        "makespan_s": round(makespan, 3),
        "utilization": round(busy / (slots * makespan), 4),
        "utilization_per_server": per_server_util,
        "busy_slot_seconds": round(busy, 2),
        "mean_request_slot_s": round(busy / completed, 4) if completed else None,
        "requests_per_s": round(requests / makespan, 2),
        "output_tokens_per_s": round(sim_output_tokens / makespan, 1),
        "client_cpu_s": round(cpu, 3),
        "client_cpu_user_s": round(usage1.user - usage0.user, 3),
        "client_cpu_system_s": round(usage1.system - usage0.system, 3),
        "client_cpu_s_per_1000_requests": round(1000 * cpu / requests, 3) if requests else None,
        "client_cores_busy": round(cpu / makespan, 3),
        "simulator_cpu_s": round(sim_cpu, 3),
        "simulator_cpu_ms_per_request": round(1000 * sim_cpu / completed, 3) if completed else None,
        "machine_cpu_busy_fraction": round((busy1 - busy0) / max(1, total1 - total0), 3),
        # CPU used on this machine by neither this client nor the simulator, in cores: other
        # programs competing for the same cores during the phase.
        "other_processes_cores_busy": round(max(0.0, machine_busy_s - cpu - sim_cpu) / makespan, 3),
        "machine_cores": cores,
        # Utilization if each server were counted only until its own work ended: the gap to
        # "utilization" is what uneven finishing across servers costs.
        "utilization_until_own_finish": round(own, 4),
        "tail_s": round(tail_s, 2) if tail_s is not None else None,
        "longest_request_s": round(max(a["longest_request_s"] for a in after), 2),
        "server_finished_at_s": finished,
        "detail": outcome,
    }


def feeding(
    result: dict[str, Any], slots: int, real_ttft_s: float, real_token_latency_s: float, mean_output_tokens: float
) -> dict[str, Any]:
    """What "one process feeds 100 such servers" asks of this client's CPU per request."""
    cpu_per_request = result["client_cpu_s"] / result["requests"]
    out: dict[str, Any] = {"client_cpu_ms_per_request": round(1000 * cpu_per_request, 3)}
    scales = {
        "simulator_time_scale": result["mean_request_slot_s"],
        "gpu_time_scale": real_ttft_s + mean_output_tokens * real_token_latency_s,
    }
    for label, duration in scales.items():
        demand = 100 * slots / duration  # requests/s that 100 full servers complete
        out[label] = {
            "mean_request_s": round(duration, 3),
            "requests_per_s_for_100_servers": round(demand, 1),
            "cores_needed_for_100_servers": round(demand * cpu_per_request, 3),
            "servers_one_core_can_feed": round(duration / (slots * cpu_per_request), 1),
        }
    return out


# --------------------------------------------------------------------------------------------
# Main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--requests", type=int, default=20_000, help="prompts sent by each client")
    p.add_argument("--servers", type=int, default=8)
    p.add_argument("--slots", type=int, default=72, help="--max-running-requests of each simulated server")
    p.add_argument("--ttft-ms", type=float, default=20.0, help="simulator time model: time to first token")
    p.add_argument("--token-latency-ms", type=float, default=3.0, help="simulator time model: per output token")
    p.add_argument("--context-length", type=int, default=8192)
    p.add_argument(
        "--max-output-tokens", type=int, default=8192, help="the max_tokens cap (each prompt's budget is computed)"
    )
    p.add_argument("--seed", type=int, default=1, help="workload seed")
    p.add_argument("--sim-seed", type=int, default=0)
    p.add_argument("--clients", choices=("both", "engine", "baseline"), default="both")
    p.add_argument("--stream-interval", type=int, default=DEFAULT_STREAM_INTERVAL,
                   help="the simulators' --stream-interval; the engine streams (stops loops) as it does in a run")
    p.add_argument("--no-spill", action="store_true", help="engine shards use only their own server")
    p.add_argument("--real-ttft-ms", type=float, default=200.0, help="GPU time model for the 100-server figure")
    p.add_argument(
        "--real-token-latency-ms",
        type=float,
        default=25.0,
        help="GPU time model for the 100-server figure: per output token of one request at full batch",
    )
    p.add_argument(
        "--quick", action="store_true", help="a smoke run: 4 servers, 1,200 requests, 1 ms per token (~30 s)"
    )
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for the JSON result")
    return p


def _table(results: list[dict[str, Any]], feeds: dict[str, dict[str, Any]]) -> str:
    rows = [
        ("utilization (busy slot-s / slots x makespan)", "utilization", "{:.3f}"),
        ("  same, each server until its own last answer", "utilization_until_own_finish", "{:.3f}"),
        ("  policy alone, zero client overhead (model)", "policy_model_utilization", "{:.3f}"),
        ("makespan, s", "makespan_s", "{:.1f}"),
        ("  policy alone, zero client overhead (model)", "policy_model_makespan_s", "{:.1f}"),
        ("tail: last full-fleet moment to the end, s", "tail_s", "{:.1f}"),
        ("longest request, s", "longest_request_s", "{:.1f}"),
        ("requests / s", "requests_per_s", "{:.1f}"),
        ("output tokens / s", "output_tokens_per_s", "{:,.0f}"),
        ("client CPU s per 1,000 requests", "client_cpu_s_per_1000_requests", "{:.2f}"),
        ("client CPU s (total)", "client_cpu_s", "{:.1f}"),
        ("client cores busy (CPU s / makespan)", "client_cores_busy", "{:.2f}"),
        ("simulator CPU ms per request", "simulator_cpu_ms_per_request", "{:.2f}"),
        ("machine CPU busy fraction", "machine_cpu_busy_fraction", "{:.2f}"),
        ("other processes' cores busy", "other_processes_cores_busy", "{:.2f}"),
        ("failed requests", "failed", "{:d}"),
    ]
    names = [r["client"] for r in results]
    header = ["SIMULATOR figures", *names] + (["ratio engine/baseline"] if len(results) == 2 else [])
    lines = [header]
    for label, key, fmt in rows:
        values = [r[key] for r in results]
        line = [label, *(fmt.format(v) if v is not None else "-" for v in values)]
        if len(results) == 2:
            a, b = values
            line.append(f"{a / b:.2f}" if isinstance(a, (int, float)) and b else "-")
        lines.append(line)
    for scale in ("simulator_time_scale", "gpu_time_scale"):
        for title, key, fmt in (
            ("cores to feed 100 servers", "cores_needed_for_100_servers", "{:.2f}"),
            ("servers one core feeds", "servers_one_core_can_feed", "{:,.0f}"),
        ):
            values = [feeds[n][scale][key] for n in names]
            line = [f"{title} ({scale.replace('_', ' ')})", *(fmt.format(v) for v in values)]
            if len(results) == 2:
                line.append(f"{values[0] / values[1]:.2f}" if values[1] else "-")
            lines.append(line)
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in lines
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.requests, args.servers = 1200, 4
        if args.token_latency_ms == _parser().get_default("token_latency_ms"):
            args.token_latency_ms = 1.0
    started = time.perf_counter()
    document = header("generation", "httpx", simulator=True, argv=argv)
    print(f"building {args.requests:,} prompts ...", flush=True)
    prompts = build_workload(
        args.requests,
        seed=args.seed,
        context_length=args.context_length,
        max_output_tokens=args.max_output_tokens,
        sim_seed=args.sim_seed,
    )
    slots_total = args.servers * args.slots
    summary = workload_summary(prompts, args.ttft_ms / 1000, args.token_latency_ms / 1000, slots_total)
    sampling = sampling_settings(GenerationConfig(), max_output_tokens=args.max_output_tokens)
    shards = assign(prompts, args.servers)
    items = [p.item for p in prompts]
    durations = {p.item.key: args.ttft_ms / 1000 + p.sim_output_tokens * args.token_latency_ms / 1000 for p in prompts}
    model = policy_model(shards, items, durations, args.servers, args.slots)
    print(
        f"{len(items):,} prompts ({summary['output_tokens_total']:,} output tokens on the simulator), "
        f"{args.servers} servers x {args.slots} slots; makespan lower bound {summary['makespan_lower_bound_s']:.1f} s "
        f"(workload built in {time.perf_counter() - started:.1f} s)",
        flush=True,
    )

    sim = simulated_fleet(args)
    scratch = Path(tempfile.mkdtemp(prefix="bench-generation-"))

    def on_term(signum, frame):  # make `kill` run the finally blocks
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    results: list[dict[str, Any]] = []
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(sim)
        print(f"simulator pid {sim.pid} on {sim.urls[0]} .. {sim.urls[-1]}", flush=True)
        if args.clients in ("both", "engine"):
            print("engine: running ...", flush=True)
            results.append(
                measure(
                    "engine",
                    sim,
                    lambda: run_engine(
                        shards, sim.urls, args.slots, scratch / "store", sampling,
                        spill=not args.no_spill, stream_interval=args.stream_interval,
                    ),
                )
            )
            print(f"engine: done in {results[-1]['makespan_s']:.1f} s", flush=True)
            # Transient errors the engine retried do not show as failures: count them from the store.
            store = CompletionStore(scratch / "store")
            attempts = [r["attempts"] for shard in store.shards() for r in store.records(shard)]
            results[-1]["detail"]["requests_retried"] = sum(a > 1 for a in attempts)
            results[-1]["detail"]["extra_attempts"] = sum(a - 1 for a in attempts)
        if args.clients in ("both", "baseline"):
            print("baseline: running ...", flush=True)
            baseline_out = stack.enter_context(open(scratch / "baseline.jsonl", "w", encoding="utf-8"))  # noqa: SIM115
            results.append(
                measure("baseline", sim, lambda: run_baseline(items, sim.urls, args.slots, baseline_out, sampling))
            )
            print(f"baseline: done in {results[-1]['makespan_s']:.1f} s", flush=True)
    except KeyboardInterrupt:
        print("interrupted: stopping the simulator", file=sys.stderr)
        return 130
    finally:
        stack.close()
        shutil.rmtree(scratch, ignore_errors=True)

    for r in results:
        policy = model["engine_without_spill" if r["client"] == "engine" and args.no_spill else r["client"]]
        r["policy_model"] = policy
        r["policy_model_utilization"] = policy["utilization"]
        r["policy_model_makespan_s"] = policy["makespan_s"]
    mean_output = summary["output_tokens_total"] / summary["prompts"]
    feeds = {
        r["client"]: feeding(r, args.slots, args.real_ttft_ms / 1000, args.real_token_latency_ms / 1000, mean_output)
        for r in results
    }
    print()
    print(_table(results, feeds))
    print()
    for r in results:
        if r["other_processes_cores_busy"] > 0.25:
            print(
                f"WARNING: other programs kept {r['other_processes_cores_busy']:.2f} cores busy during the "
                f"{r['client']} phase: its figures are not clean (rerun on an idle machine)."
            )
    gpu = feeds[results[0]["client"]]["gpu_time_scale"]
    sim_scale = feeds[results[0]["client"]]["simulator_time_scale"]
    print(
        f"100 servers x {args.slots} slots complete {sim_scale['requests_per_s_for_100_servers']:,.0f} requests/s at the "
        f"simulator's mean request time ({sim_scale['mean_request_s']:.2f} s), "
        f"{gpu['requests_per_s_for_100_servers']:,.0f} requests/s at the GPU time model ({gpu['mean_request_s']:.1f} s: "
        f"{args.real_ttft_ms:.0f} ms + {mean_output:.0f} tokens x {args.real_token_latency_ms:.0f} ms)."
    )
    document.update({
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "simulator": dataclasses.asdict(sim.configs[0]) | {"servers": len(sim.configs)},
        "workload": summary,
        "policy_model": model,
        "results": results,
        "feeding_100_servers": feeds,
        "total_wall_s": round(time.perf_counter() - started, 1),
    })
    path = write_result("generation", document, out_dir=args.out)
    print(f"total {document['total_wall_s']:.0f} s; results written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
