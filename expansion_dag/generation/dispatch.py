"""Which prompt goes next, and how many of another server's idle slots a shard may take.

:class:`PromptQueue` orders a shard's prompts longest expected work first, the expectation learned
(``expansion_dag.generation.answer_lengths``) from the store and from each answer that returns, and re-orders
itself as the estimates settle. A conversation's work is its whole remaining chain (each turn waits
for the answer before it), so its short first turn is not left to the end, where its later turns
would run alone past everything else. :func:`claim_share` splits a server's idle slots between the shards
that may borrow them, the same way in every shard's process, so that together they never send it
more than it has idle: piled on, a server with a bounded queue answers 503 to the surplus.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from expansion_dag.core import DEFAULT_MODE, SamplingSettings
from expansion_dag.generation.answer_lengths import AnswerLengths, prompt_bucket, prompt_features
from expansion_dag.generation.speed import Stream

#: The queue is re-ordered when this many answers have returned, then at each doubling: estimates
#: move most while they rest on few answers, and a sort of the queue costs CPU.
FIRST_REORDER = 16


@dataclass(frozen=True)
class Turn:
    """Where a request stands in its conversation (``WorkItem.turn``; ``expansion_dag.generation.conversations``)."""

    conversation_id: str
    turn: int
    turns: int
    #: The source's turns after this turn's answer, later placeholders included.
    rest: tuple[Mapping[str, Any], ...]
    prior_finish_reasons: tuple[str, ...] = ()

    @property
    def last(self) -> bool:
        return self.turn == self.turns

    def record_fields(self) -> dict[str, Any]:
        return {
            "conversation_id": self.conversation_id,
            "turn": self.turn,
            "turns": self.turns,
            "prior_finish_reasons": list(self.prior_finish_reasons),
        }


@dataclass(frozen=True)
class WorkItem:
    key: str
    prompt_id: str
    source: str
    messages: Sequence[Mapping[str, Any]]
    prompt_tokens: int
    max_tokens: int
    #: The answer length the budget expects (its per-source prior, capped by ``max_tokens``):
    #: decode time follows it, so it orders the queue until answers teach better.
    expected_output_tokens: int
    #: The prompt's generation mode and its settings (None: the shard's own).
    mode: str = DEFAULT_MODE
    sampling: SamplingSettings | None = None
    #: Tool definitions sent with the request, for the chat template.
    tools: Sequence[Mapping[str, Any]] | None = None
    #: Where the request stands in its conversation; None for a single-turn prompt.
    turn: Turn | None = None


@dataclass
class _Cell:
    """The queued prompts of one source and prompt bucket, summed for the time to finish."""

    prompts: int = 0
    #: Their expectations over their cell's when they were ordered: what their words (and caps) add.
    shift: float = 0.0
    #: The same of the cell's prompts already taken, and how many.
    taken_shift: float = 0.0
    taken: int = 0
    #: Answers of the cell learned before the run (the store's: earlier nights, a whole population).
    before: int = 0
    #: Conversation turns after theirs.
    later: int = 0
    #: One of them (its prompt tokens, prior and cap stand for the cell's).
    sample: WorkItem | None = None

    def add(self, item: WorkItem, shift: float, sign: int) -> None:
        self.prompts += sign
        self.shift += sign * shift
        self.later += sign * (item.turn.turns - item.turn.turn if item.turn is not None else 0)
        self.sample = self.sample or item

    def relative_shift(self) -> float:
        """The queued prompts' shifts over those of the answers the cell's learned length rests on:
        the words' level, learned against a moving mean, cancels. Those answers are this run's
        prompts taken (the longest first) and the store's, whose prompts stand for all of the run's."""
        if not self.taken and not self.before:
            return float(self.prompts)
        everyone = (self.shift + self.taken_shift) / (self.prompts + self.taken)
        taken = self.taken_shift / self.taken if self.taken else 0.0
        reference = (self.before * everyone + self.taken * taken) / (self.before + self.taken)
        return self.shift / reference


@dataclass(frozen=True)
class WorkLeft:
    """Output tokens still to come of a shard's prompts, from what the run has learned."""

    tokens: float
    #: Of them, the rest of the answers still running (past their tokens so far).
    running_tokens: float
    #: The tokens one stream decodes until the last answer ends, the answers dealt longest first
    #: onto the slots: the time to finish at a stream's speed once fewer answers are left than slots.
    drain_tokens: float
    queued: int
    running: int
    #: Answers the expectations rest on (the store's and this run's); 0: the typed priors alone.
    learned: int

    def basis(self) -> str:
        rests = f"learned from {self.learned:,} answers" if self.learned else "configured (no answers yet)"
        return f"{rests}; {self.queued:,} queued, {self.running:,} running at least their tokens so far"


class PromptQueue:
    """A shard's prompts still to send, longest expected remaining work first (:meth:`remaining`)."""

    def __init__(self, items: Iterable[WorkItem], lengths: AnswerLengths | None = None):
        #: Learned from the store when given, and from this run's answers as they return.
        self.lengths = lengths if lengths is not None else AnswerLengths()
        items = list(items)
        self._features = {item.key: prompt_features(item.messages) for item in items}
        #: Each item's expectation when the queue was last ordered: what put it where it was taken.
        self._ordered_on: dict[str, int] = {}
        #: Each item's expectation over its cell's then (``_Cell.shift``), and the queued cells' sums.
        self._shift: dict[str, float] = {}
        self._cells: dict[tuple[str, int], _Cell] = {}
        #: Per cell, the answers learned before the run (the store's), counted as a cell first appears.
        self._before: dict[tuple[str, int], int] = {}
        #: Items sent and not settled, with their stream once sent (``decoding``).
        self._running: dict[str, tuple[WorkItem, Stream | None]] = {}
        self._items = collections.deque(sorted(items, key=self._order))
        #: Items taken from the queue (sent, or answered): the learned lengths rest on them.
        self._taken: dict[str, WorkItem] = {}
        self._count_cells()
        self._returned = 0
        self._next_reorder = FIRST_REORDER
        self.reorders = 0
        #: Set once the last prompt is taken: nothing is left to lend out.
        self.drained = asyncio.Event()
        if not self._items:
            self.drained.set()
        #: Conversation turns in flight whose answer may bring a next turn.
        self._open = 0
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def finished(self) -> bool:
        """Nothing queued, and no answer in flight can bring more."""
        return not self._items and not self._open

    def opened(self, item: WorkItem) -> None:
        """``item`` is being sent; a turn before its conversation's last may bring the next."""
        if item.turn is not None and not item.turn.last:
            self._open += 1
        self._running[item.key] = (item, None)

    def decoding(self, item: WorkItem, stream: Stream) -> None:
        """``item`` went out as ``stream``: its tokens so far are counted from when it decodes."""
        self._running[item.key] = (item, stream)

    def settled(self, item: WorkItem, following: WorkItem | None = None) -> None:
        """``item``'s outcome is known; ``following`` is its conversation's next turn, first in line:
        a conversation finishes soon after it starts, so its turns do not wait behind the whole queue."""
        self._running.pop(item.key, None)
        if following is not None:
            self._features[following.key] = prompt_features(following.messages)
            self._order(following)
            self._items.appendleft(following)
            self._queued(following, +1)
            self.drained.clear()
        if item.turn is not None and not item.turn.last:
            self._open -= 1
        self._changed.set()

    async def wait_for_more(self) -> None:
        """Until a turn in flight settles (and may have queued its successor)."""
        self._changed.clear()
        await self._changed.wait()

    def features(self, item: WorkItem) -> tuple[int, ...]:
        """The hashed words of the prompt that the length estimate reads (kept with its record)."""
        return self._features[item.key]

    def expected(self, item: WorkItem) -> int:
        """The learned expectation of an item's answer, within its ``max_tokens``."""
        estimate = self.lengths.expect(item.source, item.prompt_tokens, item.expected_output_tokens, self._features[item.key])
        return min(item.max_tokens, estimate)

    def ordered_on(self, item: WorkItem) -> int:
        """The expectation the queue's order rested on when ``item`` was taken."""
        return self._ordered_on[item.key]

    def remaining(self, item: WorkItem) -> int:
        """The expected work of ``item``'s conversation from this turn on (its answer alone for a
        single prompt): this answer, and each later turn at its source's learned answer length."""
        expected = self.expected(item)
        if item.turn is None or item.turn.last:
            return expected
        later = self.lengths.estimate(item.source, item.prompt_tokens, item.expected_output_tokens).tokens
        return expected + (item.turn.turns - item.turn.turn) * min(item.max_tokens, later)

    def _order(self, item: WorkItem) -> tuple[int, str]:
        expected = self._ordered_on[item.key] = self.expected(item)
        self._shift[item.key] = self._shift_of(item, expected)
        return (-self.remaining(item), item.prompt_id)

    def _shift_of(self, item: WorkItem, expected: int) -> float:
        return expected / max(self.lengths.estimate(item.source, item.prompt_tokens, item.expected_output_tokens).tokens, 1)

    def _cell(self, item: WorkItem) -> _Cell:
        key = (item.source, prompt_bucket(item.prompt_tokens))
        if key not in self._cells:
            self._cells[key] = _Cell(before=self._before.setdefault(key, self._learned(item)))
        return self._cells[key]

    def _learned(self, item: WorkItem) -> int:
        estimate = self.lengths.estimate(item.source, item.prompt_tokens, item.expected_output_tokens)
        return estimate.answers if estimate.basis == "source+bucket" else 0

    def _queued(self, item: WorkItem, sign: int) -> None:
        self._cell(item).add(item, self._shift[item.key], sign)

    def _took(self, item: WorkItem, sign: int) -> None:
        cell = self._cell(item)
        cell.taken += sign
        cell.taken_shift += sign * self._shift[item.key]
        if sign > 0:
            self._taken[item.key] = item
        else:
            del self._taken[item.key]

    def _count_cells(self) -> None:
        """The cells' sums, the taken prompts' shifts said again by what the queue's order now rests
        on: a shift compares with another only under the same learned words."""
        self._cells = {}
        for item in self._items:
            self._queued(item, +1)
        for item in self._taken.values():
            self._shift[item.key] = self._shift_of(item, self.expected(item))
            cell = self._cell(item)
            cell.taken += 1
            cell.taken_shift += self._shift[item.key]

    def work_left(self, stream_rate: float | None, now: float, slots: int) -> WorkLeft:
        """The output tokens still to come (:func:`work_left`) on ``slots``; ``stream_rate``: tokens
        a second a stream decodes (None: not measured yet)."""
        running = []
        for item, stream in self._running.values():
            since = stream.decoding_since if stream is not None else None
            so_far = min(item.max_tokens, stream_rate * (now - since)) if stream_rate and since is not None else 0.0
            running.append((item, so_far))
        return work_left(self.lengths, self._cells.values(), running, queued=len(self._items), slots=slots)

    def take(self, *, shortest: bool = False) -> WorkItem:
        """The longest expected work (``shortest``: the other end, for a canary)."""
        item = self._items.pop() if shortest else self._items.popleft()
        self._queued(item, -1)
        self._took(item, +1)
        if not self._items:
            self.drained.set()
        return item

    def put_back(self, item: WorkItem) -> None:
        """A prompt that could not be sent where it went: first in line again."""
        self._items.appendleft(item)
        self._queued(item, +1)
        self._took(item, -1)
        self.drained.clear()

    def learn(self, item: WorkItem, output_tokens: int) -> None:
        self.lengths.observe(
            item.source, item.prompt_tokens, output_tokens, self._features[item.key], item.expected_output_tokens
        )
        self._returned += 1
        if self._returned >= self._next_reorder:
            self._next_reorder *= 2
            if self._items:
                self._items = collections.deque(sorted(self._items, key=self._order))
                self._count_cells()
                self.reorders += 1


def work_left(
    lengths: AnswerLengths, cells: Iterable[_Cell], running: list[tuple[WorkItem, float]], *, queued: int, slots: int
) -> WorkLeft:
    """The output tokens still to come: each queued prompt's expected answer (and its
    conversation's later turns), each running answer's expected rest past its tokens so far, every
    source's expectations scaled for survivorship (``AnswerLengths.survivorship``).

    A source no answer has reached yet has its configured prior, scaled by what the sources with
    answers say of theirs: priors wrong by 2x for the sources seen are likely so for the rest.
    """
    cells = [cell for cell in cells if cell.prompts and cell.sample is not None]
    bounds: dict[str, list[int]] = collections.defaultdict(list)
    for item, so_far in running:
        bounds[item.source].append(int(so_far))
    priors: dict[str, int] = {}
    caps: dict[str, int] = collections.defaultdict(int)  # a source's highest: its means uncut
    for item in [cell.sample for cell in cells if cell.sample] + [item for item, _ in running]:
        priors[item.source] = item.expected_output_tokens
        caps[item.source] = max(caps[item.source], item.max_tokens)
    fits = {s: lengths.survivorship(s, prior, bounds[s], caps[s]) for s, prior in priors.items()}
    seen = {s: lengths.source_answers(s) for s in priors}
    configured = sum(n * fits[s][1].prior.area(caps[s]) for s, n in seen.items())
    if configured > 0:
        scale = sum(n * fits[s][1].area(caps[s]) for s, n in seen.items()) / configured
        priors = {s: max(1, round(prior * scale)) for s, prior in priors.items()}
        fits = {s: lengths.survivorship(s, prior, bounds[s], caps[s], again=fits[s][1]) for s, prior in priors.items()}

    def mean(item: WorkItem) -> float:
        """The cell's expected answer, scaled for survivorship, not yet capped."""
        return fits[item.source][0] * lengths.estimate(item.source, item.prompt_tokens, priors[item.source]).tokens

    # Past this many answers a slot, the slots' loads differ by less than an answer in hundreds:
    # the tokens left over the slots are the time to finish, without dealing each answer.
    deal = sum(cell.prompts for cell in cells) + len(running) <= _DEALT_PER_SLOT * slots
    total, answers = 0.0, []
    for cell in cells:
        assert cell.sample is not None
        cap, each = cell.sample.max_tokens, mean(cell.sample)
        # The learned lengths are of answers as capped: the cap bounds, it does not cut again.
        tokens = min(cell.prompts * cap, cell.relative_shift() * each) + cell.later * min(cap, each)
        total += tokens
        if deal:
            answers += [tokens / cell.prompts] * cell.prompts
    rest = 0.0
    for item, so_far in running:
        later = item.turn.turns - item.turn.turn if item.turn is not None else 0
        its = fits[item.source][1].rest(so_far, item.max_tokens) + later * min(item.max_tokens, mean(item))
        rest += its
        answers.append(its)
    drain = longest_first_makespan(answers, slots) if deal else (total + rest) / slots
    return WorkLeft(total + rest, rest, drain, queued, len(running), lengths.answers)


_DEALT_PER_SLOT = 16


def longest_first_makespan(durations: list[float], slots: int) -> float:
    """The makespan of ``durations`` on ``slots`` parallel slots, longest first, each to the slot
    that frees first: the clairvoyant bound a queue ordered on estimates is measured against."""
    if not durations or slots < 1:
        return 0.0
    free = [0.0] * min(slots, len(durations))
    for duration in sorted(durations, reverse=True):
        heapq.heapreplace(free, free[0] + duration)
    return max(free)


def claim_share(idle: int, borrowers: int, rank: int, turn: int = 0) -> int:
    """This borrower's share of a server's ``idle`` slots, among ``borrowers`` that may borrow it.

    ``rank`` is this borrower's place among them, ``turn`` a counter that every borrower reads alike
    (the wall clock's poll interval): the slots a split leaves over go round, so none stays idle for
    long. Each borrower computes the same split, so their shares never add up to more than ``idle``.
    """
    if idle <= 0 or borrowers < 1:
        return 0
    base, left_over = divmod(idle, borrowers)
    return base + (1 if (rank + turn) % borrowers < left_over else 0)
