"""The plan: what a run will send, cost and yield, known before any GPU time.

From the budgeted prompts still to send (after dedup, quotas and budgets, each with its own
``max_tokens``) and the answer lengths the store already holds for the run's identity, per source:
prompts, prompt tokens, expected output tokens and their spread, and the expected share cut at the
cap; then the store's and the training set's growth on disk, and GPU-hours and wall time at a
throughput per server (read from live servers' ``/v1/loads`` ``gen_throughput``, or a setting).
Every figure says what it rests on: the store's answers of a source, or the configured estimate
(``expected_output_by_source``, spread assumed lognormal, ``PRIOR_SIGMA``) where the store has
too few. What cannot be planned (no prompts, no servers, a throughput of 0) is said, and the rest
is still planned; with no throughput at all, the plan says how the run will measure it
(``expansion_dag.generation.speed``). Prefill time is not counted: decode dominates the GPU time of
long answers.

An answer that ended by itself tells its length; one cut at its cap tells only that it was at
least that long, which still says whether a prompt budgeted no higher would be cut too.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from expansion_dag.core import OK
from expansion_dag.generation.answer_lengths import PRIOR_SIGMA
from expansion_dag.generation.speed import MIN_ANSWERS, PLAN_MARGIN

#: Answers of a source the store must hold before its figures come from them.
MIN_OBSERVED = 20
_PRIOR_POINTS = 400
#: Bytes on disk per token, where nothing measured says better: a store record is JSON text (the
#: prompt's messages and the answer, about 4 characters a token, and its fields); a training row is
#: int32 ids and uint8 mask, zstd-compressed (BENCHMARKS.md, "The plan against the run").
STORE_BYTES_PER_TOKEN = 5.0
STORE_BYTES_PER_RECORD = 700
TRAINING_BYTES_PER_TOKEN = 2.0
#: What the plan says of the time when it has no throughput: how the run will know it.
MEASURED_IN_THE_RUN = (
    "no throughput yet: measured in the run's first minute from the tokens each server streams with its "
    f"slots full (its first {MIN_ANSWERS} answers' decode rate, times the streams decoding), then the time to "
    "finish and the GPU-hours are printed and kept up to date"
)


class Observed:
    """Answer lengths per source as the store holds them, for one identity's records."""

    def __init__(self, owns: Callable[[Mapping[str, Any]], bool]):
        self._owns = owns
        self.natural: dict[str, list[int]] = defaultdict(list)  # answers that ended by themselves
        self.cut: dict[str, list[int]] = defaultdict(list)  # answers cut at their cap: at least this long

    def reading(self, records: Iterable[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
        """The records passed through, each complete answer of the identity noted."""
        for record in records:
            # A loop stopped early counts at the tokens it streamed: what its slot spent on it.
            tokens = record.get("completion_tokens") if record.get("status") == OK else record.get("streamed_tokens")
            if isinstance(tokens, int) and self._owns(record):
                (self.cut if record.get("finish_reason") == "length" else self.natural)[str(record["source"])].append(tokens)
            yield record

    def answers(self, source: str) -> int:
        return len(self.natural.get(source, ())) + len(self.cut.get(source, ()))


@dataclass(frozen=True)
class _Lengths:
    """A source's answer lengths: a sample of whole lengths and of lower bounds (cut answers)."""

    natural: np.ndarray
    cut: np.ndarray
    basis: str

    def expect(self, caps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per cap: expected output tokens and the chance the answer is cut there."""
        natural, cut = np.sort(self.natural), np.sort(self.cut)
        prefix = np.concatenate([[0.0], np.cumsum(natural)])
        below = np.searchsorted(natural, caps, side="left")
        reaching = natural.size - below  # whole answers of the cap's length or more: cut there
        # A cut answer says something about a cap no higher than where it was cut, not above.
        cut_usable = cut.size - np.searchsorted(cut, caps, side="left")
        usable = np.maximum(natural.size + cut_usable, 1)
        tokens = (prefix[below] + caps * (reaching + cut_usable)) / usable
        return tokens, (reaching + cut_usable) / usable

    def spread(self) -> tuple[int, int, int]:
        """p10, p50, p90 of the answers' lengths (the cut ones at their cut)."""
        values = np.concatenate([self.natural, self.cut])
        return tuple(int(round(float(np.percentile(values, q)))) for q in (10, 50, 90))  # type: ignore[return-value]


def _prior(mean_tokens: int) -> _Lengths:
    mu = math.log(mean_tokens) - PRIOR_SIGMA**2 / 2  # the configured figure is the mean
    normal = statistics.NormalDist()
    sample = [math.exp(mu + PRIOR_SIGMA * normal.inv_cdf((i + 0.5) / _PRIOR_POINTS)) for i in range(_PRIOR_POINTS)]
    return _Lengths(np.array(sample), np.array([]), f"configured: {mean_tokens:,} tokens, spread assumed")


def source_lengths(observed: Observed, source: str, prior_tokens: int) -> _Lengths:
    if observed.answers(source) >= MIN_OBSERVED:
        return _Lengths(
            np.array(observed.natural.get(source, []), dtype=float), np.array(observed.cut.get(source, []), dtype=float),
            f"learned from {observed.answers(source):,} answers in the store",
        )
    return _prior(prior_tokens)


def expected_per_prompt(
    prompts: pl.DataFrame, observed: Observed, priors: Callable[[str], int]
) -> tuple[np.ndarray, np.ndarray]:
    """Each prompt's expected output tokens and chance of being cut at its ``max_tokens``."""
    tokens = np.zeros(prompts.height)
    cut = np.zeros(prompts.height)
    sources = prompts["source"].to_numpy()
    caps = prompts["max_tokens"].to_numpy().astype(float)
    for source in np.unique(sources):
        where = sources == source
        tokens[where], cut[where] = source_lengths(observed, str(source), priors(str(source))).expect(caps[where])
    return tokens, cut


@dataclass(frozen=True)
class SourcePlan:
    source: str
    prompts: int
    prompt_tokens: int
    output_tokens: int
    truncated_share: float
    spread: tuple[int, int, int]  # p10, p50, p90 of an answer's length
    basis: str


@dataclass(frozen=True)
class Throughput:
    """Output tokens a second per server, and where the figure comes from."""

    tokens_per_s: float | None
    basis: str


@dataclass(frozen=True)
class Plan:
    sources: list[SourcePlan]
    servers: int
    throughput: Throughput
    simulated: bool
    #: Prompts of the budget already answered under this identity: not sent again.
    done: int
    drop_truncated: bool
    problems: list[str]

    @property
    def prompts(self) -> int:
        return sum(s.prompts for s in self.sources)

    @property
    def prompt_tokens(self) -> int:
        return sum(s.prompt_tokens for s in self.sources)

    @property
    def output_tokens(self) -> int:
        return sum(s.output_tokens for s in self.sources)

    @property
    def truncated_share(self) -> float:
        cut = sum(s.truncated_share * s.prompts for s in self.sources)
        return cut / self.prompts if self.prompts else 0.0

    @property
    def rows(self) -> int:
        """Answers expected to become training rows (cut ones left out when ``drop_truncated``)."""
        return round(self.prompts * (1 - self.truncated_share)) if self.drop_truncated else self.prompts

    @property
    def store_bytes(self) -> int:
        return round((self.prompt_tokens + self.output_tokens) * STORE_BYTES_PER_TOKEN + self.prompts * STORE_BYTES_PER_RECORD)

    @property
    def training_set_bytes(self) -> int:
        kept = self.rows / self.prompts if self.prompts else 0.0
        return round((self.prompt_tokens + self.output_tokens) * kept * TRAINING_BYTES_PER_TOKEN)

    @property
    def gpu_hours(self) -> float | None:
        rate = self.throughput.tokens_per_s
        return self.output_tokens / rate / 3600 if rate else None

    @property
    def wall_s(self) -> float | None:
        hours = self.gpu_hours
        return hours * 3600 / self.servers if hours is not None and self.servers else None

    def figures(self) -> dict[str, Any]:
        """The plan's totals, flat, for metadata and for the shards' plan-against-actual."""
        return {
            "plan_prompts": self.prompts,
            "plan_prompt_tokens": self.prompt_tokens,
            "plan_output_tokens": self.output_tokens,
            "plan_truncated_share": round(self.truncated_share, 4),
            "plan_training_rows": self.rows,
            "plan_store_bytes": self.store_bytes,
            "plan_training_set_bytes": self.training_set_bytes,
            "plan_tokens_per_s_per_server": self.throughput.tokens_per_s or 0.0,
            "plan_gpu_hours": round(self.gpu_hours, 3) if self.gpu_hours is not None else self._unknown_time,
            "plan_wall_s": round(self.wall_s, 1) if self.wall_s is not None else self._unknown_time,
        }

    @property
    def _unknown_time(self) -> str:
        return "measured in the run's first minute" if self.throughput.tokens_per_s is None else "unknown"

    def lines(self) -> list[str]:
        """The plan as a person reads it, estimates marked as such."""
        sim = " (simulator)" if self.simulated else ""
        out = [f"plan: {self.prompts:,} prompts to send ({self.done:,} already answered), {self.prompt_tokens:,} prompt tokens"]
        for s in self.sources:
            out.append(
                f"  {s.source}: {s.prompts:,} prompts, {s.prompt_tokens:,} prompt tokens, {s.output_tokens:,} output "
                f"tokens expected (an answer p10/p50/p90 {s.spread[0]:,}/{s.spread[1]:,}/{s.spread[2]:,}), "
                f"{s.truncated_share:.1%} cut at the cap [{s.basis}]"
            )
        out.append(
            f"  output: {self.output_tokens:,} tokens expected, {self.truncated_share:.1%} cut at the cap; "
            f"{self.rows:,} training rows expected"
        )
        out.append(
            f"  disk: store +{_size(self.store_bytes)}, training set {_size(self.training_set_bytes)} "
            f"[estimates: {STORE_BYTES_PER_TOKEN:g} and {TRAINING_BYTES_PER_TOKEN:g} bytes a token]"
        )
        if self.gpu_hours is not None and self.wall_s is not None:
            out.append(
                f"  time: {self.gpu_hours:,.2f} GPU-hours{sim}, {_duration(self.wall_s)} wall on {self.servers} server(s) at "
                f"{self.throughput.tokens_per_s:,.0f} output tokens/s each [{self.throughput.basis}; decode only]; "
                f"the run measures its own speed in its first minute and says if this is off by over {PLAN_MARGIN:.0%}"
            )
        elif self.throughput.tokens_per_s is None:
            out.append(f"  time: {MEASURED_IN_THE_RUN} [{self.throughput.basis}]")
        out += [f"  cannot plan: {p}" for p in self.problems]
        return out

    def markdown(self) -> str:
        return "\n".join(["```", *self.lines(), "```"]) + "\n"


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _duration(seconds: float) -> str:
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def make_plan(
    prompts: pl.DataFrame,
    observed: Observed,
    priors: Callable[[str], int],
    *,
    servers: int,
    throughput: Throughput,
    simulated: bool,
    done: int = 0,
    drop_truncated: bool,
    problems: Iterable[str] = (),
) -> Plan:
    """The plan for ``prompts`` (budgeted, still to send: ``source``, ``prompt_tokens``, ``max_tokens``)."""
    problems = list(problems)
    if prompts.height == 0 and not done:
        problems.append("the catalog yields no prompts (after dedup, filters, quotas and budgets)")
    if throughput.tokens_per_s is not None and throughput.tokens_per_s <= 0:
        problems.append(f"a throughput of 0 output tokens/s ({throughput.basis}): no time or GPU-hours")
    tokens, cut = expected_per_prompt(prompts, observed, priors)
    frame = prompts.select("source", "prompt_tokens").with_columns(
        pl.Series("output", tokens), pl.Series("cut", cut)
    )
    sources = []
    for source in sorted(set(frame["source"].to_list())):
        rows = frame.filter(pl.col("source") == source)
        lengths = source_lengths(observed, source, priors(source))
        sources.append(
            SourcePlan(
                source=source,
                prompts=rows.height,
                prompt_tokens=int(rows["prompt_tokens"].sum()),
                output_tokens=round(float(rows["output"].sum())),
                truncated_share=float(rows["cut"].mean()),
                spread=lengths.spread(),
                basis=lengths.basis,
            )
        )
    return Plan(sources, servers, throughput, simulated, done, drop_truncated, problems)
