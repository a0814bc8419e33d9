"""The training set's settings (``TrainingSetConfig``): the outputs a build can write (``FORMATS``),
the mask convention, and ``BuildTrace``, what a build's pass keeps for the checks and the nightly table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_LENGTH = 32_768  # Qwen3's native context
DEFAULT_CHUNK_ROWS = 512  # peak memory: about 250 bytes per token of a chunk (3 in flight)
DEFAULT_ROWS_PER_FILE = 50_000  # about 100M tokens, a few hundred MB, per shard
REASONING_POLICIES = ("keep", "drop")
LOOP_PREFIX_POLICIES = ("keep", "drop")
CONVERSATIONS_NAME = "conversations.jsonl"
#: One file serves both trainers: each reads ``{"id", "input_ids", "loss_mask"}`` lines unchanged.
PRETOKENIZED_NAME = "pretokenized.jsonl"


@dataclass(frozen=True)
class Output:
    """An output a build can write: its file (the Parquet set: its shards), what it is to its
    reader, and the command that loads it (the dataset card's; ``{model}``, ``{max_length}`` and
    ``{specforge_template}`` filled in)."""

    file: str
    what: str
    command: str


#: How each trainer's own renderer differs from the set's rows when it reads the conversations
#: (pre-tokenized rows it takes unchanged). expansion_dag_tests/trainers/ proves these, row by row.
SPECFORGE_RENDERS = (
    "SpecForge renders and masks the conversations itself. It adds its template's default "
    "system prompt (`You are a helpful assistant.`, mask 0) to a conversation that has none, "
    "and trains the newline after the end-of-turn token. Otherwise it masks as this set does: "
    "`qwen3-thinking` (thinking on) trains the reasoning with its think tags, `qwen3-instruct` "
    "(thinking off) leaves the empty think block untrained (its `ignore_token`). A conversation "
    "carries its `tools` (JSON text) and its assistant turns' `tool_calls`, which SpecForge "
    "passes to the template; it parses each call's arguments and the template writes them back "
    "as JSON, the same text when the server wrote them as `json.dumps` does (vLLM, SGLang)."
)
SPECULATORS_RENDERS = (
    "speculators renders conversations through vLLM's `/v1/chat/completions/render` without "
    "chat_template_kwargs: it always trains the newline after the end-of-turn token and, with "
    "thinking off, also the empty think block the template adds (its generation prompt has "
    "none). Hence the pre-tokenized rows for it, which it keeps as they are."
)
FORMATS: dict[str, Output] = {
    "parquet": Output(
        "part-*.parquet",
        "The tokenized set, Parquet shards of `id`, `source`, `input_ids`, `loss_mask`, `length`, `ids_from`, "
        "`ids_match_text`.",
        'python -c \'import datasets; print(datasets.load_dataset("parquet", data_files="part-*.parquet", '
        'split="train"))\'\n'
        "python -c 'import polars as pl; print(pl.read_parquet(\"part-*.parquet\"))'",
    ),
    "specforge-pretokenized": Output(
        PRETOKENIZED_NAME,
        "SpecForge 0.2 (`data.prompts_path`): one `{{id, input_ids, loss_mask}}` line per row, taken as "
        "it is (only cut to `data.max_length`).",
        "specforge train -c YOUR_SPECFORGE_CONFIG.yaml data.prompts_path=$PWD/pretokenized.jsonl "
        "data.max_length={max_length}",
    ),
    "specforge-conversations": Output(
        CONVERSATIONS_NAME,
        "SpecForge 0.2 (`data.train_data_path`): `{{id, conversations}}` with the reasoning inline as "
        "`<think>...</think>` before the answer, which Qwen3's template (run by its ThinkingParser) "
        "reads back as the model's reasoning. " + SPECFORGE_RENDERS,
        "specforge train -c YOUR_SPECFORGE_CONFIG.yaml data.train_data_path=$PWD/conversations.jsonl "
        "data.chat_template={specforge_template} data.max_length={max_length}",
    ),
    "speculators-pretokenized": Output(
        PRETOKENIZED_NAME,
        "vLLM's speculators 0.9 (`prepare-data`, then `train --data-path`): the same "
        "`{{id, input_ids, loss_mask}}` lines, passed through without rendering. " + SPECULATORS_RENDERS,
        "speculators prepare-data --model {model} --data $PWD/pretokenized.jsonl --output ./speculators-data "
        "--seq-length {max_length}",
    ),
}
MASK_CONVENTION = (
    "loss_mask is 1 on exactly the tokens the assistant wrote: its answer, the reasoning kept "
    "with its think tags, and the end-of-turn token, in every assistant turn of a conversation "
    "(its tool calls as the template renders them). The generation prompt "
    "(`<|im_start|>assistant\\n`, and with thinking off the empty think block the template adds), "
    "system, user and tool turns are 0. The newline the template writes after the end-of-turn "
    "token is {newline}."
)
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True, kw_only=True)
class TrainingSetConfig:
    """How the set is built: what the run configuration sets, a run passes
    (``expansion_dag.config.training_set_config``); the rest are the build's own."""

    drop_truncated: bool  # leave out answers cut at max_tokens (finish_reason "length")
    formats: tuple[str, ...]  # outputs written (FORMATS); "parquet" always
    train_newline_after_end_of_turn: bool  # the mask convention (MASK_CONVENTION)
    reasoning: str  # "keep": reasoning_content in the model's own format; "drop"
    loop_prefix: str  # "keep": a stopped loop's text before it is a row, cut (``truncated: loop``); "drop"
    max_length: int = DEFAULT_MAX_LENGTH  # the training context: longer samples are left out
    min_length: int  # shorter samples are left out
    chunk_rows: int = DEFAULT_CHUNK_ROWS  # records held and tokenized at once
    rows_per_file: int = DEFAULT_ROWS_PER_FILE

    def __post_init__(self) -> None:
        for name in ("drop_truncated", "train_newline_after_end_of_turn"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool")
        formats = (self.formats,) if isinstance(self.formats, str) else tuple(self.formats)
        unknown = [f for f in formats if f not in FORMATS]
        if unknown or "parquet" not in formats:
            raise ValueError(
                f"formats must name some of {sorted(FORMATS)}, 'parquet' among them (the checks "
                f"and the dataset card read it), not {list(formats)!r}"
            )
        object.__setattr__(self, "formats", tuple(sorted(set(formats), key=list(FORMATS).index)))
        if self.loop_prefix not in LOOP_PREFIX_POLICIES:
            raise ValueError(f"loop_prefix must be one of {LOOP_PREFIX_POLICIES}, not {self.loop_prefix!r}")
        if self.reasoning not in REASONING_POLICIES:
            raise ValueError(
                f"reasoning must be one of {REASONING_POLICIES}, not {self.reasoning!r}"
            )
        for name in ("max_length", "chunk_rows", "rows_per_file"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, not {value!r}")
        if isinstance(self.min_length, bool) or not isinstance(self.min_length, int):
            raise ValueError(f"min_length must be an int, not {self.min_length!r}")
        if not 0 <= self.min_length <= self.max_length:
            raise ValueError("min_length must lie in [0, max_length]")
        # Parquet list offsets are int32: a chunk's tokens must fit.
        if self.chunk_rows * self.max_length > _INT32_MAX:
            raise ValueError("chunk_rows * max_length must stay below 2**31")

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "formats": list(self.formats)}  # as JSON reads it back


def mask_convention(config: TrainingSetConfig) -> str:
    return MASK_CONVENTION.format(
        newline="trained (mask 1), as SpecForge and speculators train it"
        if config.train_newline_after_end_of_turn
        else "not trained (mask 0): the model stops at the end-of-turn token and never writes it"
    )


@dataclass
class BuildTrace:
    """What a build's pass saw, kept for the checks and the nightly table so they need no pass of their own."""

    renders: dict[str, list[bytes]] = field(default_factory=dict)  # row id -> render digests (``render_digest``)
    completion_tokens: dict[str, int] = field(default_factory=dict)  # prompt_id -> tokens of its completion
    failed: set[str] = field(default_factory=set)  # prompt_ids whose record is a failure
