"""What a shard run is given: its servers (``Server``) and how hard the engine pushes them and when
it gives up (``EngineConfig``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from expansion_dag.core import RequestError, WeightsProbe
from expansion_dag.generation.answer_yield import YieldGate
from expansion_dag.servers import SGLANG, AnswerIdentity, Dialect, LoopThresholds, RetryPolicy


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How hard the engine pushes and when it gives up.

    What the run configuration sets has no default here: a run passes the configured value
    (``expansion_dag.config.engine_config``). The rest are the engine's own, tuned for a GPU fleet.
    """

    #: Extra requests queued at the server beyond its slots, so a freed slot never waits on a
    #: round trip: ``max(min_headroom, slots * headroom_fraction)``.
    headroom_fraction: float = 0.1
    min_headroom: int = 2
    connect_timeout_s: float = 10.0
    #: A long generation on a loaded server takes minutes; this bounds a hung request.
    request_timeout_s: float
    max_attempts: int
    #: The canary's bound on its first streamed text, and each request's allowance for its wait
    #: and prefill within its deadline: ``first_output_timeout_s + deadline_slack * max_tokens /
    #: per-stream speed`` (``Deadline``), the speed measured on the server, else ``floor_stream_rate``.
    first_output_timeout_s: float
    deadline_slack: float
    #: Tokens a second a stream is taken to decode at least until its server's speed is measured.
    floor_stream_rate: float
    backoff_initial_s: float
    backoff_max_s: float
    backoff_jitter_s: float
    #: Tokens kept free when ``max_tokens`` is recomputed after a context-length 400, and the
    #: fewest output tokens such a retry may ask for.
    context_margin: int
    min_output_tokens: int
    canary: bool = True
    breaker_window: int = 24
    breaker_failure_fraction: float = 0.8
    progress_interval_s: float
    #: How often the other servers' loads are read while this shard has queued prompts.
    spill_poll_s: float = 1.0
    #: How long another server's own shard has to show itself (from this shard's start, then from
    #: its first request seen there) before its idle slots are borrowed without having seen it fill
    #: them: a shard done before this one started, absent, or with fewer prompts than slots. Shards
    #: of one run start seconds apart; a server borrowed before its shard starts refuses that
    #: shard's first requests once its queue is bounded (``Borrowing``).
    owner_wait_s: float
    #: How long a prompt may wait in all on its server's full queue (backpressure) before the
    #: queue-full answer is its failure; such waits use none of its attempts.
    backpressure_wait_s: float = 600.0
    #: Stream each answer and stop it as soon as it loops (recorded as a ``degenerate`` outcome,
    #: text kept, final for the prompt); False sends plain requests and lets every answer run to its end.
    stop_degenerate: bool
    #: A loop is a span of at least ``loop_min_span_chars`` repeated back to back at least
    #: ``loop_min_repeats`` times over at least ``loop_min_chars``, within the last
    #: ``loop_window_chars`` (see ``expansion_dag.servers.loops.degeneration``).
    loop_min_span_chars: int
    loop_min_repeats: int
    loop_min_chars: int
    loop_window_chars: int
    #: A prompt whose answer was stopped as a loop is asked once more, with another seed, when 1;
    #: 0: the stop is final (``generation.loop_retries``).
    loop_retries: int
    #: Stops a shard whose first answers the training set would mostly leave out (a content
    #: verdict, only with a ``judge``: ``expansion_dag.generation.answer_yield``).
    yield_gate: YieldGate

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.breaker_window < 1:
            raise ValueError(f"breaker_window must be at least 1, got {self.breaker_window}")
        if not 0.0 < self.breaker_failure_fraction <= 1.0:
            raise ValueError("breaker_failure_fraction must be within (0, 1]")
        if self.spill_poll_s <= 0:
            raise ValueError(f"spill_poll_s must be positive, got {self.spill_poll_s}")
        if self.owner_wait_s < 0:
            raise ValueError(f"owner_wait_s must be at least 0, got {self.owner_wait_s}")
        self.loop_thresholds()  # validates the loop fields

    def loop_thresholds(self) -> LoopThresholds | None:
        """The detector's thresholds; None when answers are not streamed and never stopped."""
        if not self.stop_degenerate:
            return None
        return LoopThresholds(
            min_span_chars=self.loop_min_span_chars,
            min_repeats=self.loop_min_repeats,
            min_loop_chars=self.loop_min_chars,
            window_chars=self.loop_window_chars,
        )

    def workers_for(self, slots: int) -> int:
        return slots + max(self.min_headroom, int(slots * self.headroom_fraction))

    def retry_policy(self, *, borrowed: bool = False) -> RetryPolicy:
        """On a borrowed server a prompt gets one attempt and no wait on a full queue: its retries
        and its patience belong to its own server."""
        return RetryPolicy(
            attempts=1 if borrowed else self.max_attempts,
            wait_initial_s=self.backoff_initial_s,
            wait_max_s=self.backoff_max_s,
            wait_jitter_s=self.backoff_jitter_s,
            context_retry=not borrowed,
            context_margin=self.context_margin,
            min_output_tokens=self.min_output_tokens,
            backpressure_wait_s=0.0 if borrowed else self.backpressure_wait_s,
        )


@dataclass(frozen=True)
class Server:
    url: str
    slots: int
    #: How to read its answers and its load (the probe's ``ServerInfo.dialect``).
    dialect: Dialect = SGLANG
    #: Tokens per streamed event (the probe's ``ServerInfo.stream_interval``): asked for in each
    #: request where the dialect takes it, and how a stopped answer's tokens are counted.
    stream_interval: int = 1
    #: What requests with tools ask for (the probe's ``ServerInfo.tool_choice``).
    tool_choice: str = "auto"
    #: The probed context (``ServerInfo.context_length``): a context-length 400 naming another stops
    #: the shard (``ContextMismatchError``). None: not checked.
    context_length: int | None = None
    #: What its answers must say of themselves (``AnswerIdentity``); None: not checked.
    identity: AnswerIdentity | None = None


@dataclass(frozen=True)
class WeightsWatch:
    """The weights' probe asked again while a run goes: of the server at ``url``, every ``every_s``
    (``probe``); an answer other than the run's first (``expected``, as ``reprobe_difference`` reads
    it) stops the shard. A probe that fails says nothing of the weights: the breaker judges the server."""

    url: str
    expected: WeightsProbe
    probe: Callable[[], Awaitable[WeightsProbe | RequestError]]
    every_s: float
