"""Token budgets per prompt, and shards balanced on expected work.

Every prompt gets its own ``max_tokens = min(max_output_tokens, context_length - prompt_tokens -
margin)``, with ``prompt_tokens`` counted exactly as the server counts (the model's chat template,
``add_generation_prompt=True``, the ``chat_template_kwargs`` of the prompt's mode, its tools). A cap
at or above the context is therefore harmless, and no fixed conservative cap wastes the window.

The margin absorbs small disagreements between this tokenizer and the server's (a different
tokenizer revision, a template the server patches). It is a few tokens, not a fraction of the
window; a disagreement larger than it shows up as budget drift in the generation report.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl
from transformers import PreTrainedTokenizerBase

from expansion_dag.core import count_prompt_tokens

PROMPT_TOO_LONG = "prompt_too_long"
#: Over the server's own input limit (SGLang's ``max_req_input_len``, set by the KV cache too).
PROMPT_OVER_INPUT_LIMIT = "prompt_over_input_limit"


@dataclass(frozen=True, kw_only=True)
class BudgetConfig:
    """How prompts are budgeted: a run passes the configured values (``expansion_dag.config.budget_config``)."""

    #: Cap on generated tokens. It may exceed the context: each prompt's budget is computed.
    max_output_tokens: int
    #: A prompt that leaves less room than this for the answer is set aside, never sent.
    min_output_tokens: int
    margin: int
    #: Expected answer length used to balance shards and to start long requests first.
    expected_output_tokens: int
    expected_output_by_source: Mapping[str, int]
    chat_template_kwargs: Mapping[str, Any]
    #: Each generation mode's template arguments, for prompts that carry a ``mode`` column.
    chat_template_kwargs_by_mode: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: Prompts rendered and tokenized per batch: bounds memory at 650K-prompt scale.
    batch_size: int = 4096

    def __post_init__(self) -> None:
        if self.max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be positive, got {self.max_output_tokens}")
        if self.min_output_tokens < 1:
            raise ValueError(f"min_output_tokens must be positive, got {self.min_output_tokens}")
        if self.min_output_tokens > self.max_output_tokens:
            raise ValueError(
                f"min_output_tokens ({self.min_output_tokens}) exceeds max_output_tokens ({self.max_output_tokens})"
            )
        if self.margin < 0:
            raise ValueError(f"margin must not be negative, got {self.margin}")

    def template_kwargs(self, mode: str | None) -> Mapping[str, Any]:
        """The template arguments of a prompt in ``mode`` (None: a prompt without a mode)."""
        if mode is None:
            return self.chat_template_kwargs
        if mode not in self.chat_template_kwargs_by_mode:
            known = ", ".join(self.chat_template_kwargs_by_mode) or "none"
            raise ValueError(
                f"no chat_template_kwargs for mode {mode!r} (modes configured: {known}); "
                "a prompts frame with a mode column needs BudgetConfig.chat_template_kwargs_by_mode"
            )
        return self.chat_template_kwargs_by_mode[mode]


@dataclass(frozen=True)
class BudgetResult:
    prompts: pl.DataFrame
    set_aside: pl.DataFrame
    context_length: int
    shard_keys: list[str]

    def shard_stats(self) -> pl.DataFrame:
        """Prompts and expected tokens per shard, every shard listed even when empty."""
        counted = self.prompts.group_by("shard").agg(
            pl.len().alias("prompts"),
            pl.col("prompt_tokens").sum().alias("prompt_tokens"),
            pl.col("expected_tokens").sum().alias("expected_tokens"),
        )
        return (
            pl.DataFrame({"shard": self.shard_keys})
            .join(counted, on="shard", how="left")
            .fill_null(0)
            .sort("shard")
        )

    def balance(self) -> float:
        """Largest shard's expected tokens over the mean: 1.0 is perfect."""
        loads = self.shard_stats()["expected_tokens"]
        mean = loads.mean()
        return float(loads.max() / mean) if mean else 1.0


def shard_keys(num_shards: int) -> list[str]:
    return [f"shard-{i:02d}" for i in range(num_shards)]


def count_all_prompt_tokens(
    prompts: pl.DataFrame, tokenizer: PreTrainedTokenizerBase, config: BudgetConfig
) -> pl.Series:
    """Each prompt's tokens as the server counts its request: with its mode's template arguments
    (a ``mode`` column) and its tools (a ``tools`` column of JSON text, null for none).

    Rows are counted in groups of one mode and with or without tools, ``batch_size`` at a time, so
    prompts without tools keep the batched render.
    """
    rows = prompts.select(
        row=pl.int_range(pl.len(), dtype=pl.Int64),
        mode=pl.col("mode") if "mode" in prompts.columns else pl.lit(None, pl.String),
        has_tools=pl.col("tools").is_not_null() if "tools" in prompts.columns else pl.lit(False),
    )
    counts = np.zeros(prompts.height, dtype=np.int64)
    groups = rows.group_by("mode", "has_tools", maintain_order=True).agg("row")
    for mode, has_tools, group in groups.iter_rows():
        kwargs = config.template_kwargs(mode)
        for start in range(0, len(group), config.batch_size):
            chunk = group[start : start + config.batch_size]
            messages = prompts["messages"].gather(chunk).to_list()
            tools = [json.loads(t) for t in prompts["tools"].gather(chunk)] if has_tools else None
            counts[chunk] = count_prompt_tokens(tokenizer, messages, kwargs, tools=tools)
    return pl.Series("prompt_tokens", counts, dtype=pl.Int64)


def budget_prompts(
    prompts: pl.DataFrame,
    tokenizer: PreTrainedTokenizerBase,
    *,
    context_length: int,
    num_shards: int,
    config: BudgetConfig,
    select: Callable[[pl.DataFrame], pl.DataFrame] | None = None,
    max_prompt_tokens: int | None = None,
) -> BudgetResult:
    """Count, budget, set aside what cannot fit, and assign the rest to balanced shards.

    ``max_prompt_tokens`` is the longest prompt the servers admit (``FleetInfo.max_prompt_tokens``);
    SGLang refuses longer ones with a 400 however much context is left, so they are set aside too.

    ``select`` picks, among the prompts that fit, the ones to shard (a night's quota); it sees
    them with their budgets, so a prompt that can never be sent never takes a place in a quota.
    """
    if context_length <= config.margin + config.min_output_tokens:
        raise ValueError(
            f"context length {context_length} leaves no room for min_output_tokens "
            f"{config.min_output_tokens} plus margin {config.margin}"
        )
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    expected_by_source = pl.DataFrame(
        {
            "source": list(config.expected_output_by_source),
            "_expected_out": list(config.expected_output_by_source.values()),
        },
        schema={"source": pl.String, "_expected_out": pl.Int64},
    )
    budgeted = (
        prompts.with_columns(count_all_prompt_tokens(prompts, tokenizer, config))
        .with_columns(
            pl.min_horizontal(
                pl.lit(config.max_output_tokens, pl.Int64),
                pl.lit(context_length, pl.Int64) - pl.col("prompt_tokens") - config.margin,
            ).alias("max_tokens")
        )
        .join(expected_by_source, on="source", how="left")
        .with_columns(
            (
                pl.col("prompt_tokens")
                + pl.min_horizontal(
                    pl.col("max_tokens"), pl.col("_expected_out").fill_null(config.expected_output_tokens)
                ).clip(lower_bound=0)
            ).alias("expected_tokens")
        )
        .drop("_expected_out")
    )
    too_long = pl.col("max_tokens") < config.min_output_tokens
    over_limit = (
        pl.col("prompt_tokens") > max_prompt_tokens if max_prompt_tokens is not None else pl.lit(False)
    )
    fits = ~too_long & ~over_limit
    set_aside = (
        budgeted.filter(~fits)
        .with_columns(
            pl.when(too_long)
            .then(pl.lit(PROMPT_TOO_LONG))
            .otherwise(pl.lit(PROMPT_OVER_INPUT_LIMIT))
            .alias("reason"),
            pl.when(too_long)
            .then(
                pl.format(
                    "{} prompt tokens leave {} for the answer (< min_output_tokens {}) at context {}",
                    pl.col("prompt_tokens"),
                    pl.col("max_tokens"),
                    pl.lit(config.min_output_tokens),
                    pl.lit(context_length),
                )
            )
            .otherwise(
                pl.format(
                    "{} prompt tokens are over the servers' input limit of {} (max_req_input_len)",
                    pl.col("prompt_tokens"),
                    pl.lit(max_prompt_tokens),
                )
            )
            .alias("detail"),
        )
        .sort("prompt_id")
    )
    kept = budgeted.filter(fits)
    if select is not None:
        kept = select(kept)
    keys = shard_keys(num_shards)
    kept = kept.with_columns(pl.Series("shard", assign_shards(kept, keys), dtype=pl.String)).sort("prompt_id")
    return BudgetResult(prompts=kept, set_aside=set_aside, context_length=context_length, shard_keys=keys)


def assign_shards(prompts: pl.DataFrame, keys: list[str]) -> list[str]:
    """Greedy longest-first assignment to the least loaded shard: balanced on expected tokens.

    Ties break on prompt id and shard index, so the same prompts give the same shards everywhere.
    """
    order = prompts.select(
        pl.int_range(pl.len()).alias("row"), "expected_tokens", "prompt_id"
    ).sort(["expected_tokens", "prompt_id"], descending=[True, False])
    loads = [(0, index) for index in range(len(keys))]
    assigned = [""] * prompts.height
    for row, expected in zip(order["row"].to_list(), order["expected_tokens"].to_list()):
        load, index = heapq.heappop(loads)
        assigned[row] = keys[index]
        heapq.heappush(loads, (load + expected, index))
    return assigned

