"""Progress a person can watch: per-shard figures, as a live table on a terminal or as plain lines.

A shard's run reports its progress (``ShardProgress``, from the engine's ``Progress``) as Dagster
asset observations (``assets/progress.py``); ``expansion-dag run`` reads the latest one of each
shard from the instance and shows the whole fleet in one place (``ProgressDisplay``): a table
redrawn in place when the output is a terminal, one line per interval otherwise. Retries are
counted in the figures instead of logged one per line, and third-party progress bars are silenced
(``quiet_third_party``). No Dagster here.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from expansion_dag.generation.shard_report import Progress


@dataclass(frozen=True)
class ShardProgress:
    """What a person watching a shard wants: done, rate, ETA, failures and retries."""

    done: int
    total: int
    failed: int
    retries: int
    requests_per_s: float
    output_tokens_per_s: float
    eta_s: float | None
    elapsed_s: float
    #: What the answers so far will yield: ``rows 96%; truncated 3%`` (``AnswerYield.summary``).
    answer_yield: str = ""

    @classmethod
    def from_engine(cls, progress: Progress) -> ShardProgress:
        return cls(
            done=progress.done,
            total=progress.total,
            failed=progress.failed,
            retries=sum(progress.retries.values()),
            requests_per_s=round(progress.done / progress.elapsed_s, 3) if progress.elapsed_s > 0 else 0.0,
            output_tokens_per_s=round(progress.output_tokens_per_s, 1),
            eta_s=None if progress.eta_s is None else round(progress.eta_s, 1),
            elapsed_s=round(progress.elapsed_s, 1),
            answer_yield=progress.answer_yield,
        )

    def as_metadata(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_metadata(cls, values: Mapping[str, Any]) -> ShardProgress:
        return cls(**{name: values.get(name) for name in cls.__dataclass_fields__})


class ObservationThrottle:
    """Which of a shard's progress reports are kept as observations in the Dagster UI.

    The engine reports every few seconds (``progress_interval_s``): ~17,000 reports over a day-long
    shard, a wall in the asset's history. Kept: the first, then one each ``every_s`` or on each
    whole percent of progress, whichever comes first (at most ``86,400 / every_s + 100`` a day),
    and, through :meth:`last`, the final one: the latest observation is always current.
    """

    def __init__(self, every_s: float = 60.0, clock: Any = time.monotonic):
        self._every_s = every_s
        self._clock = clock
        self._kept_at: float | None = None
        self._kept_percent = -1
        self._held: ShardProgress | None = None

    def keep(self, figures: ShardProgress) -> bool:
        """Whether to observe ``figures`` now; if not, they are held for :meth:`last`."""
        now = self._clock()
        percent = 100 * figures.done // figures.total if figures.total else 100
        if self._kept_at is None or now - self._kept_at >= self._every_s or percent > self._kept_percent:
            self._kept_at, self._kept_percent, self._held = now, percent, None
            return True
        self._held = figures
        return False

    def last(self) -> ShardProgress | None:
        """The latest report not yet observed, if any: observed at the end of the run."""
        held, self._held = self._held, None
        return held


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def _cells(shard: str, state: str, p: ShardProgress | None) -> list[str]:
    if p is None:
        return [shard, state, "-", "-", "-", "-", "-", "-", "-"]
    share = f"{p.done:,}/{p.total:,} ({p.done / p.total:.0%})" if p.total else f"{p.done:,}/0"
    return [
        shard,
        state,
        share,
        f"{p.requests_per_s:,.2f}/s",
        f"{p.output_tokens_per_s:,.0f}",
        _duration(p.eta_s) if state == "running" else "-",
        f"{p.failed:,}",
        f"{p.retries:,}",
        p.answer_yield or "-",  # observations written before the yield was counted have none
    ]


HEADER = ["shard", "state", "done", "rate", "tok/s", "ETA", "failed", "retries", "yield"]


def render_table(states: Mapping[str, str], figures: Mapping[str, ShardProgress | None]) -> list[str]:
    """The fleet as aligned rows, one per shard, under a header."""
    rows = [HEADER] + [_cells(shard, state, figures.get(shard)) for shard, state in states.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def render_line(states: Mapping[str, str], figures: Mapping[str, ShardProgress | None]) -> str:
    """The fleet on one line: ``shard-00 120/400 2.1/s ETA 2m13s failed 0 retries 3 | ...``."""
    parts = []
    for shard, state in states.items():
        p = figures.get(shard)
        if p is None:
            parts.append(f"{shard} {state}")
            continue
        cells = dict(zip(HEADER, _cells(shard, state, p)))
        eta = f" ETA {cells['ETA']}" if state == "running" else f" {state}"
        parts.append(
            f"{shard} {cells['done']} {cells['rate']}{eta} failed {cells['failed']} retries {cells['retries']}"
            f" yield {cells['yield']}"
        )
    return "progress: " + " | ".join(parts)


class ProgressDisplay:
    """Shows the fleet's progress: redrawn in place on a terminal, a plain line per interval otherwise."""

    def __init__(self, out: TextIO = sys.stdout, *, line_interval_s: float = 15.0, live: bool | None = None):
        self._out = out
        self._live = out.isatty() if live is None else live
        self._line_interval_s = line_interval_s
        self._drawn = 0
        self._last_line = float("-inf")

    def update(
        self, states: Mapping[str, str], figures: Mapping[str, ShardProgress | None], *, final: bool = False
    ) -> None:
        if self._live:
            lines = render_table(states, figures)
            # Up to the table's first line, clear to the end, draw again.
            prefix = f"\x1b[{self._drawn}F\x1b[J" if self._drawn else ""
            self._out.write(prefix + "\n".join(lines) + "\n")
            self._drawn = len(lines)
        elif final or time.monotonic() - self._last_line >= self._line_interval_s:
            self._out.write(render_line(states, figures) + "\n")
            self._last_line = time.monotonic()
        self._out.flush()


def retry_summary(figures: Mapping[str, ShardProgress | None]) -> str:
    counts = {shard: p.retries for shard, p in figures.items() if p is not None and p.retries}
    if not counts:
        return "retries: none"
    detail = ", ".join(f"{shard} {n:,}" for shard, n in counts.items())
    return f"retries: {sum(counts.values()):,} ({detail})"


#: Environment read by datasets, huggingface_hub, transformers and tqdm when they import.
QUIET_ENV = {
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TQDM_DISABLE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
}


def quiet_third_party() -> None:
    """Silence other libraries' progress bars (here and in child processes) and per-retry logging."""
    os.environ.update(QUIET_ENV)
    if "datasets" in sys.modules:
        import datasets

        datasets.disable_progress_bars()
    silence_retry_logging()


def silence_retry_logging() -> None:
    """stamina logs every scheduled retry; the progress figures count them instead."""
    import stamina.instrumentation

    stamina.instrumentation.set_on_retry_hooks([])
