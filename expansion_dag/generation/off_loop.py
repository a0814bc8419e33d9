"""The run's blocking work off its event loop: the loop only streams, while the store's appends,
fsyncs and segment creation and the progress events a Dagster run writes to its event log run in
an ``OffLoop`` thread, fed by a bounded queue."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any


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
