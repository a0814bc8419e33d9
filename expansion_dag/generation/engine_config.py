"""What a shard run is given: its servers (``Server``) and how hard the engine pushes them and when
it gives up (``EngineConfig``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

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
    #: How often a prompt is tried on its own server (on a borrowed one: :meth:`retry_policy`).
    retry: RetryPolicy
    #: The canary's bound on its first streamed text, and each request's allowance for its wait
    #: and prefill within its deadline: ``first_output_timeout_s + deadline_slack * max_tokens /
    #: per-stream speed`` (``Deadline``), the speed measured on the server, else ``floor_stream_rate``.
    first_output_timeout_s: float
    deadline_slack: float
    #: Tokens a second a stream is taken to decode at least until its server's speed is measured.
    floor_stream_rate: float
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
    #: When an answer is a loop: each answer is streamed and stopped as soon as it loops (recorded
    #: as a ``degenerate`` outcome, text kept, final for the prompt). None: plain requests, every
    #: answer runs to its end.
    loop: LoopThresholds | None
    #: A prompt whose answer was stopped as a loop is asked once more, with another seed, when 1;
    #: 0: the stop is final (``generation.loop_retries``).
    loop_retries: int
    #: Stops a shard whose first answers the training set would mostly leave out (a content
    #: verdict, only with a ``judge``: ``expansion_dag.generation.answer_yield``).
    yield_gate: YieldGate

    def __post_init__(self) -> None:
        if self.retry.attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.retry.attempts}")
        if self.breaker_window < 1:
            raise ValueError(f"breaker_window must be at least 1, got {self.breaker_window}")
        if not 0.0 < self.breaker_failure_fraction <= 1.0:
            raise ValueError("breaker_failure_fraction must be within (0, 1]")
        if self.spill_poll_s <= 0:
            raise ValueError(f"spill_poll_s must be positive, got {self.spill_poll_s}")
        if self.owner_wait_s < 0:
            raise ValueError(f"owner_wait_s must be at least 0, got {self.owner_wait_s}")

    def workers_for(self, slots: int) -> int:
        return slots + max(self.min_headroom, int(slots * self.headroom_fraction))

    def retry_policy(self, *, borrowed: bool = False) -> RetryPolicy:
        """On a borrowed server a prompt gets one attempt and no wait on a full queue: its retries
        and its patience belong to its own server."""
        return replace(self.retry, attempts=1, context_retry=False, backpressure_wait_s=0.0) if borrowed else self.retry


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
