"""Idle servers (``Borrowing``).

A shard runs on its own server, but once another server of the fleet reports idle slots while this
shard still has queued prompts, extra workers take its share of them (``dispatch.claim_share``: the
shards that borrow one server never claim more than it has idle, without any coordination between
their processes), and retire as soon as that server has a queue again. Shards balanced on
*expected* work finish apart by the luck of the draw; this keeps the early finishers' GPUs busy
with the late ones' work.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable, Sequence

import httpx

from expansion_dag.generation.dispatch import PromptQueue, claim_share
from expansion_dag.generation.engine_config import Server
from expansion_dag.servers import read_idle_slots

#: Load readings in a row that must show a server idle before its slots are claimed.
STEADY_READINGS = 3
#: Of a server with work on it that is not this shard's, the share of its slots never borrowed: its
#: owner's workers between two requests read as idle slots, and a busy client can leave them so for
#: readings in a row (issue 36: those were the 503s left once borrowers waited for the owners).
OWNER_RESERVE = 1 / 16

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
    only its idle slots are borrowed, less a reserve (``OWNER_RESERVE`` of its slots, at least one)
    while work that is not this shard's runs on it, and given back as soon as it queues. An owner that
    starts later than ``owner_wait_s`` finds its server borrowed, and its first requests may be refused
    (503, waited out as backpressure) until the borrowers have given back.
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
        self._reserve = {h.url: max(1, int(h.slots * OWNER_RESERVE)) for h in self.helpers}
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
        client: Callable[[], httpx.AsyncClient],
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
        self, helper: Server, client: httpx.AsyncClient, queue: PromptQueue, start: Callable[[Server], None],
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
        if helper.slots - idle > in_flight(helper):  # its owner (or another borrower) at work on it
            steady -= self._reserve[helper.url]
        share = min(claim_share(steady, borrowers, rank, turn), len(queue))
        claimed = min(self._cap[helper.url], working + share)
        self._claimed[helper.url] = claimed
        for _ in range(claimed - working):
            self._working[helper.url] += 1
            start(helper)
        return BORROWED if claimed else OWNER_BUSY
