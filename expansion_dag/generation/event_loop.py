"""The generation client's event loop: one wake-up a tick, not one an event, while events come often.

A streamed answer is one network read per event, and at the reference rate a client process sees
dozens of events a second from different streams, each after the process slept. Waking up (the
kernel's and, on a VM, the hypervisor's part) costs about as much as reading the event itself
(BENCHMARKS.md, "Client CPU of a streamed event, layer by layer"). While events come often, this
loop's selector sleeps through a tick and then takes every socket that has data, so one wake-up
serves all the events of the tick. An event is read at most a tick late: 0.1 s by default, against
the ~135 s of an answer at the reference rate, while the requests each server holds queued (the
engine's headroom) keep its slots busy. While events are rare it waits on the sockets as asyncio
does, so a lone answer is read the moment it arrives and an idle run costs nothing.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Coroutine
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
