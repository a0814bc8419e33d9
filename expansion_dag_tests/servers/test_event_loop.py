"""The generation client's event loop: frequent events from many sockets share a wake-up, a lone
event is read at once, timers keep their time. Real sockets, a sender thread playing the servers."""

import asyncio
import bisect
import socket
import statistics
import threading
import time

import pytest

from expansion_dag.servers import CoalescingSelector
from expansion_dag_tests.helpers import until

STREAMS = 24
EVENT = 32  # bytes: an event's index, padded


class Counting(CoalescingSelector):
    """Records each poll: when it began, whether it was coalescing then, how many sockets it returned."""

    def __init__(self, tick_s):
        super().__init__(tick_s)
        self.polls: list[tuple[float, bool, int]] = []

    def select(self, timeout=None):
        began, coalescing = time.monotonic(), self.coalescing
        ready = super().select(timeout)
        self.polls.append((began, coalescing, len(ready)))
        return ready


def send(pairs, gaps, burst, sent):
    """From a thread, after each gap, one event on each of the next ``burst`` sockets, as servers
    stream; ``sent[i]``: when event ``i`` was in its socket. A loaded machine only stretches the
    gaps: events come no more often."""
    for i, gap in enumerate(gaps):
        time.sleep(gap)
        for j in range(burst):
            pairs[(i * burst + j) % len(pairs)][1].send(str(len(sent)).encode().ljust(EVENT))
            sent.append(time.monotonic())


async def receive(pairs, gaps, burst=1) -> tuple[list[float], list[tuple[int, float]]]:
    """When each event was in its socket, and each event's index and the moment it was read, in the
    order read."""
    loop = asyncio.get_running_loop()
    sent: list[float] = []
    reads: list[tuple[int, float]] = []
    done = asyncio.Event()

    def readable(sock):
        data, now = sock.recv(1 << 16), time.monotonic()
        reads.extend((int(data[i : i + EVENT]), now) for i in range(0, len(data), EVENT))
        if len(reads) == len(gaps) * burst:
            done.set()

    for reader, _ in pairs:
        reader.setblocking(False)
        loop.add_reader(reader, readable, reader)
    sender = threading.Thread(target=send, args=(pairs, gaps, burst, sent))
    sender.start()
    try:
        await asyncio.wait_for(done.wait(), 10 * sum(gaps) + 60)  # for a hang only: load stretches the gaps
    finally:
        sender.join()
        for reader, _ in pairs:
            loop.remove_reader(reader)
    return sent, reads


def polls_waited_for(selector: Counting, sent: list[float], reads: list[tuple[int, float]]) -> list[int]:
    """For each event, how many polls began after it was in its socket and returned without it.

    The poll that read an event is the last to begin before the read; one that began after the
    event was there, and returned before that one, left it behind."""
    began = [b for b, _, _ in selector.polls]
    return [
        (bisect.bisect_right(began, read) - 1) - bisect.bisect_left(began, sent[index])
        for index, read in reads
    ]


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
        sent, fast = loop.run_until_complete(receive(pairs, frequent, burst=STREAMS))
        assert selector.coalescing
        rare_from = len(selector.polls)
        slow_sent, slow = loop.run_until_complete(receive(pairs, rare))
    finally:
        loop.close()

    batches = [n for _, coalescing, n in selector.polls[:rare_from] if coalescing and n]
    # Once the rate is known, a poll takes the events of a whole tick from many sockets at once.
    assert len(batches) >= 5 and statistics.median(batches) >= 8, selector.polls
    assert sorted(index for index, _ in fast) == list(range(len(frequent) * STREAMS))
    # At most a tick late: each event is taken by the first poll that began once it was there (a
    # poll sleeps a tick, then takes every socket with data), never left for a later one.
    assert max(polls_waited_for(selector, sent, fast)) <= 0
    # The rare events: the rate falls below 2 a tick within a second, and then each is read by a
    # poll that waited on the sockets (read at once), not by one that slept a tick first.
    assert not selector.coalescing
    assert len(slow) == len(rare) and max(polls_waited_for(selector, slow_sent, slow)) <= 0
    returned = [coalescing for _, coalescing, n in selector.polls[rare_from:] if n]
    assert not any(returned[2:]), selector.polls[rare_from:]


def test_fewer_than_two_events_a_tick_never_switch_coalescing_on(pairs):
    """Below 2 events a tick most ticks would find nothing: the selector keeps waiting on the sockets."""
    selector = Counting(0.005)  # 200 events/s: 1 a tick
    loop = asyncio.SelectorEventLoop(selector)
    try:
        _, reads = loop.run_until_complete(receive(pairs, [0.005] * 500))
    finally:
        loop.close()
    assert len(reads) == 500
    # However late the loop runs on a loaded machine, events come no oftener than this.
    assert not any(coalescing for _, coalescing, _ in selector.polls)


def test_timers_keep_their_time_while_coalescing(pairs):
    # A long tick, so that a timer kept waiting for it stands out from any scheduling delay.
    tick = 2.0
    selector = Counting(tick)

    async def main():
        receiving = asyncio.ensure_future(receive(pairs, [0.005] * 600))  # 3 s of frequent events
        await until(lambda: selector.coalescing, "coalescing to switch on")
        started = time.monotonic()
        await asyncio.sleep(0.05)
        slept = time.monotonic() - started
        # Every poll while the timer waited slept ticks: the timer was due in the middle of one.
        during = [coalescing for began, coalescing, _ in selector.polls if began >= started]
        await receiving
        return slept, during

    loop = asyncio.SelectorEventLoop(selector)
    try:
        slept, during = loop.run_until_complete(main())
    finally:
        loop.close()
    assert during and all(during), selector.polls
    # The claim is about time: the timer wakes its poll 50 ms in, not after the 2 s tick. The bound,
    # half the tick, is 20 times the expected figure and far beyond a loaded machine's scheduling delay.
    assert slept < tick / 2, "a timer waited for the tick"


def test_a_tick_must_be_positive():
    with pytest.raises(ValueError, match="tick_s"):
        CoalescingSelector(0)
