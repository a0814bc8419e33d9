"""What happened in one run of one shard: per-server figures, the report, and progress snapshots.

Kept by the engine's units as the run goes (``expansion_dag.generation.recorder`` counts each outcome); the
completions asset turns the report into metadata and checks.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

from expansion_dag.generation.answer_yield import AnswerYield
from expansion_dag.generation.dispatch import PromptQueue, WorkLeft, longest_first_makespan
from expansion_dag.generation.speed import MIN_ANSWERS, Speed, SpeedMeter, Stream


@dataclass
class ServerStats:
    slots: int
    requests: int = 0
    output_tokens: int = 0
    in_flight: int = 0
    busy_slot_seconds: float = 0.0
    #: Another shard's server only: why each reading of its load did or did not lead to borrowing it
    #: (``borrowing.Borrowing``), e.g. its own shard not started yet.
    borrowing: collections.Counter = field(default_factory=collections.Counter)
    _since: float = field(default_factory=time.monotonic)
    #: The output speed of this shard's requests here (``expansion_dag.generation.speed``).
    meter: SpeedMeter = field(init=False)

    def __post_init__(self) -> None:
        self.meter = SpeedMeter(self.slots)

    def _account(self, now: float) -> None:
        # Busy slots are what the server is running: requests beyond its slots wait in its queue.
        self.busy_slot_seconds += min(self.in_flight, self.slots) * (now - self._since)
        self._since = now

    def started(self, now: float, *, streamed: bool = False) -> Stream:
        self._account(now)
        self.in_flight += 1
        return self.meter.sent(now, streamed=streamed)

    def finished(self, now: float, stream: Stream) -> None:
        self._account(now)
        self.in_flight -= 1
        self.meter.ended(stream, now)


@dataclass
class ShardReport:
    """What happened to a shard's requests; the asset turns it into metadata and checks."""

    total: int = 0
    ok: int = 0
    failed: int = 0
    failures_by_kind: collections.Counter = field(default_factory=collections.Counter)
    finish_reasons: collections.Counter = field(default_factory=collections.Counter)
    requests_by_source: collections.Counter = field(default_factory=collections.Counter)
    truncated_by_source: collections.Counter = field(default_factory=collections.Counter)
    output_tokens: int = 0
    #: Retries by the kind of error that caused them (``context_length``: the one smaller retry).
    retries_by_kind: collections.Counter = field(default_factory=collections.Counter)
    #: Server prompt tokens minus local count, per completion (0 when the counts agree).
    prompt_token_drift: collections.Counter = field(default_factory=collections.Counter)
    servers: dict[str, ServerStats] = field(default_factory=dict)
    #: Other shards' servers that ran some of this shard's prompts while they were idle.
    helpers: dict[str, ServerStats] = field(default_factory=dict)
    elapsed_s: float = 0.0
    #: The process's CPU seconds while the run lasted: what the client costs, start-up apart.
    client_cpu_s: float = 0.0
    aborted: str | None = None
    #: Output tokens generated, by outcome: the finish reason of an answer (``stop``, ``length``),
    #: ``degenerate`` for a stopped loop (the tokens it streamed, estimated from its chunks).
    output_tokens_by_outcome: collections.Counter = field(default_factory=collections.Counter)
    #: Answers stopped as loops, by the detector's rule that saw each (``servers.LOOP_RULES``).
    degenerate_by_rule: collections.Counter = field(default_factory=collections.Counter)
    #: Prompts asked again with another seed after a loop (``generation.loop_retries``): ``asked``,
    #: and ``completed`` where the second answer ended on its own (the rest looped again).
    loop_retried: collections.Counter = field(default_factory=collections.Counter)
    #: Seconds from send to outcome, summed by outcome: a finish reason, or a failure's kind.
    #: Includes the time a request beyond the server's slots waits in its queue (the headroom).
    slot_seconds_by_outcome: collections.Counter = field(default_factory=collections.Counter)
    #: Times the queue was re-ordered on what returning answers taught the length estimates.
    reorders: int = 0
    #: Requests sent, every attempt and every server counted.
    attempts: int = 0
    #: Full-queue answers (backpressure): waited out or sent elsewhere, never an attempt used.
    backpressure: int = 0
    #: (expected tokens when dispatched, actual tokens, seconds from send to answer) of each answer:
    #: how well the queue foresaw the long ones (``length_rank_correlation``, ``clairvoyant_makespan_s``).
    answers: list[tuple[int, int, float]] = field(default_factory=list)
    #: This run's answers judged by the training set's rules as they arrived: rows, and why not.
    answer_yield: AnswerYield = field(default_factory=AnswerYield)

    def __post_init__(self) -> None:
        # A run with fewer prompts than slots never fills them: its speed is measured once all are in flight.
        for stats in self.servers.values():
            stats.meter.fill = max(1, min(stats.slots, -(-self.total // len(self.servers))))

    @property
    def done(self) -> int:
        return self.ok + self.failed

    @property
    def failure_rate(self) -> float:
        return self.failed / self.done if self.done else 0.0

    @property
    def context_retries(self) -> int:
        return self.retries_by_kind["context_length"]

    @property
    def drifted_completions(self) -> int:
        return sum(n for d, n in self.prompt_token_drift.items() if d != 0)

    @property
    def generated_output_tokens(self) -> int:
        return sum(self.output_tokens_by_outcome.values())

    @staticmethod
    def _kept(outcome: str, drop_truncated: bool) -> bool:
        return outcome == "stop" or (outcome == "length" and not drop_truncated)

    def kept_output_tokens(self, drop_truncated: bool) -> int:
        """Output tokens of answers the training set keeps (``drop_truncated``: its setting)."""
        return sum(n for o, n in self.output_tokens_by_outcome.items() if self._kept(o, drop_truncated))

    def useful_token_share(self, drop_truncated: bool) -> float:
        """Kept output tokens over generated ones (1.0 when nothing was generated)."""
        generated = self.generated_output_tokens
        return self.kept_output_tokens(drop_truncated) / generated if generated else 1.0

    def dropped_slot_seconds(self, drop_truncated: bool) -> dict[str, float]:
        """Seconds spent on answers the training set will not hold, by reason."""
        return {
            o: round(s, 3) for o, s in sorted(self.slot_seconds_by_outcome.items()) if not self._kept(o, drop_truncated)
        }

    def length_rank_correlation(self) -> float | None:
        """Spearman's rank correlation of expected against actual answer lengths (None: under 3 answers)."""
        if len(self.answers) < 3:
            return None
        return spearman([a[0] for a in self.answers], [a[1] for a in self.answers])

    def clairvoyant_makespan_s(self) -> float:
        """The makespan had the answers' service times been known: longest first on the own slots."""
        return longest_first_makespan([a[2] for a in self.answers], sum(s.slots for s in self.servers.values()))

    def speed(self, now: float) -> Speed | None:
        """The output speed of the shard's own servers so far (``expansion_dag.generation.speed``)."""
        # A run of fewer prompts says its speed on all their answers (those that fail give none).
        needed = max(1, min(MIN_ANSWERS, self.total - self.failed))
        return Speed.combined([s.meter.sample(now, needed) for s in self.servers.values()], needed)

    def progress(self, elapsed_s: float, now: float | None = None, queue: PromptQueue | None = None) -> Progress:
        """The figures at ``elapsed_s`` into the run; ``now``: the clock the servers' times are on;
        ``queue``: the prompts still to send, whose expected answers make the tokens left."""
        rate = self.done / elapsed_s if elapsed_s > 0 else 0.0
        now = time.monotonic() if now is None else now
        speed = self.speed(now)
        stream_rate = speed.tokens_per_s / speed.streams if speed is not None and speed.streams > 0 else None
        return Progress(
            done=self.done,
            total=self.total,
            elapsed_s=elapsed_s,
            output_tokens_per_s=self.output_tokens / elapsed_s if elapsed_s > 0 else 0.0,
            in_flight={
                **{url: s.in_flight for url, s in self.servers.items()},
                **{url: s.in_flight for url, s in self.helpers.items() if s.in_flight},
            },
            eta_s=(self.total - self.done) / rate if rate > 0 else None,
            failed=self.failed,
            retries=dict(self.retries_by_kind),
            answer_yield=self.answer_yield.summary() if self.answer_yield.judged else "",
            speed=speed,
            answered_tokens=self.output_tokens,
            work=queue.work_left(stream_rate, now, sum(s.slots for s in self.servers.values())) if queue is not None else None,
        )

    def utilization(self) -> float:
        """Busy slot-seconds over available slot-seconds, across the shard's own servers."""
        capacity = sum(s.slots for s in self.servers.values()) * self.elapsed_s
        busy = sum(s.busy_slot_seconds for s in self.servers.values())
        return busy / capacity if capacity > 0 else 0.0


@dataclass(frozen=True)
class Progress:
    done: int
    total: int
    elapsed_s: float
    output_tokens_per_s: float
    in_flight: dict[str, int]
    eta_s: float | None
    #: Prompts whose last attempt failed (failure records written) so far.
    failed: int = 0
    #: Retries so far by kind, summed rather than logged one per line.
    retries: dict[str, int] = field(default_factory=dict)
    #: What the answers so far will yield (``AnswerYield.summary``); empty before the first.
    answer_yield: str = ""
    #: The output speed measured so far; None until the slots are full.
    speed: Speed | None = None
    #: Output tokens of the answers so far.
    answered_tokens: int = 0
    #: The output tokens still to come, learned from the answers (None: no queue to ask).
    work: WorkLeft | None = None

    def __str__(self) -> str:
        eta = "unknown" if self.eta_s is None else f"{self.eta_s:,.0f} s"
        flight = ", ".join(f"{url}: {n}" for url, n in self.in_flight.items())
        retries = ", ".join(f"{kind} {n:,}" for kind, n in sorted(self.retries.items()))
        return (
            f"{self.done:,}/{self.total:,} done ({self.failed:,} failed), {self.output_tokens_per_s:,.0f} output tok/s, "
            f"in flight [{flight}], retries [{retries or 'none'}], ETA {eta}"
            + (f", yield [{self.answer_yield}]" if self.answer_yield else "")
        )


def _ranks(values: list[float]) -> list[float]:
    """Ranks from 1, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (Pearson's on the ranks); 0.0 when either side is constant."""
    rx, ry = _ranks(xs), _ranks(ys)
    n = len(rx)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    return cov / (vx * vy) ** 0.5 if vx > 0 and vy > 0 else 0.0

