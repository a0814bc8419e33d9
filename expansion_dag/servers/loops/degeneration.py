"""Spotting a degenerate answer while it is generated: a loop, by one of five rules.

How a model repeats itself was read off a real model's answers (SmolLM2-135M-Instruct:
``expansion_dag_tests/data/real_model_answers.jsonl.gz``), and each way is a rule (``LOOP_RULES``):

- ``exact``: one span repeated back to back, the same characters each time (``loop_periodic``);
- ``counter``: one span repeated whose numbers all count by constant steps (``#define MAX 242``,
  ``243``, ...): an enumeration that never ends (a long span, a block of code, in fewer copies);
- ``numbers``: one span repeated whose numbers change in any other way;
- ``cycle``: a few lines recurring in any order (``loop_units``);
- ``resaid``: sentence after sentence saying again, in nearly the same words, what one said before.

Legitimate repetition (a table, a list, unit tests, a chorus) repeats a *shape* whose cells change,
and it ends: the shape rules ask for more copies than legitimate answers hold
(``expansion_dag_tests/data/repetitive_answers.jsonl.gz``), a list of numbers alone more still
(counting to 400 is an answer), and worked arithmetic whose arithmetic holds (``loop_derivation``)
is left alone. Characters, not tokens: the client sees text, and a token loop is a character loop.

Cost: the rules run every ``check_every_chars`` new characters; the span rules look at the last
``window_chars`` only, and each line and sentence is judged once, when complete. Known limit: an
answer *meant* to be one span many times (a matrix of zeros) or to count past hundreds reads as a
loop; such answers are rare and poor training data anyway.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from expansion_dag.servers.loops.loop_periodic import Shape, exact_loop, long_counter_loop, shape_loop
from expansion_dag.servers.loops.loop_units import Units


def _count(default: Any = MISSING, *, least: int) -> Any:
    """A count of the thresholds and the least it may be (a repeat needs two copies, a check or a
    span one character), checked when they are made."""
    return field(default=default, metadata={"least": least})


@dataclass(frozen=True, kw_only=True)
class LoopThresholds:
    """When each rule calls the text a loop; see the module docstring. The span rule's fields are
    the run configuration's (``generation.loop_*``): given, never assumed here."""

    #: The shortest span counted (1: a run of one character, e.g. endless newlines, counts too); a
    #: run of a shorter span is not counted as a run of its multiples either.
    min_span_chars: int = _count(least=1)
    #: Back-to-back copies of the span, the first included.
    min_repeats: int = _count(least=2)
    #: The repeated region must cover at least this many characters: short runs ("| --- | --- |",
    #: "ha ha ha", a row of "=") are formatting, not a loop.
    min_chars: int
    #: How far back a check looks; the longest span found is ``window_chars // min_repeats``.
    window_chars: int
    #: New characters between checks.
    check_every_chars: int = _count(64, least=1)
    #: ``counter``: copies of a span whose numbers all count by constant steps; a span of numbers
    #: and punctuation alone (a list of numbers) needs ``counter_repeats_numeric``.
    counter_repeats: int = _count(64, least=2)
    counter_repeats_numeric: int = _count(512, least=2)
    #: ``numbers``: copies of a span whose numbers change in any way (not mostly counting, for a
    #: span of numbers and punctuation alone: ``numbers_repeats_numeric``).
    numbers_repeats: int = _count(96, least=2)
    numbers_repeats_numeric: int = _count(128, least=2)
    #: ``cycle``: the last ``cycle_lines`` lines hold at most ``cycle_distinct`` different lines.
    cycle_lines: int = _count(48, least=2)
    cycle_distinct: int = 6
    #: ``resaid``: ``resaid_sentences`` sentences in a row (of ``resaid_min_words`` words at least)
    #: each share ``resaid_similarity`` of their words with one of the ``resaid_lookback`` before.
    resaid_sentences: int = _count(16, least=1)
    resaid_similarity: float = 0.8
    resaid_min_words: int = _count(6, least=1)
    resaid_lookback: int = _count(48, least=1)

    def __post_init__(self) -> None:
        for count in fields(self):
            least, value = count.metadata.get("least"), getattr(self, count.name)
            if least is not None and value < least:
                raise ValueError(f"{count.name} must be at least {least}, got {value}")
        if self.window_chars < max(self.min_chars, self.min_repeats * self.min_span_chars):
            raise ValueError(
                f"window_chars ({self.window_chars}) must hold min_chars ({self.min_chars}) "
                f"and min_repeats x min_span_chars"
            )
        if not 1 <= self.cycle_distinct < self.cycle_lines:
            raise ValueError(f"cycle_distinct must be within [1, cycle_lines), got {self.cycle_distinct}")
        if not 0.0 < self.resaid_similarity <= 1.0:
            raise ValueError(f"resaid_similarity must be within (0, 1], got {self.resaid_similarity}")


#: What each rule saw, for a message; in the order a check tries them (each stop's record names its rule).
_SEEN = {
    "exact": "a span of {chars} characters repeated {n} times back to back",
    "counter": "a span repeated {n} times back to back, its numbers counting",
    "numbers": "a span repeated {n} times back to back, only its numbers changing",
    "cycle": "{n} lines in a row made of a few lines recurring",
    "resaid": "{n} sentences in a row each saying again what an earlier one said",
}
LOOP_RULES = tuple(_SEEN)


@dataclass(frozen=True)
class Loop:
    """A detected loop: the rule that saw it, a repeated span (the last copy, as written), how many
    copies (spans, lines or sentences) and how much of the text's end they cover; ``start``: where
    the copies the rule saw begin in the text (the span rules: about, in the text's shape)."""

    span: str
    repeats: int
    chars: int
    rule: str = "exact"
    start: int = 0

    def describe(self) -> str:
        """What the rule saw: ``rule counter: a span repeated 64 times back to back, ...``."""
        return f"rule {self.rule}: " + _SEEN[self.rule].format(n=self.repeats, chars=len(self.span))


def loop_cut(text: str, loop: Loop) -> int:
    """Where ``text`` (the text the detector was fed, up to its stop) is cut to keep what came
    before its loop: after the first copy of the span (``exact``: the copies are followed back
    before ``loop.start`` for as long as they repeat; ``counter``, ``numbers``: one copy past the
    copies' start, as the last copy is long), or before the first line or sentence said again
    (``cycle``, ``resaid``: the first copy is the earlier one that it repeats)."""
    start = min(max(loop.start, 0), len(text))
    if loop.rule == "exact":
        period = len(loop.span)
        while start > 0 and text[start - 1] == text[start - 1 + period]:
            start -= 1
        return start + period
    if loop.rule in ("counter", "numbers"):
        return min(start + len(loop.span), len(text))
    return start


def find_loop(text: str, thresholds: LoopThresholds) -> Loop | None:
    """The loop a detector fed ``text`` in one piece finds (by any rule), or None."""
    return LoopDetector(thresholds, check_every_chars=1).feed(text)


class LoopDetector:
    """Fed the text of one stream as it arrives; says once it ends in a loop.

    It keeps only the last ``window_chars`` (and the rules' own short memory): the caller keeps the
    whole text. Deltas are gathered and the rules run once ``check_every_chars`` have come.
    """

    def __init__(self, thresholds: LoopThresholds, *, check_every_chars: int | None = None):
        self._thresholds = thresholds
        self._check_every = check_every_chars or thresholds.check_every_chars
        self._tail = ""
        self._shape = Shape(thresholds.window_chars)
        t = thresholds
        self._units = Units(
            cycle_lines=t.cycle_lines, cycle_distinct=t.cycle_distinct, resaid_sentences=t.resaid_sentences,
            resaid_similarity=t.resaid_similarity, resaid_min_words=t.resaid_min_words, resaid_lookback=t.resaid_lookback,
        )
        self._pending: list[str] = []
        self._unchecked = 0
        #: Characters checked so far: where the text the rules have seen ends.
        self._checked = 0
        self.loop: Loop | None = None

    def feed(self, delta: str) -> Loop | None:
        """Add ``delta``; the loop once one is found (and from then on), else None."""
        if not delta or self.loop is not None:
            return self.loop
        self._pending.append(delta)
        self._unchecked += len(delta)
        if self._unchecked >= self._check_every:
            self._unchecked = 0
            new = "".join(self._pending)
            self._pending = []
            self.loop = self._check(new)
        return self.loop

    def _check(self, new: str) -> Loop | None:
        t = self._thresholds
        self._checked += len(new)
        self._tail = (self._tail + new)[-t.window_chars :]
        self._shape.feed(new)
        # Every rule sees every piece of text, whichever fires: the unit rules keep their own memory.
        units = self._units.feed(new)
        exact = exact_loop(self._tail, min_repeats=t.min_repeats, min_chars=t.min_chars, min_span=t.min_span_chars)
        if exact is not None:
            return Loop(*exact, rule="exact", start=self._checked - exact[2])
        shaped = shape_loop(
            self._shape, counter=t.counter_repeats, counter_numeric=t.counter_repeats_numeric,
            numbers=t.numbers_repeats, numbers_numeric=t.numbers_repeats_numeric,
        ) or long_counter_loop(self._shape, counter=t.counter_repeats)
        if shaped is not None:
            rule, span, repeats, chars = shaped
            return Loop(span, repeats, chars, rule=rule, start=self._checked - self._shape.held - chars)
        if units is not None:
            rule, span, repeats, chars, start = units
            return Loop(span, repeats, chars, rule=rule, start=start)
        return None
