"""Generation settings shared by budgeting, generation and the training set.

One resource, so the chat template arguments that count prompt tokens are the ones sent with the
requests and the ones that render the training set. Its fields are the run configuration's
``generation`` section (``expansion_dag/config/schema.py``), plus the tokenizer (``model.tokenizer``).
"""

from __future__ import annotations

import json
from typing import Any

import dagster as dg
from pydantic import Field

from expansion_dag.config import GenerationConfig
from expansion_dag.core import DEFAULT_TOKENIZER, ModeIdentities, load_tokenizer
from expansion_dag.generation import EngineConfig, TurnPlanner, YieldGate
from expansion_dag.prompts import BudgetConfig
from expansion_dag.training import TrainingSetConfig

#: Settings that change how fast a shard runs and reports, never what it generates: left out of
#: the record the configuration drift check compares.
_NOT_RECORDED = frozenset(
    {"progress_interval_s", "client_tick_s", "training_formats", "train_newline_after_end_of_turn",
     "training_build_workers",
     "plan_output_tokens_per_s", "owner_wait_s"}
)


class GenerationSettings(dg.ConfigurableResource, GenerationConfig):
    """How prompts are budgeted, sampled, retried and turned into training samples."""

    tokenizer: str = Field(
        default=DEFAULT_TOKENIZER,
        description="Tokenizer of the served model: a local folder, a hub id, or the bundled Qwen3 one.",
    )

    def template_kwargs(self) -> dict[str, Any]:
        return json.loads(self.chat_template_kwargs)

    def load_tokenizer(self):
        return load_tokenizer(self.tokenizer)

    def budget_config(self) -> BudgetConfig:
        return BudgetConfig(
            max_output_tokens=self.max_output_tokens,
            min_output_tokens=self.min_output_tokens,
            margin=self.margin,
            expected_output_tokens=self.expected_output_tokens,
            expected_output_by_source=dict(self.expected_output_by_source),
            chat_template_kwargs=self.template_kwargs(),
            chat_template_kwargs_by_mode={m.name: m.chat_template_kwargs for m in self.mix().modes},
        )

    def turn_planner(self, context_length: int, identities: ModeIdentities) -> TurnPlanner:
        """Budgets each next turn of a conversation as the budget stage budgets turn 1."""
        finished = ("stop", "tool_calls") if self.drop_truncated else ("stop", "tool_calls", "length")
        return TurnPlanner(
            tokenizer=self.load_tokenizer(),
            context_length=context_length,
            max_output_tokens=self.max_output_tokens,
            min_output_tokens=self.min_output_tokens,
            margin=self.margin,
            identities=identities.by_mode,
            continue_on=finished,
        )

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            request_timeout_s=self.request_timeout_s,
            max_attempts=self.max_attempts,
            backoff_initial_s=self.backoff_initial_s,
            backoff_max_s=max(self.backoff_initial_s, 30.0),
            backoff_jitter_s=self.backoff_initial_s,
            context_margin=self.margin,
            min_output_tokens=self.min_output_tokens,
            progress_interval_s=self.progress_interval_s,
            stop_degenerate=self.stop_degenerate,
            loop_min_span_chars=self.loop_min_span_chars,
            loop_min_repeats=self.loop_min_repeats,
            loop_min_chars=self.loop_min_chars,
            loop_window_chars=self.loop_window_chars,
            client_tick_s=self.client_tick_s,
            owner_wait_s=self.owner_wait_s,
            yield_gate=YieldGate(self.min_yield, self.yield_gate_answers, self.max_output_tokens),
        )

    def training_set_config(self, context_length: int) -> TrainingSetConfig:
        return TrainingSetConfig(
            drop_truncated=self.drop_truncated,
            reasoning=self.reasoning,
            max_length=context_length,
            min_length=self.min_sample_tokens,
            formats=tuple(self.training_formats),
            train_newline_after_end_of_turn=self.train_newline_after_end_of_turn,
        )

    def as_metadata(self) -> dict[str, Any]:
        """The settings as recorded with each shard, for the configuration drift check."""
        return {k: v for k, v in self.model_dump().items() if k not in _NOT_RECORDED}
