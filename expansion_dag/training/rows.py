"""Samples to rows: each sample's token ids and loss mask, chunk by chunk, from the server's ids or
its render tokenized. A row says where its ids come from (``ids_from``):

* ``server``: a record that carries the ids the server ran and sampled (``token_ids``) is its row:
  the prompt ids, the sampled ids (closed by their end-of-turn token, or the template's where the
  answer was cut before one) and the trailer's; mask 0 on the prompt, 1 on the sampled ids, the
  trailer by the convention. No render and no tokenization: that is what makes the build fast. Ids
  that do not decode to the returned text (compared without whitespace and think tags, which
  reasoning parsers move) win: the ids are what the model sampled (``ids_match_text`` says so).
* ``retokenized``: the render split and tokenized (``rendering``), for a record without ids (an
  older server), with ids not whole (not ``completion_tokens`` of them), or whose row is not a
  sequence the model sampled (``reasoning="drop"`` with reasoning). The manifest counts each reason.

A conversation's earlier turns are the server's rendering of them in its last turn's prompt, not
their own sampled ids: that prompt is the context the model answered in (Qwen3 drops earlier turns'
reasoning), and a drafter learns the target in the contexts it runs. They are found where the
client's render puts them, by each token's bytes; a server prompt that does not decode to the
client's render is re-tokenized (``prompt_not_located``).

What re-tokenizing would have changed is measured on the first ``MEASURED_PER_CHUNK`` rows from ids
of each chunk: rows whose ids differ and by how many tokens, and prompts whose server ids differ
from the client's render (``Manifest.retokenization``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from expansion_dag.core import unpack
from expansion_dag.training.config import TrainingSetConfig
from expansion_dag.training.mode_rules import _encode, _mode_rules, _ModeRules
from expansion_dag.training.rendering import _segments
from expansion_dag.training.samples import (
    IDS_INCOMPLETE,
    PROMPT_NOT_LOCATED,
    THINK_TAGS,
    _Sample,
    _screened_chunks,
    _Tally,
)

#: Where a row's ids come from (its ``ids_from`` column): the ids the server ran and sampled, or the
#: text rendered and tokenized again (a record without ids, or a row that is not what was sampled).
FROM_SERVER, RETOKENIZED = "server", "retokenized"
#: Rows from ids also re-tokenized, to measure the difference (``Manifest.retokenization``): the first
#: this many of each chunk. A sample, since re-tokenizing is the cost the ids save.
MEASURED_PER_CHUNK = 32


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
            else:  # unpacked: the packed copies would live on with the chunk (a third of its memory)
                row.sample = dataclasses.replace(row.sample, prompt_ids=None, output_ids=None)
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
    prompt, answer = unpack(sample.prompt_ids or ""), row.output or []
    row.output = None  # the row's segments hold it from here
    eot = rules.end_of_turn_ids
    # A row cut before its loop is the sampled ids as they are: the model wrote no end there.
    if not sample.truncated and not (answer[-len(eot) :] == eot or (answer and answer[-1] in rules.special_ids)):
        answer.extend(eot)  # in place: a chunk's answers are most of its memory
    if not sample.conversation:
        return [prompt, answer, [] if sample.truncated else rules.trailer_ids]
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


def _squashed(text: str) -> str:
    """Text as the ids and the server's text are compared: without whitespace and think tags, which
    reasoning parsers strip and move at the ``</think>`` boundary."""
    text = "".join(text.split())
    for tag in THINK_TAGS:
        text = text.replace(tag, "")
    return text


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
        agrees = _agrees(next(decoded), row.sample)
        chunk.add(dataclasses.replace(row.sample, said=""), row.ids, None, agrees, difference)  # said: compared, done
    return chunk


def _encoded_chunks(
    records: Iterable[Mapping[str, Any]], tokenizer: PreTrainedTokenizerBase, config: TrainingSetConfig, tally: _Tally
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
