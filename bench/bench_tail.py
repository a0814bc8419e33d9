"""The tail of a mixed night over real HTTP (issue 36): makespan over the clairvoyant bound, the
engine beside a plain loop, and the attempts a full queue refuses (SIMULATOR).

Every figure is a SIMULATOR figure (``expansion_dag.sim``), never a GPU one. The workload is issue
36's, and ``bench_waste.py`` part C's in its policy model, here sent over HTTP: ``--prompts`` prompts
(20,000), ``--conversation-share`` of them (5%) tool conversations of 2 to 6 assistant turns (the
bundled Hermes sample's, copied with distinct ids and words, a tool result or a second question
between turns, each next turn built from the answer before it), the rest single prompts of part C's
sources (their prompt lengths, filled by a system message, and answer medians). Answer lengths
follow the source, the prompt's length and the user's *phrases* (the simulator's
``output_phrase_sigma``: pairs of adjacent words, a rule the client's single-word learner cannot read
off), 3% of prompts loop every time they are asked (``looping_prompt_share``), and the servers'
queues are bounded at 40 (a 503 "The request queue is full." beyond it). Thinking is on (a qwen3
reasoning parser), tool calls are parsed (qwen25). Budgets are the budget stage's
(``budget_prompts``: exact prompt counts, ``max_tokens = min(cap, context - prompt - margin)``,
shards balanced on expected tokens), requests are built from ``ShardWork`` and ``TurnPlanner``, as
the Dagster assets build them.

The fleet: ``--servers`` (8) simulated SGLang servers of 72 slots at the reference fleet's per-slot
speed (``bench_waste.py``: 0.05 s an output token, 0.2 s to the first) divided by ``--time-factor``,
in a process of their own (``FleetProcess``), each keeping its timeline (``keep_timeline``): every request's arrival,
end and status, from which each request's start on a slot is replayed (the scheduler's first come,
first served queue). Two phases on the same prompts, side by side, each on a fresh fleet:

- ``engine``: one process per shard, as Dagster runs them (``generate_shard`` with the default
  ``EngineConfig``: streaming, loops stopped, the canary, borrowing other servers' idle slots once
  their own shard has shown itself), one shard per server, shard ``i`` starting ``i x --stagger-s``
  (reference seconds, divided by the time factor) after the first.
- ``plain loop``: SpecForge's regeneration script, as ``bench_waste.py`` part C models it: per
  server 72 asyncio workers on one ``httpx.AsyncClient``, each taking the next prompt of that
  server's shard in dataset order and asking a conversation's turns in order (the same requests:
  ``chat_request``, each next turn from ``TurnPlanner``); plain requests, so loops run to the cap;
  no borrowing; a 503 asked again after ``RETRY_WAIT_S``. Its servers start with the same stagger.

Reported for each phase, from the servers' timelines: the makespan (the first shard's first request
to the last answer), the clairvoyant bound from *that phase's* service times (longest first on one
fleet-wide queue, a conversation's whole chain on one slot, each server's slots from its shard's
first request: ``bench_waste.makespan_clairvoyant_units``), their ratio and the plain loop's makespan
over the engine's bound; attempts, 503 refusals and their share; prompts failed (from 503s); loops
asked and stopped; requests ending after the bound (conversation turns among them); each server's
wait for its second request (the engine's canary runs alone until its first streamed text);
client and simulator CPU; for the engine, each shard's borrowing, by the reason each
reading of a server's load did or did not lead to it. Seconds are the scaled run's
(``*_reference_s``: times the factor). A streamed answer holds its slot a little longer in the
simulator than the same answer sent plain (an event every 256 tokens, each a timer of the one
simulator process): each phase's bound is on its own service times.

Not measured: the Dagster run itself (no assets, no answer judge or yield gate, an empty store, so
lengths are learned in the run only), a resumed run, and GPU servers. The engine's own clocks (its
load polls, stream reading tick, backoff, ``owner_wait_s``) are not scaled: against answers
``--time-factor`` times shorter than a GPU's they weigh that much more than on a real fleet.

    .venv/bin/python bench/bench_tail.py           # ~20 min on 2 quiet cores
    .venv/bin/python bench/bench_tail.py --quick   # a smoke run, ~1-2 min
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import polars as pl
from bench_waste import (  # (bench/ is on sys.path when run as a script)
    ANSWER_MEDIAN,
    CONTEXT,
    CONVERSATION_SOURCE,
    CONVERSATION_TURNS,
    INSTRUCTION_WORDS,
    MODEL,
    PHRASE_SIGMA,
    PROMPT_EXPONENT,
    PROMPT_SIGMA,
    REFERENCE_TOKEN_LATENCY_S,
    REFERENCE_TTFT_S,
    SLOTS,
    SOURCE_SIGMA,
    SOURCES,
    VOCABULARY,
    MixedNight,
    makespan_clairvoyant_units,
)
from harness import RESULTS_DIR, header, process_cpu_s, write_result

from expansion_dag.config import DEFAULT_STREAM_INTERVAL, GenerationConfig, budget_config, engine_config, sampling_settings, turn_planner
from expansion_dag.core import ModeIdentities, ModeMix, load_tokenizer
from expansion_dag.generation import Server, ShardWork, TurnPlanner, WorkItem, generate_shard
from expansion_dag.prompts import budget_prompts, extract_prompts, package_dir, shard_keys
from expansion_dag.servers import (
    SGLANG,
    chat_request,
    parse_chat_completion,
    template_tools,
)
from expansion_dag.sim import FleetProcess, SimServerConfig
from expansion_dag.store import CompletionStore

BUDGET = budget_config(GenerationConfig())
SAMPLING = sampling_settings(GenerationConfig(), max_output_tokens=BUDGET.max_output_tokens)
IDENTITIES = ModeIdentities(ModeMix.single(SAMPLING), f"{MODEL} (simulator)", True)
#: Tokens of one vocabulary word (" w" and its digits) on the bundled tokenizer: sizes a prompt's filler.
WORD_TOKENS = 4.6
#: The plain loop's wait before asking a refused (503) request again, and how often it asks.
RETRY_WAIT_S = 1.0
RETRY_ATTEMPTS = 30
ANSWER = {"role": "assistant", "content": None}
_MESSAGE = pl.Struct({"role": pl.String, "content": pl.String})
_FRAME_SCHEMA = {"prompt_id": pl.String, "source": pl.String, "messages": pl.List(_MESSAGE),
                 "conversation": pl.List(_MESSAGE), "tools": pl.String}  # fmt: skip

# --------------------------------------------------------------------------------------------
# The workload


@dataclasses.dataclass
class Night:
    shards: list[list[WorkItem]]  # each shard's first requests, in dataset order
    planner: TurnPlanner
    #: Each user text's prompt: the simulator's timeline names a request by its last user text.
    prompt_of: dict[str, str]
    shard_of: dict[str, int]
    conversations: set[str]
    summary: dict[str, Any]


def hermes_samples() -> list[dict[str, Any]]:
    """The bundled Hermes sample, as the catalog extracts it (conversations with their tools)."""
    raw = pl.read_json(package_dir("samples") / "hermes_function_calling" / "func_calling.json")
    extracted = extract_prompts(raw, source="hermes_fc", extractor="hermes_function_calling", conversation=True)
    return extracted.prompts.to_dicts()


def mixed_night(n: int, conversation_share: float, servers: int, seed: int) -> Night:
    """``n`` prompts in dataset order, budgeted and sharded as the budget stage does."""
    rng = random.Random(seed)
    names, weights = [s[0] for s in SOURCES], [s[1] for s in SOURCES]
    prompt_medians = {s[0]: s[3] for s in SOURCES}
    hermes = CONVERSATION_SOURCE[0]
    samples = hermes_samples()
    prompt_of: dict[str, str] = {}

    def words(count: int) -> str:  # Zipf-like, as part C's: common words are shared by many prompts
        return " ".join(VOCABULARY[int(len(VOCABULARY) * rng.random() ** 3)] for _ in range(count))

    def distinct(prompt_id: str, make) -> str:
        text = make()
        while text in prompt_of:
            text = make()
        prompt_of[text] = prompt_id
        return text

    rows = []
    for i in range(n):
        prompt_id = f"p{i:06d}"
        if rng.random() < conversation_share:
            base = samples[i % len(samples)]
            *head, question = (dict(m) for m in base["messages"])
            question["content"] = distinct(prompt_id, lambda: f"<{hermes}> {question['content']} {words(6)}")
            tool = json.loads(base["tools"])[0]["function"]["name"]
            conversation = [*head, question, ANSWER]
            for turn in range(2, rng.randint(*CONVERSATION_TURNS) + 1):
                if turn % 2 == 0:
                    result = {"name": tool, "content": {"status": "ok", "note": words(4)}}
                    conversation.append({"role": "tool", "content": json.dumps(result)})
                else:
                    follow_up = distinct(prompt_id, lambda: f"Thanks. Now {words(8)}?")
                    conversation.append({"role": "user", "content": follow_up})
                conversation.append(ANSWER)
            rows.append({"prompt_id": prompt_id, "source": hermes, "messages": [*head, question],
                         "conversation": conversation,
                         "tools": json.dumps(template_tools(json.loads(base["tools"]), SGLANG))})  # fmt: skip
            continue
        source = rng.choices(names, weights)[0]
        target = max(8, min(6000, round(rng.lognormvariate(math.log(prompt_medians[source]), PROMPT_SIGMA))))
        instruction = distinct(prompt_id, lambda: f"<{source}> {words(INSTRUCTION_WORDS)}")
        # The prompt's length in a system message: the phrases that move the answer are the user's.
        filler = round(target / WORD_TOKENS) - INSTRUCTION_WORDS - 1
        system = [{"role": "system", "content": " ".join(rng.choices(VOCABULARY, k=filler))}] if filler > 0 else []
        messages = [*system, {"role": "user", "content": instruction}]
        rows.append({"prompt_id": prompt_id, "source": source, "messages": messages, "conversation": None,
                     "tools": None})  # fmt: skip
    tokenizer = load_tokenizer()
    budget = budget_prompts(pl.DataFrame(rows, schema=_FRAME_SCHEMA), tokenizer, context_length=CONTEXT,
                            num_shards=servers, config=BUDGET)  # fmt: skip
    planner = turn_planner(GenerationConfig(), tokenizer, CONTEXT, IDENTITIES)
    shards = []
    for key in shard_keys(servers):
        work = ShardWork(budget.prompts.filter(pl.col("shard") == key), IDENTITIES, retry_outcomes=(), planner=planner)
        items, _ = work.items(lambda keys: {})  # an empty store: everything to send
        shards.append(items)
    kept = budget.prompts
    conversations = kept["conversation"].drop_nulls().to_list()
    turns = collections.Counter(sum(m["role"] == "assistant" for m in c) for c in conversations)
    return Night(
        shards=shards,
        planner=planner,
        prompt_of=prompt_of,
        shard_of={pid: int(shard.split("-")[1]) for pid, shard in zip(kept["prompt_id"], kept["shard"])},
        conversations=set(kept.filter(pl.col("conversation").is_not_null())["prompt_id"]),
        summary={
            "prompts": kept.height,
            "set_aside": budget.set_aside.height,
            "conversations": int(sum(turns.values())),
            "conversation_turns": dict(sorted(turns.items())),
            "prompt_tokens_mean": round(kept["prompt_tokens"].mean(), 1),
            "prompts_by_source": dict(sorted(kept.group_by("source").len().iter_rows())),
            "prompts_by_shard": [len(s) for s in shards],
        },
    )


# --------------------------------------------------------------------------------------------
# The fleet, with its timelines


def sim_config(args: argparse.Namespace) -> SimServerConfig:
    hermes, hermes_median, _ = CONVERSATION_SOURCE
    markers = (*((f"<{name}>", median) for name, _, median, _ in SOURCES), (f"<{hermes}>", hermes_median))
    return SimServerConfig(
        port=0, context_length=CONTEXT, max_running_requests=SLOTS, max_queued_requests=args.max_queued_requests,
        stream_interval=DEFAULT_STREAM_INTERVAL, reasoning_parser="qwen3", tool_call_parser="qwen25",
        ttft_s=REFERENCE_TTFT_S / args.time_factor, token_latency_s=REFERENCE_TOKEN_LATENCY_S / args.time_factor,
        output_median_tokens=ANSWER_MEDIAN, output_sigma=SOURCE_SIGMA, output_median_by_marker=markers,
        output_prompt_exponent=PROMPT_EXPONENT, output_phrase_sigma=PHRASE_SIGMA,
        looping_prompt_share=args.looping_prompt_share, keep_timeline=True,
    )  # fmt: skip


def slot_starts(requests: list[dict[str, Any]], slots: int) -> dict[int, float]:
    """When each accepted request took a slot, by its index: the timeline has arrivals and ends, and
    the server runs ``slots`` requests at once and queues the rest first come, first served."""
    events = []
    for i, r in enumerate(requests):
        if r["instruction"] is not None:  # refused before it was queued: none
            events += [(r["arrived"], 1, i), (r["ended"], 0, i)]
    start: dict[int, float] = {}
    ended: set[int] = set()
    waiting: collections.deque[int] = collections.deque()
    running = 0
    for t, arrival, i in sorted(events):  # an end before an arrival at the same instant
        if arrival:
            if i in ended:  # answered in the instant it came: it held no slot
                continue
            if running < slots:
                start[i], running = t, running + 1
            else:
                waiting.append(i)
            continue
        ended.add(i)
        if i in start:
            running -= 1
            while waiting and running < slots:
                j = waiting.popleft()
                if j not in ended:  # one that left the queue (its client went away) never ran
                    start[j], running = t, running + 1
    return start


def timeline_figures(stats: list[dict[str, Any]], night: Night, time_factor: float) -> dict[str, Any]:
    """Makespan, the clairvoyant bound on this phase's service times, and refusals, server-side."""
    service: collections.Counter[str] = collections.Counter()
    first_request: dict[int, float] = {}
    done: list[tuple[float, str]] = []  # (end, prompt) of every request that ran
    unit_start: dict[str, float] = {}
    attempts = refused = 0
    statuses: collections.Counter[str] = collections.Counter()
    second_request: list[float] = []
    for server in stats:
        requests = server["timeline"]["requests"]
        starts = slot_starts(requests, server["slots"])
        arrivals = sorted(r["arrived"] for r in requests)
        second_request.append(arrivals[1] - arrivals[0] if len(arrivals) > 1 else math.nan)
        for i, r in enumerate(requests):
            attempts += 1
            statuses[str(r["status"])] += 1
            if r["instruction"] is None:
                refused += r["status"] == 503
                continue
            prompt = night.prompt_of[r["instruction"]]
            shard = night.shard_of[prompt]
            first_request[shard] = min(first_request.get(shard, math.inf), r["arrived"])
            if i in starts:
                service[prompt] += r["ended"] - starts[i]
                unit_start[prompt] = min(unit_start.get(prompt, math.inf), starts[i])
                done.append((r["ended"], prompt))
    origin = min(first_request.values())
    makespan = max(end for end, _ in done) - origin
    starts_s = [first_request.get(s, origin) - origin for s in range(len(stats))]
    units = MixedNight(items=[], following={}, duration=dict(service), units=[[p] for p in service])
    bound = makespan_clairvoyant_units(units, len(stats), starts_s)["makespan_s"]
    late = [p for end, p in done if end - origin > bound]
    conversation_starts = [unit_start[p] - origin for p in night.conversations if p in unit_start]
    return {
        "makespan_s": round(makespan, 2),
        "makespan_reference_s": round(makespan * time_factor, 1),
        "clairvoyant_bound_s": round(bound, 2),
        "clairvoyant_bound_reference_s": round(bound * time_factor, 1),
        "makespan_over_bound": round(makespan / bound, 4),
        "shard_starts_s": [round(s, 3) for s in starts_s],
        "attempts": attempts,
        "refused_503": refused,
        "refused_share": round(refused / attempts, 5) if attempts else 0.0,
        "answers_by_status": dict(statuses),
        "requests_run": len(done),
        # The engine's canary: each server's first request runs alone until its first streamed text.
        "second_request_after_first_s": [round(s, 3) for s in second_request],
        "slot_seconds": round(sum(service.values()), 1),
        "requests_ending_after_bound": len(late),
        "conversation_turns_ending_after_bound": sum(p in night.conversations for p in late),
        # Issue 36's symptom: conversations started last, their later turns running alone at the end.
        "conversation_first_turn_start_median_over_bound": (
            round(statistics.median(conversation_starts) / bound, 3) if conversation_starts else None
        ),
        "loops_asked": sum(s["loops"] for s in stats),
    }


# --------------------------------------------------------------------------------------------
# Phase 1: the engine, a process a shard

#: Set before the shard processes fork: each reads its own shard from it.
_FORKED: dict[str, Any] = {}


def _engine_shard(index: int, urls: list[str], first_start: float, stagger_s: float,
                  store_root: Path) -> dict[str, Any]:  # fmt: skip
    """One shard in its own process, as Dagster runs a partition: its server, the others to borrow."""
    servers = [Server(url, SLOTS, SGLANG, stream_interval=DEFAULT_STREAM_INTERVAL) for url in urls]
    time.sleep(max(0.0, first_start + index * stagger_s - time.monotonic()))
    with CompletionStore(store_root).writer(f"shard-{index:02d}") as writer:
        report = generate_shard(
            _FORKED["shards"][index], [servers[index]], writer=writer, model=MODEL, sampling=SAMPLING,
            config=engine_config(GenerationConfig()), helpers=[s for s in servers if s.url != urls[index]], fleet_urls=urls,
            planner=_FORKED["planner"],
        )  # fmt: skip
    rank = report.length_rank_correlation()
    return {
        "shard": index,
        "ok": report.ok,
        "failed": report.failed,
        "failures_by_kind": dict(report.failures_by_kind),
        "finish_reasons": dict(report.finish_reasons),
        "attempts": report.attempts,
        "backpressure": report.backpressure,
        "client_cpu_s": round(report.client_cpu_s, 2),
        "elapsed_s": round(report.elapsed_s, 2),
        "reorders": report.reorders,
        "length_rank_correlation": None if rank is None else round(rank, 3),
        "borrowed": {url: {"requests": helper.requests, "reasons": dict(helper.borrowing)}
                     for url, helper in report.helpers.items()},  # fmt: skip
    }


def engine_phase(night: Night, urls: list[str], stagger_s: float) -> dict[str, Any]:
    n = len(urls)
    _FORKED.update(shards=night.shards, planner=night.planner)
    fork = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="bench-tail-") as store, concurrent.futures.ProcessPoolExecutor(
        n, mp_context=fork
    ) as pool:
        list(pool.map(time.sleep, [0.1] * n))  # every process up before the first shard starts
        first = time.monotonic() + 0.5
        shards = list(pool.map(_engine_shard, range(n), [urls] * n, [first] * n, [stagger_s] * n, [Path(store)] * n))
    kinds = sum((collections.Counter(s["failures_by_kind"]) for s in shards), collections.Counter())
    return {
        "answered": sum(s["ok"] for s in shards),
        "requests_failed": sum(s["failed"] for s in shards),
        "failures_by_kind": dict(kinds),
        "prompts_failed": sum(s["failed"] for s in shards) - kinds["degenerate"],
        "prompts_failed_queue_full": kinds["queue_full"],
        "loops_stopped": kinds["degenerate"],
        "backpressure_counted": sum(s["backpressure"] for s in shards),
        "client_cpu_s": round(sum(s["client_cpu_s"] for s in shards), 2),
        "shards": shards,
    }


# --------------------------------------------------------------------------------------------
# Phase 2: a plain loop, as SpecForge's regeneration script


async def plain_loop(night: Night, urls: list[str], stagger_s: float) -> dict[str, Any]:
    counts: collections.Counter[str] = collections.Counter()
    first = time.monotonic() + 0.5

    async def ask(client: httpx.AsyncClient, url: str, item: WorkItem):
        request = chat_request(MODEL, item.messages, item.max_tokens, item.sampling or SAMPLING, tools=item.tools)
        for _ in range(RETRY_ATTEMPTS):
            try:
                response = await client.post(f"{url}/v1/chat/completions", json=request.body())
            except httpx.HTTPError:
                counts["failed"] += 1
                return None
            if response.status_code == 503:
                counts["refused_503"] += 1
                await asyncio.sleep(RETRY_WAIT_S)
                continue
            if response.status_code != 200:
                counts["failed"] += 1
                return None
            counts["answered"] += 1
            return parse_chat_completion(response.json(), SGLANG)
        counts["failed"] += 1
        counts["failed_queue_full"] += 1
        return None

    async def server_loop(index: int) -> None:
        await asyncio.sleep(max(0.0, first + index * stagger_s - time.monotonic()))
        share = iter(night.shards[index])  # one share a server, taken in dataset order
        limits = httpx.Limits(max_connections=SLOTS, max_keepalive_connections=SLOTS)
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(1800.0, connect=10.0)) as client:

            async def worker() -> None:
                for item in share:
                    # A conversation's turns in order on this worker, each from the answer before it.
                    while isinstance(item, WorkItem):
                        answer = await ask(client, urls[index], item)
                        if answer is None:
                            break
                        item = night.planner.next_item(item, answer.content, answer.finish_reason, answer.tool_calls)

            await asyncio.gather(*(worker() for _ in range(SLOTS)))

    cpu = time.process_time()
    await asyncio.gather(*(server_loop(i) for i in range(len(urls))))
    return {
        "answered": counts["answered"],
        "prompts_failed": counts["failed"],
        "prompts_failed_queue_full": counts["failed_queue_full"],
        "loops_stopped": 0,
        "client_cpu_s": round(time.process_time() - cpu, 2),
    }


# --------------------------------------------------------------------------------------------


def run_phase(name: str, night: Night, args: argparse.Namespace) -> dict[str, Any]:
    stagger_s = args.stagger_s / args.time_factor
    with FleetProcess([sim_config(args)] * args.servers) as fleet:
        print(f"{name}: running on {len(fleet.urls)} simulated servers ...", flush=True)
        sim_cpu, wall = process_cpu_s(fleet.pid), time.perf_counter()
        if name == "engine":
            client = engine_phase(night, fleet.urls, stagger_s)
        else:
            client = asyncio.run(plain_loop(night, fleet.urls, stagger_s))
        wall, sim_cpu = time.perf_counter() - wall, process_cpu_s(fleet.pid) - sim_cpu
        # A stopped answer's end is recorded when the server sees its client go: a moment later.
        stats = fleet.wait_idle()
    figures = timeline_figures(stats, night, args.time_factor)
    ratio = figures["makespan_over_bound"]
    print(f"{name}: makespan {figures['makespan_s']:.1f} s, {ratio:.3f}x its bound", flush=True)
    return {**figures, **client, "simulator_cpu_s": round(sim_cpu, 2), "wall_s": round(wall, 1)}


ROWS = (
    ("requests run (server-side)", lambda p, e: f"{p['requests_run']:,}"),
    ("makespan, s", lambda p, e: f"{p['makespan_s']:.1f}"),
    ("  at reference speed, s", lambda p, e: f"{p['makespan_reference_s']:,.0f}"),
    ("clairvoyant bound (this phase's service times), s", lambda p, e: f"{p['clairvoyant_bound_s']:.1f}"),
    ("makespan / its bound", lambda p, e: f"{p['makespan_over_bound']:.3f}"),
    ("makespan / the engine's bound", lambda p, e: f"{p['makespan_s'] / e['clairvoyant_bound_s']:.3f}"),
    ("attempts", lambda p, e: f"{p['attempts']:,}"),
    ("503 refusals (queue full)", lambda p, e: f"{p['refused_503']:,}"),
    ("  share of attempts", lambda p, e: f"{100 * p['refused_share']:.2f}%"),
    ("prompts failed (from 503s)", lambda p, e: f"{p['prompts_failed']} ({p['prompts_failed_queue_full']})"),
    ("loops asked / stopped", lambda p, e: f"{p['loops_asked']} / {p['loops_stopped']}"),
    ("requests ending after the bound (conv. turns)",
     lambda p, e: f"{p['requests_ending_after_bound']} ({p['conversation_turns_ending_after_bound']})"),
    ("conv. first turn, median start / bound", lambda p, e: f"{p['conversation_first_turn_start_median_over_bound']}"),
    ("longest wait for a server's 2nd request, s", lambda p, e: f"{max(p['second_request_after_first_s']):.2f}"),
    ("client CPU, s", lambda p, e: f"{p['client_cpu_s']:.1f}"),
    ("simulator CPU, s", lambda p, e: f"{p['simulator_cpu_s']:.1f}"),
)  # fmt: skip


def table(phases: dict[str, dict[str, Any]]) -> str:
    engine = phases["engine"]
    lines = [["SIMULATOR figures", *phases]]
    lines += [[label, *(cell(p, engine) for p in phases.values())] for label, cell in ROWS]
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
           for line in lines]  # fmt: skip
    for shard in engine["shards"]:
        reasons = sum((collections.Counter(b["reasons"]) for b in shard["borrowed"].values()), collections.Counter())
        borrowed = sum(b["requests"] for b in shard["borrowed"].values())
        out.append(f"engine shard {shard['shard']}: {borrowed} requests on other servers; readings: "
                   + ", ".join(f"{k} {v}" for k, v in reasons.most_common()))  # fmt: skip
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: 1,000 prompts, time factor 40 (~1-2 min)")
    p.add_argument("--prompts", type=int, default=20_000)
    p.add_argument("--conversation-share", type=float, default=0.05)
    p.add_argument("--servers", type=int, default=8, help="simulated servers of 72 slots, one shard each")
    p.add_argument("--time-factor", type=float, default=12.0,
                   help="the reference fleet's time (token latency, TTFT, the stagger) divided by this")  # fmt: skip
    p.add_argument("--stagger-s", type=float, default=5.0, help="reference seconds between two shards' starts")
    p.add_argument("--looping-prompt-share", type=float, default=0.03)
    p.add_argument("--max-queued-requests", type=int, default=40)
    p.add_argument("--seed", type=int, default=0, help="the workload's seed")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for the JSON result")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.time_factor = 1_000, 40.0
    # The shard processes are forked after the budget has tokenized: parallel tokenizers would
    # warn in each, then run single-threaded anyway.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.perf_counter()
    document = header("tail", "httpx", "tokenizers", simulator=True, argv=argv)
    print(f"building {args.prompts:,} prompts ...", flush=True)
    night = mixed_night(args.prompts, args.conversation_share, args.servers, args.seed)
    print(f"workload: {night.summary}", flush=True)
    phases = {name: run_phase(name, night, args) for name in ("engine", "plain loop")}
    engine_bound = phases["engine"]["clairvoyant_bound_s"]
    phases["plain loop"]["makespan_over_engine_bound"] = round(phases["plain loop"]["makespan_s"] / engine_bound, 4)
    print()
    print(table(phases))
    document.update(
        args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        simulator_config={k: v for k, v in dataclasses.asdict(sim_config(args)).items() if k != "api_key"},
        workload=night.summary,
        phases=phases,
        total_wall_s=round(time.perf_counter() - started, 1),
    )
    path = write_result("tail", document, out_dir=args.out)
    print(f"\ntotal {document['total_wall_s']:.0f} s; written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
