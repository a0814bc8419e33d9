"""Waste and tail benchmark (issue 14): early stopping of loops, streaming's client CPU, learned order.

Every figure is a SIMULATOR figure (``expansion_dag.sim``), never a GPU one. The reference fleet is
8 servers x 72 slots at about 3.4 requests/s fleet-wide with answers of ~2,710 tokens on average:
at 0.8 utilization that is ~135 s a request, ~0.05 s an output token per slot. Time is scaled
down by ``--time-factor`` (token latency and TTFT divided by it).

Part A (real HTTP, one process): the engine (``ShardRun``, as the Dagster asset builds it) against
simulated SGLang servers in a process of their own (``FleetProcess``), so the CPU measured here is
the client's alone. 3% of prompts loop until the cap each time they are asked (``--looping-prompt-share``),
and the servers' queues are bounded (``--max-queued-requests``: a 503 beyond it, backpressure). Phases on the same prompts:
``stream+stop`` (streaming at ``--stream-interval`` tokens an event, loops stopped by the
detector), ``stream+stop, every token`` (the servers'
default interval of 1, for the CPU it costs) and ``plain`` (no streaming, every answer runs to
its end). The answers that are not loops are lognormal (median ``ANSWER_MEDIAN``, sigma
``ANSWER_SIGMA``): 0.4% of them are longer than the cap and cut there, in every phase, which no
stopping rule can save; ``--natural-max-tokens`` under the cap ends them first, so that loops are
the only answers cut. Reported: slot-seconds on answers the training set drops (by reason),
the useful token share, client CPU per request, and what that CPU means at the reference rate.
The fleet here is ``--servers`` x 72 slots, fewer than 8, so that the simulator and the client
fit on a small machine; the rate per slot is the reference one times the time factor.

Part B (policy model, no HTTP): the makespan on the reference fleet (8 x 72, unscaled time) of a
workload whose answer lengths depend on the source, the prompt length and the instruction's words,
drawn by the simulator's own output model (``OutputModel`` with per-source medians, a prompt
exponent and word effects), 3% of its prompts looping (costing what a stopped loop streams).
The engine's dispatch (one queue per shard, idle servers taking from the longest queue, the
canary ignored) is modelled with zero client overhead and its own ordering code
(its ``PromptQueue``: ``AnswerLengths`` and the re-order schedule), with no typed priors:

- ``learned (earlier night)``: estimates from an earlier night's answers (other prompts, same
  sources), refined as answers return;
- ``learned (in run only)``: an empty store, estimates from the run's own answers;
- ``words ignored``: as the first, with no prompt text for the estimate to read;
- ``no learning``: no priors, no learning (prompt id order);
- ``plain loop``: 72 workers per server with fixed round-robin shares in dataset order;
- ``clairvoyant longest-first``: the true lengths, longest first, on one fleet-wide queue.

Each policy reports its makespan over the clairvoyant one and the rank correlation (Spearman's) of
the length it expected when it took each prompt against the actual length.

Part C (policy model, as part B; issue 36): a mixed night, ``--conversation-share`` of the prompts
tool conversations of 2 to 6 turns (each turn a short answer, its prompt growing, the next turn
asked when its answer returns; a loop ends its conversation), shards starting ``--stagger-s`` apart
(no server borrowed before its shard starts). Answer lengths follow the source, the prompt's length
and the instruction's *phrases* (``OutputModel(phrase_sigma=...)``: pairs of adjacent words), a rule
the client's single-word features cannot read off: the simulator does not mirror the learner. The
engine orders conversations by their remaining chain (``PromptQueue.remaining``); beside it, the
order before (each turn by its own answer), a plain loop (as SpecForge's script: 72 workers a
server taking the next prompt in dataset order, a conversation's turns in order; loops to the cap,
and stopped) and the clairvoyant bound (longest first on the true service times, a conversation
its whole chain on one slot, each slot from its shard's start).

    .venv/bin/python bench/bench_waste.py           # ~5 min on 2 shared cores
    .venv/bin/python bench/bench_waste.py --quick   # a smoke run, ~1 min
    .venv/bin/python bench/bench_waste.py --skip-a --skip-b   # part C alone, ~20 s
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import copy
import dataclasses
import heapq
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import header, write_result  # (bench/ is on sys.path when run as a script)

from expansion_dag.config import DEFAULT_STREAM_INTERVAL, GenerationConfig, engine_config, sampling_settings
from expansion_dag.core import DEFAULT_TOKENIZER
from expansion_dag.generation import (
    AnswerLengths,
    PromptQueue,
    Server,
    ShardRun,
    Turn,
    WorkItem,
    spearman,
)
from expansion_dag.servers import find_loop
from expansion_dag.sim import DEFAULT_REASONING_SHARE, FleetProcess, OutputModel, SimServerConfig
from expansion_dag.store import CompletionStore

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


def simulated_fleet(args: argparse.Namespace, stream_interval: int) -> FleetProcess:
    server = SimServerConfig(
        port=0, max_running_requests=SLOTS, context_length=CONTEXT, stream_interval=stream_interval,
        ttft_s=REFERENCE_TTFT_S / args.time_factor, token_latency_s=REFERENCE_TOKEN_LATENCY_S / args.time_factor,
        output_median_tokens=ANSWER_MEDIAN, output_sigma=ANSWER_SIGMA, reasoning_parser="qwen3",
        looping_prompt_share=args.looping_prompt_share, max_queued_requests=args.max_queued_requests,
        output_max_tokens=args.natural_max_tokens,
    )  # fmt: skip
    return FleetProcess([server] * args.servers)


def part_a_items(n: int, servers: int) -> list[list[WorkItem]]:
    sampling = sampling_settings(GenerationConfig(), max_output_tokens=CONTEXT)
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
    shards: list[list[WorkItem]], urls: list[str], store_root: Path, stop: bool, stream_interval: int
) -> dict[str, Any]:
    config = engine_config(GenerationConfig(), stop_degenerate=stop, canary=False)
    store = CompletionStore(store_root)
    sampling = sampling_settings(GenerationConfig(), max_output_tokens=CONTEXT)

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
    thresholds = engine_config(GenerationConfig()).loop
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
        # Backpressure: the servers' full queues answered 503; none may cost a prompt.
        "queue_full_answers": sum(r.backpressure for r in reports),
        "attempts": sum(r.attempts for r in reports),
        "prompts_failed_queue_full": sum(r.failures_by_kind["queue_full"] for r in reports),
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
    """The phases on the same prompts, each against simulators launched with its stream interval."""
    shards = part_a_items(args.requests, args.servers)
    phases = [
        ("stream+stop", True, args.stream_interval),
        ("plain", False, 1),
    ]
    if args.stream_interval > 1:
        phases.insert(1, ("stream+stop, every token", True, 1))
    results = {}
    for name, stop, interval in phases:
        with simulated_fleet(args, interval) as fleet, tempfile.TemporaryDirectory(prefix="bench-waste-") as scratch:
            results[name] = asyncio.run(run_phase(shards, fleet.urls, Path(scratch), stop, interval))
            results[name]["stream_interval"] = interval if stop else None
    stream, plain = results["stream+stop"], results["plain"]

    def fall(key: str) -> float | None:  # None: nothing was dropped without stopping (a run too small)
        return round(1 - stream[key] / plain[key], 4) if plain[key] else None

    cpu_ratio = stream["client_cpu_ms_per_request"] / plain["client_cpu_ms_per_request"]
    # One core's worth at the reference rate: unscaled, a request costs the same client CPU.
    reference_core_share = REFERENCE_RATE * stream["client_cpu_ms_per_request"] / 1000
    return {
        "phases": results,
        "dropped_slot_seconds_fall": fall("dropped_slot_seconds_total"),
        "dropped_slot_seconds_fall_loops_only": fall("dropped_slot_seconds_loops"),
        "cpu_ratio_stream_over_plain": round(cpu_ratio, 3),
        "reference_rate_core_share_streaming": round(reference_core_share, 4),
    }


# --------------------------------------------------------------------------------------------
# Part B: the learned order, a policy model on the reference fleet


#: Part B's instructions: words of a vocabulary, a tenth of which move answer lengths (the
#: simulator's ``output_word_sigma``); 3% of prompts loop each time they are asked, stopped by the
#: detector after about ``LOOP_STOP_TOKENS`` (seen after ~250 tokens, one 256-token event more).
VOCABULARY = [f"w{i}" for i in range(3000)]
INSTRUCTION_WORDS = 14
WORD_SIGMA = 0.6
LOOPING_SHARE = 0.03
LOOP_STOP_TOKENS = 512


def part_b_workload(n: int, seed: int, output_model: OutputModel) -> tuple[list[WorkItem], dict[str, float]]:
    """``n`` prompts in dataset order, no typed priors; their true durations (for the model only).

    An answer's length follows its source, its prompt's length and its instruction's words; a
    looping prompt costs what its stopped loop streamed."""
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
        # Zipf-like: common words are shared by many prompts, so what one teaches applies to others.
        words = " ".join(VOCABULARY[int(len(VOCABULARY) * rng.random() ** 3)] for _ in range(INSTRUCTION_WORDS))
        text = f"<{source}> {words}"
        if output_model.loops(text, LOOPING_SHARE):
            tokens = LOOP_STOP_TOKENS
        else:
            tokens = output_model.generate(text, request_seed=None, cap=max_tokens, thinking=False, split_reasoning=False,
                                           prompt_tokens=prompt_tokens, instruction=text).completion_tokens
        item = WorkItem(key=prompt_id, prompt_id=prompt_id, source=source, messages=({"role": "user", "content": text},),
                        prompt_tokens=prompt_tokens, max_tokens=max_tokens, expected_output_tokens=0)  # no typed priors
        items.append(item)
        duration[prompt_id] = REFERENCE_TTFT_S + tokens * REFERENCE_TOKEN_LATENCY_S
    return items, duration


def without_words(items: list[WorkItem]) -> list[WorkItem]:
    """The same prompts with no text for the estimate to read: source and prompt length only."""
    return [dataclasses.replace(item, messages=()) for item in items]


def makespan_engine(items: list[WorkItem], duration: dict[str, float], servers: int, learned: AnswerLengths | None,
                    learn: bool, *, following: dict[str, WorkItem] | None = None, starts: list[float] | None = None,
                    queue: type[PromptQueue] = PromptQueue) -> dict[str, float]:
    """The engine's dispatch: shards dealt round-robin (the budget balances equal priors by count),
    one ``PromptQueue`` per shard (the engine's own, re-ordered as answers return), a slot whose
    shard has nothing queued taking from the longest queue of a started shard (spill).

    ``following``: a conversation turn's next turn, queued first in line when its answer returns
    (as ``Sender`` does); ``starts``: when each shard (and its server) starts, none borrowed before."""
    following = following or {}
    starts = starts or [0.0] * servers
    queues = [queue(items[s::servers], _copy(learned)) for s in range(servers)]
    # (what the order rested on when each prompt was taken, its actual tokens): the rank correlation
    expected: list[tuple[int, int]] = []
    events: list[tuple[float, int, int, str | None]] = [(starts[s], s, j, None) for s in range(servers) for j in range(SLOTS)]
    heapq.heapify(events)
    by_key = {it.prompt_id: it for it in [*items, *following.values()]}
    #: Slots with nothing to take while a conversation's turn may still bring the next.
    parked: list[tuple[int, int]] = []
    makespan = drained_at = 0.0
    while events:
        t, server, slot, finished = heapq.heappop(events)
        if finished is not None:
            makespan = max(makespan, t)
            owner, prompt_id = finished.split("|")
            if learn:  # the shard that sent it learns from it, as ShardRun does
                queues[int(owner)].learn(by_key[prompt_id], _tokens(duration[prompt_id]))
            queues[int(owner)].settled(by_key[prompt_id], following.get(prompt_id))
            if prompt_id in following:
                events.extend((t, *woken, None) for woken in parked)
                heapq.heapify(events)
                parked.clear()
        started = [k for k in range(servers) if starts[k] <= t]
        source = server if len(queues[server]) else max(started, key=lambda k: len(queues[k]))
        if not len(queues[source]):
            if not all(queues[k].finished for k in range(servers)):
                parked.append((server, slot))
                continue
            drained_at = drained_at or t
            continue
        item = queues[source].take()
        queues[source].opened(item)
        expected.append((queues[source].ordered_on(item), _tokens(duration[item.prompt_id])))
        heapq.heappush(events, (t + duration[item.prompt_id], server, slot, f"{source}|{item.prompt_id}"))
    rank = spearman([e for e, _ in expected], [a for _, a in expected])
    return {"makespan_s": makespan, "queue_empty_at_s": drained_at, "rank_correlation": rank}


def _tokens(duration_s: float) -> int:
    return round((duration_s - REFERENCE_TTFT_S) / REFERENCE_TOKEN_LATENCY_S)


def _copy(lengths: AnswerLengths | None) -> AnswerLengths:
    return copy.deepcopy(lengths) if lengths is not None else AnswerLengths()


def makespan_plain(items: list[WorkItem], duration: dict[str, float], servers: int) -> dict[str, Any]:
    sums = [0.0] * (servers * SLOTS)
    for i, item in enumerate(items):
        sums[(i % servers) * SLOTS + (i // servers) % SLOTS] += duration[item.prompt_id]
    return {"makespan_s": max(sums), "queue_empty_at_s": 0.0, "rank_correlation": None}


def makespan_clairvoyant(items: list[WorkItem], duration: dict[str, float], servers: int) -> dict[str, float]:
    free = [0.0] * (servers * SLOTS)
    end = last_start = 0.0
    for item in sorted(items, key=lambda it: -duration[it.prompt_id]):
        start = heapq.heappop(free)
        last_start = start
        end = max(end, start + duration[item.prompt_id])
        heapq.heappush(free, start + duration[item.prompt_id])
    return {"makespan_s": end, "queue_empty_at_s": last_start, "rank_correlation": 1.0}


def part_b(n: int) -> dict[str, Any]:
    output_model = OutputModel(
        tokenizer_spec=DEFAULT_TOKENIZER, max_length=CONTEXT, median_tokens=ANSWER_MEDIAN, sigma=SOURCE_SIGMA,
        reasoning_share=DEFAULT_REASONING_SHARE, seed=0,
        median_by_marker=tuple((f"<{name}>", median) for name, _, median, _ in SOURCES), prompt_exponent=PROMPT_EXPONENT,
        word_sigma=WORD_SIGMA,
    )
    items, duration = part_b_workload(n, seed=2, output_model=output_model)
    night, night_duration = part_b_workload(n, seed=1, output_model=output_model)
    # An earlier night's answers, as the store gives them to a shard run (the loops' are failure
    # records: no completion tokens to learn from). One queue learns them, as a run's start does.
    earlier = PromptQueue(night).lengths
    learner = PromptQueue(night, earlier)
    for item in night:
        if _tokens(night_duration[item.prompt_id]) != LOOP_STOP_TOKENS:
            learner.learn(item, _tokens(night_duration[item.prompt_id]))
    earlier_sources = PromptQueue(without_words(night)).lengths
    for item in without_words(night):
        if _tokens(night_duration[item.prompt_id]) != LOOP_STOP_TOKENS:
            earlier_sources.observe(item.source, item.prompt_tokens, _tokens(night_duration[item.prompt_id]))
    servers = REFERENCE_SERVERS
    bound = makespan_clairvoyant(items, duration, servers)
    policies = {
        "engine: learned (earlier night)": makespan_engine(items, duration, servers, earlier, learn=True),
        "engine: learned (in run only)": makespan_engine(items, duration, servers, None, learn=True),
        "engine, words ignored (earlier night)": makespan_engine(
            without_words(items), duration, servers, earlier_sources, learn=True
        ),
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
                # Expected lengths (when each prompt was taken) against actual ones; none for
                # the plain loop (no expectation), 1 for the clairvoyant (the lengths themselves).
                "rank_correlation": None if r.get("rank_correlation") is None else round(r["rank_correlation"], 4),
            }
            for name, r in policies.items()
        },
    }


# --------------------------------------------------------------------------------------------
# Part C: the tail of a mixed night (issue 36): conversations among single prompts

#: Tool conversations: 2 to 6 assistant turns, each a short answer; a turn's prompt is the
#: conversation so far (tool definitions first), so it grows turn by turn.
CONVERSATION_SOURCE = ("hermes", 700, 900)  # name, answer median a turn, turn 1's prompt tokens
CONVERSATION_TURNS = (2, 6)
TURN_PROMPT_GROWTH = 400
#: Lengths follow phrases (pairs of adjacent words, anywhere in the text), not single words: the
#: rule of the simulator's ``output_phrase_sigma``, which the client's word features cannot read.
PHRASE_SIGMA = 0.6


class TurnByTurn(PromptQueue):
    """The order before issue 36: a conversation's turn by its own expected answer alone."""

    def remaining(self, item: WorkItem) -> int:
        return self.expected(item)


@dataclasses.dataclass
class MixedNight:
    items: list[WorkItem]  # single prompts and conversations' first turns, in dataset order
    following: dict[str, WorkItem]  # a turn's next turn, by the turn's id
    duration: dict[str, float]  # every request's service time, by its id
    units: list[list[str]]  # the requests of each prompt, a conversation's turns in order


def part_c_workload(n: int, seed: int, output_model: OutputModel, conversation_share: float) -> MixedNight:
    """``n`` prompts, ``conversation_share`` of them conversations; a looping prompt costs what
    its stopped loop streamed, and a conversation ends at a turn that loops (its answer is no context)."""
    rng = random.Random(seed)
    names = [s[0] for s in SOURCES]
    weights = [s[1] for s in SOURCES]
    prompt_medians = {s[0]: s[3] for s in SOURCES}
    hermes, _, first_prompt = CONVERSATION_SOURCE
    night = MixedNight([], {}, {}, [])

    def words() -> str:
        return " ".join(VOCABULARY[int(len(VOCABULARY) * rng.random() ** 3)] for _ in range(INSTRUCTION_WORDS))

    def cost(text: str, prompt_tokens: int) -> tuple[float, bool]:
        max_tokens = CONTEXT - prompt_tokens - 16
        if output_model.loops(text, LOOPING_SHARE):
            return REFERENCE_TTFT_S + LOOP_STOP_TOKENS * REFERENCE_TOKEN_LATENCY_S, True
        tokens = output_model.generate(text, request_seed=None, cap=max_tokens, thinking=False, split_reasoning=False,
                                       prompt_tokens=prompt_tokens, instruction=text).completion_tokens
        return REFERENCE_TTFT_S + tokens * REFERENCE_TOKEN_LATENCY_S, False

    for i in range(n):
        prompt_id = f"s{seed}-{i:06d}"
        if rng.random() < conversation_share:
            turns = rng.randint(*CONVERSATION_TURNS)
            topic = words()
            unit, previous = [], None
            for k in range(1, turns + 1):
                turn_id = f"{prompt_id}.t{k}"
                prompt_tokens = first_prompt + (k - 1) * TURN_PROMPT_GROWTH
                text = f"<{hermes}> {topic} step {k}"
                item = WorkItem(key=turn_id, prompt_id=turn_id, source=hermes,
                                messages=({"role": "user", "content": text},), prompt_tokens=prompt_tokens,
                                max_tokens=CONTEXT - prompt_tokens - 16, expected_output_tokens=0,
                                turn=Turn(prompt_id, k, turns, ()))  # fmt: skip
                if previous is None:
                    night.items.append(item)
                else:
                    night.following[previous] = item
                night.duration[turn_id], looped = cost(text, prompt_tokens)
                unit.append(turn_id)
                previous = turn_id
                if looped:
                    break
            night.units.append(unit)
            continue
        source = rng.choices(names, weights)[0]
        prompt_tokens = max(8, min(6000, round(rng.lognormvariate(math.log(prompt_medians[source]), PROMPT_SIGMA))))
        text = f"<{source}> {words()}"
        night.items.append(WorkItem(key=prompt_id, prompt_id=prompt_id, source=source,
                                    messages=({"role": "user", "content": text},), prompt_tokens=prompt_tokens,
                                    max_tokens=CONTEXT - prompt_tokens - 16, expected_output_tokens=0))  # fmt: skip
        night.duration[prompt_id], _ = cost(text, prompt_tokens)
        night.units.append([prompt_id])
    return night


def makespan_plain_units(night: MixedNight, servers: int, starts: list[float]) -> dict[str, Any]:
    """A plain loop, as SpecForge's generation script: prompts dealt to the servers round-robin, each
    server's 72 workers taking its next prompt in dataset order and asking a conversation's turns in
    order; no stopping (each loop runs to the cap: ``cap_s``)."""
    end = 0.0
    for s in range(servers):
        free = [starts[s]] * SLOTS
        for unit in night.units[s::servers]:
            start = heapq.heappop(free)
            finish = start + sum(night.duration[r] for r in unit)
            heapq.heappush(free, finish)
            end = max(end, finish)
    return {"makespan_s": end, "queue_empty_at_s": 0.0, "rank_correlation": None}


def makespan_clairvoyant_units(night: MixedNight, servers: int, starts: list[float]) -> dict[str, float]:
    """Longest first on one fleet-wide queue, the true service times known, a conversation's turns
    back to back on one slot (its chain, which no schedule shortens); each slot from its shard's start."""
    free = [start for start in starts for _ in range(SLOTS)]
    heapq.heapify(free)
    end = last_start = 0.0
    for unit_s in sorted((sum(night.duration[r] for r in unit) for unit in night.units), reverse=True):
        start = heapq.heappop(free)
        last_start = start
        end = max(end, start + unit_s)
        heapq.heappush(free, start + unit_s)
    return {"makespan_s": end, "queue_empty_at_s": last_start, "rank_correlation": 1.0}


def part_c(n: int, conversation_share: float, stagger_s: float) -> dict[str, Any]:
    output_model = OutputModel(
        tokenizer_spec=DEFAULT_TOKENIZER, max_length=CONTEXT, median_tokens=ANSWER_MEDIAN, sigma=SOURCE_SIGMA,
        reasoning_share=DEFAULT_REASONING_SHARE, seed=0,
        median_by_marker=(*((f"<{name}>", median) for name, _, median, _ in SOURCES),
                          (f"<{CONVERSATION_SOURCE[0]}>", CONVERSATION_SOURCE[1])),
        prompt_exponent=PROMPT_EXPONENT, phrase_sigma=PHRASE_SIGMA,
    )  # fmt: skip
    night = part_c_workload(n, 2, output_model, conversation_share)
    earlier = part_c_workload(n, 1, output_model, conversation_share)
    # An earlier night's answers, as the store gives them (loops are failures: nothing to learn).
    learner = PromptQueue([*earlier.items, *earlier.following.values()])
    for item in [*earlier.items, *earlier.following.values()]:
        if _tokens(earlier.duration[item.prompt_id]) != LOOP_STOP_TOKENS:
            learner.learn(item, _tokens(earlier.duration[item.prompt_id]))
    servers = REFERENCE_SERVERS
    starts = [s * stagger_s for s in range(servers)]
    bound = makespan_clairvoyant_units(night, servers, starts)
    chains = dict(following=night.following, starts=starts)
    policies = {
        "engine: remaining chain first (earlier night)": makespan_engine(night.items, night.duration, servers,
                                                                          learner.lengths, learn=True, **chains),
        "engine: remaining chain first (in run only)": makespan_engine(night.items, night.duration, servers, None,
                                                                        learn=True, **chains),
        "engine: each turn by its own answer (earlier night)": makespan_engine(
            night.items, night.duration, servers, learner.lengths, learn=True, queue=TurnByTurn, **chains),
        "plain loop (conversations whole, loops to the cap)": makespan_plain_units(
            _loops_to_the_cap(night), servers, starts),
        "plain loop, loops stopped": makespan_plain_units(night, servers, starts),
        "clairvoyant longest-first": bound,
    }  # fmt: skip
    conversations = [u for u in night.units if "." in u[0]]
    return {
        "prompts": len(night.units),
        "conversations": len(conversations),
        "requests": sum(map(len, night.units)),
        "stagger_s": stagger_s,
        "policies": {
            name: {
                "makespan_s": round(r["makespan_s"], 1),
                "vs_clairvoyant": round(r["makespan_s"] / bound["makespan_s"], 4),
                "rank_correlation": None if r.get("rank_correlation") is None else round(r["rank_correlation"], 4),
            }
            for name, r in policies.items()
        },
    }


def _loops_to_the_cap(night: MixedNight) -> MixedNight:
    """The same night with every loop running to its cap, as a client that does not stop them sees it."""
    looped = {r for r, d in night.duration.items() if _tokens(d) == LOOP_STOP_TOKENS}
    # A loop runs until the context is full: its max_tokens, from its prompt.
    caps = {it.prompt_id: it.max_tokens for it in [*night.items, *night.following.values()]}
    duration = {r: REFERENCE_TTFT_S + caps[r] * REFERENCE_TOKEN_LATENCY_S if r in looped else d
                for r, d in night.duration.items()}  # fmt: skip
    return dataclasses.replace(night, duration=duration)


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run")
    p.add_argument("--servers", type=int, default=1, help="part A: simulated servers of 72 slots")
    p.add_argument("--requests", type=int, default=432, help="part A: requests per phase")
    p.add_argument("--time-factor", type=float, default=8.0, help="part A: simulated time runs this much faster")
    p.add_argument("--looping-prompt-share", type=float, default=0.03,
                   help="part A: share of prompts that loop every time they are asked")
    p.add_argument("--max-queued-requests", type=int, default=40, help="part A: the servers' bounded queue")
    p.add_argument("--natural-max-tokens", type=int, default=None,
                   help="part A: the longest answer that is not a loop (the simulator's --output-max-tokens); "
                        f"under the cap ({CONTEXT - 64}), only loops are cut: the workload of loops alone")  # fmt: skip
    p.add_argument("--model-requests", type=int, nargs="+", default=[19_543, 4_000],
                   help="part B: requests on 8 x 72 slots, one run per value (fewer: a bigger tail)")
    p.add_argument("--stream-interval", type=int, default=DEFAULT_STREAM_INTERVAL,
                   help="part A: tokens per streamed event (a phase at 1 runs beside it)")
    p.add_argument("--skip-a", action="store_true")
    p.add_argument("--skip-b", action="store_true")
    p.add_argument("--mixed-prompts", type=int, default=20_000,
                   help="part C: prompts on 8 x 72 slots, --conversation-share of them conversations")
    p.add_argument("--conversation-share", type=float, default=0.05, help="part C: share of prompts that are conversations")
    p.add_argument("--stagger-s", type=float, default=5.0, help="part C: seconds between two shards' starts")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.time_factor, args.model_requests, args.mixed_prompts = 144, 20.0, [3000], 3000
    result = header("waste", simulator=True, argv=argv)
    result["args"] = vars(args)
    if not args.skip_a:
        started = time.perf_counter()
        result["part_a"] = part_a(args)
        result["part_a"]["wall_s"] = round(time.perf_counter() - started, 1)
    if not args.skip_b:
        started = time.perf_counter()
        result["part_b"] = [part_b(n) for n in args.model_requests]
        result["part_b_wall_s"] = round(time.perf_counter() - started, 1)
    started = time.perf_counter()
    result["part_c"] = part_c(args.mixed_prompts, args.conversation_share, args.stagger_s)
    result["part_c_wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result, indent=2))
    print(f"written to {write_result('waste', result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
