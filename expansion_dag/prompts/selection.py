"""Prompt selection: ``select_prompts`` removes duplicates within and across sources and samples
each source down to its quota or weight.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from math import floor
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np
import polars as pl

from expansion_dag.prompts.extract import ExtractResult
from expansion_dag.prompts.extractors import PROMPT_SCHEMA, QUARANTINE_SCHEMA, REASONS

DEFAULT_SEED = 0


@dataclass(frozen=True)
class SourceStats:
    """Where each row of one source went.

    ``rows_in`` counts the rows left after the filters; ``quarantined`` has a count for every
    reason code, in ``REASONS`` order. Construction checks that every row is accounted for.
    """

    source: str
    rows_read: int
    filtered: int
    rows_in: int
    prompts_out: int
    duplicates: int
    quarantined: Mapping[str, int]
    not_sampled: int

    @property
    def quarantined_total(self) -> int:
        return sum(self.quarantined.values())

    def __post_init__(self) -> None:
        accounted = self.prompts_out + self.duplicates + self.quarantined_total + self.not_sampled
        if self.rows_read != self.filtered + self.rows_in or self.rows_in != accounted:
            raise AssertionError(
                f"source {self.source!r}: rows do not add up: rows_read {self.rows_read} = filtered "
                f"{self.filtered} + rows_in {self.rows_in}; rows_in = prompts_out {self.prompts_out} "
                f"+ duplicates {self.duplicates} + quarantined {self.quarantined_total} "
                f"+ not_sampled {self.not_sampled}"
            )

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "rows_read": self.rows_read,
            "filtered": self.filtered,
            "rows_in": self.rows_in,
            "prompts_out": self.prompts_out,
            "duplicates": self.duplicates,
            "quarantined": self.quarantined_total,
            **{f"quarantined_{reason}": count for reason, count in self.quarantined.items()},
            "not_sampled": self.not_sampled,
        }


class PlannedSource(Protocol):
    name: str
    quota: int | None
    weight: float | None


class SelectionPlan(Protocol):
    """What selection needs of a catalog (``expansion_dag.prompts.catalog.Catalog`` is one): the sources in
    priority order with their quotas or weights, the total to reach, and the sampling seed."""

    @property
    def sources(self) -> Sequence[PlannedSource]: ...

    total_prompts: int | None
    seed: int


@dataclass(frozen=True)
class Selection:
    """The final prompts (``PROMPT_SCHEMA``), every quarantined row, and per-source accounting."""

    prompts: pl.DataFrame
    quarantine: pl.DataFrame
    stats: Mapping[str, SourceStats]


def select_prompts(
    results: Sequence[ExtractResult],
    *,
    plan: SelectionPlan | None = None,
    quotas: Mapping[str, int] | None = None,
    seed: int | None = None,
) -> Selection:
    """Deduplicate across sources, then sample each source down to its quota or weight.

    Either ``plan`` (a catalog: its sources' quotas and weights, ``total_prompts`` and ``seed``;
    results are put in its order) or ``quotas`` and ``seed`` with results already in priority order.
    Duplicates are prompts with the same prompt_id, i.e. the same normalized messages; the first in
    order wins. Sampling ranks each source's prompts by a seeded mix of their ids, so the selection
    is the same on every machine, and raising a quota only adds prompts.
    """
    weights: Mapping[str, float] = {}
    total_prompts = None
    if plan is not None:
        if quotas is not None or seed is not None:
            raise ValueError("pass either a catalog or quotas and a seed, not both")
        position = {spec.name: i for i, spec in enumerate(plan.sources)}
        if unknown := sorted({r.source for r in results} - position.keys()):
            raise ValueError(f"results for sources not in the catalog: {', '.join(unknown)}")
        results = sorted(results, key=lambda r: position[r.source])
        quotas = {s.name: s.quota for s in plan.sources if s.quota is not None}
        weights = {s.name: s.weight for s in plan.sources if s.weight is not None}
        total_prompts, seed = plan.total_prompts, plan.seed
    quotas = quotas or {}
    seed = DEFAULT_SEED if seed is None else seed
    names = [r.source for r in results]
    if len(set(names)) != len(names):
        raise ValueError(f"more than one result per source: {', '.join(names)}")

    # Dedup, ranking and quotas need no messages: they run on these columns, and the chosen rows
    # are then filtered out of each source's prompts, so no copy of every candidate's messages is made.
    frames = [r.prompts for r in results] or [pl.DataFrame(schema=PROMPT_SCHEMA)]
    candidates = pl.concat(
        [
            frame.select("prompt_id", "source", order=pl.lit(i, pl.Int64), position=pl.int_range(pl.len()))
            for i, frame in enumerate(frames)
        ]
    )
    unique = candidates.filter(pl.col("prompt_id").is_first_distinct())
    available = dict(unique.group_by("source").len().iter_rows())
    targets = _targets(
        names, available=available, quotas=quotas, weights=weights, total_prompts=total_prompts
    )
    chosen = (
        unique.with_columns(key=pl.Series(_rank_keys(unique["prompt_id"], seed=seed)))
        .sort("key", "prompt_id")
        .filter(
            pl.int_range(pl.len()).over("source")
            < pl.col("source").replace_strict(targets, default=0, return_dtype=pl.Int64)
        )
    )
    # A filter, not a gather by position: a gather copies the text of the rows it takes, a filter
    # shares the source's buffers.
    prompts = pl.concat(
        [
            frame.filter(
                pl.int_range(pl.len()).is_in(chosen.filter(pl.col("order") == i)["position"].implode())
            ).sort("row_index")
            for i, frame in enumerate(frames)
        ]
    )
    chosen_counts = dict(chosen.group_by("source").len().iter_rows())
    stats = {}
    for result in results:
        name = result.source
        reasons = dict.fromkeys(REASONS, 0) | dict(result.quarantine.group_by("reason").len().iter_rows())
        stats[name] = SourceStats(
            source=name,
            rows_read=result.rows_read,
            filtered=result.filtered,
            rows_in=result.rows_in,
            prompts_out=chosen_counts.get(name, 0),
            duplicates=result.prompts.height - available.get(name, 0),
            quarantined=MappingProxyType(reasons),
            not_sampled=available.get(name, 0) - chosen_counts.get(name, 0),
        )
    quarantine = pl.concat([r.quarantine for r in results] or [pl.DataFrame(schema=QUARANTINE_SCHEMA)])
    return Selection(prompts=prompts.select(PROMPT_SCHEMA.names()), quarantine=quarantine, stats=stats)


def _targets(
    names: Sequence[str],
    *,
    available: Mapping[str, int],
    quotas: Mapping[str, int],
    weights: Mapping[str, float],
    total_prompts: int | None,
) -> dict[str, int]:
    """How many prompts each source gives: its quota, its weighted share, or all it has."""
    targets = {name: min(quotas.get(name, available.get(name, 0)), available.get(name, 0)) for name in names}
    weighted = [name for name in names if name in weights]
    if weighted:
        if total_prompts is None:
            raise ValueError("sources with a weight need total_prompts")
        targets.update(_weighted_shares(weighted, available=available, weights=weights, total=total_prompts))
    return targets


def _weighted_shares(
    names: Sequence[str], *, available: Mapping[str, int], weights: Mapping[str, float], total: int
) -> dict[str, int]:
    """``total`` split by weight; a source with fewer prompts than its share gives all it has.

    The rest is shared among the others. Exact fractions keep the split the same everywhere.
    """
    shares: dict[str, int] = {}
    open_names = list(names)
    budget = total
    while open_names:
        weight_sum = sum(Fraction(weights[n]) for n in open_names)
        exact = {n: budget * Fraction(weights[n]) / weight_sum for n in open_names}
        exhausted = [n for n in open_names if available.get(n, 0) <= exact[n]]
        if not exhausted:
            # Largest remainder, ties to the earlier source: the shares sum exactly to the budget.
            floors = {n: floor(exact[n]) for n in open_names}
            by_remainder = sorted(open_names, key=lambda n: -(exact[n] - floors[n]))
            for n in by_remainder[: budget - sum(floors.values())]:
                floors[n] += 1
            shares.update(floors)
            break
        for n in exhausted:
            shares[n] = available.get(n, 0)
            budget -= shares[n]
            open_names.remove(n)
    return shares


_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def _rank_keys(prompt_ids: pl.Series, *, seed: int) -> np.ndarray:
    """A seeded pseudo-random key per prompt: splitmix64 over the id's first 60 bits plus the seed.

    Pure integer arithmetic on the ids, so no hash seed, thread count or library version changes it.
    """
    with np.errstate(over="ignore"):
        x = prompt_ids.str.head(15).str.to_integer(base=16).to_numpy().astype(np.uint64)
        x += np.uint64((seed * _GOLDEN) & _MASK64)
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x
