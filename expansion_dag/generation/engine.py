"""The generation engine: one shard's prompts through its SGLang server(s), every slot kept busy.

Dispatch: ``slots + headroom`` workers per server pull from one queue ordered longest expected
answer first (``expansion_dag.generation.dispatch``), so a slot is refilled the moment it frees and the long
tail starts early instead of setting the makespan.

Each worker owns one keep-alive connection: a shared pool of hundreds of connections costs more
CPU per request (httpcore scans every connection on each checkout) than the rest of the client
together. Each result is written to the completion store (``expansion_dag.generation.recorder``) before the
worker takes the next prompt.

Idle servers (:class:`Borrowing`): a shard runs on its own server, but once another server of the
fleet reports idle slots while this shard still has queued prompts, extra workers take its share of
them (``dispatch.claim_share``: the shards that borrow one server never claim more than it has
idle, without any coordination between their processes), and retire as soon as that server has a
queue again. Shards balanced on *expected* work finish apart by the luck of the draw; this keeps
the early finishers' GPUs busy with the late ones' work.

Outcomes (``expansion_dag.core.outcomes``): what a server says, and how often a prompt is tried on it,
is ``server_api``'s business; which outcome is whose fault is the taxonomy's. Here a canary per
server runs before the rest and fails only on the server's fault, a circuit breaker aborts the
shard when most recent requests failed the same way, and a model's answer (a loop included) is
never held against a server. The yield gate (``expansion_dag.generation.answer_yield``) stops a shard whose first
answers (borrowed servers' too) the training set would mostly leave out: a verdict on the answers,
judged where the breaker is, that benches and blames no server.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import httpx

from expansion_dag.core import (
    CANARY_PROMPTS,
    CONTENT,
    Breaker,
    QueueFullError,
    RequestError,
    SamplingSettings,
    ShardAborted,
    borrowed_verdict,
    canary_verdict,
    describe,
    of_error,
)
from expansion_dag.generation.answer_lengths import AnswerLengths
from expansion_dag.generation.answer_yield import YieldGate
from expansion_dag.generation.conversations import Ended, TurnPlanner
from expansion_dag.generation.dispatch import PromptQueue, WorkItem, claim_share
from expansion_dag.generation.event_loop import run_ticked
from expansion_dag.generation.recorder import Judge, Recorder
from expansion_dag.generation.shard_report import Progress, ServerStats, ShardReport
from expansion_dag.servers import (
    SGLANG,
    Answer,
    Dialect,
    HttpClient,
    LoopThresholds,
    RetryPolicy,
    chat_request,
    generate,
    make_client,
    read_idle_slots,
)
from expansion_dag.store import SegmentWriter

__all__ = ["EngineConfig", "Server", "ShardRun", "WorkItem", "generate_shard"]


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
    #: How long another server's own shard has to show itself (from this shard's start, then from
    #: its first request seen there) before its idle slots are borrowed without having seen it fill
    #: them: a shard done before this one started, absent, or with fewer prompts than slots. Shards
    #: of one run start seconds apart; a server borrowed before its shard starts refuses that
    #: shard's first requests once its queue is bounded (``Borrowing``).
    owner_wait_s: float = 60.0
    #: How long a prompt may wait in all on its server's full queue (backpressure) before the
    #: queue-full answer is its failure; such waits use none of its attempts.
    backpressure_wait_s: float = 600.0
    #: Stream each answer and stop it as soon as it loops (recorded as a ``degenerate`` outcome,
    #: text kept, final for the prompt); False sends plain requests and lets every answer run to its end.
    stop_degenerate: bool = True
    #: A loop is a span of at least ``loop_min_span_chars`` repeated back to back at least
    #: ``loop_min_repeats`` times over at least ``loop_min_chars``, within the last
    #: ``loop_window_chars`` (see ``expansion_dag.servers.degeneration``).
    loop_min_span_chars: int = 1
    loop_min_repeats: int = 4
    loop_min_chars: int = 1200
    loop_window_chars: int = 8192
    #: While streamed events come often, read every stream once a tick instead of waking up for
    #: each event (``expansion_dag.generation.event_loop``); an event is read at most this late. 0: never.
    client_tick_s: float = 0.1
    #: Stops a shard whose first answers the training set would mostly leave out (a content
    #: verdict, only with a ``judge``: ``expansion_dag.generation.answer_yield``).
    yield_gate: YieldGate = YieldGate()

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




#: Load readings in a row that must show a server idle before its slots are claimed.
STEADY_READINGS = 3

#: Why a helper's load reading did or did not lead to a claim: counted per helper, in the shard's metadata.
OWNER_NOT_STARTED = "its shard not started"
OWNER_STARTING = "its shard starting"
OWNER_BUSY = "its shard using its slots"
NOT_STEADY = f"idle, not yet in {STEADY_READINGS} readings in a row"
BORROWED = "idle slots borrowed"
LOAD_UNREADABLE = "load unreadable"
BENCHED = "benched: failed through its own fault"


class Borrowing:
    """This shard's use of other shards' servers while they are idle and it still has prompts queued.

    Per helper, a number of slots claimed: one worker a slot, sending one prompt after another. Each
    load reading moves the claim by this shard's share (``dispatch.claim_share``) of what the server
    says: its idle slots, less this shard's workers between two requests (which it does not see); or,
    when it queues, its excess, given back. So the borrowers together follow the server's load from
    both sides, and never pile on: a pile-on answers 503 once the server's queue is bounded.

    However late a reading is acted on (a loaded machine), a shard never holds more of a helper than
    its fixed share of the helper's slots: together the borrowers can fill a server, never queue on it.

    A helper's own shard has first claim on it. Shards share only the servers and the storage root,
    and start seconds apart, so a borrower reads the owner's presence off the server's load: work on
    it that is not this shard's can only be the owner's before anyone borrows (every borrower waits
    the same way). A helper is left alone until its owner has been seen filling it (its canary alone
    does not: the flood follows), or ``owner_wait_s`` has passed with no sign of it (a shard already
    done, or absent) or since its first request (a shard with fewer prompts than slots). From then on
    only its idle slots are borrowed, and given back as soon as it queues. An owner that starts later
    than ``owner_wait_s`` finds its server borrowed, and its first requests may be refused (503, waited
    out as backpressure) until the borrowers have given back.
    """

    def __init__(
        self, own: Server, helpers: Sequence[Server], fleet_urls: Sequence[str], poll_s: float, owner_wait_s: float
    ):
        # A server that cannot say its load cannot be seen idle (vLLM).
        self.helpers = [h for h in helpers if h.url != own.url and h.dialect.has_loads]
        fleet = sorted({own.url, *fleet_urls, *(h.url for h in self.helpers)})
        #: Per helper: how many shards may borrow it (all but its own), and this shard's place among them.
        self._split = {h.url: (len(fleet) - 1, [u for u in fleet if u != h.url].index(own.url)) for h in self.helpers}
        self._poll_s = poll_s
        self._claimed = dict.fromkeys(self._split, 0)
        #: The most of a helper this shard may hold: a share of its slots split by a fixed turn, so
        #: the borrowers' shares add up to the slots even when their readings are of different turns.
        self._cap = {h.url: claim_share(h.slots, *self._split[h.url]) for h in self.helpers}
        self._working = dict.fromkeys(self._split, 0)
        #: Per helper, its last readings of idle slots: a claim needs idle slots in each, and takes a
        #: share of the fewest, so a server whose own shard is only starting (its canary alone) or
        #: whose workers happen to be between two requests is left alone.
        self._readings = {url: collections.deque(maxlen=STEADY_READINGS) for url in self._split}
        #: Helpers that failed a request through their own fault: not used again in this run.
        self._benched: set[str] = set()
        self._owner_wait_s = owner_wait_s
        #: Per helper, since when its owner has had to show itself: this shard's start, then the first
        #: work seen on it that is not this shard's (``owner_seen``).
        self._waiting_since: dict[str, float] = {}
        self._owner_seen: set[str] = set()
        #: Helpers whose owner has filled them or let ``owner_wait_s`` pass: their idle slots may be borrowed.
        self._open: set[str] = set()
        #: Per helper, why each load reading did or did not lead to a claim.
        self.reasons: dict[str, collections.Counter[str]] = {url: collections.Counter() for url in self._split}

    def keep(self, helper: Server) -> bool:
        """Whether a worker on ``helper`` may send another prompt; one that may not leaves (``left``)."""
        return helper.url not in self._benched and self._working[helper.url] <= self._claimed[helper.url]

    def left(self, helper: Server) -> None:
        self._working[helper.url] -= 1

    def give_back(self, helper: Server) -> None:
        """Busy again (a full queue): one slot less claimed."""
        self._claimed[helper.url] = max(0, self._claimed[helper.url] - 1)

    def bench(self, helper: Server) -> None:
        self._benched.add(helper.url)

    def _owner_lets(self, helper: Server, idle: int, mine: int, now: float) -> str | None:
        """None once ``helper``'s own shard leaves its idle slots to borrowers; else why not yet."""
        url = helper.url
        if url in self._open:
            return None
        if helper.slots - idle > mine:  # running or queued requests that are not this shard's
            if url not in self._owner_seen:
                self._owner_seen.add(url)
                self._waiting_since[url] = now
                self._readings[url].clear()  # readings from before its owner came say nothing of its use
            if idle <= 0:
                self._open.add(url)
                return None
        if now - self._waiting_since[url] >= self._owner_wait_s:
            self._open.add(url)
            return None
        return OWNER_STARTING if url in self._owner_seen else OWNER_NOT_STARTED

    async def run(
        self,
        queue: PromptQueue,
        client: Callable[[], HttpClient],
        start: Callable[[Server], None],
        stopped: Callable[[], bool],
        in_flight: Callable[[Server], int],
    ) -> None:
        """Read each helper's load every ``poll_s`` while prompts are queued, and move the claims."""
        async with contextlib.AsyncExitStack() as stack:
            # A client a helper: one client for all of them would reconnect on every poll, each
            # helper being another origin to its one connection.
            clients = {h.url: await stack.enter_async_context(client()) for h in self.helpers}
            self._waiting_since = dict.fromkeys(self._split, time.monotonic())
            while len(queue) and not stopped():
                try:
                    await asyncio.wait_for(queue.drained.wait(), timeout=self._poll_s)
                    break  # nothing left to share
                except asyncio.TimeoutError:
                    pass
                turn = int(time.time() / self._poll_s)  # the same in every shard's process
                for helper in self.helpers:
                    reason = await self._poll(helper, clients[helper.url], queue, start, in_flight, turn)
                    self.reasons[helper.url][reason] += 1

    async def _poll(
        self, helper: Server, client: HttpClient, queue: PromptQueue, start: Callable[[Server], None],
        in_flight: Callable[[Server], int], turn: int,
    ) -> str:
        """One reading of ``helper``'s load, and the claim it moves; why it did or did not borrow."""
        if helper.url in self._benched:
            return BENCHED
        idle = await read_idle_slots(
            client, helper.url, helper.dialect, slots=helper.slots, timeout_s=self._poll_s * 10
        )
        if idle is None:
            return LOAD_UNREADABLE
        borrowers, rank = self._split[helper.url]
        working = self._working[helper.url]
        readings = self._readings[helper.url]
        readings.append(idle)
        waiting = self._owner_lets(helper, idle, in_flight(helper), time.monotonic())
        if idle < 0:
            self._claimed[helper.url] = max(0, working - claim_share(-idle, borrowers, rank, turn))
            return OWNER_BUSY
        if waiting is not None:
            return waiting
        if len(readings) < STEADY_READINGS:
            return NOT_STEADY
        between = working - in_flight(helper)
        steady = min(readings) - between
        share = min(claim_share(steady, borrowers, rank, turn), len(queue))
        claimed = min(self._cap[helper.url], working + share)
        self._claimed[helper.url] = claimed
        for _ in range(claimed - working):
            self._working[helper.url] += 1
            start(helper)
        return BORROWED if claimed else OWNER_BUSY


class Sender:
    """Sends one prompt to one server and records its outcome: the request, the exchange, the books."""

    def __init__(
        self, *, model: str, sampling: SamplingSettings, config: EngineConfig, queue: PromptQueue, recorder: Recorder,
        planner: TurnPlanner | None = None,
    ):
        self._model = model
        self._sampling = sampling
        self._planner = planner
        self._policies = {borrowed: config.retry_policy(borrowed=borrowed) for borrowed in (False, True)}
        self._thresholds = config.loop_thresholds()
        self._queue = queue
        self._recorder = recorder
        self.report = recorder.report

    async def send(self, client: HttpClient, item: WorkItem, server: Server, *, borrowed: bool = False) -> RequestError | None:
        """Send one prompt and record its outcome; return the error if any.

        On a ``borrowed`` server there is one attempt, and only a content outcome is recorded: any
        other failure leaves the prompt this shard's, to send to its own server.
        """
        self._queue.opened(item)
        following: WorkItem | None = None
        try:
            error, answer = await self._exchange(client, item, server, borrowed)
            if answer is not None and self._planner is not None:
                planned = self._planner.next_item(item, answer.content, answer.finish_reason, answer.tool_calls)
                if isinstance(planned, Ended):
                    self._recorder.ended(planned, item, server.url)
                elif planned is not None:
                    following = planned
                    self.report.total += 1
        finally:
            self._queue.settled(item, following)
        return error

    async def _exchange(
        self, client: HttpClient, item: WorkItem, server: Server, borrowed: bool
    ) -> tuple[RequestError | None, Answer | None]:
        stats = self.report.servers.get(server.url) or self.report.helpers[server.url]
        request = chat_request(
            self._model,
            item.messages,
            item.max_tokens,
            item.sampling or self._sampling,
            stream=self._thresholds is not None,
            stream_interval=server.stream_interval if server.dialect.stream_interval_per_request else None,
            continuous_usage=server.dialect.continuous_usage,
            tools=item.tools,
            tool_choice=server.tool_choice,
            token_ids=server.dialect.token_ids,
        )
        started = time.monotonic()
        stats.started(started)
        try:
            exchange = await generate(
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
        latency = time.monotonic() - started
        self.report.attempts += exchange.attempts
        error = exchange.error
        if isinstance(error, QueueFullError):
            self.report.backpressure += 1
        if error is None:
            assert exchange.answer is not None
            features = self._queue.features(item)
            expected = self._queue.ordered_on(item)
            self._recorder.answer(item, server.url, exchange.answer, exchange, latency, expected=expected, features=features)
            self._queue.learn(item, exchange.answer.completion_tokens)
        elif not borrowed or of_error(error) == CONTENT:
            self._recorder.failure(item, server.url, error, exchange, latency)
        return error, exchange.answer if error is None else None

    def _count_retry(self, kind: str) -> None:
        self.report.retries_by_kind[kind] += 1
        if kind == QueueFullError.kind:
            self.report.backpressure += 1


class ShardRun:
    """One run of one shard: sends each queued prompt, judges what came back, keeps the books."""

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
        fleet_urls: Sequence[str] = (),
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        lengths: AnswerLengths | None = None,
        planner: TurnPlanner | None = None,
        judge: Judge | None = None,
    ):
        if not servers:
            raise ValueError("a shard needs at least one server")
        self.queue = PromptQueue(items, lengths)
        self._servers = list(servers)
        self._borrowing = Borrowing(self._servers[0], helpers, fleet_urls, config.spill_poll_s, config.owner_wait_s)
        self._api_key = api_key
        self._transport = transport
        self._config = config
        self._on_progress = on_progress
        self._breaker = Breaker(config.breaker_window, config.breaker_failure_fraction)
        self.report = ShardReport(
            total=len(self.queue),
            servers={s.url: ServerStats(s.slots) for s in self._servers},
            helpers={h.url: ServerStats(h.slots, borrowing=self._borrowing.reasons[h.url]) for h in self._borrowing.helpers},
        )
        self._send = Sender(
            model=model, sampling=sampling, config=config, queue=self.queue,
            recorder=Recorder(writer, self.report, judge), planner=planner,
        ).send
        self._start = time.monotonic()
        self._cpu_start = time.process_time()
        self._workers: list[asyncio.Task[None]] = []
        #: Workers on the shard's own servers still taking prompts.
        self._own_workers = 0

    @property
    def lengths(self) -> AnswerLengths:
        return self.queue.lengths

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
        self.report.reorders = self.queue.reorders
        for stats in self._all_stats():
            stats._account(now)

    def _all_stats(self) -> list[ServerStats]:
        return [*self.report.servers.values(), *self.report.helpers.values()]

    def _client(self) -> HttpClient:
        return make_client(
            timeout_s=self._config.request_timeout_s,
            connect_timeout_s=self._config.connect_timeout_s,
            api_key=self._api_key,
            transport=self._transport,
        )

    async def _canaries(self) -> None:
        # One request per server, alone, before the flood: a misconfigured fleet fails in seconds.
        # It is the shortest expected answer, so a healthy fleet waits on it the least. It judges
        # the server: any answer passes, a loop included; a refused request tries another prompt.
        for server in self._servers:
            async with self._client() as client:
                for tried in range(1, CANARY_PROMPTS + 1):
                    if not len(self.queue):
                        return
                    error = await self._send(client, self.queue.take(shortest=True), server)
                    verdict = canary_verdict(error, tried)
                    if verdict == "passed":
                        break
                    if verdict == "failed":
                        assert error is not None
                        self.report.aborted = f"canary request to {server.url} failed ({describe(error)})"
                        return

    async def _run_workers(self) -> None:
        if self.report.aborted or not len(self.queue):
            return
        self._workers = [
            asyncio.create_task(self._worker(server))
            for server in self._servers
            for _ in range(self._config.workers_for(server.slots))
        ]
        borrowed: list[asyncio.Task[None]] = []
        if self._borrowing.helpers:

            def start(helper: Server) -> None:
                task = asyncio.create_task(self._borrowed_worker(helper))
                borrowed.append(task)
                self._workers.append(task)  # so the breaker and a termination stop it too

            async def lend() -> None:
                await self._borrowing.run(
                    self.queue,
                    self._client,
                    start,
                    stopped=lambda: bool(self.report.aborted),
                    in_flight=lambda helper: self.report.helpers[helper.url].in_flight,
                )
                await asyncio.gather(*borrowed)

            self._workers.append(asyncio.create_task(lend()))
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
        self._own_workers += 1
        try:
            async with self._client() as client:
                while not self.report.aborted:
                    if len(self.queue):
                        self._judge(server, await self._send(client, self.queue.take(), server))
                    elif self.queue.finished:
                        break
                    else:  # a conversation's next turn may come with an answer in flight
                        await self.queue.wait_for_more()
        finally:
            self._own_workers -= 1

    async def _borrowed_worker(self, helper: Server) -> None:
        """Takes queued prompts to an idle server while its slot stays claimed; one it cannot answer
        goes back to the queue (a full queue) or home (the prompt's or the server's trouble)."""
        try:
            async with self._client() as client:
                while len(self.queue) and not self.report.aborted and self._borrowing.keep(helper):
                    item = self.queue.take()
                    verdict = borrowed_verdict(await self._send(client, item, helper, borrowed=True))
                    if verdict == "recorded":
                        continue
                    if verdict == "give_back_and_requeue":
                        self._borrowing.give_back(helper)
                        self.queue.put_back(item)
                        if self._own_workers:
                            return
                        # Nobody at home would take it again: this worker sends it there.
                        item = self.queue.take()
                    elif verdict == "bench_and_send_home":
                        self._borrowing.bench(helper)
                    self._judge(self._servers[0], await self._send(client, item, self._servers[0]))
        finally:
            self._borrowing.left(helper)

    def _judge(self, server: Server, error: RequestError | None) -> None:
        reason = self._breaker.record(error)
        reason = f"{server.url}: {reason}" if reason else self.report.answer_yield.gate(self._config.yield_gate)
        if reason and not self.report.aborted:
            self.report.aborted = reason
            # Stop the other workers now: their requests would fail, or be wasted, the same way.
            for task in self._workers:
                if task is not asyncio.current_task():
                    task.cancel()

    def progress(self) -> Progress:
        return self.report.progress(time.monotonic() - self._start)

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
    fleet_urls: Sequence[str] = (),
    api_key: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    lengths: AnswerLengths | None = None,
    planner: TurnPlanner | None = None,
    judge: Judge | None = None,
) -> ShardReport:
    """Run a shard to the end (or to its abort) on a fresh event loop (``config.client_tick_s``);
    the synchronous entry point.

    ``helpers``: the fleet's other servers, borrowed while idle; ``fleet_urls``: every server of the
    fleet, so that every shard splits a helper's idle slots alike (default: this shard's servers and
    its helpers). ``lengths``: answer lengths learned from the store (``answer_lengths.learn``); the
    run refines them in place, so the caller can show what they became. ``planner``: builds each
    conversation's next turn when an answer arrives (``expansion_dag.generation.conversations``). ``judge``:
    the training set's verdict on each answer (``training_set.AnswerJudge``), counted in the report's
    ``answer_yield`` and gated by ``config.yield_gate``.
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
            fleet_urls=fleet_urls,
            api_key=api_key,
            transport=transport,
            on_progress=on_progress,
            lengths=lengths,
            planner=planner,
            judge=judge,
        )
        return await run.run()

    return run_ticked(main(), tick_s=config.client_tick_s)
