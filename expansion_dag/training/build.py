"""The tokenized drafter training set, built from completion records.

Each kept completion becomes one sample: the prompt and the target model's answer rendered with
the chat template, as token ids plus a loss mask that is 1 on exactly the tokens the assistant
wrote. A regenerated conversation becomes one sample too, from the record of its last turn (whose
messages hold the earlier regenerated turns), with every assistant turn masked 1. Templates such
as Qwen3's have no ``{% generation %}`` markers, so the assistant's part is found in the rendered text:

* The prompt is rendered as the server rendered it (``add_generation_prompt=True``, the same
  ``chat_template_kwargs``) and must be a prefix of the whole conversation's render; what follows,
  up to the end-of-turn token, is the assistant's. So whatever the template puts into the
  generation prompt (``<|im_start|>assistant\\n``; Qwen3's ``<think>\\n\\n</think>\\n\\n`` when
  ``enable_thinking=False``) is prompt (mask 0), and the think tags around kept reasoning are the
  assistant's (mask 1): in thinking mode Qwen3 writes them itself.
* The whitespace the template adds after the end-of-turn token (ChatML's ``\\n`` after
  ``<|im_end|>``) stays in ``input_ids`` (so they decode to the exact render) with mask 0 by
  default: the model stops at ``<|im_end|>`` and never writes it. SpecForge's and speculators'
  own renderers train it; ``train_newline_after_end_of_turn=True`` follows them (the mask
  convention, ``MASK_CONVENTION``; each trainer's other differences: ``dataset_card.CONSUMER_NOTES``).
* An earlier assistant turn of a conversation is found by rendering the conversation again with
  that turn's content replaced by a marker: the renders agree up to the marker (the turn's role
  header) and after it (the rest), so what differs is the turn as the template renders it there
  (Qwen3 drops earlier turns' think blocks), followed by the template's end-of-turn text. A
  conversation that does not split so is left out (``render_mismatch``), never guessed at.
* Each turn gives three texts, what precedes it, its own part and that trailer, tokenized apart
  and concatenated.
  Tokenized whole, a render can merge characters across the boundary (Qwen's vocabulary with a
  ChatML template like Qwen2.5's turns ``assistant\\n`` + an answer starting ``" \\n"`` into one
  ``"\\n \\n"`` token), and no offset can split that token. Tokenized apart, the prompt's ids are
  exactly those the server fed the model, and the answer's start where its generation started.
* With ``reasoning="drop"`` Qwen3's template still renders an empty ``<think>\\n\\n</think>\\n\\n``
  on the final turn. A mode with ``chat_template_kwargs={"enable_thinking": False}`` has it as
  prompt, as the server renders it in non-thinking mode; otherwise it counts as written by the assistant.

Rows from the server's ids (issue 38). A record that carries the ids the server ran and sampled
(``token_ids``) is its row: the prompt ids, the sampled ids (closed by the end-of-turn token they
end with, or the template's where the answer was cut before one) and the trailer's ids; the mask
is 0 on the prompt and 1 on the sampled ids, the trailer by the convention. No render and no
tokenization: that is what makes the build fast. A row says where its ids come from (``ids_from``):

* ``server``: as above. Ids that do not decode to the text the server returned (compared without
  whitespace and think tags, which reasoning parsers strip and move) win: the text is what a
  parser made of them, the ids are what the target model sampled; the row says so
  (``ids_match_text``), counted in the manifest.
* ``retokenized``: the path above, for a record without ids (an older server), one whose ids are not
  whole (fewer or more than ``completion_tokens``: never trained from), or one whose row is not a
  sequence the model sampled (``reasoning="drop"`` on an answer with reasoning). The manifest
  counts each reason.

A conversation's earlier turns are the server's own rendering of them in its last turn's prompt,
not their own sampled ids: that prompt is the context the model answered the last turn in (Qwen3's
template drops earlier turns' reasoning, so their sampled ids, reasoning first, are in no context
the model ran), and a drafter learns to predict the target in the contexts it runs. They are found
where the client's render puts them, by each token's bytes; a conversation whose server prompt does
not decode to the client's render is re-tokenized (``prompt_not_located``).

What re-tokenizing would have changed is measured on a sample of the rows from ids (the first
``MEASURED_PER_CHUNK`` of each chunk: the measurement re-tokenizes, the cost the ids save): rows
whose ids differ and by how many tokens, and prompts whose server ids differ from the client's own
render, id by id (``Manifest.retokenization``).

Which records: exactly those of the run's modes (``ModeIdentities``: each mode is an ``Identity``,
the model as served, simulated or not, the mode's sampling settings and the cap), each prompt's
only under the mode the mix draws it into now (another mode's answer to it is ``other_mode``: a
changed mix leaves out the answers of the prompts whose mode changed), and of those only complete
answers: ``finish_reason`` ``stop`` or ``tool_calls``, or ``length`` unless ``drop_truncated``, the
same for every earlier turn of a conversation. Everything else is counted by reason (and other
identities by name) in the manifest, never merged. The answers themselves pass quality gates, each a counted
reason: an empty answer; a raw ``<think>`` or ``</think>`` left in the content; reasoning missing
while the mode's thinking is on, or present while it is off (``thinking_mode``). Each answer is
rendered with its own mode's ``chat_template_kwargs``.

One pass: ``build_training_set`` reads the records once, in the order given (the store's file
order), tokenizes each kept sample once, and writes from that pass every output the config's
``formats`` name (the Parquet set always; the trainers' JSONL files beside it, ``FORMATS``), the
manifest naming them, the dataset card (``README.md``, ``dataset_card``) and, in a
``BuildTrace``, what the checks and the nightly table need: a digest of each row's expected
render (the round trip decodes sampled rows against it) and each prompt's outcome.

``check_round_trip`` assumes a lossless (byte-level) tokenizer, as Qwen's, Llama 3's and GPT's
are: decoding the ids must give back the render character for character.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
import os
import shutil
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from expansion_dag.core import (
    ENDINGS,
    IDS_LEFT_OUT,
    OK,
    OUTPUT_IDS,
    PROMPT_IDS,
    Identity,
    ModeIdentities,
    as_upath,
    bar_chart_png,
    base_prompt_id,
    png_data_uri,
    render_prompts,
    unpack,
)
from expansion_dag.training.dataset_card import dataset_card, mode_table, token_ids_lines
from expansion_dag.training.manifest import MANIFEST_NAME, Manifest

DEFAULT_MAX_LENGTH = 32_768  # Qwen3's native context
DEFAULT_MIN_LENGTH = 16
DEFAULT_CHUNK_ROWS = 512  # peak memory: about 250 bytes per token of a chunk (3 in flight)
DEFAULT_ROWS_PER_FILE = 50_000  # about 100M tokens, a few hundred MB, per shard
REASONING_POLICIES = ("keep", "drop")
LEFT_OUT_REASONS = (
    "other_identity", "other_mode",
    # No answer: the server's or the request's failure; a loop the client stopped (the model's
    # doing, never the server's); a conversation the engine ended before its last turn.
    "failed", "degenerate", "conversation_ended",
    "unfinished", "truncated",
    # The quality gates on the answer itself.
    "empty", "think_tag_in_content", "reasoning_missing", "reasoning_unexpected",
    "render_mismatch", "too_long", "too_short",
)
#: An earlier turn of a conversation: its answer is in the row of the conversation's last turn.
FOLDED = "folded"
#: ``AnswerJudge``'s verdict on an answer that becomes a training row.
ROW = "row"
#: Stands in for an earlier assistant turn's content, to find that turn in the render.
_MARKER = "\ue000expansion-dag-turn\ue000"
THINK_TAGS = ("<think>", "</think>")
#: Answers the model finished (``tool_calls``: it stopped at a tool call the server parsed);
#: anything else (``abort``, ``unknown``...) is left out as unfinished.
FINISHED = ("stop", "length", "tool_calls")
UNREGISTERED = "unregistered identity"  # a record whose key matches no identity in the store's registry
#: How Qwen3 (and DeepSeek-R1) write reasoning inline; Qwen3's template turns it back into the same
#: render as ``reasoning_content``. Used for the conversations JSONL.
INLINE_REASONING = "<think>\n{reasoning}\n</think>\n\n{answer}"
CARD_NAME = "README.md"
CONVERSATIONS_NAME = "conversations.jsonl"
#: One file serves both trainers: each reads ``{"id", "input_ids", "loss_mask"}`` lines unchanged.
PRETOKENIZED_NAME = "pretokenized.jsonl"
#: Outputs a build can write, and the file each is (the Parquet set: its shards).
FORMATS = {
    "parquet": "part-*.parquet",
    "specforge-pretokenized": PRETOKENIZED_NAME,
    "specforge-conversations": CONVERSATIONS_NAME,
    "speculators-pretokenized": PRETOKENIZED_NAME,
}
DEFAULT_FORMATS = ("parquet", "specforge-conversations")
MASK_CONVENTION = (
    "loss_mask is 1 on exactly the tokens the assistant wrote: its answer, the reasoning kept "
    "with its think tags, and the end-of-turn token, in every assistant turn of a conversation "
    "(its tool calls as the template renders them). The generation prompt "
    "(`<|im_start|>assistant\\n`, and with thinking off the empty think block the template adds), "
    "system, user and tool turns are 0. The newline the template writes after the end-of-turn "
    "token is {newline}."
)
#: Where a row's ids come from (its ``ids_from`` column): the ids the server ran and sampled, or the
#: text rendered and tokenized again (a record without ids, or a row that is not what was sampled).
FROM_SERVER, RETOKENIZED = "server", "retokenized"
#: Why a row is re-tokenized (``Manifest.retokenized_because``).
NO_IDS = "no_ids"  # the server returned none (an older version)
IDS_INCOMPLETE = "ids_incomplete"  # the record's ids were left out, or fewer than the tokens it counted
REASONING_DROPPED = "reasoning_dropped"  # reasoning="drop": the row without it is no sequence the model sampled
END_OF_TURN_UNKNOWN = "end_of_turn_unknown"  # a template whose turn end could not be found
NOT_BYTE_LEVEL = "not_byte_level"  # a conversation's earlier turns are located by byte offsets
PROMPT_NOT_LOCATED = "prompt_not_located"  # a conversation's server prompt is not the client's render
#: Rows from ids also re-tokenized, to measure the difference (``Manifest.retokenization``): the first
#: this many of each chunk. A sample, since re-tokenizing is the cost the ids save.
MEASURED_PER_CHUNK = 32
HISTOGRAM_BINS = 40
MAX_FAILING_IDS = 10

SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("length", pa.int32()),
        ("ids_from", pa.string()),  # FROM_SERVER or RETOKENIZED
        # A row from ids: whether they decode to the text the server returned (the ids win either way).
        ("ids_match_text", pa.bool_()),
    ]
)
# Spelled out so that a pyarrow upgrade changing its defaults cannot silently change the bytes.
_PARQUET_OPTIONS: dict[str, Any] = {
    "version": "2.6",
    "compression": "zstd",
    "compression_level": 3,
    "use_dictionary": ["source", "ids_from"],
    "write_statistics": False,
    "data_page_size": 1 << 20,
}
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class TrainingSetConfig:
    drop_truncated: bool = True  # leave out answers cut at max_tokens (finish_reason "length")
    formats: tuple[str, ...] = DEFAULT_FORMATS  # outputs written (FORMATS); "parquet" always
    train_newline_after_end_of_turn: bool = False  # the mask convention (MASK_CONVENTION)
    reasoning: str = "keep"  # "keep": reasoning_content in the model's own format; "drop"
    max_length: int = DEFAULT_MAX_LENGTH  # the training context: longer samples are left out
    min_length: int = DEFAULT_MIN_LENGTH  # shorter samples are left out
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


@dataclass
class BuildTrace:
    """What a build's pass saw, kept for the checks and the nightly table so they need no pass of their own."""

    renders: dict[str, list[bytes]] = field(default_factory=dict)  # row id -> render digests (``render_digest``)
    completion_tokens: dict[str, int] = field(default_factory=dict)  # prompt_id -> tokens of its completion
    failed: set[str] = field(default_factory=set)  # prompt_ids whose record is a failure


@dataclass
class _Tally:
    """Records left out: by reason, and those of other identities by identity; the mix's output tokens."""

    identities: ModeIdentities
    known: Mapping[str, Identity]  # fingerprint -> identity, to name the other identities
    trace: BuildTrace | None = None
    reasons: Counter[str] = field(default_factory=Counter)
    others: Counter[str] = field(default_factory=Counter)
    output_tokens: int = 0
    folded: int = 0  # records of earlier turns of a conversation
    folded_tokens: Counter[str] = field(default_factory=Counter)  # conversation_id -> its earlier turns' tokens

    def own(self, record: Mapping[str, Any]) -> None:
        """A record of a prompt's current mode: its tokens were generated, whatever becomes of it."""
        tokens = _output_tokens(record)
        self.output_tokens += tokens
        if self.trace is not None:
            # By prompt: a conversation's turns add up under its id, the one a night takes.
            prompt = base_prompt_id(record)
            if record.get("status") == OK:
                self.trace.completion_tokens[prompt] = self.trace.completion_tokens.get(prompt, 0) + tokens
            else:
                self.trace.failed.add(prompt)

    def fold(self, record: Mapping[str, Any]) -> None:
        self.folded += 1
        self.folded_tokens[base_prompt_id(record)] += _output_tokens(record)

    def other_identity(self, record: Mapping[str, Any]) -> None:
        self.reasons["other_identity"] += 1
        label = next((i.label for i in self.known.values() if i.owns(record)), UNREGISTERED)
        self.others[label] += 1

    def left_out(self) -> dict[str, int]:
        return {reason: self.reasons[reason] for reason in LEFT_OUT_REASONS}


def _output_tokens(record: Mapping[str, Any]) -> int:
    # A failure stopped mid-stream (a degenerate loop) records the tokens it streamed (stores
    # written before stream intervals have only the chunks, one token each).
    return int(record.get("completion_tokens") or record.get("streamed_tokens") or record.get("streamed_chunks") or 0)


@dataclass(frozen=True)
class RoundTripResult:
    checked: int
    passed: int
    failed: int  # rows that decode differently from their record's render
    missing: int  # rows whose record was not among the records given
    failing_ids: list[str]  # the first MAX_FAILING_IDS failed or missing rows

    @property
    def ok(self) -> bool:
        return self.checked > 0 and self.passed == self.checked


# ---------------------------------------------------------------------------------------------
# Records to samples: the filtering shared by the Parquet set and the JSONL export


@dataclass(frozen=True)
class _Sample:
    id: str  # the prompt's, or the conversation's for a conversation's row
    source: str
    mode: str
    prompt: list[dict[str, Any]]  # what precedes the answer: earlier assistant turns with their tool calls
    reasoning: str  # "" when dropped or absent
    answer: str
    tool_calls: list[dict[str, Any]] | None  # the answer's, as the server parsed them
    tools: list[dict[str, Any]] | None  # the tool definitions the template renders
    conversation: bool  # a regenerated conversation's row
    output_tokens: int  # the server's count for the answer
    # The server's ids, packed (``token_ids``), when the row is built from them; otherwise why not.
    prompt_ids: str | None = None
    output_ids: str | None = None
    retokenized: str = ""
    said: str = ""  # the text the server returned, think block inline: what the sampled ids must decode to


@dataclass(frozen=True)
class _ModeRules:
    """How one mode's answers are gated and rendered."""

    kwargs: Mapping[str, Any]  # chat_template_kwargs, as at generation
    thinking: bool | None  # thinking_mode
    end_of_turn: str | None  # what the template closes an assistant turn with; None if unknown
    # For rows from ids: the end of turn's ids, the whitespace after it (Qwen3's newline) as ids,
    # the special tokens (a sampled one ends the turn itself), each token's bytes (None unless byte-level).
    end_of_turn_ids: list[int] = field(default_factory=list)
    trailer_ids: list[int] = field(default_factory=list)
    special_ids: frozenset[int] = frozenset()
    token_bytes: np.ndarray | None = None


def _mode_rules(tokenizer: PreTrainedTokenizerBase, identities: ModeIdentities) -> dict[str, _ModeRules]:
    rules = {}
    for mode in identities.mix.modes:
        tail = _turn_tail(tokenizer, mode.chat_template_kwargs)
        end_of_turn = tail.rstrip() or None
        ids = _encode([end_of_turn or "", tail[len(end_of_turn or "") :]], tokenizer)
        rules[mode.name] = _ModeRules(
            kwargs=mode.chat_template_kwargs,
            thinking=thinking_mode(tokenizer, mode.chat_template_kwargs),
            end_of_turn=end_of_turn,
            end_of_turn_ids=ids[0],
            trailer_ids=ids[1],
            special_ids=frozenset(tokenizer.all_special_ids),
            token_bytes=_token_bytes(tokenizer),
        )
    return rules


def _turn_tail(tokenizer: PreTrainedTokenizerBase, kwargs: Mapping[str, Any]) -> str:
    """The text after the last assistant's content (Qwen3's ``<|im_end|>\\n``); "" if not found."""
    probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARKER}]
    try:
        [text] = _render(tokenizer, [probe], kwargs)
    except TemplateError:
        return ""
    return text.partition(_MARKER)[2] if text.count(_MARKER) == 1 else ""


@functools.lru_cache(maxsize=4)
def _token_bytes(tokenizer: PreTrainedTokenizerBase) -> np.ndarray | None:
    """Each token id's length in bytes, for a byte-level tokenizer (Qwen's, Llama 3's); else None."""
    backend = tokenizer.backend_tokenizer
    if type(backend.decoder).__name__ != "ByteLevel":
        return None
    added = backend.get_added_tokens_decoder()
    vocab = backend.get_vocab(with_added_tokens=True)
    lengths = np.zeros(max(vocab.values()) + 1, dtype=np.int64)
    for token, index in vocab.items():
        # A byte-level token spells one byte a character; an added token is its own text.
        lengths[index] = len(added[index].content.encode()) if index in added else len(token)
    return lengths


def _split_reasoning(reasoning_content: str | None, content: str | None) -> tuple[str, str]:
    """(reasoning, answer); a server without a reasoning parser leaves the think block inline."""
    reasoning, answer = reasoning_content or "", content or ""
    if not reasoning and "</think>" in answer:
        head, _, answer = answer.partition("</think>")
        reasoning = head.split("<think>")[-1]
    return reasoning, answer


def thinking_mode(tokenizer: PreTrainedTokenizerBase, chat_template_kwargs: Mapping[str, Any]) -> bool | None:
    """Whether every answer must carry reasoning (True), none may (False), or either (None).

    A template with a thinking switch (Qwen3's ``enable_thinking``, on unless the kwargs turn it
    off) says which; one without it (Qwen2.5's ChatML, a thinking-only model's) sets no rule.
    """
    template = tokenizer.chat_template
    if "enable_thinking" not in json.dumps(template):
        return None
    return bool(chat_template_kwargs.get("enable_thinking", True))


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    # Templates test content as a string; an assistant turn of only tool calls has none.
    out = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = list(message["tool_calls"])
    return out


def _screen(
    record: Mapping[str, Any], config: TrainingSetConfig, identities: ModeIdentities, rules: Mapping[str, _ModeRules]
) -> _Sample | str:
    """The sample a record gives, or the reason it is left out (``FOLDED`` for an earlier turn)."""
    mode = identities.mode_of(record)
    if mode is None:
        return "other_identity"
    if identities.mix.assign(base_prompt_id(record)).name != mode:
        return "other_mode"
    answered = record.get("status") == OK
    if answered and int(record.get("turn") or 1) < int(record.get("turns") or 1):
        return FOLDED
    # A conversation is as finished as its least finished turn; one the engine stopped for such a
    # turn has a failed record for the next, which counts for that reason.
    finishes = [*(record.get("prior_finish_reasons") or ()), *([record.get("finish_reason")] if answered else [])]
    if any(reason not in FINISHED for reason in finishes):
        return "unfinished"
    if config.drop_truncated and "length" in finishes:
        return "truncated"
    if not answered:
        return _unanswered(record)
    reasoning, answer = _split_reasoning(record.get("reasoning_content"), record.get("content"))
    tool_calls = list(record.get("tool_calls") or ()) or None
    if not answer.strip() and not tool_calls:
        return "empty"
    if any(tag in answer for tag in THINK_TAGS):
        return "think_tag_in_content"
    thinking = rules[mode].thinking
    if thinking is True and not reasoning.strip():
        return "reasoning_missing"
    if thinking is False and reasoning.strip():
        return "reasoning_unexpected"
    retokenized = _why_retokenized(record, reasoning, config, rules[mode])
    return _Sample(
        id=record.get("conversation_id") or record["prompt_id"],
        source=record["source"],
        mode=mode,
        prompt=[_message(m) for m in record["messages"]],
        reasoning=reasoning if config.reasoning == "keep" else "",
        answer=answer,
        tool_calls=tool_calls,
        tools=list(record.get("tools") or ()) or None,
        conversation=bool(record.get("conversation_id")),
        output_tokens=_output_tokens(record),
        prompt_ids=None if retokenized else record[PROMPT_IDS],
        output_ids=None if retokenized else record[OUTPUT_IDS],
        retokenized=retokenized,
        said="" if retokenized else _said(record),
    )


def _why_retokenized(record: Mapping[str, Any], reasoning: str, config: TrainingSetConfig, rules: _ModeRules) -> str:
    """Why an answer's row cannot be its server's ids ("" when it is).

    The rule for ids that disagree with the text: ids that are not whole (the client left them out,
    or ``_prepared`` counts fewer or more than ``completion_tokens``) are never trained, and the row
    falls back to the text; whole ids win over the text they should decode to, and the row says
    whether they do (``ids_match_text``).
    """
    if record.get(PROMPT_IDS) is None or record.get(OUTPUT_IDS) is None:
        return IDS_INCOMPLETE if record.get(IDS_LEFT_OUT) else NO_IDS
    if config.reasoning == "drop" and reasoning.strip():
        return REASONING_DROPPED
    if rules.end_of_turn is None:
        return END_OF_TURN_UNKNOWN
    if record.get("conversation_id") and rules.token_bytes is None:
        return NOT_BYTE_LEVEL
    return ""


def _said(record: Mapping[str, Any]) -> str:
    """The answer as the server returned it, its reasoning inline as Qwen3 writes it."""
    reasoning, content = record.get("reasoning_content"), record.get("content") or ""
    return f"<think>\n{reasoning}\n</think>\n\n{content}" if reasoning else content


def _squashed(text: str) -> str:
    """Text as the ids and the server's text are compared: without whitespace and think tags, which
    reasoning parsers strip and move at the ``</think>`` boundary."""
    text = "".join(text.split())
    for tag in THINK_TAGS:
        text = text.replace(tag, "")
    return text


def _unanswered(record: Mapping[str, Any]) -> str:
    """Why a failure record is no row, named for what happened (a loop is not a server's failure)."""
    if record.get("error") == "degenerate":
        return "degenerate"
    if record.get("error") in ENDINGS:
        return "conversation_ended"
    return "failed"


class AnswerJudge:
    """The training set's rules on one answer of the run's modes, as it arrives: ``ROW``, ``FOLDED``
    (an earlier turn of a conversation, in its last turn's row) or the reason it is left out.

    The same function the build screens each record with (``_screen``); what only the build can see
    (the render splitting, the row's token length) is not judged here.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, config: TrainingSetConfig, identities: ModeIdentities):
        self._config = config
        self._identities = identities
        self._rules = _mode_rules(tokenizer, identities)

    def __call__(self, record: Mapping[str, Any]) -> str:
        screened = _screen(record, self._config, self._identities, self._rules)
        return screened if isinstance(screened, str) else ROW


def _screened_chunks(
    records: Iterable[Mapping[str, Any]], config: TrainingSetConfig, tally: _Tally, rules: Mapping[str, _ModeRules]
) -> Iterator[list[_Sample]]:
    """Samples of at most ``chunk_rows`` records at a time; the records themselves are let go."""
    it = iter(records)
    while True:
        chunk = list(itertools.islice(it, config.chunk_rows))
        if not chunk:
            return
        samples = []
        for record in chunk:
            screened = _screen(record, config, tally.identities, rules)
            if screened == "other_identity":
                tally.other_identity(record)
            elif screened == "other_mode":  # not this mix's work: the prompt is drawn into another mode
                tally.reasons[screened] += 1
            else:
                tally.own(record)
                if screened == FOLDED:
                    tally.fold(record)
                elif isinstance(screened, str):
                    tally.reasons[screened] += 1
                else:
                    samples.append(screened)
        del chunk, record  # so that the next chunk is read with no record of this one alive
        yield samples


def _assistant_message(sample: _Sample) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": sample.answer}
    if sample.reasoning:
        message["reasoning_content"] = sample.reasoning
    if sample.tool_calls:
        message["tool_calls"] = sample.tool_calls
    return message


def _render(
    tokenizer: PreTrainedTokenizerBase,
    conversations: Sequence[Sequence[Mapping[str, Any]]],
    kwargs: Mapping[str, Any],
    tools: list[dict[str, Any]] | None = None,
) -> list[str]:
    """Whole conversations, as a trainer renders them (no generation prompt)."""
    return list(tokenizer.apply_chat_template(list(map(list, conversations)), tools=tools, tokenize=False, **kwargs))


def _segments(
    samples: Sequence[_Sample], tokenizer: PreTrainedTokenizerBase, rules: Mapping[str, _ModeRules]
) -> list[list[str] | None]:
    """Each sample's texts, three per assistant turn (what precedes it, the turn, its trailer),
    together the full render; None where the render does not split."""
    texts: list[list[str] | None] = [None] * len(samples)
    batches: dict[str, list[int]] = {}  # samples of one answer, by mode: rendered in one batch each
    for i, sample in enumerate(samples):
        if not sample.conversation:
            batches.setdefault(sample.mode, []).append(i)
        else:
            texts[i] = _conversation_segments(sample, tokenizer, rules[sample.mode])
    for mode, indices in batches.items():
        group = [samples[i] for i in indices]
        kwargs = rules[mode].kwargs
        prompts = render_prompts(tokenizer, [s.prompt for s in group], kwargs)
        fulls = _render(tokenizer, [[*s.prompt, _assistant_message(s)] for s in group], kwargs)
        for i, sample, prompt, full in zip(indices, group, prompts, fulls):
            texts[i] = _split_render(sample, prompt, full, tokenizer, rules[mode])
    return texts


def _conversation_segments(
    sample: _Sample, tokenizer: PreTrainedTokenizerBase, rules: _ModeRules
) -> list[str] | None:
    # Rendered alone: a batch takes one list of tools for all. A template that refuses a
    # conversation (its roles out of order, say) leaves out that one.
    try:
        [prompt] = render_prompts(tokenizer, [sample.prompt], rules.kwargs, tools=[sample.tools])
        [full] = _render(tokenizer, [[*sample.prompt, _assistant_message(sample)]], rules.kwargs, sample.tools)
        return _split_render(sample, prompt, full, tokenizer, rules)
    except TemplateError:
        return None


def _split_render(
    sample: _Sample, prompt: str, full: str, tokenizer: PreTrainedTokenizerBase, rules: _ModeRules
) -> list[str] | None:
    if not full.startswith(prompt):
        return None  # the generation prompt is not how the template renders the turn
    end = len(full.rstrip())
    assistant = full[len(prompt) : end]
    for name, text in (("content", sample.answer), ("reasoning_content", sample.reasoning)):
        if text.strip() and text.strip() not in assistant:
            raise ValueError(
                f"record {sample.id}: the chat template does not render the assistant's {name}"
                + ("; use reasoning='drop'" if name == "reasoning_content" else "")
            )
    spans = []  # (start, end of turn, end of trailer) of each regenerated assistant turn in ``full``
    for index, message in enumerate(sample.prompt):
        # A prompt's own assistant turns (a source read up to a later user turn) are the dataset's
        # text, never trained; a conversation's are the model's.
        if sample.conversation and message["role"] == "assistant":
            span = _turn_span(sample, index, full, tokenizer, rules)
            if span is None:
                return None
            spans.append(span)
    spans.append((len(prompt), end, len(full)))
    texts, position = [], 0
    for start, stop, trail in spans:
        if not position <= start <= stop <= trail:
            return None
        texts += [full[position:start], full[start:stop], full[stop:trail]]
        position = trail
    return texts


def _turn_span(
    sample: _Sample, index: int, full: str, tokenizer: PreTrainedTokenizerBase, rules: _ModeRules
) -> tuple[int, int, int] | None:
    """Where the earlier assistant turn ``sample.prompt[index]`` lies in ``full``: from its content
    to the end of its end-of-turn text, and to the end of the whitespace after it."""
    if rules.end_of_turn is None:
        return None
    marked = [*sample.prompt[:index], {"role": "assistant", "content": _MARKER}, *sample.prompt[index + 1 :]]
    [render] = _render(tokenizer, [[*marked, _assistant_message(sample)]], rules.kwargs, sample.tools)
    start = render.find(_MARKER)
    tail = render[start + len(_MARKER) :]
    if (
        render.count(_MARKER) != 1
        or render[:start] != full[:start]
        or not full.endswith(tail)
        or len(full) - len(tail) < start
        or not tail.startswith(rules.end_of_turn)
    ):
        return None
    stop = len(full) - len(tail) + len(rules.end_of_turn)
    after = tail[len(rules.end_of_turn) :]
    return start, stop, stop + len(after) - len(after.lstrip())


def _encode(segments: Sequence[str], tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Token ids of every segment, in one parallel batch."""
    # The Rust backend tokenizes the batch on all cores; encode_batch_fast skips the offsets.
    encodings = tokenizer.backend_tokenizer.encode_batch_fast(list(segments), add_special_tokens=False)
    return [e.ids for e in encodings]


def render_digest(full: str, written: str) -> bytes:
    """What a row must decode to, hashed: the whole render and the assistant's (masked) part."""
    return hashlib.blake2b(f"{full}\0{written}".encode(), digest_size=16).digest()


def ids_digest(input_ids: np.ndarray, loss_mask: np.ndarray) -> bytes:
    """What a row built from a server's ids must be, hashed: its ids and mask themselves."""
    data = input_ids.astype("<i4").tobytes() + b"\0" + loss_mask.astype(np.uint8).tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()


def _trained(config: TrainingSetConfig) -> tuple[int, ...]:
    """Which of a turn's three segments (before it, the turn, its trailer) the mask trains."""
    return (1, 2) if config.train_newline_after_end_of_turn else (1,)


def _digest(texts: Sequence[str], config: TrainingSetConfig) -> bytes:
    return render_digest("".join(texts), "".join(t for i, t in enumerate(texts) if i % 3 in _trained(config)))


@dataclass
class _Row:
    """A sample on its way to a row: its segments from the server's ids (three per assistant turn),
    and the texts of the re-tokenizing path, rendered for a row without ids or to measure one."""

    sample: _Sample
    output: list[int] | None = None  # the sampled ids, unpacked
    texts: list[str] | None = None
    ids: list[list[int]] | None = None
    measured: bool = False


@dataclass(frozen=True)
class _Difference:
    """A measured row from ids against its re-tokenization, in tokens (0: the same ids)."""

    row: int
    prompt: int  # the server's prompt ids against the client's own render of the prompt, tokenized


def _differing_tokens(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens of the longer sequence between the longest common prefix and suffix: 0 when equal."""
    x, y = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    n = min(len(x), len(y))
    unequal = np.flatnonzero(x[:n] != y[:n])
    head = int(unequal[0]) if unequal.size else n
    rest = n - head
    unequal = np.flatnonzero(x[len(x) - rest :][::-1] != y[len(y) - rest :][::-1]) if rest else np.empty(0)
    tail = int(unequal[0]) if unequal.size else rest
    return max(len(x), len(y)) - head - tail


def _prepared(
    samples: Sequence[_Sample], tokenizer: PreTrainedTokenizerBase, rules: Mapping[str, _ModeRules], measure: int
) -> tuple[list[_Row], int]:
    """Each sample's row as far as this thread takes it (the Python work: renders, ids unpacked),
    and how many were left out because their render does not split.

    Rendered: rows without ids, conversations (their earlier turns are found in the render) and
    the first ``measure`` rows from ids. A single answer from ids needs no render at all.
    """
    rows = []
    for sample in samples:
        output = None if sample.retokenized else unpack(sample.output_ids or "")
        if output is not None and len(output) != sample.output_tokens:
            # Not as many as the server counted: ids that are not whole are never trained.
            sample, output = dataclasses.replace(sample, prompt_ids=None, output_ids=None, retokenized=IDS_INCOMPLETE), None
        rows.append(_Row(sample, output))
    from_ids = [r for r in rows if not r.sample.retokenized]
    for row in from_ids[:measure]:
        row.measured = True
    rendered = [r for r in rows if r.sample.retokenized or r.sample.conversation or r.measured]
    for row, texts in zip(rendered, _segments([r.sample for r in rendered], tokenizer, rules)):
        row.texts = texts
    kept = []
    for row in rows:
        if not row.sample.retokenized:
            row.ids = _server_segments(row, rules[row.sample.mode], tokenizer)
            if row.ids is None and row.texts is not None:
                # A conversation whose earlier turns cannot be found in the server's prompt: its text.
                row.sample = dataclasses.replace(row.sample, prompt_ids=None, output_ids=None, retokenized=PROMPT_NOT_LOCATED)
            row.measured = row.measured and row.ids is not None and row.texts is not None
        if row.ids is not None or row.texts is not None:
            kept.append(row)
    return kept, len(rows) - len(kept)


def _server_segments(row: _Row, rules: _ModeRules, tokenizer: PreTrainedTokenizerBase) -> list[list[int]] | None:
    """A row from the server's ids: its prompt ids, the sampled ids closed by the end of turn, the trailer.

    A sampled end of turn (or another special token the server stopped at) closes the turn itself;
    an answer without one (cut at ``max_tokens``) gets the template's. A conversation's earlier
    turns are the server's own rendering of them in the last turn's prompt (the context the model
    answered the last turn in; Qwen3's template drops their reasoning): they are found where the
    client's render puts them, through each token's bytes, so the prompt must decode to that render
    exactly; None where it does not (or the render does not split).
    """
    sample, texts = row.sample, row.texts
    prompt, output = unpack(sample.prompt_ids or ""), row.output or []
    eot = rules.end_of_turn_ids
    closed = output[-len(eot) :] == eot or (output and output[-1] in rules.special_ids)
    answer = output if closed else output + eot
    if not sample.conversation:
        return [prompt, answer, rules.trailer_ids]
    if texts is None or rules.token_bytes is None:
        return None
    if tokenizer.backend_tokenizer.decode(prompt, skip_special_tokens=False) != "".join(texts[:-2]):
        return None
    ends = np.cumsum(rules.token_bytes[np.asarray(prompt, dtype=np.int64)])
    cuts = np.cumsum([len(t.encode()) for t in texts[:-3]])
    # A token across a boundary (a header's newline merged with the answer's first characters)
    # goes to the segment after it.
    bounds = [0, *np.searchsorted(ends, cuts, side="right").tolist(), len(prompt)]
    return [prompt[a:b] for a, b in zip(bounds, bounds[1:])] + [answer, rules.trailer_ids]


def _flat(segments: Sequence[Sequence[int]]) -> list[int]:
    return list(itertools.chain.from_iterable(segments))


def _agrees(decoded: str, sample: _Sample) -> bool:
    """Whether sampled ids decode to the text the server returned: the same, or the same once
    ``_squashed``. A tool parser moves the calls out of the content: after it, the ids must still
    name each call."""
    if decoded == sample.said:
        return True
    text, said = _squashed(decoded), _squashed(sample.said)
    if not sample.tool_calls:
        return text == said
    names = [_squashed(str((call.get("function") or {}).get("name") or "")) for call in sample.tool_calls]
    return text.startswith(said) and all(name in text for name in names)


@dataclass
class _Chunk:
    """Rows of a chunk of records: their segments (three per assistant turn: before it, the turn,
    its trailer), flat, and for each row its turns, digest, source of ids and measurement."""

    samples: list[_Sample] = field(default_factory=list)
    ids: list[Sequence[int]] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    digests: list[bytes | None] = field(default_factory=list)  # a render's; None for a row from ids (``_digests``)
    match_text: list[bool | None] = field(default_factory=list)  # None: re-tokenized
    differences: list[_Difference | None] = field(default_factory=list)  # None: not measured
    trained: list[int] = field(default_factory=list)  # each row's tokens of loss_mask 1

    def add(self, sample: _Sample, segments: Sequence[Sequence[int]], digest: bytes | None,
            match_text: bool | None, difference: _Difference | None) -> None:
        self.samples.append(sample)
        self.ids.extend(segments)
        self.turns.append(len(segments) // 3)
        self.digests.append(digest)
        self.match_text.append(match_text)
        self.differences.append(difference)


def _tokenize(rows: Sequence[_Row], tokenizer: PreTrainedTokenizerBase, config: TrainingSetConfig) -> _Chunk:
    """The tokenizer's work on a chunk's rows, one batch each way (off the main thread: the Rust
    backend releases the GIL): the texts of re-tokenized and measured rows encoded, each measured
    prompt encoded whole as a server would, each sampled answer decoded to compare with its text."""
    retokenize = [r for r in rows if r.ids is None or r.measured]
    measured = [r for r in rows if r.measured]
    encoded = _encode([t for r in retokenize for t in r.texts or ()] + ["".join((r.texts or ())[:-2]) for r in measured], tokenizer)
    position, segments_of = 0, {}
    for row in retokenize:
        segments_of[id(row)] = encoded[position : position + len(row.texts or ())]
        position += len(row.texts or ())
    client_prompts = iter(encoded[position:])
    answers = [r.ids[-2] for r in rows if r.ids is not None]
    decoded = iter(tokenizer.backend_tokenizer.decode_batch(answers, skip_special_tokens=True))
    chunk = _Chunk()
    for row in rows:
        if row.ids is None:
            chunk.add(row.sample, segments_of[id(row)], _digest(row.texts or (), config), None, None)
            continue
        difference = None
        if row.measured:
            retokenized = segments_of[id(row)]
            difference = _Difference(
                row=_differing_tokens(_flat(row.ids), _flat(retokenized)),
                prompt=_differing_tokens(_flat(row.ids[:-2]), next(client_prompts)),
            )
        chunk.add(row.sample, row.ids, None, _agrees(next(decoded), row.sample), difference)
    return chunk


def _encoded_chunks(
    records: Iterable[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    config: TrainingSetConfig,
    tally: _Tally,
) -> Iterator[_Chunk]:
    """The rows of each chunk of records, tokenized, with their digests, in input order.

    One chunk is tokenized in a worker thread (the Rust backend releases the GIL and uses every
    core) while this thread renders the next chunk and the consumer writes the previous one, so
    the Python work hides behind tokenization. At most three chunks of samples are alive.
    """
    rules = _mode_rules(tokenizer, tally.identities)
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending: Future[_Chunk] | None = None
        for samples in _screened_chunks(records, config, tally, rules):
            rows, mismatched = _prepared(samples, tokenizer, rules, MEASURED_PER_CHUNK)
            tally.reasons["render_mismatch"] += mismatched
            if not rows:
                continue
            future = pool.submit(_tokenize, rows, tokenizer, config)
            if pending is not None:
                yield _within_length(pending.result(), config, tally.reasons)
            pending = future
        if pending is not None:
            yield _within_length(pending.result(), config, tally.reasons)


def _within_length(built: _Chunk, config: TrainingSetConfig, left_out: Counter[str]) -> _Chunk:
    kept = _Chunk()
    trained = _trained(config)
    position = 0
    for sample, count, digest, match, difference in zip(
        built.samples, built.turns, built.digests, built.match_text, built.differences
    ):
        segments = built.ids[position : position + 3 * count]
        position += 3 * count
        length = sum(map(len, segments))
        if length > config.max_length:
            left_out["too_long"] += 1
        elif length < config.min_length:
            left_out["too_short"] += 1
        else:
            kept.add(sample, segments, digest, match, difference)
            kept.trained.append(sum(len(s) for i, s in enumerate(segments) if i % 3 in trained))
    return kept


# ---------------------------------------------------------------------------------------------
# The Parquet training set


def _table(chunk: _Chunk, config: TrainingSetConfig) -> pa.Table:
    ids = chunk.ids
    segment_lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    values = np.concatenate([np.asarray(s, dtype=np.int32) for s in ids]) if ids else np.empty(0, np.int32)
    # Segments alternate before the turn, the turn, its trailer: the mask is 0, 1 and the
    # convention's over their lengths; a sample is its turns' segments.
    trailer = int(config.train_newline_after_end_of_turn)
    pattern = np.tile(np.array([0, 1, trailer], dtype=np.uint8), len(ids) // 3)
    mask = np.repeat(pattern, segment_lengths)
    turn_lengths = segment_lengths.reshape(-1, 3).sum(axis=1)
    first_turns = np.concatenate([[0], np.cumsum(chunk.turns)[:-1]])
    lengths = np.add.reduceat(turn_lengths, first_turns)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    return pa.Table.from_arrays(
        [
            pa.array([s.id for s in chunk.samples], pa.string()),
            pa.array([s.source for s in chunk.samples], pa.string()),
            pa.ListArray.from_arrays(offsets, pa.array(values)),
            pa.ListArray.from_arrays(offsets, pa.array(mask)),
            pa.array(lengths.astype(np.int32)),
            pa.array([RETOKENIZED if m is None else FROM_SERVER for m in chunk.match_text], pa.string()),
            pa.array(chunk.match_text, pa.bool_()),
        ],
        schema=SCHEMA,
    )


def _digests(chunk: _Chunk, table: pa.Table) -> list[bytes]:
    """Each row's digest (``BuildTrace.renders``): its render's, or for a row from ids, taken from the
    table only when asked for (a build without a trace hashes nothing), its ids' and mask's."""
    ids, masks = table.column("input_ids"), table.column("loss_mask")
    return [
        ids_digest(ids[i].values.to_numpy(), masks[i].values.to_numpy()) if digest is None else digest
        for i, digest in enumerate(chunk.digests)
    ]


class _ShardWriter:
    """Parquet shards ``part-00000.parquet``... of at most ``rows_per_file`` rows each."""

    def __init__(self, directory: Path, rows_per_file: int):
        self._directory = directory
        self._rows_per_file = rows_per_file
        self._writer: pq.ParquetWriter | None = None
        self._files: list[dict[str, Any]] = []

    def write(self, table: pa.Table) -> None:
        while table.num_rows:
            if self._writer is None or self._files[-1]["rows"] == self._rows_per_file:
                self._open()
            part = table.slice(0, self._rows_per_file - self._files[-1]["rows"])
            table = table.slice(part.num_rows)
            self._writer.write_table(part, row_group_size=part.num_rows)
            self._files[-1]["rows"] += part.num_rows

    def _open(self) -> None:
        if self._writer is not None:
            self._writer.close()
        name = f"part-{len(self._files):05d}.parquet"
        self._writer = pq.ParquetWriter(self._directory / name, SCHEMA, **_PARQUET_OPTIONS)
        self._files.append({"name": name, "rows": 0})

    def close(self) -> list[dict[str, Any]]:
        if self._writer is None:
            self._open()  # an empty set still gets one (empty) shard, so that it loads
        self._writer.close()
        return [{**f, "sha256": _sha256(self._directory / f["name"])} for f in self._files]


class _Stats:
    """Counts that stay bounded: lengths are binned exactly, one counter per possible length."""

    def __init__(self, max_length: int):
        self.length_counts = np.zeros(max_length + 1, dtype=np.int64)
        self.assistant_tokens = 0
        self.by_source: dict[str, dict[str, int]] = {}
        self.by_mode: Counter[tuple[str, str]] = Counter()  # (mode, "samples" | "assistant_tokens")
        self.conversations: set[str] = set()  # ids of the rows that are whole conversations
        self.output_tokens = 0  # the server's count for the answers that became rows
        self.from_server = 0  # rows from the server's ids
        self.text_differs = 0  # of those, rows whose sampled ids decode to other text than the server's
        self.retokenized: Counter[str] = Counter()  # why each re-tokenized row is
        self.measured: Counter[str] = Counter()  # rows from ids re-tokenized too: the sums
        self.most: Counter[str] = Counter()  # and the largest differences

    def add(self, table: pa.Table, chunk: _Chunk) -> None:
        lengths = table.column("length").to_numpy()
        self.length_counts += np.bincount(lengths, minlength=self.length_counts.size)
        self.assistant_tokens += sum(chunk.trained)
        for source, length in zip(table.column("source").to_pylist(), lengths.tolist()):
            entry = self.by_source.setdefault(source, {"samples": 0, "tokens": 0})
            entry["samples"] += 1
            entry["tokens"] += length
        for sample, trained in zip(chunk.samples, chunk.trained):
            self.by_mode[sample.mode, "samples"] += 1
            self.by_mode[sample.mode, "assistant_tokens"] += trained
            self.output_tokens += sample.output_tokens
            if sample.conversation:
                self.conversations.add(sample.id)
        for sample, match, difference in zip(chunk.samples, chunk.match_text, chunk.differences):
            if match is None:
                self.retokenized[sample.retokenized] += 1
                continue
            self.from_server += 1
            self.text_differs += not match
            if difference is not None:
                for name, tokens in (("", difference.row), ("prompt_", difference.prompt)):
                    self.measured[f"{name}rows_differing"] += tokens > 0
                    self.measured[f"{name}tokens_differing_sum"] += tokens
                    self.most[f"{name}tokens_differing_max"] = max(self.most[f"{name}tokens_differing_max"], tokens)
                self.measured["rows_measured"] += 1

    def retokenization(self, chunk_rows: int) -> dict[str, Any]:
        """The measured difference between rows from ids and their re-tokenization (``Manifest.retokenization``)."""
        names = ("rows_measured", "rows_differing", "tokens_differing_sum", "tokens_differing_max",
                 "prompt_rows_differing", "prompt_tokens_differing_sum", "prompt_tokens_differing_max")
        return {
            "sample": f"the first {MEASURED_PER_CHUNK} rows from ids of each chunk of {chunk_rows} records",
            **{name: self.measured[name] + self.most[name] for name in names},
        }

    def modes(self, identities: ModeIdentities) -> dict[str, dict[str, Any]]:
        """Each mode: its configured share and settings, and the rows and trained tokens it got."""
        samples = int(self.length_counts.sum())
        section = {}
        for mode in identities.mix.describe():
            rows = self.by_mode[mode["name"], "samples"]
            section[mode["name"]] = {
                "share": mode["share"],
                "fingerprint": identities.by_mode[mode["name"]].fingerprint,
                "settings": json.loads(json.dumps(mode["settings"])),  # as the manifest reads back
                "samples": rows,
                "sample_share": round(rows / samples, 4) if samples else 0.0,
                "assistant_tokens": self.by_mode[mode["name"], "assistant_tokens"],
            }
        return section

    def summary(self) -> tuple[int, int, dict[str, float], dict[str, Any]]:
        """samples, tokens, tokens per sample, histogram."""
        counts = self.length_counts
        samples = int(counts.sum())
        tokens = int((counts * np.arange(counts.size)).sum())
        if samples == 0:
            zero = {k: 0 for k in ("mean", "p50", "p90", "p99", "max")}
            return 0, 0, zero, {"start": 0, "bin_width": 1, "counts": []}
        cumulative = np.cumsum(counts)
        nonzero = np.flatnonzero(counts)
        low, high = int(nonzero[0]), int(nonzero[-1])

        def rank(q: float) -> int:  # nearest-rank percentile: exact, no interpolation
            return int(np.searchsorted(cumulative, math.ceil(q * samples)))

        per_sample = {
            "mean": round(tokens / samples, 2),
            "p50": rank(0.50),
            "p90": rank(0.90),
            "p99": rank(0.99),
            "max": high,
        }
        width = max(1, math.ceil((high - low + 1) / HISTOGRAM_BINS))
        bins = math.ceil((high - low + 1) / width)
        padded = np.zeros(bins * width, dtype=np.int64)
        padded[: high - low + 1] = counts[low : high + 1]
        histogram = {
            "start": low,
            "bin_width": width,
            "counts": padded.reshape(bins, width).sum(axis=1).tolist(),
        }
        return samples, tokens, per_sample, histogram


def build_training_set(
    records: Iterable[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    config: TrainingSetConfig,
    out_dir: str | os.PathLike[str],
    *,
    identities: ModeIdentities,
    known: Mapping[str, Identity] | None = None,
    trace: BuildTrace | None = None,
) -> Manifest:
    """Write the outputs ``config.formats`` names, ``manifest.json`` and the card under ``out_dir``, replacing what was there.

    Only records of ``identities`` are taken, each prompt's under the mode the mix draws it into,
    rendered with that mode's chat_template_kwargs; ``known`` (the store's registry, by
    fingerprint) names the other identities in the manifest. ``trace``, if given, is filled with
    what the pass saw.

    Everything is written into a sibling temporary folder that is renamed into place at the end,
    so ``out_dir`` only ever holds a complete set (between the two renames that replace an old set
    it is briefly absent). The same records in the same order give byte-identical files.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)  # left by a crashed run of a recycled pid
    staging.mkdir()
    try:
        manifest = _write_training_set(records, tokenizer, config, staging, _Tally(identities, known or {}, trace))
        # On disk before the rename, so that a machine crash cannot leave a renamed set whose
        # files were still in the page cache.
        for path in [*staging.iterdir(), staging]:
            _fsync(path)
        _replace_dir(staging, out_dir)
        _fsync(out_dir.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


class _JsonlOutputs:
    """The trainers' JSONL files of a build, each opened only when its format is asked for."""

    def __init__(self, directory: Path, formats: Collection[str]):
        names = {FORMATS[f] for f in formats if f != "parquet"}
        self._files = {name: open(directory / name, "wb") for name in sorted(names)}

    def write(self, samples: Sequence[_Sample], table: pa.Table) -> None:
        if CONVERSATIONS_NAME in self._files:
            self._files[CONVERSATIONS_NAME].write("".join(map(_conversation_line, samples)).encode())
        if PRETOKENIZED_NAME in self._files:
            # polars writes the int lists in Rust: JSON for hundreds of millions of tokens.
            pl.from_arrow(table.select(["id", "input_ids", "loss_mask"])).write_ndjson(
                self._files[PRETOKENIZED_NAME]
            )

    def close(self) -> list[dict[str, Any]]:
        for fh in self._files.values():
            fh.close()
        return [{"name": name, "sha256": _sha256(Path(fh.name))} for name, fh in self._files.items()]


def _write_training_set(
    records: Iterable[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    config: TrainingSetConfig,
    directory: Path,
    tally: _Tally,
) -> Manifest:
    stats = _Stats(config.max_length)
    writer = _ShardWriter(directory, config.rows_per_file)
    jsonl = _JsonlOutputs(directory, config.formats)
    try:
        for chunk in _encoded_chunks(records, tokenizer, config, tally):
            if not chunk.samples:
                continue
            table = _table(chunk, config)
            writer.write(table)
            jsonl.write(chunk.samples, table)
            stats.add(table, chunk)
            if tally.trace is not None:
                for sample, digest in zip(chunk.samples, _digests(chunk, table)):
                    tally.trace.renders.setdefault(sample.id, []).append(digest)
    finally:
        files = writer.close() + jsonl.close()
    shards = [f["name"] for f in files if f["name"].endswith(".parquet")]
    samples, tokens, per_sample, histogram = stats.summary()
    template = json.dumps(tokenizer.chat_template, sort_keys=True).encode()
    # A conversation's row holds its earlier turns' answers too.
    in_set = stats.output_tokens + sum(tally.folded_tokens[c] for c in stats.conversations)
    identity = _identity(tally.identities)
    manifest = Manifest(
        samples=samples,
        tokens=tokens,
        assistant_tokens=stats.assistant_tokens,
        tokens_per_sample=per_sample,
        by_source=dict(sorted(stats.by_source.items())),
        left_out=tally.left_out(),
        other_identities=dict(sorted(tally.others.items())),
        identity=identity,
        simulated=identity["simulated"],
        histogram=histogram,
        config=config.to_dict(),
        tokenizer={
            "vocab_size": len(tokenizer),
            "chat_template_sha256": hashlib.sha256(template).hexdigest(),
        },
        files=[f for f in files if f["name"] in shards],
        output_tokens=tally.output_tokens,
        output_tokens_in_set=in_set,
        useful_token_share=round(in_set / tally.output_tokens, 4) if tally.output_tokens else 0.0,
        outputs={f: shards if f == "parquet" else [FORMATS[f]] for f in config.formats},
        trainer_files=[f for f in files if f["name"] not in shards],
        mask_convention=mask_convention(config),
        modes=stats.modes(tally.identities),
        conversations=len(stats.conversations),
        conversation_turns_folded=tally.folded,
        ids_from={FROM_SERVER: stats.from_server, RETOKENIZED: sum(stats.retokenized.values())},
        retokenized_because=dict(sorted(stats.retokenized.items())),
        ids_text_differs=stats.text_differs,
        retokenization=stats.retokenization(config.chunk_rows),
    )
    (directory / CARD_NAME).write_text(dataset_card(manifest))
    (directory / MANIFEST_NAME).write_text(manifest.to_json())
    return manifest


def _identity(identities: ModeIdentities) -> dict[str, Any]:
    """What the set was taken from: a run without modes, its identity; a mix, the model and one
    fingerprint of every mode's settings, share and the draw's seed (each mode: ``Manifest.modes``)."""
    if len(identities.by_mode) == 1:
        return next(iter(identities.by_mode.values())).to_dict()
    first = identities.identities[0]
    mix = [[m["name"], m["share"], identities.by_mode[m["name"]].fingerprint] for m in identities.mix.describe()]
    canonical = json.dumps({"modes": mix, "seed": identities.mix.seed}, sort_keys=True).encode()
    return {"model": first.model, "simulated": first.simulated,
            "fingerprint": hashlib.sha256(canonical).hexdigest()[:16], "settings": {}}


def mask_convention(config: TrainingSetConfig) -> str:
    return MASK_CONVENTION.format(
        newline="trained (mask 1), as SpecForge and speculators train it"
        if config.train_newline_after_end_of_turn
        else "not trained (mask 0): the model stops at the end-of-turn token and never writes it"
    )


def _replace_dir(new: Path, target: Path) -> None:
    if target.exists():
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
        os.rename(new, target)
        shutil.rmtree(old)
    else:
        os.rename(new, target)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # directories too, on Linux
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def data_files(out_dir: str | os.PathLike[str]) -> list[str]:
    """The shard paths (URLs) of a built set, for ``datasets.load_dataset("parquet", data_files=...)``."""
    return [str(as_upath(out_dir) / f["name"]) for f in Manifest.read(out_dir).files]


# ---------------------------------------------------------------------------------------------
# Checking a built set against its records


def sample_rows(out_dir: str | os.PathLike[str], n: int) -> list[dict[str, Any]]:
    """``n`` rows spread evenly over the set, reading only the row groups that hold them."""
    manifest = Manifest.read(out_dir)
    if manifest.samples == 0 or n <= 0:
        return []
    wanted = sorted({i * manifest.samples // n for i in range(min(n, manifest.samples))})
    rows: list[dict[str, Any]] = []
    first = 0  # global index of the current row group's first row
    for entry in manifest.files:
        with (as_upath(out_dir) / entry["name"]).open("rb") as fh:
            parquet = pq.ParquetFile(fh)
            for group in range(parquet.num_row_groups):
                size = parquet.metadata.row_group(group).num_rows
                local = [i - first for i in wanted if first <= i < first + size]
                if local:
                    rows.extend(parquet.read_row_group(group).take(local).to_pylist())
                first += size
    return rows


def expected_renders(
    records: Iterable[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    config: TrainingSetConfig,
    *,
    identities: ModeIdentities,
    ids: Collection[str] | None = None,
) -> dict[str, list[bytes]]:
    """Render digests of the rows the records of ``identities`` give (those whose row id is in
    ``ids``: the prompt's, or the conversation's), rendered afresh.

    What ``BuildTrace.renders`` holds, computed from records instead of by a build: a row from a
    server's ids has the digest of those ids and their mask (``ids_digest``).
    """
    candidates: list[_Sample] = []
    rules = _mode_rules(tokenizer, identities)
    for record in records:
        if ids is None or (record.get("conversation_id") or record.get("prompt_id")) in ids:
            screened = _screen(record, config, identities, rules)
            if not isinstance(screened, str):
                candidates.append(screened)
    expected: dict[str, list[bytes]] = {}
    rows, _ = _prepared(candidates, tokenizer, rules, measure=0)
    chunk = _tokenize(rows, tokenizer, config)
    for sample, digest in zip(chunk.samples, _digests(chunk, _table(chunk, config)) if chunk.samples else ()):
        expected.setdefault(sample.id, []).append(digest)
    return expected


def check_round_trip(
    rows: Iterable[Mapping[str, Any]],
    expected: Mapping[str, Collection[bytes]],
    tokenizer: PreTrainedTokenizerBase,
) -> RoundTripResult:
    """Check rows against the renders their records give (``expected``: a build's trace, or ``expected_renders``).

    A row passes when its ids decode to the conversation's render and its masked ids decode to
    exactly the assistant's part (answer, kept reasoning and end-of-turn token), or, for a row from
    a server's ids, when its ids and mask are those the record's ids give. A row whose id has
    no expected render (e.g. made from another identity's answer) is missing. A prompt answered
    more than once passes if any of its renders matches.
    """
    rows = list(rows)
    decode = tokenizer.backend_tokenizer.decode
    passed = failed = missing = 0
    failing: list[str] = []
    for row in rows:
        ids = [int(i) for i in row["input_ids"]]
        mask = [int(m) for m in row["loss_mask"]]
        if row["id"] not in expected:
            missing += 1
            ok = False
        else:
            full = decode(ids, skip_special_tokens=False)
            written = decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
            digests = (render_digest(full, written), ids_digest(np.asarray(ids), np.asarray(mask)))
            ok = len(ids) == len(mask) == row["length"] and any(d in expected[row["id"]] for d in digests)
            passed += ok
            failed += not ok
        if not ok and len(failing) < MAX_FAILING_IDS:
            failing.append(row["id"])
    return RoundTripResult(
        checked=len(rows), passed=passed, failed=failed, missing=missing, failing_ids=failing
    )


# ---------------------------------------------------------------------------------------------
# The conversations JSONL of SpecForge-style trainers


def _conversation_line(sample: _Sample) -> str:
    answer = sample.answer
    if sample.reasoning:
        # Stripped as Qwen3's template strips them, so both routes render the same text.
        answer = INLINE_REASONING.format(
            reasoning=sample.reasoning.strip("\n"), answer=answer.lstrip("\n")
        )
    final: dict[str, Any] = {"role": "assistant", "content": answer}
    if sample.tool_calls:
        final["tool_calls"] = sample.tool_calls
    line: dict[str, Any] = {"id": sample.id, "conversations": [*sample.prompt, final]}
    if sample.tools:
        # As text, as SpecForge takes it: tools differ in shape, and a JSON reader inferring one
        # schema for the column would fill each tool with the others' fields.
        line["tools"] = json.dumps(sample.tools, ensure_ascii=False)
    return json.dumps(line, ensure_ascii=False) + "\n"


# ---------------------------------------------------------------------------------------------
# Markdown for the Dagster UI


def manifest_markdown(manifest: Manifest) -> str:
    """Totals, a histogram of tokens per sample (an embedded PNG), tables by source and reason."""
    per = manifest.tokens_per_sample
    model = manifest.identity["model"]
    lines = [
        f"**Built from SIMULATED completions** ({model}): simulator answers, not a model's; for "
        "trying the pipeline, never for training a drafter."
        if manifest.simulated
        else f"Completions of **{model}**.",
        f"Settings fingerprint `{manifest.identity['fingerprint']}` (model, sampling settings, cap).",
        "",
        f"**{manifest.samples:,} samples**, {manifest.tokens:,} tokens "
        f"({manifest.assistant_tokens:,} written by the assistant). Tokens per sample: "
        f"mean {per['mean']:,}, p50 {per['p50']:,}, p90 {per['p90']:,}, p99 {per['p99']:,}, "
        f"max {per['max']:,}.",
        "",
    ]
    histogram = manifest.histogram
    if histogram["counts"]:
        start, width = histogram["start"], histogram["bin_width"]
        end = start + width * len(histogram["counts"]) - 1
        uri = png_data_uri(bar_chart_png(histogram["counts"]))
        lines += [
            f"![tokens per sample]({uri})",
            "",
            f"*Tokens per sample from {start:,} to {end:,}, bins of {width:,}.*",
            "",
        ]
    lines += ["| source | samples | tokens |", "|---|---:|---:|"]
    lines += [
        f"| {source} | {entry['samples']:,} | {entry['tokens']:,} |"
        for source, entry in manifest.by_source.items()
    ]
    lines += ["", *mode_table(manifest)]
    if manifest.conversations or manifest.conversation_turns_folded:
        lines += ["", f"{manifest.conversations:,} of the samples are whole conversations (every assistant "
                  f"turn trained), holding {manifest.conversation_turns_folded:,} records of earlier turns."]
    lines += ["", *token_ids_lines(manifest)[:3]]
    lines += ["", "| left out | records |", "|---|---:|"]
    lines += [f"| {reason} | {count:,} |" for reason, count in manifest.left_out.items()]
    if manifest.other_identities:
        lines += ["", "| left out: other identity | records |", "|---|---:|"]
        lines += [f"| {label} | {count:,} |" for label, count in manifest.other_identities.items()]
    return "\n".join(lines) + "\n"
