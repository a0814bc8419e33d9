"""Generation settings shared by budgeting, generation and the training set.

One resource, so the chat template arguments that count prompt tokens are the ones sent with the
requests and the ones that render the training set.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import dagster as dg
from pydantic import Field

from expansion_dag.budget import BudgetConfig
from expansion_dag.engine import EngineConfig, SamplingSettings
from expansion_dag.tokenizer import DEFAULT_TOKENIZER, load_tokenizer
from expansion_dag.training_set import TrainingSetConfig


class GenerationSettings(dg.ConfigurableResource):
    """How prompts are budgeted, sampled, retried and turned into training samples."""

    tokenizer: str = Field(
        default=DEFAULT_TOKENIZER,
        description="Tokenizer of the served model: a local folder, a hub id, or the bundled Qwen3 one.",
    )
    max_output_tokens: int = Field(default=8192, description="Cap on max_tokens; each prompt's budget is computed.")
    min_output_tokens: int = Field(default=256, description="Prompts leaving less room are set aside.")
    margin: int = Field(default=16, description="Tokens kept free against tokenizer disagreement.")
    expected_output_tokens: int = Field(default=1024, description="Prior answer length for balancing and ordering.")
    expected_output_by_source: dict[str, int] = {}
    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    chat_template_kwargs: str = Field(
        default="{}", description='JSON object passed to the chat template, e.g. {"enable_thinking": false}.'
    )
    request_timeout_s: float = 1800.0
    max_attempts: int = 5
    backoff_initial_s: float = 1.0
    max_failure_rate: float = Field(default=0.01, description="A shard fails above this failure rate.")
    max_truncation_rate: float = Field(default=0.2, description="Warn above this rate of finish_reason length.")
    progress_interval_s: float = 15.0
    spill_to_idle_servers: bool = Field(
        default=True,
        description="Send queued prompts to other fleet servers while they report idle slots (end-of-run balance).",
    )
    drop_truncated: bool = True
    reasoning: str = Field(default="keep", description="'keep' reasoning in the assistant turn or 'drop' it.")
    min_sample_tokens: int = 16

    def template_kwargs(self) -> dict[str, Any]:
        try:
            value = json.loads(self.chat_template_kwargs or "{}")
        except ValueError as exc:
            raise ValueError(f"chat_template_kwargs is not JSON: {self.chat_template_kwargs!r}") from exc
        if not isinstance(value, dict):
            raise ValueError(f"chat_template_kwargs must be a JSON object, got {self.chat_template_kwargs!r}")
        return value

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
        )

    def sampling(self) -> SamplingSettings:
        return SamplingSettings(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            chat_template_kwargs_json=json.dumps(self.template_kwargs(), sort_keys=True),
            max_output_tokens=self.max_output_tokens,
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
        )

    def training_set_config(self, context_length: int) -> TrainingSetConfig:
        return TrainingSetConfig(
            drop_truncated=self.drop_truncated,
            reasoning=self.reasoning,
            chat_template_kwargs=self.template_kwargs(),
            max_length=context_length,
            min_length=self.min_sample_tokens,
        )

    def as_metadata(self) -> dict[str, Any]:
        """The settings as recorded with each shard, for the configuration drift check."""
        return {k: v for k, v in self.model_dump().items() if k not in {"progress_interval_s"}}
