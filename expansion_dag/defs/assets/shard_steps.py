"""The completions asset's steps' records: what one step hands the next and the shard's metadata."""

from __future__ import annotations

import dataclasses

from expansion_dag.generation import AnswerLengths, Ended, Estimate, Observed, ShardFigures, WorkItem
from expansion_dag.servers import ServerInfo
from expansion_dag.store import ScanResult


@dataclasses.dataclass(frozen=True)
class Target:
    """The server the shard runs on: its own, or a healthy one when its own is down."""

    url: str
    fell_back: bool
    server: ServerInfo


@dataclasses.dataclass(frozen=True)
class Todo:
    """What the store says is left to send, and what it taught about answer lengths."""

    items: list[WorkItem]
    #: Resumed conversations whose next turn no longer fits, each with why.
    endings: list[tuple[Ended, WorkItem]]
    lengths: AnswerLengths
    observed: Observed
    learned_from_store: int
    #: (source, prompt tokens, prior) of each item, and the estimates of their cells before the run.
    cells: list[tuple[str, int, int]]
    estimates_before: dict[tuple[str, int], tuple[int, Estimate]]


@dataclasses.dataclass(frozen=True)
class Standing:
    """The shard's standing across every run and every shard folder, read back after the run."""

    final: ScanResult
    keys: set[str]
    figures: ShardFigures

    @property
    def done(self) -> int:
        return len(self.keys & self.final.done)

    @property
    def failed(self) -> int:
        return len(self.keys & self.final.failed)

    @property
    def missing(self) -> int:
        return len(self.keys) - self.done - self.failed
