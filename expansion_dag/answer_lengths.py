"""Expected answer lengths, learned from completions, to start the long answers first.

A run ends when its longest answer ends, so the queue is ordered longest expected answer first.
The expectation is learned per source and per prompt-length bucket (powers of two of the prompt's
tokens) from completions of the same model and settings: those already in the store (earlier
nights, earlier parts of this run) and those that return while the run goes on. The typed
per-source priors are only where the learning starts.

Each level shrinks toward the one above it by ``prior_weight`` pseudo-answers: a bucket with a
few answers leans on its source's mean, a source with a few answers on the prior. So one odd
answer moves an estimate part of the way, and a handful of answers outweigh a wrong prior.

Pure: no I/O. ``learn`` takes store records (``CompletionStore.records``) and keeps those of one
identity; the caller reads the store once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

#: Prompts shorter than this share the first bucket: below it, length says little about the answer.
_SMALLEST_BUCKET = 64


def prompt_bucket(prompt_tokens: int) -> int:
    """The bucket's lower bound: 0 (under 64 tokens), 64, 128, 256, ... (powers of two)."""
    if prompt_tokens < _SMALLEST_BUCKET:
        return 0
    return 1 << (prompt_tokens.bit_length() - 1)


def bucket_label(bucket: int) -> str:
    return f"<{_SMALLEST_BUCKET}" if bucket == 0 else f"{bucket}-{2 * bucket - 1}"


@dataclasses.dataclass
class _Mean:
    n: int = 0
    total: int = 0

    def add(self, value: int) -> None:
        self.n += 1
        self.total += value

    def shrunk(self, toward: float, weight: float) -> float:
        return (self.total + weight * toward) / (self.n + weight)


@dataclasses.dataclass(frozen=True)
class Estimate:
    tokens: int
    #: Answers the estimate rests on: its bucket's, else its source's (0: the typed prior alone).
    answers: int
    #: "prior", "source" (the source's answers, none of this bucket) or "source+bucket".
    basis: str


class AnswerLengths:
    """Mean answer length per source and prompt-length bucket, shrunk toward the prior."""

    def __init__(self, *, prior_weight: float = 2.0):
        if prior_weight <= 0:
            raise ValueError(f"prior_weight must be positive, got {prior_weight}")
        self._weight = prior_weight
        self._sources: dict[str, _Mean] = {}
        self._cells: dict[tuple[str, int], _Mean] = {}

    @property
    def answers(self) -> int:
        return sum(m.n for m in self._sources.values())

    def observe(self, source: str, prompt_tokens: int, output_tokens: int) -> None:
        self._sources.setdefault(source, _Mean()).add(output_tokens)
        self._cells.setdefault((source, prompt_bucket(prompt_tokens)), _Mean()).add(output_tokens)

    def estimate(self, source: str, prompt_tokens: int, prior: int) -> Estimate:
        """The expected answer length of a prompt; ``prior`` is the typed one for its source."""
        by_source = self._sources.get(source)
        if by_source is None:
            return Estimate(tokens=prior, answers=0, basis="prior")
        source_mean = by_source.shrunk(prior, self._weight)
        cell = self._cells.get((source, prompt_bucket(prompt_tokens)))
        if cell is None:
            return Estimate(tokens=round(source_mean), answers=by_source.n, basis="source")
        return Estimate(tokens=round(cell.shrunk(source_mean, self._weight)), answers=cell.n, basis="source+bucket")


def learn(
    records: Iterable[Mapping[str, Any]],
    owns: Callable[[Mapping[str, Any]], bool],
    lengths: AnswerLengths | None = None,
) -> AnswerLengths:
    """Lengths of the completions among ``records`` that ``owns`` accepts (one identity's).

    The prompt length is the project's own count (``local_prompt_tokens``), the one the queue's
    prompts carry, falling back to the server's.
    """
    lengths = lengths or AnswerLengths()
    for record in records:
        if not owns(record):
            continue
        prompt_tokens = record.get("local_prompt_tokens", record.get("prompt_tokens"))
        output_tokens = record.get("completion_tokens")
        if isinstance(prompt_tokens, int) and isinstance(output_tokens, int):
            lengths.observe(str(record.get("source")), prompt_tokens, output_tokens)
    return lengths


def cell_estimates(
    lengths: AnswerLengths, prompts: Iterable[tuple[str, int, int]]
) -> dict[tuple[str, int], tuple[int, Estimate]]:
    """Per (source, prompt bucket) of ``prompts`` (source, prompt tokens, prior): how many, and the estimate."""
    counts: dict[tuple[str, int], int] = {}
    first: dict[tuple[str, int], tuple[int, int]] = {}
    for source, prompt_tokens, prior in prompts:
        cell = (source, prompt_bucket(prompt_tokens))
        counts[cell] = counts.get(cell, 0) + 1
        first.setdefault(cell, (prompt_tokens, prior))
    return {cell: (n, lengths.estimate(cell[0], *first[cell])) for cell, n in sorted(counts.items())}
