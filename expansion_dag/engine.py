"""The generation engine: one shard's prompts through its SGLang server(s), every slot kept busy.

Dispatch: ``slots + headroom`` workers per server pull from one queue ordered longest expected
answer first, so a slot is refilled the moment it frees and the long tail starts early instead of
setting the makespan. The expectation is learned (``expansion_dag.answer_lengths``): from the
store's completions when the caller gives them, refined by each answer that returns, the queue
re-ordered as the estimates settle; the budget's typed prior is only where it starts.

Each worker owns one keep-alive connection: a shared pool of hundreds of connections costs more
CPU per request (httpcore scans every connection on each checkout) than the rest of the client
together. Each result is written to the completion store before the worker takes
the next prompt.

Idle servers: a shard runs on its own server, but once another server of the fleet reports idle
slots (its load: running + waiting below its slots) while this shard still has queued
prompts, extra workers send them there, and retire as soon as that server has a queue again. Shards
balanced on *expected* work finish apart by the luck of the draw; this keeps the early finishers'
GPUs busy with the late ones' work, without any coordination between the shards' processes.

Faults: what a server says, and how often a prompt is tried on it, is ``server_api``'s business
(transient errors and unfinished answers retried with backoff, one context-length retry); this
module only orchestrates: it counts the retries by kind, records each prompt's outcome, runs a
canary request per server before the rest, and a circuit breaker aborts the shard when most recent
requests failed the same way, quoting the server.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hashlib
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from expansion_dag import event_loop, server_api
from expansion_dag.answer_lengths import AnswerLengths
from expansion_dag.degeneration import LoopThresholds
from expansion_dag.errors import RequestError, ShardAborted
from expansion_dag.http_client import HttpClient, make_client
from expansion_dag.server_api import SGLANG, Answer, DegenerateError, Dialect, RetryPolicy
from expansion_dag.store import FAILED, OK, SegmentWriter, completion_key


@dataclass(frozen=True, kw_only=True)
class SamplingSettings:
    """Everything sent with a request that shapes the answer; part of each completion's identity."""

    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    #: JSON object text, e.g. ``{"enable_thinking": false}``: kept as text so the settings hash.
    chat_template_kwargs_json: str = "{}"
    #: The ``max_tokens`` cap: a higher cap changes which answers are cut, so it is identity too.
    max_output_tokens: int = 4096

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be within [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be within (0, 1], got {self.top_p}")
        if self.max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be positive, got {self.max_output_tokens}")
        if not isinstance(self.chat_template_kwargs, dict):
            raise ValueError("chat_template_kwargs_json must be a JSON object")

    @functools.cached_property
    def chat_template_kwargs(self) -> dict[str, Any]:
        # Cached: every request carries it, and parsing it per request costs CPU the fleet needs.
        return json.loads(self.chat_template_kwargs_json)

    def fingerprint(self, model: str) -> str:
        """Hash of the model and settings: changing either gives new completion keys."""
        canonical = json.dumps({"model": model, **asdict(self)}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def key(self, prompt_id: str, model: str) -> str:
        return completion_key(prompt_id, self.fingerprint(model))


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How hard the engine pushes and when it gives up; the defaults suit a GPU fleet."""

    #: Extra requests queued at the server beyond its slots, so a freed slot never waits on a
    #: round trip: ``max(min_headroom, slots * headroom_fraction)``.
    headroom_fraction: float = 0.1
    min_headroom: int = 2
    connect_timeout_s: float = 10.0
    #: A long generation on a loaded server takes minutes; this bounds a hung request.
    request_timeout_s: float = 1800.0
    max_attempts: int = 5
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0
    backoff_jitter_s: float = 1.0
    #: Tokens kept free when ``max_tokens`` is recomputed after a context-length 400.
    context_margin: int = 16
    min_output_tokens: int = 16
    canary: bool = True
    breaker_window: int = 24
    breaker_failure_fraction: float = 0.8
    progress_interval_s: float = 30.0
    #: How often the other servers' loads are read while this shard has queued prompts.
    spill_poll_s: float = 1.0
    #: Stream each answer and stop it as soon as it loops (recorded as a ``degenerate`` failure,
    #: text kept); False sends plain requests and lets every answer run to its end.
    stop_degenerate: bool = True
    #: A loop is a span of at least ``loop_min_span_chars`` repeated back to back at least
    #: ``loop_min_repeats`` times over at least ``loop_min_chars``, within the last
    #: ``loop_window_chars`` (see ``expansion_dag.degeneration``).
    loop_min_span_chars: int = 1
    loop_min_repeats: int = 4
    loop_min_chars: int = 1200
    loop_window_chars: int = 8192
    #: While streamed events come often, read every stream once a tick instead of waking up for
    #: each event (``expansion_dag.event_loop``); an event is read at most this late. 0: never.
    client_tick_s: float = 0.1

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.breaker_window < 1:
            raise ValueError(f"breaker_window must be at least 1, got {self.breaker_window}")
        if not 0.0 < self.breaker_failure_fraction <= 1.0:
            raise ValueError("breaker_failure_fraction must be within (0, 1]")
        if self.spill_poll_s <= 0:
            raise ValueError(f"spill_poll_s must be positive, got {self.spill_poll_s}")
        if self.client_tick_s < 0:
            raise ValueError(f"client_tick_s must be at least 0, got {self.client_tick_s}")
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
        """On a borrowed server a prompt gets one attempt: its retries belong to its own server."""
        return RetryPolicy(
            attempts=1 if borrowed else self.max_attempts,
            wait_initial_s=self.backoff_initial_s,
            wait_max_s=self.backoff_max_s,
            wait_jitter_s=self.backoff_jitter_s,
            context_retry=not borrowed,
            context_margin=self.context_margin,
            min_output_tokens=self.min_output_tokens,
        )


@dataclass(frozen=True)
class WorkItem:
    key: str
    prompt_id: str
    source: str
    messages: Sequence[Mapping[str, Any]]
    prompt_tokens: int
    max_tokens: int
    #: The answer length the budget expects (its per-source prior, capped by ``max_tokens``):
    #: decode time follows it, so it orders the queue.
    expected_output_tokens: int


def dispatch_order(item: WorkItem) -> tuple[int, str]:
    """The queue's order on the typed priors alone: longest expected answer first."""
    return (-item.expected_output_tokens, item.prompt_id)


def expected_output_tokens(item: WorkItem, lengths: AnswerLengths) -> int:
    """The learned expectation of an item's answer, within its ``max_tokens``."""
    return min(item.max_tokens, lengths.estimate(item.source, item.prompt_tokens, item.expected_output_tokens).tokens)


#: The queue is re-ordered when this many answers have returned, then at each doubling: estimates
#: move most while they rest on few answers, and a sort of the queue costs CPU.
FIRST_REORDER = 16


@dataclass(frozen=True)
class Server:
    url: str
    slots: int
    #: How to read its answers and its load (the probe's ``ServerInfo.dialect``).
    dialect: Dialect = SGLANG
    #: Tokens per streamed event (the probe's ``ServerInfo.stream_interval``): asked for in each
    #: request where the dialect takes it, and how a stopped answer's tokens are counted.
    stream_interval: int = 1


@dataclass
class ServerStats:
    slots: int
    requests: int = 0
    output_tokens: int = 0
    in_flight: int = 0
    busy_slot_seconds: float = 0.0
    _since: float = field(default_factory=time.monotonic)

    def _account(self, now: float) -> None:
        # Busy slots are what the server is running: requests beyond its slots wait in its queue.
        self.busy_slot_seconds += min(self.in_flight, self.slots) * (now - self._since)
        self._since = now

    def started(self, now: float) -> None:
        self._account(now)
        self.in_flight += 1

    def finished(self, now: float) -> None:
        self._account(now)
        self.in_flight -= 1


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
    #: Seconds from send to outcome, summed by outcome: a finish reason, or a failure's kind.
    #: Includes the time a request beyond the server's slots waits in its queue (the headroom).
    slot_seconds_by_outcome: collections.Counter = field(default_factory=collections.Counter)
    #: Times the queue was re-ordered on what returning answers taught the length estimates.
    reorders: int = 0
    #: Keys whose answer was stopped as a loop: the model's doing, not the fleet's, so the asset
    #: keeps them out of the failure rate (they are sent again next run, never kept).
    degenerate_keys: set[str] = field(default_factory=set)

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

    def __str__(self) -> str:
        eta = "unknown" if self.eta_s is None else f"{self.eta_s:,.0f} s"
        flight = ", ".join(f"{url}: {n}" for url, n in self.in_flight.items())
        retries = ", ".join(f"{kind} {n:,}" for kind, n in sorted(self.retries.items()))
        return (
            f"{self.done:,}/{self.total:,} done ({self.failed:,} failed), {self.output_tokens_per_s:,.0f} output tok/s, "
            f"in flight [{flight}], retries [{retries or 'none'}], ETA {eta}"
        )


class _Breaker:
    """Opens when most of the last ``window`` outcomes are failures of one kind and status."""

    def __init__(self, window: int, fraction: float):
        self._outcomes: collections.deque[RequestError | None] = collections.deque(maxlen=window)
        self._fraction = fraction

    def record(self, error: RequestError | None) -> str | None:
        self._outcomes.append(error)
        if len(self._outcomes) < (self._outcomes.maxlen or 0):
            return None
        failures = [e for e in self._outcomes if e is not None]
        if len(failures) < self._fraction * len(self._outcomes):
            return None
        signature, count = collections.Counter(e.signature for e in failures).most_common(1)[0]
        if count < self._fraction * len(self._outcomes):
            return None
        example = next(e for e in reversed(failures) if e.signature == signature)
        status = f" HTTP {example.status}" if example.status else ""
        return (
            f"circuit breaker: {count} of the last {len(self._outcomes)} requests failed with "
            f"{example.kind}{status}: {example.message}"
        )


class ShardRun:
    """One run of one shard: owns the queue, the workers, the breaker and the report."""

    def __init__(
        self,
        items: Iterable[WorkItem],
        servers: Sequence[Server],
        *,
        writer: SegmentWriter,
        model: str,
        sampling: SamplingSettings,
        config: EngineConfig,
        helpers: Sequence[Server] = (),
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        lengths: AnswerLengths | None = None,
    ):
        if not servers:
            raise ValueError("a shard needs at least one server")
        #: Learned from the store when given, and from this run's answers as they return.
        self.lengths = lengths if lengths is not None else AnswerLengths()
        self._next_reorder = FIRST_REORDER
        self._returned = 0
        self._queue = collections.deque(sorted(items, key=self._order))
        self._servers = list(servers)
        own = {s.url for s in servers}
        # A server that cannot say its load cannot be seen idle (vLLM).
        self._helpers = [h for h in helpers if h.url not in own and h.dialect.has_loads]
        #: Helpers whose last load reading had no queue: their workers may take another prompt.
        self._helper_open: dict[str, bool] = {}
        #: Helpers that failed a request: not used again in this run.
        self._benched: set[str] = set()
        self._drained = asyncio.Event()
        self._api_key = api_key
        self._transport = transport
        self._writer = writer
        self._model = model
        self._sampling = sampling
        self._config = config
        self._policies = {borrowed: config.retry_policy(borrowed=borrowed) for borrowed in (False, True)}
        self._thresholds = config.loop_thresholds()
        self._on_progress = on_progress
        self._breaker = _Breaker(config.breaker_window, config.breaker_failure_fraction)
        self.report = ShardReport(
            total=len(self._queue),
            servers={s.url: ServerStats(s.slots) for s in servers},
            helpers={h.url: ServerStats(h.slots) for h in self._helpers},
        )
        self._start = time.monotonic()
        self._cpu_start = time.process_time()
        self._workers: list[asyncio.Task[None]] = []

    async def run(self) -> ShardReport:
        self._start = time.monotonic()
        self._cpu_start = time.process_time()
        for stats in self._all_stats():
            stats._since = self._start
        progress = asyncio.create_task(self._progress_loop()) if self._on_progress else None
        try:
            if self._config.canary:
                await self._canaries()
            await self._run_workers()
        finally:
            if progress is not None:
                progress.cancel()
            self._close_books()
        if self._on_progress is not None:
            # The final figures, also for a shard that ends before its first periodic report.
            self._on_progress(self.progress())
        if self.report.aborted:
            raise ShardAborted(self.report.aborted, report=self.report)
        return self.report

    def _close_books(self) -> None:
        now = time.monotonic()
        self.report.elapsed_s = now - self._start
        self.report.client_cpu_s = time.process_time() - self._cpu_start
        for stats in self._all_stats():
            stats._account(now)

    def _all_stats(self) -> list[ServerStats]:
        return [*self.report.servers.values(), *self.report.helpers.values()]

    def _stats(self, server: Server) -> ServerStats:
        return self.report.servers.get(server.url) or self.report.helpers[server.url]

    def _client(self) -> HttpClient:
        return make_client(
            timeout_s=self._config.request_timeout_s,
            connect_timeout_s=self._config.connect_timeout_s,
            api_key=self._api_key,
            transport=self._transport,
        )

    async def _canaries(self) -> None:
        # One request per server, alone, before the flood: a misconfigured fleet fails in seconds.
        # It is the shortest expected answer, so a healthy fleet waits on it the least.
        for server in self._servers:
            if not self._queue:
                return
            async with self._client() as client:
                error = await self._process(client, self._take(last=True), server)
            if error is not None:
                self.report.aborted = (
                    f"canary request to {server.url} failed ({error.kind}"
                    f"{f' HTTP {error.status}' if error.status else ''}): {error.message}"
                )
                return

    async def _run_workers(self) -> None:
        if self.report.aborted or not self._queue:
            return
        self._workers = [
            asyncio.create_task(self._worker(server))
            for server in self._servers
            for _ in range(self._config.workers_for(server.slots))
        ]
        if self._helpers:
            self._workers.append(asyncio.create_task(self._spill()))
        try:
            await asyncio.gather(*self._workers)
        except asyncio.CancelledError:
            if not self.report.aborted:
                raise  # cancelled from outside (run terminated), not by the breaker
        finally:
            for task in self._workers:
                task.cancel()
            await asyncio.gather(*self._workers, return_exceptions=True)

    async def _worker(self, server: Server) -> None:
        async with self._client() as client:
            while self._queue and not self.report.aborted:
                self._judge(server, await self._process(client, self._take(), server))

    async def _helper_worker(self, helper: Server) -> None:
        """Takes queued prompts to an idle server while it stays idle; one that fails there goes home."""
        async with self._client() as client:
            while self._queue and not self.report.aborted and self._open(helper):
                item = self._take()
                if await self._process(client, item, helper, borrowed=True) is not None:
                    # Its trouble is not this shard's: it is not used again in this run.
                    self._benched.add(helper.url)
                    home = self._servers[0]
                    self._judge(home, await self._process(client, item, home))

    def _judge(self, server: Server, error: RequestError | None) -> None:
        reason = self._breaker.record(error)
        if reason and not self.report.aborted:
            self.report.aborted = f"{server.url}: {reason}"
            # Stop the other workers now: their requests would fail the same way.
            for task in self._workers:
                if task is not asyncio.current_task():
                    task.cancel()

    def _order(self, item: WorkItem) -> tuple[int, str]:
        """Longest expected answer first (the canary is taken from the other end)."""
        return (-expected_output_tokens(item, self.lengths), item.prompt_id)

    def _learn(self, item: WorkItem, output_tokens: int) -> None:
        self.lengths.observe(item.source, item.prompt_tokens, output_tokens)
        self._returned += 1
        if self._returned >= self._next_reorder:
            self._next_reorder *= 2
            if self._queue:
                self._queue = collections.deque(sorted(self._queue, key=self._order))
                self.report.reorders += 1

    def _take(self, *, last: bool = False) -> WorkItem:
        item = self._queue.pop() if last else self._queue.popleft()
        if not self._queue:
            self._drained.set()
        return item

    async def _spill(self) -> None:
        """Start workers on other servers' idle slots while this shard still has queued prompts."""
        spilled: list[asyncio.Task[None]] = []
        async with contextlib.AsyncExitStack() as stack:
            # A client a helper: one client for all of them would reconnect on every poll, each
            # helper being another origin to its one connection.
            clients = {h.url: await stack.enter_async_context(self._client()) for h in self._helpers}
            while self._queue and not self.report.aborted:
                try:
                    await asyncio.wait_for(self._drained.wait(), timeout=self._config.spill_poll_s)
                    break  # nothing left to share
                except asyncio.TimeoutError:
                    pass
                for helper in self._helpers:
                    if helper.url in self._benched:
                        continue
                    idle = await server_api.read_idle_slots(
                        clients[helper.url],
                        helper.url,
                        helper.dialect,
                        slots=helper.slots,
                        timeout_s=self._config.connect_timeout_s,
                    )
                    self._helper_open[helper.url] = idle is not None and idle >= 0
                    if not self._open(helper):
                        continue
                    for _ in range(min(idle or 0, len(self._queue))):
                        task = asyncio.create_task(self._helper_worker(helper))
                        spilled.append(task)
                        self._workers.append(task)  # so the breaker and a termination stop it too
        await asyncio.gather(*spilled)

    def _open(self, helper: Server) -> bool:
        return self._helper_open.get(helper.url, False) and helper.url not in self._benched

    async def _process(
        self, client: HttpClient, item: WorkItem, server: Server, *, borrowed: bool = False
    ) -> RequestError | None:
        """Send one prompt, write its completion or failure record; return the error if any.

        On a ``borrowed`` server there is one attempt, and a failure is returned, not recorded:
        the prompt is still this shard's to send to its own server.
        """
        stats = self._stats(server)
        started = time.monotonic()
        request = server_api.chat_request(
            self._model,
            item.messages,
            item.max_tokens,
            self._sampling,
            stream=self._thresholds is not None,
            stream_interval=server.stream_interval if server.dialect.stream_interval_per_request else None,
            continuous_usage=server.dialect.continuous_usage,
        )
        stats.started(started)
        try:
            exchange = await server_api.generate(
                client,
                server.url,
                request,
                server.dialect,
                self._policies[borrowed],
                on_retry=self._count_retry,
                thresholds=self._thresholds,
                stream_interval=server.stream_interval,
            )
        finally:
            stats.finished(time.monotonic())
        if exchange.error is not None:
            if not borrowed:
                self.report.slot_seconds_by_outcome[exchange.error.kind] += time.monotonic() - started
                self._record_failure(item, server, exchange.error, exchange.attempts, exchange.max_tokens)
            return exchange.error
        assert exchange.answer is not None
        self._record_success(item, server, exchange.answer, exchange, time.monotonic() - started)
        return None

    def _count_retry(self, kind: str) -> None:
        self.report.retries_by_kind[kind] += 1

    def _record_success(
        self, item: WorkItem, server: Server, answer: Answer, exchange: server_api.Exchange, latency: float
    ) -> None:
        finish = answer.finish_reason
        self._writer.append(
            {
                "key": item.key,
                "status": OK,
                "prompt_id": item.prompt_id,
                "source": item.source,
                "messages": list(item.messages),
                "content": answer.content,
                "reasoning_content": answer.reasoning,
                "finish_reason": finish,
                "prompt_tokens": answer.prompt_tokens,
                "completion_tokens": answer.completion_tokens,
                "local_prompt_tokens": item.prompt_tokens,
                "max_tokens": exchange.max_tokens,
                "server": server.url,
                "latency_s": round(latency, 4),
                "attempts": exchange.attempts,
            }
        )
        report = self.report
        report.ok += 1
        report.finish_reasons[finish] += 1
        report.requests_by_source[item.source] += 1
        if finish == "length":
            report.truncated_by_source[item.source] += 1
        report.output_tokens += answer.completion_tokens
        report.output_tokens_by_outcome[finish] += answer.completion_tokens
        report.slot_seconds_by_outcome[finish] += latency
        self._learn(item, answer.completion_tokens)
        if answer.prompt_tokens is not None:
            report.prompt_token_drift[answer.prompt_tokens - item.prompt_tokens] += 1
        stats = self._stats(server)
        stats.requests += 1
        stats.output_tokens += answer.completion_tokens

    def _record_failure(
        self, item: WorkItem, server: Server, error: RequestError, attempts: int, max_tokens: int
    ) -> None:
        record = {
            "key": item.key,
            "status": FAILED,
            "prompt_id": item.prompt_id,
            "source": item.source,
            "error": error.kind,
            "http_status": error.status,
            "message": error.message,
            "attempts": attempts,
            "server": server.url,
            "max_tokens": max_tokens,
        }
        if isinstance(error, DegenerateError):
            # Kept for inspection only: a failure record never reaches the training set.
            record |= {
                "content": error.content,
                "reasoning_content": error.reasoning,
                "loop_span": error.loop.span,
                "loop_repeats": error.loop.repeats,
                "streamed_chunks": error.chunks,
                "streamed_tokens": error.tokens,
            }
            self.report.output_tokens_by_outcome[error.kind] += error.tokens
            self.report.degenerate_keys.add(item.key)
        self._writer.append(record)
        self.report.failed += 1
        self.report.failures_by_kind[error.kind] += 1
        self._stats(server).requests += 1

    def progress(self) -> Progress:
        elapsed = time.monotonic() - self._start
        report = self.report
        rate = report.done / elapsed if elapsed > 0 else 0.0
        remaining = report.total - report.done
        return Progress(
            done=report.done,
            total=report.total,
            elapsed_s=elapsed,
            output_tokens_per_s=report.output_tokens / elapsed if elapsed > 0 else 0.0,
            in_flight={
                **{url: s.in_flight for url, s in report.servers.items()},
                **{url: s.in_flight for url, s in report.helpers.items() if s.in_flight},
            },
            eta_s=remaining / rate if rate > 0 else None,
            failed=report.failed,
            retries=dict(report.retries_by_kind),
        )

    async def _progress_loop(self) -> None:
        assert self._on_progress is not None
        while True:
            await asyncio.sleep(self._config.progress_interval_s)
            self._on_progress(self.progress())


def generate_shard(
    items: Iterable[WorkItem],
    servers: Sequence[Server],
    *,
    writer: SegmentWriter,
    model: str,
    sampling: SamplingSettings,
    config: EngineConfig = EngineConfig(),
    helpers: Sequence[Server] = (),
    api_key: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    lengths: AnswerLengths | None = None,
) -> ShardReport:
    """Run a shard to the end (or to its abort) on a fresh event loop (``config.client_tick_s``);
    the synchronous entry point.

    ``lengths``: answer lengths learned from the store (``answer_lengths.learn``); the run refines
    them in place, so the caller can show what they became.
    """

    async def main() -> ShardReport:
        run = ShardRun(
            items,
            servers,
            writer=writer,
            model=model,
            sampling=sampling,
            config=config,
            helpers=helpers,
            api_key=api_key,
            transport=transport,
            on_progress=on_progress,
            lengths=lengths,
        )
        return await run.run()

    return event_loop.run(main(), tick_s=config.client_tick_s)
