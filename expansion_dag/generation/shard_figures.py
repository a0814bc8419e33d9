"""A shard's figures as its completion store holds them: what the ``completions`` checks judge.

Computed from the stored records, not from a run's report, so a check sees what the training set
will read (earlier runs, other writers and damaged segments included). One pass over the records.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from expansion_dag.core import ENDINGS, FAILED, OK, ContextCappedError, ContextMismatchError

#: A failure kind that is the model's doing (a stopped loop), not the fleet's: not a failed prompt.
DEGENERATE = "degenerate"
CONTEXT_LENGTH = "context_length"
CONTEXT_KINDS = (CONTEXT_LENGTH, ContextCappedError.kind, ContextMismatchError.kind)


@dataclass
class ShardFigures:
    """Counts over one shard's prompts, from each key's latest stored record of one identity."""

    prompts: int = 0
    ok: int = 0
    #: Prompts whose latest record is a failure (stopped loops and ended conversations aside) and
    #: that succeeded nowhere.
    failed: int = 0
    degenerate: int = 0
    #: Conversations that ended before their last turn for their content's sake (``conversations.ENDINGS``).
    ended: int = 0
    failures_by_kind: collections.Counter = field(default_factory=collections.Counter)
    #: Completions cut at max_tokens (finish_reason ``length``).
    truncated: int = 0
    #: Server prompt tokens minus the local count, per completion the server counted.
    prompt_token_drift: collections.Counter = field(default_factory=collections.Counter)

    @property
    def failure_rate(self) -> float:
        return self.failed / self.prompts if self.prompts else 0.0

    @property
    def truncation_rate(self) -> float:
        return self.truncated / self.ok if self.ok else 0.0

    @property
    def context_length_failures(self) -> int:
        """Prompts the context lost: refused, cut by a cap the server forced, or sent to a server
        whose context is not the probed one."""
        return sum(self.failures_by_kind[kind] for kind in CONTEXT_KINDS)

    @property
    def drifted(self) -> int:
        return sum(n for d, n in self.prompt_token_drift.items() if d != 0)


def shard_figures(
    records: Iterable[Mapping[str, Any]],
    keys: Collection[str],
    owns: Callable[[Mapping[str, Any]], bool],
    done_anywhere: Collection[str] = (),
) -> ShardFigures:
    """Figures of the shard whose prompts have ``keys``, from ``records`` (each key's latest, as
    ``CompletionStore.latest_records`` yields them) that ``owns`` accepts (the current identity).

    A failure whose key has a completion in ``done_anywhere`` (another shard's folder: prompts move
    between shards) is not a failed prompt.
    """
    figures = ShardFigures(prompts=len(keys))
    for record in records:
        key = record.get("key")
        if key not in keys or not owns(record):
            continue
        status = record.get("status")
        if status == OK:
            figures.ok += 1
            if record.get("finish_reason") == "length":
                figures.truncated += 1
            if record.get("prompt_tokens") is not None:
                figures.prompt_token_drift[record["prompt_tokens"] - record["local_prompt_tokens"]] += 1
        elif status == FAILED and key not in done_anywhere:
            kind = record.get("error") or "unknown"
            figures.failures_by_kind[kind] += 1
            if kind == DEGENERATE:
                figures.degenerate += 1
            elif kind in ENDINGS:
                figures.ended += 1
            else:
                figures.failed += 1
    return figures
