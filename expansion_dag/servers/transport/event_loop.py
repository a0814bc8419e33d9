"""The generation client's event loop: one wake-up a tick, not one an event, while events come often.

A streamed answer is one network read per event, and at the reference rate a client process sees
dozens of events a second from different streams, each after the process slept. Waking up (the
kernel's and, on a VM, the hypervisor's part) costs about as much as reading the event itself
(BENCHMARKS.md, "Client CPU of a streamed event, layer by layer"). While events come often, this
loop's selector sleeps through a tick and then takes every socket that has data, so one wake-up
serves all the events of the tick. An event is read at most a tick late (the run configuration's
``generation.client_tick_s``: a tenth of a second against the ~135 s of an answer at the reference
rate), while the requests each server holds queued (the engine's headroom) keep its slots busy.
While events are rare it waits on the sockets as asyncio does, so a lone answer is read the moment
it arrives and an idle run costs nothing.

The loop only streams: what blocks (the store's appends, fsyncs and segment creation, the progress
events a Dagster run writes to its event log) runs in an ``OffLoop`` thread, fed by a bounded queue.
"""

from __future__ import annotations

import asyncio
import queue
import selectors
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

#: Coalesce while at least this many events are expected a tick: below it most ticks would find
#: nothing, a wake-up for nothing.
MIN_EVENTS_PER_TICK = 2.0
#: Seconds over which the event rate is measured, to switch coalescing on or off.
RATE_WINDOW_S = 1.0


class CoalescingSelector(selectors.DefaultSelector):
    """asyncio's selector, sleeping a tick before each poll while events are frequent."""

    def __init__(self, tick_s: float):
        if tick_s <= 0:
            raise ValueError(f"tick_s must be positive, got {tick_s}")
        super().__init__()
        self._tick_s = tick_s
        self.coalescing = False
        self._events = 0
        self._window_start = time.monotonic()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        # A zero timeout means callbacks are waiting: never delay them.
        if self.coalescing and (timeout is None or timeout > 0):
            time.sleep(self._tick_s if timeout is None else min(self._tick_s, timeout))
            ready = super().select(0)
        else:
            ready = super().select(timeout)
        self._measure(len(ready))
        return ready

    def _measure(self, events: int) -> None:
        self._events += events
        now = time.monotonic()
        elapsed = now - self._window_start
        if elapsed >= RATE_WINDOW_S:
            self.coalescing = self._events * self._tick_s >= MIN_EVENTS_PER_TICK * elapsed
            self._events = 0
            self._window_start = now


def run_ticked(main: Coroutine[Any, Any, T], *, tick_s: float) -> T:
    """``asyncio.run(main)`` on a loop that coalesces wake-ups; ``tick_s`` 0: asyncio's own loop."""
    factory = (lambda: asyncio.SelectorEventLoop(CoalescingSelector(tick_s))) if tick_s > 0 else None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


class OffLoop:
    """A thread that runs, in order, the blocking jobs an event loop hands it, from a bounded queue.

    ``submit`` returns once its job is queued: at once while there is room; else the task that
    submits waits for room while every other task runs on, so a stuck disk holds back the tasks
    that have something to write (back-pressure) and the queue never grows past ``max_jobs``. The
    first job that raises ends the thread's work: the jobs queued after it are dropped, and its
    error is raised by every ``submit`` after it and by ``close``, never swallowed.
    """

    def __init__(self, name: str, max_jobs: int):
        if max_jobs < 1:
            raise ValueError(f"an off-loop queue holds at least one job, got {max_jobs}")
        self._jobs: queue.Queue[tuple[Callable[..., object], tuple[Any, ...]] | None] = queue.Queue(max_jobs)
        self._name = name
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._room = asyncio.Event()
        #: Tasks waiting for room in the queue now.
        self.waiting = 0
        self._error: BaseException | None = None

    def start(self) -> None:
        """Start the thread; called on the loop whose tasks will submit."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
        self._thread.start()

    async def submit(self, job: Callable[..., object], *args: Any) -> None:
        """Queue ``job(*args)``, waiting for room while the queue is full."""
        self._raise()
        while True:
            try:
                self._jobs.put_nowait((job, args))
                return
            except queue.Full:
                pass
            self._room.clear()
            self.waiting += 1
            try:
                try:  # again, now that the thread knows to wake this task: room may have come between
                    self._jobs.put_nowait((job, args))
                    return
                except queue.Full:
                    await self._room.wait()
            finally:
                self.waiting -= 1

    def _work(self) -> None:
        assert self._loop is not None
        while (item := self._jobs.get()) is not None:
            if self.waiting:
                self._loop.call_soon_threadsafe(self._room.set)
            job, args = item
            if self._error is None:
                try:
                    job(*args)
                except BaseException as exc:  # raised on the loop: a writer error fails the run
                    self._error = exc

    async def drain(self) -> None:
        """``close``, from the loop, to its end even when the waiting task is cancelled meanwhile (the
        cancellation is raised after): a stopped run keeps every answer it queued."""
        closing = asyncio.ensure_future(asyncio.to_thread(self.close))
        cancelled = False
        while True:
            try:
                await asyncio.shield(closing)
                break
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError

    def close(self) -> None:
        """Run every job queued, end the thread, and raise its error if a job raised one. Blocks (a
        loop calls ``drain``)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error
