"""Generation settings shared by budgeting, generation and the training set.

One resource, so the chat template arguments that count prompt tokens are the ones sent with the
requests and the ones that render the training set. Its fields are the run configuration's
``generation`` section (``expansion_dag/config/schema.py``), plus the tokenizer (``model.tokenizer``);
what the stages are given from them is ``expansion_dag.config``'s (``derived.py``).
"""

from __future__ import annotations

from typing import Any

import dagster as dg
from pydantic import Field

from expansion_dag.config import (
    GenerationConfig,
    ModelConfig,
    budget_config,
    engine_config,
    schema_default,
    training_set_config,
    turn_planner,
)
from expansion_dag.core import ModeIdentities, load_tokenizer
from expansion_dag.generation import EngineConfig, TurnPlanner
from expansion_dag.prompts import BudgetConfig
from expansion_dag.training import TrainingSetConfig

#: Settings that change how fast a shard runs and reports, never what it generates: left out of
#: the record the configuration drift check compares.
_NOT_RECORDED = frozenset(
    {"progress_interval_s", "training_formats", "train_newline_after_end_of_turn",
     "training_build_workers",
     "plan_output_tokens_per_s", "owner_wait_s"}
)


class GenerationSettings(dg.ConfigurableResource, GenerationConfig):
    """How prompts are budgeted, sampled, retried and turned into training samples."""

    tokenizer: str = Field(
        default=schema_default(ModelConfig, "tokenizer"),
        description="Tokenizer of the served model: a local folder, a hub id, or the bundled Qwen3 one.",
    )

    def load_tokenizer(self):
        return load_tokenizer(self.tokenizer)

    def budget_config(self) -> BudgetConfig:
        return budget_config(self)

    def turn_planner(self, context_length: int, identities: ModeIdentities) -> TurnPlanner:
        return turn_planner(self, self.load_tokenizer(), context_length, identities)

    def engine_config(self) -> EngineConfig:
        return engine_config(self)

    def training_set_config(self, context_length: int) -> TrainingSetConfig:
        return training_set_config(self, context_length)

    def as_metadata(self) -> dict[str, Any]:
        """The settings as recorded with each shard, for the configuration drift check."""
        return {k: v for k, v in self.model_dump().items() if k not in _NOT_RECORDED}
