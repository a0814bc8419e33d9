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
from expansion_dag.generation.speed import PLAN_MARGIN, ShardPlan, outlook


@dataclass(frozen=True)
class ShardProgress:
    """What a person watching a shard wants: done, rate, ETA, failures and retries, and the speed
    measured so far with the time to finish and GPU-hours it gives (``expansion_dag.generation.speed``)."""

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
    #: Output tokens a second per server, measured; None until it is defensible.
    speed_tokens_per_s: float | None = None
    #: What the speed rests on, or what it still waits for (``measuring: ...``).
    speed_basis: str | None = None
    #: Seconds to finish and GPU-hours of the run's prompts, at the measured speed.
    finish_s: float | None = None
    gpu_hours: float | None = None
    #: The plan's throughput per server (None: it had none), which the measurement checks.
    plan_tokens_per_s: float | None = None
    simulated: bool | None = None
    #: Output tokens still to come, learned from the answers (``PromptQueue.work_left``), and what
    #: that rests on (``learned from 1,930 answers; ...`` or ``configured``).
    tokens_left: float | None = None
    tokens_left_basis: str | None = None
    #: While the shard waits for another run's lease: for whom, and until when at most.
    waiting: str | None = None

    @classmethod
    def waiting_for(cls, holder: str, gives_up_at: float) -> ShardProgress:
        """Nothing sent yet: the shard waits for ``holder``, and gives up at ``gives_up_at`` (``time.time()``)."""
        until = time.strftime("%H:%M:%S UTC", time.gmtime(gives_up_at))
        return cls(done=0, total=0, failed=0, retries=0, requests_per_s=0.0, output_tokens_per_s=0.0, eta_s=None,
                   elapsed_s=0.0, waiting=f"for {holder}; gives up at {until} (storage.shard_busy_wait_s)")

    @classmethod
    def from_engine(cls, progress: Progress, plan: ShardPlan | None = None) -> ShardProgress:
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
            **({"tokens_left": round(progress.work.tokens), "tokens_left_basis": progress.work.basis()}
               if progress.work is not None else {}),
            **(_speed_fields(progress, plan) if plan is not None else {}),
        )

    def as_metadata(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_metadata(cls, values: Mapping[str, Any]) -> ShardProgress:
        return cls(**{name: values.get(name) for name in cls.__dataclass_fields__})


def _speed_fields(progress: Progress, plan: ShardPlan) -> dict[str, Any]:
    speed = progress.speed
    fields: dict[str, Any] = {"plan_tokens_per_s": plan.tokens_per_s, "simulated": plan.simulated}
    if speed is None:
        return fields | {"speed_basis": "measuring: slots not full yet"}
    ahead = outlook(speed, plan, answered_tokens=progress.answered_tokens, answers=progress.done - progress.failed,
                    left=progress.total - progress.done,
                    tokens_left=progress.work.tokens if progress.work is not None else None,
                    drain_tokens=progress.work.drain_tokens if progress.work is not None else 0.0)
    if ahead is None:
        return fields | {"speed_basis": f"measuring: {speed.answers} of {speed.needed} answers since the slots filled"}
    return fields | {
        "speed_tokens_per_s": round(ahead.tokens_per_s, 1),
        "speed_basis": speed.basis(),
        "finish_s": round(ahead.finish_s, 1),
        "gpu_hours": round(ahead.gpu_hours, 4),
    }


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
        self._speed_kept = False

    def keep(self, figures: ShardProgress) -> bool:
        """Whether to observe ``figures`` now; if not, they are held for :meth:`last`."""
        now = self._clock()
        percent = 100 * figures.done // figures.total if figures.total else 100
        # The first measured speed is shown at once: the time to finish is what the run waited for.
        first_speed = figures.speed_tokens_per_s is not None and not self._speed_kept
        if self._kept_at is None or now - self._kept_at >= self._every_s or percent > self._kept_percent or first_speed:
            self._kept_at, self._kept_percent, self._held = now, percent, None
            self._speed_kept = self._speed_kept or first_speed
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
    if p.waiting is not None and state == "running":
        return [shard, "waiting", p.waiting, "-", "-", "-", "-", "-", "-"]
    share = f"{p.done:,}/{p.total:,} ({p.done / p.total:.0%})" if p.total else f"{p.done:,}/0"
    return [
        shard,
        state,
        share,
        f"{p.requests_per_s:,.2f}/s",
        f"{p.output_tokens_per_s:,.0f}",
        _eta_cell(p) if state == "running" else "-",
        f"{p.failed:,}",
        f"{p.retries:,}",
        p.answer_yield or "-",  # observations written before the yield was counted have none
    ]


#: The time to finish and the prompts' rate disagreeing by more than this factor are both shown.
RATE_DISAGREES = 2.0


def _eta_cell(p: ShardProgress) -> str:
    # From the measured speed and the tokens left once there are both: early answers are the short
    # ones, so a rate of answers says the run ends too soon. Where the prompts' rate says otherwise
    # by a wide margin, the reader sees both.
    if p.finish_s is None or p.eta_s is None:
        return _duration(p.finish_s if p.finish_s is not None else p.eta_s)
    low, high = sorted((p.finish_s, p.eta_s))
    if high > RATE_DISAGREES * max(low, 1.0):
        return f"{_duration(p.finish_s)} (prompts' rate: {_duration(p.eta_s)})"
    return _duration(p.finish_s)


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
        if p.waiting is not None and state == "running":
            parts.append(f"{shard} waiting {p.waiting}")
            continue
        cells = dict(zip(HEADER, _cells(shard, state, p)))
        eta = f" ETA {cells['ETA']}" if state == "running" else f" {state}"
        parts.append(
            f"{shard} {cells['done']} {cells['rate']}{eta} failed {cells['failed']} retries {cells['retries']}"
            f" yield {cells['yield']}"
        )
    return "progress: " + " | ".join(parts)


@dataclass(frozen=True)
class FleetSpeed:
    """The fleet's speed, time to finish and GPU-hours, once every shard has measured its speed."""

    tokens_per_s: float  # per server, the shards' mean
    servers: int
    #: When the last shard ends at this speed, on the shards' clocks (seconds from their start).
    ends_at_s: float
    finish_s: float
    gpu_hours: float
    said_at_s: float

    @staticmethod
    def of(figures: Mapping[str, ShardProgress | None]) -> FleetSpeed | None:
        """None until every shard has measured its speed: a fleet's time to finish is its slowest shard's."""
        shards = [p for p in figures.values() if p is not None and p.speed_basis is not None]
        if len(shards) < len(figures) or any(p.speed_tokens_per_s is None or p.finish_s is None for p in shards):
            return None
        return FleetSpeed(
            tokens_per_s=sum(p.speed_tokens_per_s or 0.0 for p in shards) / len(shards),
            servers=len(shards),
            ends_at_s=max(p.elapsed_s + (p.finish_s or 0.0) for p in shards),
            finish_s=max(p.finish_s or 0.0 for p in shards),
            gpu_hours=sum(p.gpu_hours or 0.0 for p in shards),
            said_at_s=max(p.elapsed_s for p in shards),
        )


def speed_line(figures: Mapping[str, ShardProgress | None]) -> str | None:
    """The fleet's measured speed, the time to finish and the GPU-hours it gives, and the plan's
    throughput checked against it; what it still waits for before that; None: no shard says."""
    shards = {shard: p for shard, p in figures.items() if p is not None and p.speed_basis is not None}
    if not shards:
        return None
    fleet = FleetSpeed.of(figures)
    if fleet is None:
        waiting = "; ".join(
            f"{shard} {'no report yet' if p is None else 'waiting for its lease' if p.waiting else p.speed_basis}"
            for shard, p in figures.items() if p is None or p.speed_tokens_per_s is None
        )
        return f"speed: {waiting}"
    planned = next((p.plan_tokens_per_s for p in shards.values() if p.plan_tokens_per_s), None)
    if planned is None:
        check = "the plan had no throughput"
    else:
        off = fleet.tokens_per_s / planned - 1
        check = f"the plan's {planned:,.0f} tokens/s " + (
            f"is off by {off:+.0%}" if abs(off) > PLAN_MARGIN else f"holds (within {PLAN_MARGIN:.0%})"
        )
    label = " (simulator: not a GPU figure)" if any(p.simulated for p in shards.values()) else ""
    shard, first = next(iter(shards.items()))
    return (
        f"speed: {fleet.tokens_per_s:,.0f} output tokens/s per server{label} measured on {fleet.servers} "
        f"server(s) [{shard}: {first.speed_basis}]: time to finish {_duration(fleet.finish_s)}, "
        f"{fleet.gpu_hours:,.2f} GPU-hours for this run's prompts; {check}"
        + (f"; {shard}'s tokens left: {first.tokens_left_basis}" if first.tokens_left_basis else "")
    )


def estimate_line(first: FleetSpeed, figures: Mapping[str, ShardProgress | None]) -> str:
    """The first time to finish said, against when the shards ended."""
    ended = max(p.elapsed_s for p in figures.values() if p is not None)
    error = first.ends_at_s / ended - 1 if ended > 0 else 0.0
    return (
        f"speed: said at {_duration(first.said_at_s)}, the shards would end at {_duration(first.ends_at_s)}; "
        f"they ended at {_duration(ended)} (estimate {error:+.0%})"
    )


class ProgressDisplay:
    """Shows the fleet's progress: redrawn in place on a terminal, a plain line per interval otherwise.

    Under it, the fleet's speed (``speed_line``), printed at once the first time it is measured, and
    at the end the first time to finish it gave against the actual one.
    """

    def __init__(self, out: TextIO = sys.stdout, *, line_interval_s: float = 15.0, live: bool | None = None):
        self._out = out
        self._live = out.isatty() if live is None else live
        self._line_interval_s = line_interval_s
        self._drawn = 0
        self._last_line = float("-inf")
        #: The first measured figures: checked against the end.
        self.first_speed: FleetSpeed | None = None

    def update(
        self, states: Mapping[str, str], figures: Mapping[str, ShardProgress | None], *, final: bool = False
    ) -> None:
        speed = speed_line(figures)
        fleet = FleetSpeed.of(figures) if self.first_speed is None else None
        first = fleet is not None
        if first:
            self.first_speed = fleet
        ending = [estimate_line(self.first_speed, figures)] if final and self.first_speed is not None else []
        if self._live:
            lines = render_table(states, figures) + ([speed] if speed else []) + ending
            # Up to the table's first line, clear to the end, draw again.
            prefix = f"\x1b[{self._drawn}F\x1b[J" if self._drawn else ""
            self._out.write(prefix + "\n".join(lines) + "\n")
            self._drawn = len(lines)
        elif final or first or time.monotonic() - self._last_line >= self._line_interval_s:
            lines = [render_line(states, figures)] + ([speed] if speed else []) + ending
            self._out.write("\n".join(lines) + "\n")
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
