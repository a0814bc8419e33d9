"""The generation client's event loop: frequent events from many sockets share a wake-up, a lone
event is read at once, timers keep their time. Real sockets, a sender thread playing the servers."""

import asyncio
import socket
import statistics
import threading
import time

import pytest

from expansion_dag.generation import CoalescingSelector, run_ticked

STREAMS = 24


class Counting(CoalescingSelector):
    """Records how many sockets each poll returned, and whether it was coalescing then."""

    def __init__(self, tick_s):
        super().__init__(tick_s)
        self.polls: list[tuple[bool, int]] = []

    def select(self, timeout=None):
        coalescing = self.coalescing
        ready = super().select(timeout)
        if ready:
            self.polls.append((coalescing, len(ready)))
        return ready


def send(pairs, gaps, burst):
    """From a thread, after each gap, one timestamped event on each of the next ``burst`` sockets,
    as servers stream. A loaded machine only stretches the gaps: events come no more often."""
    for i, gap in enumerate(gaps):
        time.sleep(gap)
        for j in range(burst):
            pairs[(i * burst + j) % len(pairs)][1].send(repr(time.monotonic()).encode().ljust(32))


async def receive(pairs, gaps, burst=1) -> list[float]:
    """Each event's delay from sent to read, in the order read."""
    loop = asyncio.get_running_loop()
    delays: list[float] = []
    done = asyncio.Event()

    def readable(sock):
        data = sock.recv(1 << 16)
        for i in range(0, len(data), 32):
            delays.append(time.monotonic() - float(data[i : i + 32]))
        if len(delays) == len(gaps) * burst:
            done.set()

    for reader, _ in pairs:
        reader.setblocking(False)
        loop.add_reader(reader, readable, reader)
    sender = threading.Thread(target=send, args=(pairs, gaps, burst))
    sender.start()
    try:
        await asyncio.wait_for(done.wait(), sum(gaps) + 10)
    finally:
        sender.join()
        for reader, _ in pairs:
            loop.remove_reader(reader)
    return delays


@pytest.fixture
def pairs():
    made = [socket.socketpair() for _ in range(STREAMS)]
    yield made
    for a, b in made:
        a.close()
        b.close()


def test_frequent_events_share_a_wake_up_and_rare_ones_are_read_at_once(pairs):
    tick = 0.2
    frequent = [0.02] * 150  # a burst on every socket each 20 ms for 3 s: hundreds of events a tick
    rare = [0.7] * 5  # 1.4 events/s (fewer on a loaded machine): fewer than 2 a tick
    selector = Counting(tick)
    loop = asyncio.SelectorEventLoop(selector)
    try:
        fast = loop.run_until_complete(receive(pairs, frequent, burst=STREAMS))
        assert selector.coalescing
        rare_from = len(selector.polls)
        slow = loop.run_until_complete(receive(pairs, rare))
    finally:
        loop.close()

    batches = [n for coalescing, n in selector.polls[:rare_from] if coalescing]
    # Once the rate is known, a poll takes the events of a whole tick from many sockets at once.
    assert len(batches) >= 5 and statistics.median(batches) >= 8, selector.polls
    assert len(fast) == len(frequent) * STREAMS
    # At most a tick late; the second beyond it is for a loaded machine's scheduling, which stays
    # far under it, while an event left for a later poll would wait for the next burst's tick too.
    assert max(fast) < tick + 1.0, "an event waited longer than a tick"
    # The rare events: the rate falls below 2 a tick within a second, and then each is read by a
    # poll that waited on the sockets (read at once), not by one that slept a tick first.
    assert not selector.coalescing
    assert len(slow) == len(rare)
    assert not any(coalescing for coalescing, _ in selector.polls[rare_from:][2:]), selector.polls[rare_from:]


def test_fewer_than_two_events_a_tick_never_switch_coalescing_on(pairs):
    """Below 2 events a tick most ticks would find nothing: the selector keeps waiting on the sockets."""
    selector = Counting(0.005)  # 200 events/s: 1 a tick
    loop = asyncio.SelectorEventLoop(selector)
    try:
        delays = loop.run_until_complete(receive(pairs, [0.005] * 500))
    finally:
        loop.close()
    assert len(delays) == 500
    # However late the loop runs on a loaded machine, events come no oftener than this.
    assert not any(coalescing for coalescing, _ in selector.polls)


def test_timers_keep_their_time_while_coalescing(pairs):
    # A long tick, so that a timer kept waiting for it stands out from any scheduling delay.
    tick = 2.0

    async def main():
        receiving = asyncio.ensure_future(receive(pairs, [0.005] * 600))  # 3 s of frequent events
        await asyncio.sleep(1.5)  # past the first rate window: coalescing by now
        started = time.monotonic()
        await asyncio.sleep(0.05)
        slept = time.monotonic() - started
        await receiving
        return slept

    assert run_ticked(main(), tick_s=tick) < tick / 2, "a timer waited for the tick"


def test_a_tick_must_be_positive():
    with pytest.raises(ValueError, match="tick_s"):
        CoalescingSelector(0)
