"""The tokenized drafter training set, built from completion records.

Each kept completion becomes one sample: the prompt and the target model's answer rendered with
the chat template, as token ids plus a loss mask that is 1 on exactly the tokens the assistant
wrote. Templates such as Qwen3's have no ``{% generation %}`` markers, so the assistant's part is
found in the rendered text:

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
* The prompt, the assistant's part and that trailer are tokenized as three texts and concatenated.
  Tokenized whole, a render can merge characters across the boundary (Qwen's vocabulary with a
  ChatML template like Qwen2.5's turns ``assistant\\n`` + an answer starting ``" \\n"`` into one
  ``"\\n \\n"`` token), and no offset can split that token. Tokenized apart, the prompt's ids are
  exactly those the server fed the model, and the answer's start where its generation started.
* With ``reasoning="drop"`` Qwen3's template still renders an empty ``<think>\\n\\n</think>\\n\\n``
  on the final turn. Pass ``chat_template_kwargs={"enable_thinking": False}`` so that it is prompt,
  as the server renders it in non-thinking mode; otherwise it counts as written by the assistant.

Which records: exactly those of the current ``Identity`` (the model as served, simulated or not, the
sampling settings and the cap: a record's key must be that identity's key for its prompt), and of
those only complete answers: ``finish_reason`` ``stop``, or ``length`` unless ``drop_truncated``.
Everything else is counted by reason (and other identities by name) in the manifest, never merged.
The answers themselves pass quality gates, each a counted reason: an empty answer; a raw ``<think>``
or ``</think>`` left in the content; reasoning missing while the template's thinking is on, or
present while it is off (``thinking_mode``).

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
from transformers import PreTrainedTokenizerBase

from expansion_dag.dataset_card import dataset_card
from expansion_dag.manifest import MANIFEST_NAME, Manifest
from expansion_dag.histogram import bar_chart_png, png_data_uri
from expansion_dag.store import OK, Identity
from expansion_dag.tokenizer import render_prompts
from expansion_dag.urls import as_upath

DEFAULT_MAX_LENGTH = 32_768  # Qwen3's native context
DEFAULT_MIN_LENGTH = 16
DEFAULT_CHUNK_ROWS = 512  # peak memory: about 250 bytes per token of a chunk (3 in flight)
DEFAULT_ROWS_PER_FILE = 50_000  # about 100M tokens, a few hundred MB, per shard
REASONING_POLICIES = ("keep", "drop")
LEFT_OUT_REASONS = (
    "other_identity", "failed", "unfinished", "truncated",
    # The quality gates on the answer itself.
    "empty", "think_tag_in_content", "reasoning_missing", "reasoning_unexpected",
    "too_long", "too_short",
)
THINK_TAGS = ("<think>", "</think>")
#: Answers the model finished; anything else (``abort``, ``unknown``...) is left out as unfinished.
FINISHED = ("stop", "length")
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
    "with its think tags, and the end-of-turn token. The generation prompt (`<|im_start|>assistant\\n`, "
    "and with thinking off the empty think block the template adds) is 0. The newline the "
    "template writes after the end-of-turn token is {newline}."
)
HISTOGRAM_BINS = 40
MAX_FAILING_IDS = 10

SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("length", pa.int32()),
    ]
)
# Spelled out so that a pyarrow upgrade changing its defaults cannot silently change the bytes.
_PARQUET_OPTIONS: dict[str, Any] = {
    "version": "2.6",
    "compression": "zstd",
    "compression_level": 3,
    "use_dictionary": ["source"],
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
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # as at generation
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
        kwargs = dict(self.chat_template_kwargs)
        try:
            json.dumps(kwargs, sort_keys=True)
        except TypeError as exc:
            raise ValueError(f"chat_template_kwargs must be JSON values: {exc}") from exc
        object.__setattr__(self, "chat_template_kwargs", kwargs)  # a copy the caller cannot mutate

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
    """Records left out: by reason, and those of other identities by identity; the identity's output tokens."""

    identity: Identity
    known: Mapping[str, Identity]  # fingerprint -> identity, to name the other identities
    trace: BuildTrace | None = None
    reasons: Counter[str] = field(default_factory=Counter)
    others: Counter[str] = field(default_factory=Counter)
    output_tokens: int = 0

    def own(self, record: Mapping[str, Any]) -> None:
        """A record of the identity: its tokens were generated, whatever becomes of it."""
        tokens = _output_tokens(record)
        self.output_tokens += tokens
        if self.trace is not None:
            if record.get("status") == OK:
                self.trace.completion_tokens[record["prompt_id"]] = tokens
            else:
                self.trace.failed.add(record["prompt_id"])

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
    id: str
    source: str
    prompt: list[dict[str, str]]
    reasoning: str  # "" when dropped or absent
    answer: str
    output_tokens: int  # the server's count for the answer


def _split_reasoning(reasoning_content: str | None, content: str | None) -> tuple[str, str]:
    """(reasoning, answer); a server without a reasoning parser leaves the think block inline."""
    reasoning, answer = reasoning_content or "", content or ""
    if not reasoning and "</think>" in answer:
        head, _, answer = answer.partition("</think>")
        reasoning = head.split("<think>")[-1]
    return reasoning, answer


def thinking_mode(tokenizer: PreTrainedTokenizerBase, config: TrainingSetConfig) -> bool | None:
    """Whether every answer must carry reasoning (True), none may (False), or either (None).

    A template with a thinking switch (Qwen3's ``enable_thinking``, on unless the kwargs turn it
    off) says which; one without it (Qwen2.5's ChatML, a thinking-only model's) sets no rule.
    """
    template = tokenizer.chat_template
    if "enable_thinking" not in json.dumps(template):
        return None
    return bool(config.chat_template_kwargs.get("enable_thinking", True))


def _screen(
    record: Mapping[str, Any], config: TrainingSetConfig, identity: Identity, thinking: bool | None
) -> _Sample | str:
    """The sample a record gives, or the reason it is left out."""
    if not identity.owns(record):
        return "other_identity"
    if record.get("status") != OK:
        return "failed"
    if record.get("finish_reason") not in FINISHED:
        return "unfinished"
    if config.drop_truncated and record.get("finish_reason") == "length":
        return "truncated"
    reasoning, answer = _split_reasoning(record.get("reasoning_content"), record.get("content"))
    if not answer.strip():
        return "empty"
    if any(tag in answer for tag in THINK_TAGS):
        return "think_tag_in_content"
    if thinking is True and not reasoning.strip():
        return "reasoning_missing"
    if thinking is False and reasoning.strip():
        return "reasoning_unexpected"
    return _Sample(
        id=record["prompt_id"],
        source=record["source"],
        prompt=[{"role": m["role"], "content": m["content"]} for m in record["messages"]],
        reasoning=reasoning if config.reasoning == "keep" else "",
        answer=answer,
        output_tokens=_output_tokens(record),
    )


def _screened_chunks(
    records: Iterable[Mapping[str, Any]], config: TrainingSetConfig, tally: _Tally, thinking: bool | None
) -> Iterator[list[_Sample]]:
    """Samples of at most ``chunk_rows`` records at a time; the records themselves are let go."""
    it = iter(records)
    while True:
        chunk = list(itertools.islice(it, config.chunk_rows))
        if not chunk:
            return
        samples = []
        for record in chunk:
            screened = _screen(record, config, tally.identity, thinking)
            if screened != "other_identity":
                tally.own(record)
            if screened == "other_identity":
                tally.other_identity(record)
            elif isinstance(screened, str):
                tally.reasons[screened] += 1
            else:
                samples.append(screened)
        del chunk, record  # so that the next chunk is read with no record of this one alive
        yield samples


def _assistant_message(sample: _Sample) -> dict[str, str]:
    message = {"role": "assistant", "content": sample.answer}
    if sample.reasoning:
        message["reasoning_content"] = sample.reasoning
    return message


def _segments(
    samples: Sequence[_Sample], tokenizer: PreTrainedTokenizerBase, config: TrainingSetConfig
) -> list[tuple[str, str, str]]:
    """(prompt, assistant, trailer) texts of each sample; together they are the full render."""
    if not samples:
        return []
    kwargs = config.chat_template_kwargs
    prompts = render_prompts(tokenizer, [s.prompt for s in samples], kwargs)
    fulls = tokenizer.apply_chat_template(
        [s.prompt + [_assistant_message(s)] for s in samples], tokenize=False, **kwargs
    )
    return [_split_render(s, p, f, kwargs) for s, p, f in zip(samples, prompts, fulls)]


def _split_render(
    sample: _Sample, prompt: str, full: str, kwargs: Mapping[str, Any]
) -> tuple[str, str, str]:
    if not full.startswith(prompt):
        raise ValueError(
            f"record {sample.id}: the prompt's render is not a prefix of the conversation's, so "
            f"the answer cannot be located; do chat_template_kwargs={dict(kwargs)} match the "
            "generation (e.g. kept reasoning with enable_thinking=False)?"
        )
    end = len(full.rstrip())
    assistant = full[len(prompt) : end]
    for name, text in (("content", sample.answer), ("reasoning_content", sample.reasoning)):
        if text.strip() and text.strip() not in assistant:
            raise ValueError(
                f"record {sample.id}: the chat template does not render the assistant's {name}"
                + ("; use reasoning='drop'" if name == "reasoning_content" else "")
            )
    return prompt, assistant, full[end:]


def _encode(
    segments: Sequence[tuple[str, str, str]], tokenizer: PreTrainedTokenizerBase
) -> list[list[int]]:
    """Token ids of every segment, flat (3 per sample), in one parallel batch."""
    texts = [text for triple in segments for text in triple]
    # The Rust backend tokenizes the batch on all cores; encode_batch_fast skips the offsets.
    encodings = tokenizer.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    return [e.ids for e in encodings]


def render_digest(full: str, written: str) -> bytes:
    """What a row must decode to, hashed: the whole render and the assistant's (masked) part."""
    return hashlib.blake2b(f"{full}\0{written}".encode(), digest_size=16).digest()


def _digest(segments: tuple[str, str, str], config: TrainingSetConfig) -> bytes:
    prompt, assistant, trailer = segments
    trained = assistant + trailer if config.train_newline_after_end_of_turn else assistant
    return render_digest(prompt + assistant + trailer, trained)


def _tokenize(
    segments: Sequence[tuple[str, str, str]], tokenizer: PreTrainedTokenizerBase, config: TrainingSetConfig
) -> tuple[list[list[int]], list[bytes]]:
    """Segment ids, and each sample's render digest (hashed here, beside the tokenizer, off the main thread)."""
    return _encode(segments, tokenizer), [_digest(triple, config) for triple in segments]


def _encoded_chunks(
    records: Iterable[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    config: TrainingSetConfig,
    tally: _Tally,
) -> Iterator[tuple[list[_Sample], list[list[int]], list[bytes]]]:
    """Kept samples of each chunk with their segment ids (3 lists per sample) and render digests, in input order.

    One chunk is tokenized in a worker thread (the Rust backend releases the GIL and uses every
    core) while this thread renders the next chunk and the consumer writes the previous one, so
    the Python work hides behind tokenization. At most three chunks of samples are alive.
    """
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending: tuple[list[_Sample], Future[tuple[list[list[int]], list[bytes]]]] | None = None
        for samples in _screened_chunks(records, config, tally, thinking_mode(tokenizer, config)):
            if not samples:
                continue
            future = pool.submit(_tokenize, _segments(samples, tokenizer, config), tokenizer, config)
            if pending is not None:
                yield _within_length(pending[0], *pending[1].result(), config, tally.reasons)
            pending = (samples, future)
        if pending is not None:
            yield _within_length(pending[0], *pending[1].result(), config, tally.reasons)


def _within_length(
    samples: list[_Sample],
    ids: list[list[int]],
    digests: list[bytes],
    config: TrainingSetConfig,
    left_out: Counter[str],
) -> tuple[list[_Sample], list[list[int]], list[bytes]]:
    kept, kept_ids, kept_digests = [], [], []
    for i, sample in enumerate(samples):
        triple = ids[3 * i : 3 * i + 3]
        length = sum(map(len, triple))
        if length > config.max_length:
            left_out["too_long"] += 1
        elif length < config.min_length:
            left_out["too_short"] += 1
        else:
            kept.append(sample)
            kept_ids.extend(triple)
            kept_digests.append(digests[i])
    return kept, kept_ids, kept_digests


# ---------------------------------------------------------------------------------------------
# The Parquet training set


def _table(samples: Sequence[_Sample], ids: Sequence[list[int]], config: TrainingSetConfig) -> pa.Table:
    segment_lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    values = np.fromiter(
        itertools.chain.from_iterable(ids), dtype=np.int32, count=int(segment_lengths.sum())
    )
    # Segments alternate prompt, assistant, trailer: the mask is 0, 1 and the convention's over their lengths.
    trailer = int(config.train_newline_after_end_of_turn)
    pattern = np.tile(np.array([0, 1, trailer], dtype=np.uint8), len(samples))
    mask = np.repeat(pattern, segment_lengths)
    lengths = segment_lengths.reshape(-1, 3).sum(axis=1)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    return pa.Table.from_arrays(
        [
            pa.array([s.id for s in samples], pa.string()),
            pa.array([s.source for s in samples], pa.string()),
            pa.ListArray.from_arrays(offsets, pa.array(values)),
            pa.ListArray.from_arrays(offsets, pa.array(mask)),
            pa.array(lengths.astype(np.int32)),
        ],
        schema=SCHEMA,
    )


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

    def add(self, table: pa.Table, assistant_tokens: int) -> None:
        lengths = table.column("length").to_numpy()
        self.length_counts += np.bincount(lengths, minlength=self.length_counts.size)
        self.assistant_tokens += assistant_tokens
        for source, length in zip(table.column("source").to_pylist(), lengths.tolist()):
            entry = self.by_source.setdefault(source, {"samples": 0, "tokens": 0})
            entry["samples"] += 1
            entry["tokens"] += length

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
    identity: Identity,
    known: Mapping[str, Identity] | None = None,
    trace: BuildTrace | None = None,
) -> Manifest:
    """Write the outputs ``config.formats`` names, ``manifest.json`` and the card under ``out_dir``, replacing what was there.

    Only records of ``identity`` are taken; ``known`` (the store's registry, by fingerprint) names
    the other identities in the manifest. ``trace``, if given, is filled with what the pass saw.

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
        manifest = _write_training_set(records, tokenizer, config, staging, _Tally(identity, known or {}, trace))
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
    in_set = 0
    try:
        for samples, ids, digests in _encoded_chunks(records, tokenizer, config, tally):
            if not samples:
                continue
            table = _table(samples, ids, config)
            writer.write(table)
            jsonl.write(samples, table)
            trailers = sum(len(x) for x in ids[2::3]) if config.train_newline_after_end_of_turn else 0
            stats.add(table, sum(len(x) for x in ids[1::3]) + trailers)
            in_set += sum(s.output_tokens for s in samples)
            if tally.trace is not None:
                for sample, digest in zip(samples, digests):
                    tally.trace.renders.setdefault(sample.id, []).append(digest)
    finally:
        files = writer.close() + jsonl.close()
    shards = [f["name"] for f in files if f["name"].endswith(".parquet")]
    samples, tokens, per_sample, histogram = stats.summary()
    template = json.dumps(tokenizer.chat_template, sort_keys=True).encode()
    manifest = Manifest(
        samples=samples,
        tokens=tokens,
        assistant_tokens=stats.assistant_tokens,
        tokens_per_sample=per_sample,
        by_source=dict(sorted(stats.by_source.items())),
        left_out=tally.left_out(),
        other_identities=dict(sorted(tally.others.items())),
        identity=tally.identity.to_dict(),
        simulated=tally.identity.simulated,
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
    )
    (directory / CARD_NAME).write_text(dataset_card(manifest))
    (directory / MANIFEST_NAME).write_text(manifest.to_json())
    return manifest


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
    identity: Identity,
    ids: Collection[str] | None = None,
) -> dict[str, list[bytes]]:
    """Render digests of the records of ``identity`` (those whose prompt_id is in ``ids``), rendered afresh.

    What ``BuildTrace.renders`` holds, computed from records instead of by a build.
    """
    candidates: list[_Sample] = []
    thinking = thinking_mode(tokenizer, config)
    for record in records:
        if ids is None or record.get("prompt_id") in ids:
            screened = _screen(record, config, identity, thinking)
            if not isinstance(screened, str):
                candidates.append(screened)
    expected: dict[str, list[bytes]] = {}
    for sample, segments in zip(candidates, _segments(candidates, tokenizer, config)):
        expected.setdefault(sample.id, []).append(_digest(segments, config))
    return expected


def check_round_trip(
    rows: Iterable[Mapping[str, Any]],
    expected: Mapping[str, Collection[bytes]],
    tokenizer: PreTrainedTokenizerBase,
) -> RoundTripResult:
    """Check rows against the renders their records give (``expected``: a build's trace, or ``expected_renders``).

    A row passes when its ids decode to the conversation's render and its masked ids decode to
    exactly the assistant's part (answer, kept reasoning and end-of-turn token). A row whose id has
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
            ok = len(ids) == len(mask) == row["length"] and render_digest(full, written) in expected[row["id"]]
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
    conversations = [*sample.prompt, {"role": "assistant", "content": answer}]
    return json.dumps({"id": sample.id, "conversations": conversations}, ensure_ascii=False) + "\n"


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
    lines += ["", "| left out | records |", "|---|---:|"]
    lines += [f"| {reason} | {count:,} |" for reason, count in manifest.left_out.items()]
    if manifest.other_identities:
        lines += ["", "| left out: other identity | records |", "|---|---:|"]
        lines += [f"| {label} | {count:,} |" for label, count in manifest.other_identities.items()]
    return "\n".join(lines) + "\n"
