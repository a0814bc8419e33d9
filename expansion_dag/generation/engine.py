"""The generation engine: one shard's prompts through its SGLang server(s), every slot kept busy.

Dispatch: ``slots + headroom`` workers per server pull from one queue ordered longest expected
answer first (``expansion_dag.generation.dispatch``), so a slot is refilled the moment it frees and
the long tail starts early. Each worker owns its client, one keep-alive connection: a shared pool of
hundreds scans every connection on each checkout. Idle servers of the fleet take a share of the queue too (``expansion_dag.generation.borrowing``).

The loop only streams. The store's writer runs in a thread of the run's own (``off_loop.OffLoop``),
fed by a queue of at most ``write_queue`` answers, and the progress callback in another, so a slow
disk or event log never delays a stream. An answer is durable once that thread wrote its line: a
run killed outright loses at most the answers still queued, which the next run sends again; a run
stopped any other way writes them all before it returns. A full queue (a stuck disk) holds back
the workers, not memory; a writer's error fails the run at the next answer, or at its end.

Outcomes (``expansion_dag.core.outcomes``): a canary per server runs before the rest and fails
only on the server's fault, a circuit breaker aborts the shard when most recent requests failed
the same way, and a model's answer (a loop included) is never held against a server. The yield
gate (``expansion_dag.generation.answer_yield``) stops a shard whose first answers the training
set would mostly leave out, benching and blaming no server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any

import httpx

from expansion_dag.core import (
    CANARY_PROMPTS,
    CONTENT,
    Breaker,
    ContextMismatchError,
    QueueFullError,
    RequestError,
    SamplingSettings,
    ShardAborted,
    WeightsProbe,
    borrowed_verdict,
    canary_verdict,
    describe,
    of_error,
)
from expansion_dag.generation.answer_lengths import AnswerLengths
from expansion_dag.generation.borrowing import Borrowing
from expansion_dag.generation.conversations import Ended, TurnPlanner
from expansion_dag.generation.dispatch import PromptQueue, WorkItem
from expansion_dag.generation.engine_config import EngineConfig, Server, WeightsWatch
from expansion_dag.generation.recorder import Judge, LoopRetry, Recorder
from expansion_dag.generation.off_loop import OffLoop
from expansion_dag.generation.shard_report import Progress, ServerStats, ShardReport
from expansion_dag.servers import (
    Answer,
    ChatRequest,
    Deadline,
    DegenerateError,
    Exchange,
    async_client,
    chat_request,
    generate,
    reprobe_difference,
)
from expansion_dag.store import SegmentWriter

__all__ = ["ShardRun", "WorkItem", "WRITE_QUEUE", "generate_shard"]

#: Answers queued for the writer thread at most: minutes of answers at the reference rate, and
#: never more than a few hundred records' memory.
WRITE_QUEUE = 256


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
        self._thresholds = config.loop
        self._first_output_s, self._slack = config.first_output_timeout_s, config.deadline_slack
        self._floor_rate = config.floor_stream_rate
        self._loop_retries = config.loop_retries
        self._queue = queue
        self._recorder = recorder
        self.report = recorder.report

    async def send(
        self, client: httpx.AsyncClient, item: WorkItem, server: Server, *, borrowed: bool = False,
        on_output: Callable[[], None] | None = None, canary: bool = False,
    ) -> RequestError | None:
        """Send one prompt and record its outcome; return the error if any.

        On a ``borrowed`` server there is one attempt, and only a content outcome is recorded: any
        other failure leaves the prompt this shard's, to send to its own server. ``on_output``: called
        once a streamed answer's first text arrives. A streamed ``canary`` waits for that text only
        ``first_output_timeout_s``; every request, a plain canary too, ends within its deadline.
        """
        self._queue.opened(item)
        following: WorkItem | None = None
        try:
            error, answer = await self._exchange(client, item, server, borrowed, on_output, canary)
            if answer is not None and self._planner is not None:
                planned = self._planner.next_item(item, answer.content, answer.finish_reason, answer.tool_calls)
                if isinstance(planned, Ended):
                    await self._recorder.ended(planned, item, server.url)
                elif planned is not None:
                    following = planned
                    self.report.total += 1
        finally:
            self._queue.settled(item, following)
        return error

    async def _exchange(
        self, client: httpx.AsyncClient, item: WorkItem, server: Server, borrowed: bool, on_output: Callable[[], None] | None,
        canary: bool,
    ) -> tuple[RequestError | None, Answer | None]:
        stats = self.report.servers.get(server.url) or self.report.helpers[server.url]
        # Scaled to the answer it may be, at the speed this server's streams decode with its slots
        # full; until that is measured (or if it says 0), at the floor speed: a server that trickles
        # keep-alives from its first request on is never measured. A plain canary's first text is its
        # whole answer: this bounds it too.
        rate = stats.meter.stream_rate or self._floor_rate
        deadline = Deadline(
            first_output_s=self._first_output_s if canary else None,
            total_s=self._first_output_s + self._slack * item.max_tokens / rate,
        )
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
        stream = stats.started(started, streamed=self._thresholds is not None)
        self._queue.decoding(item, stream)  # its tokens so far count in the time to finish

        def output() -> None:
            stream.output(time.monotonic())  # it decodes from here: the run's speed (generation.speed)
            if on_output is not None:
                on_output()

        async def ask(request: ChatRequest) -> Exchange:
            return await generate(
                client, server.url, request, server.dialect, self._policies[borrowed], on_retry=self._count_retry,
                thresholds=self._thresholds, stream_interval=server.stream_interval, on_output=output,
                identity=server.identity, deadline=deadline, context_length=server.context_length,
            )

        retried = None
        try:
            exchange = await ask(request)
            if self._loop_retries and not borrowed and isinstance(exchange.error, DegenerateError):
                retried = self._loop_retry(item, request, exchange)
                exchange = await ask(dataclasses.replace(request, sampling=retried.sampling))
        finally:
            stats.finished(time.monotonic(), stream)
        latency = time.monotonic() - started
        self.report.attempts += exchange.attempts
        error = exchange.error
        if isinstance(error, QueueFullError):
            self.report.backpressure += 1
        if error is None:
            assert exchange.answer is not None
            features = self._queue.features(item)
            expected = self._queue.ordered_on(item)
            await self._recorder.answer(
                item, server.url, exchange.answer, exchange, latency, expected=expected, features=features,
                loop_retry=retried,
            )
            if retried is not None:
                self.report.loop_retried["completed"] += 1
            stats.meter.answered(stream, exchange.answer.completion_tokens)
            self._queue.learn(item, exchange.answer.completion_tokens)
        elif not borrowed or of_error(error) == CONTENT:
            await self._recorder.failure(item, server.url, error, exchange, latency, loop_retry=retried)
            if isinstance(error, DegenerateError):  # a stopped loop spent its streamed tokens
                self._queue.learn(item, error.tokens)
        return error, exchange.answer if error is None else None

    def _loop_retry(self, item: WorkItem, request: ChatRequest, first: Exchange) -> LoopRetry:
        """The second try of a prompt whose answer looped: another seed, and the first stop's cost counted."""
        error = first.error
        assert isinstance(error, DegenerateError)
        self.report.loop_retried["asked"] += 1
        self.report.attempts += first.attempts
        self.report.output_tokens_by_outcome[error.kind] += error.tokens
        return LoopRetry.after(error, request.sampling, item.key)

    def _count_retry(self, kind: str) -> None:
        self.report.retries_by_kind[kind] += 1
        if kind == QueueFullError.kind:
            self.report.backpressure += 1


async def send_canary(
    send: Callable[..., Awaitable[RequestError | None]], client: Callable[[], httpx.AsyncClient], queue: PromptQueue,
    server: Server,
) -> tuple[str | None, asyncio.Task[RequestError | None] | None]:
    """One request to ``server``, alone, before the flood: a misconfigured fleet fails in seconds.

    It judges the server, not the answer: its first streamed text passes it (its answer goes on
    beside the flood, returned as a task: waiting for a whole answer would idle the GPU for
    minutes), as does any whole answer (a plain request's), a loop included; a refused request
    tries another prompt. It is the shortest expected answer, so a plain request's canary is waited
    on the least. Returns why the shard stops (or None), and the canary still answering (or None).
    """
    for tried in range(1, CANARY_PROMPTS + 1):
        if not len(queue):
            break
        answering = asyncio.Event()

        async def ask(item: WorkItem) -> RequestError | None:
            async with client() as http:
                return await send(http, item, server, on_output=answering.set, canary=True)

        canary = asyncio.create_task(ask(queue.take(shortest=True)))
        output = asyncio.create_task(answering.wait())
        await asyncio.wait([canary, output], return_when=asyncio.FIRST_COMPLETED)
        output.cancel()
        if not canary.done():
            return None, canary
        error = canary.result()
        verdict = canary_verdict(error, tried)
        if verdict == "passed":
            break
        if verdict == "failed":
            assert error is not None
            return f"canary request to {server.url} failed ({describe(error)})", None
    return None, None


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
        write_queue: int = WRITE_QUEUE,
        weights: WeightsWatch | None = None,
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
        self._weights = weights
        self._breaker = Breaker(config.breaker_window, config.breaker_failure_fraction)
        self.report = ShardReport(
            total=len(self.queue),
            servers={s.url: ServerStats(s.slots) for s in self._servers},
            helpers={h.url: ServerStats(h.slots, borrowing=self._borrowing.reasons[h.url]) for h in self._borrowing.helpers},
        )
        self._off_loop = OffLoop("store writer", write_queue)
        self._send = Sender(
            model=model, sampling=sampling, config=config, queue=self.queue,
            recorder=Recorder(writer, self._off_loop, self.report, judge), planner=planner,
        ).send
        self._start, self._cpu_start = time.monotonic(), time.process_time()
        self._workers: list[asyncio.Task[None]] = []
        #: Per server, its canary if it passed on its first text and its answer is still coming.
        self._answering: dict[str, asyncio.Task[RequestError | None]] = {}
        #: Workers on the shard's own servers still taking prompts.
        self._own_workers = 0

    @property
    def lengths(self) -> AnswerLengths:
        return self.queue.lengths

    async def run(self) -> ShardReport:
        self._start, self._cpu_start = time.monotonic(), time.process_time()
        for stats in self._all_stats():
            stats._since = self._start
        try:
            async with (
                _off_the_loop(self._off_loop, self._on_progress, self._config.progress_interval_s, self.progress),
                _watching(self._weights, self._abort),
            ):
                if self._config.canary:
                    await self._canaries()
                await self._run_workers()
        finally:
            self._close_books()
        if self._on_progress is not None:
            # The final figures, also for a shard that ends before its first periodic report.
            await asyncio.to_thread(self._on_progress, self.progress())
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

    def _client(self) -> httpx.AsyncClient:
        return async_client(
            timeout_s=self._config.request_timeout_s,
            connect_timeout_s=self._config.connect_timeout_s,
            api_key=self._api_key,
            transport=self._transport,
        )

    async def _canaries(self) -> None:
        for server in self._servers:
            self.report.aborted, answering = await send_canary(self._send, self._client, self.queue, server)
            if self.report.aborted:
                return
            if answering is not None:
                self._answering[server.url] = answering

    async def _run_workers(self) -> None:
        if self.report.aborted or not len(self.queue):
            for canary in self._answering.values():
                if self.report.aborted:
                    canary.cancel()
            await asyncio.gather(*self._answering.values(), return_exceptions=True)
            if self.report.aborted or not len(self.queue):  # (a conversation's next turn may have come)
                return
        self._workers = [
            asyncio.create_task(self._worker(server, after=self._answering.get(server.url) if first else None))
            for server in self._servers
            for first in [True, *[False] * (self._config.workers_for(server.slots) - 1)]
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

    async def _worker(self, server: Server, after: asyncio.Task[RequestError | None] | None = None) -> None:
        if after is not None:
            await after  # a canary still answering holds one worker's place, never one more
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
        if isinstance(error, ContextMismatchError):  # the probe was wrong: so is every prompt's budget
            reason = f"{describe(error)}. Re-run once the server serves the context it reports"
        self._abort(f"{server.url}: {reason}" if reason else self.report.answer_yield.gate(self._config.yield_gate))

    def _abort(self, reason: str | None) -> None:
        if reason and not self.report.aborted:
            self.report.aborted = reason
            # Stop the other workers now: their requests would fail, or be wasted, the same way.
            for task in self._workers:
                if task is not asyncio.current_task():
                    task.cancel()

    def progress(self) -> Progress:
        return self.report.progress(time.monotonic() - self._start, queue=self.queue)


@contextlib.asynccontextmanager
async def _watching(watch: WeightsWatch | None, abort: Callable[[str], None]) -> AsyncIterator[None]:
    """``watch_weights`` while the block runs (with a ``watch``)."""
    task = asyncio.create_task(watch_weights(watch, abort)) if watch is not None else None
    try:
        yield
    finally:
        # Cancelled again until it ends: a cancellation that lands as a probe's connection opens
        # can be swallowed on the way (Python 3.11's wait_for, under load), and the watch would
        # then probe on, or wait on an unread connection, and the shard never end.
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task], timeout=1.0)


async def watch_weights(watch: WeightsWatch, abort: Callable[[str], None]) -> None:
    """Asks the weights' probe again every ``watch.every_s`` until cancelled; ``abort`` the shard
    once it answers otherwise."""
    while True:
        await asyncio.sleep(watch.every_s)
        probe = await watch.probe()
        difference = reprobe_difference(watch.expected, probe) if isinstance(probe, WeightsProbe) else None
        if difference is not None:
            abort(f"{watch.url}: the weights probe, asked again, answers otherwise than at the run's start "
                  f"({difference}): the server now serves other weights")
            return


@contextlib.asynccontextmanager
async def _off_the_loop(
    writer: OffLoop, on_progress: Callable[[Progress], None] | None, interval_s: float,
    progress: Callable[[], Progress],
) -> AsyncIterator[None]:
    """The run's writer thread and, with ``on_progress``, its progress reports every ``interval_s``
    until the block ends; then every answer queued is written, whatever ended the block (a
    cancellation waits for it too)."""
    writer.start()
    reports = asyncio.create_task(_report_every(interval_s, on_progress, progress)) if on_progress else None
    try:
        yield
    finally:
        if reports is not None:
            reports.cancel()
        try:
            await writer.drain()
        finally:
            if reports is not None:
                await asyncio.gather(reports, return_exceptions=True)


async def _report_every(
    interval_s: float, on_progress: Callable[[Progress], None], progress: Callable[[], Progress]
) -> None:
    """Hand ``on_progress`` the run's figures every ``interval_s``, in a thread of its own: a Dagster
    run writes them to its event log, which may be as slow as any disk, and never holds up the
    store's writes. One report waits at most while one is being made."""
    reporter = OffLoop("progress", 1)
    reporter.start()
    try:
        while True:
            await asyncio.sleep(interval_s)
            await reporter.submit(on_progress, progress())
    finally:
        await reporter.drain()


def generate_shard(items: Iterable[WorkItem], servers: Sequence[Server], **options: Any) -> ShardReport:
    """Run a shard to the end (or to its abort) on a fresh event loop;
    the synchronous entry point. ``options``: :class:`ShardRun`'s keywords, ``config`` among them.

    ``helpers``: the fleet's other servers, borrowed while idle; ``fleet_urls``: every server of the
    fleet, so that every shard splits a helper's idle slots alike (default: this shard's servers and
    its helpers). ``lengths``: answer lengths learned from the store (``answer_lengths.learn``); the
    run refines them in place, so the caller can show what they became. ``planner``: builds each
    conversation's next turn when an answer arrives (``expansion_dag.generation.conversations``). ``judge``:
    the training set's verdict on each answer (``training_set.AnswerJudge``), counted in the report's
    ``answer_yield`` and gated by ``config.yield_gate``. ``write_queue``: answers queued for the
    writer thread at most (see the module's docstring). ``weights``: the weights' probe asked again
    on a schedule (:class:`WeightsWatch`).
    """

    async def main() -> ShardReport:
        return await ShardRun(items, servers, **options).run()

    return asyncio.run(main())
