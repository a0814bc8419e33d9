"""The run's own speed: output tokens a second per server, measured from its first answers, and the
time to finish and GPU-hours it gives (or the check of a throughput the plan had).

What is measured. A server decoding with its slots full gives each running stream one token a
decode step (continuous batching), so its output rate is the streams decoding times the rate each
decodes at. The client sees both before the answers end: a streamed request decodes from its
first streamed text to its end (a plain one from its send), and each answer that ended gives its
tokens over that time. The measurement starts once the server's slots are full (or every prompt of
a smaller run is in flight) and is said once ``MIN_ANSWERS`` answers have ended since.

What is not measured, and why. The canary alone is one stream, which decodes faster than a full
batch and says nothing of the batch's rate. Tokens of answers ended over the time elapsed count a
stream's tokens only at its end, and a slot's first answers are its short ones: early, that figure
is far too low. Streamed token counts arrive in events of ``stream_interval`` tokens (64 by default,
256 before): up to that many tokens a stream are unseen at any moment, seconds of a CPU engine's output, so a
stream still decoding is credited at the measured rate instead. Time waiting in the server's queue
and prefill before the first token count in neither figure: what they cost shows as fewer streams
decoding. Times are passed in (a clock), never read here.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Answers ended with the slots full before the speed is said: a rate per stream that rests on
#: one short answer would be the tick's noise.
MIN_ANSWERS = 8
#: A measured speed this far from the plan's (either way) is said to be off.
PLAN_MARGIN = 0.25


@dataclass(eq=False)
class Stream:
    """One request on one server, as the meter sees it."""

    sent: float
    streamed: bool
    first_output: float | None = None
    ended: float | None = None

    def output(self, now: float) -> None:
        """Its first streamed text arrived (each attempt's: a retried request starts again)."""
        self.first_output = now

    @property
    def decoding_since(self) -> float | None:
        """When it began to decode: its first text, a plain request's send; None: not yet."""
        return self.first_output if self.streamed else self.sent


@dataclass(frozen=True)
class Speed:
    """A shard's output speed as measured so far, with what it rests on."""

    #: Output tokens a second per server: streams decoding times the rate each decodes at.
    tokens_per_s: float
    servers: int
    #: Answers ended since the slots filled, whose tokens over their decoding time give the rate.
    answers: int
    #: Seconds since the slots filled.
    window_s: float
    #: Streams decoding on a server, on average over the window.
    streams: float
    #: Tokens the streams still decoding have made so far, at the measured rate.
    in_flight_tokens: float
    #: Answers needed before the figure is said (``MIN_ANSWERS``, or every prompt of a smaller run).
    needed: int = MIN_ANSWERS

    @property
    def defensible(self) -> bool:
        return self.answers >= self.needed and self.window_s > 0

    def basis(self) -> str:
        return (
            f"{self.answers:,} answers and {self.streams:.1f} streams decoding a server over "
            f"{self.window_s:,.0f} s with its slots full"
        )

    @staticmethod
    def combined(samples: list[Speed | None], needed: int) -> Speed | None:
        """The shard's speed over its servers (None until every one has its slots full)."""
        if not samples or any(s is None for s in samples):
            return None
        known = [s for s in samples if s is not None]
        return Speed(
            tokens_per_s=sum(s.tokens_per_s for s in known) / len(known),
            servers=len(known),
            answers=sum(s.answers for s in known),
            window_s=min(s.window_s for s in known),
            streams=sum(s.streams for s in known) / len(known),
            in_flight_tokens=sum(s.in_flight_tokens for s in known),
            needed=needed,
        )


class SpeedMeter:
    """One server's output speed, from the requests one shard sends it."""

    def __init__(self, slots: int, fill: int | None = None):
        #: Requests in flight at which the slots count as full (fewer for a run with fewer prompts).
        self.fill = fill or slots
        self.full_since: float | None = None
        self._open: set[Stream] = set()
        self._closed_decoding_s = 0.0  # decoding seconds of ended streams inside the window
        self._answers = 0
        self._answer_tokens = 0
        self._answer_decoding_s = 0.0

    def sent(self, now: float, *, streamed: bool) -> Stream:
        stream = Stream(now, streamed)
        self._open.add(stream)
        if self.full_since is None and len(self._open) >= self.fill:
            self.full_since = now
        return stream

    def ended(self, stream: Stream, now: float) -> None:
        self._open.discard(stream)
        stream.ended = now
        self._closed_decoding_s += self._in_window(stream, now)

    def answered(self, stream: Stream, tokens: int) -> None:
        """``stream`` (ended) was an answer of ``tokens`` tokens: its rate counts if it ended in the window."""
        since = stream.decoding_since
        if self.full_since is None or since is None or stream.ended is None or stream.ended < self.full_since:
            return
        self._answers += 1
        # A streamed answer's first event carries its first token; the rest came while it decoded.
        self._answer_tokens += max(tokens - 1, 0) if stream.streamed else tokens
        self._answer_decoding_s += stream.ended - since

    @property
    def stream_rate(self) -> float | None:
        """Tokens a second one stream decodes at with the slots full; None until ``MIN_ANSWERS``
        answers say it (the requests' deadlines scale with it: ``engine.Sender``)."""
        if self._answers < MIN_ANSWERS or self._answer_decoding_s <= 0:
            return None
        return self._answer_tokens / self._answer_decoding_s

    def _in_window(self, stream: Stream, now: float) -> float:
        since = stream.decoding_since
        if self.full_since is None or since is None:
            return 0.0
        return max(0.0, now - max(since, self.full_since))

    def sample(self, now: float, needed: int = MIN_ANSWERS) -> Speed | None:
        """The speed so far (None until the slots are full)."""
        if self.full_since is None:
            return None
        window = now - self.full_since
        rate = self._answer_tokens / self._answer_decoding_s if self._answer_decoding_s > 0 else 0.0
        decoding = self._closed_decoding_s + sum(self._in_window(s, now) for s in self._open)
        in_flight = sum(now - s.decoding_since for s in self._open if s.decoding_since is not None)
        return Speed(
            tokens_per_s=rate * decoding / window if window > 0 else 0.0,
            servers=1,
            answers=self._answers,
            window_s=window,
            streams=decoding / window if window > 0 else 0.0,
            in_flight_tokens=rate * in_flight,
            needed=needed,
        )


@dataclass(frozen=True)
class ShardPlan:
    """What the plan says of the prompts a shard's run sends, to put its measured speed to."""

    #: The plan's expected output tokens of those prompts (``plan.expected_per_prompt``).
    output_tokens: float
    #: The plan's throughput per server; None: it had none.
    tokens_per_s: float | None = None
    simulated: bool = False


@dataclass(frozen=True)
class Outlook:
    """Time to finish and GPU-hours at the measured speed."""

    tokens_per_s: float
    output_tokens_left: float
    finish_s: float
    #: The run's prompts at the measured speed: the plan's GPU-hours, measured (decode and prefill).
    gpu_hours: float
    #: Measured over planned throughput, minus 1; None: the plan had none.
    plan_off: float | None

    @property
    def plan_was_off(self) -> bool:
        return self.plan_off is not None and abs(self.plan_off) > PLAN_MARGIN


def outlook(
    speed: Speed, plan: ShardPlan, *, answered_tokens: int, answers: int, left: int,
    tokens_left: float | None = None, drain_tokens: float = 0.0,
) -> Outlook | None:
    """The time to finish and GPU-hours of a shard at ``speed`` (None: not yet defensible).

    What is left is ``tokens_left``, learned from the run's answers (``PromptQueue.work_left``), at
    the speed with the slots full, or, once few answers are left, ``drain_tokens`` (the longest
    slot's load) at one stream's speed (the last answers end one by one, the slots emptying); without it,
    the plan's output tokens less those made so far (answers and streams still decoding), and for a
    run whose answers outgrow the plan, at least its prompts not answered yet at the length its
    answers have had.
    """
    if not speed.defensible or speed.tokens_per_s <= 0:
        return None
    made = answered_tokens + speed.in_flight_tokens
    per_server = speed.tokens_per_s
    if tokens_left is None:
        floor = left * answered_tokens / answers if answers else 0.0
        tokens_left = max(plan.output_tokens - made, floor) if left else 0.0
        total = plan.output_tokens
    else:
        total = made + tokens_left
    finish_s = tokens_left / (per_server * speed.servers)
    if speed.streams > 0:  # a stream's speed: the server's over its streams decoding
        finish_s = max(finish_s, drain_tokens * speed.streams / per_server)
    return Outlook(
        tokens_per_s=per_server,
        output_tokens_left=tokens_left,
        finish_s=finish_s,
        gpu_hours=total / per_server / 3600,
        plan_off=per_server / plan.tokens_per_s - 1 if plan.tokens_per_s else None,
    )
