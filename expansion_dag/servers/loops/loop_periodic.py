"""The rules that look for one span repeated back to back at the text's end: ``exact`` (the same
characters each time) and, on the text's *shape* (every run of digits one placeholder, every run
of one character at most three long),
``counter`` (only numbers change, each counting by a constant step: ``n + 584, n + 585, ...``)
and ``numbers`` (only numbers change, any way at all: ``(x^240 - x^13)^2 = (x^260 - x^14)^2 = ...``).

Legitimate step-by-step text repeats a shape too (a multiplication table, unit tests of one
function, counting to 400, Fibonacci line by line), so the shape rules ask for far more repeats
than the exact one: more than the shipped corpus of legitimate answers ever holds.
"""

from __future__ import annotations

import re
from decimal import Decimal

from expansion_dag.servers.loops.loop_derivation import derived_copies

#: Characters at the text's end whose earlier occurrences propose the candidate periods.
_PROBE_CHARS = 8
#: What a run of digits becomes in the shape: a character no answer holds.
_PLACEHOLDER = "\x00"
#: A number, its decimals included (``1234.56`` is one: a derivation's numbers are compared whole).
_DIGITS = re.compile(r"[0-9]+(?:\.[0-9]+)?")
_DIGIT_CHARS = "0123456789"
#: A run of one character longer than three is three in the shape: ``MMGXLIIII...`` (a count of
#: I's that wanders) and padding that grows with a number keep one shape.
_RUN = re.compile(r"([^0-9])\1{3,}")
#: Longer numbers are not compared (an int of thousands of digits is slow to build).
_MAX_DIGITS = 18


def repeated_tail(tail: str, *, min_repeats: int, min_chars: int, max_period: int) -> tuple[int, int] | None:
    """The shortest span ``tail`` ends with, repeated back to back at least ``min_repeats`` times
    over at least ``min_chars``: (its length, the characters its copies cover), or None.

    Candidate periods are the distances back to earlier occurrences of the last few characters
    (``str.rfind``, in C), nearest first, and each is one slice comparison: microseconds a call.
    """
    n = len(tail)
    if n < _PROBE_CHARS:
        return None  # nothing yet, or too short to repeat (a shape is empty while a number arrives)
    probe = tail[-_PROBE_CHARS:]
    end = n - 1
    while True:
        start = tail.rfind(probe, 0, end)
        if start < 0:
            return None
        period = n - len(probe) - start
        end = start + len(probe) - 1
        need = max(min_chars, min_repeats * period)
        if period > max_period or need > n:
            return None  # a longer period needs more still
        region = tail[-need:]
        if region[period:] == region[:-period]:
            return period, _covered(tail, period, need)


def _covered(tail: str, period: int, known: int) -> int:
    """How far back from the end ``tail`` keeps the period (at least ``known``), in whole copies."""
    covered = known - known % period
    while covered + period <= len(tail) and tail[-covered - period : -covered] == tail[-period:]:
        covered += period
    return covered


class Shape:
    """The last ``window_chars`` of a text's shape, built as the text arrives, and its numbers.

    Each run of digits is one ``_PLACEHOLDER`` in ``text`` and one string in ``numbers``, in order.
    """

    def __init__(self, window_chars: int):
        self._window = window_chars
        self.text = ""
        self.numbers: list[str] = []
        self._held = ""

    def feed(self, delta: str) -> None:
        # The text's last run of digits, or of one character, may go on in the next delta: it waits.
        whole = self._held + delta
        text = whole.rstrip(_DIGIT_CHARS)
        if text.endswith(".") and text[-2:-1].isdigit():
            text = text[:-1].rstrip(_DIGIT_CHARS)  # a decimal point may have its decimals next
        elif len(text) == len(whole) and text:
            text = text.rstrip(text[-1])
        self._held = whole[len(text) :]
        self.numbers += _DIGITS.findall(text)
        self.text += _RUN.sub(r"\1\1\1", _DIGITS.sub(_PLACEHOLDER, text))
        cut = len(self.text) - self._window
        if cut > 0:
            dropped = self.text.count(_PLACEHOLDER, 0, cut)
            self.text = self.text[cut:]
            if dropped:
                del self.numbers[:dropped]

    @property
    def held(self) -> int:
        """Characters fed that wait for the next delta, not yet in the shape."""
        return len(self._held)


def exact_loop(tail: str, *, min_repeats: int, min_chars: int, min_span: int) -> tuple[str, int, int] | None:
    """(span, repeats, chars) of the exact loop ``tail`` ends with: a span of ``min_span`` characters
    at least, repeated ``min_repeats`` times over ``min_chars``."""
    found = repeated_tail(tail, min_repeats=min_repeats, min_chars=min_chars, max_period=len(tail) // min_repeats)
    if found is None or found[0] < min_span:
        return None  # a run of a span too short to count (its multiples are the same run)
    period, covered = found
    return tail[-period:], covered // period, covered


def shape_loop(
    shape: Shape, *, counter: int, counter_numeric: int, numbers: int, numbers_numeric: int
) -> tuple[str, str, int, int] | None:
    """(rule, span, repeats, chars) of the loop ``shape`` ends with whose numbers change: ``counter``
    copies that count (``counter_numeric`` of numbers and punctuation alone), or ``numbers`` copies
    (``numbers_numeric``) whose numbers change otherwise."""
    least = min(counter, counter_numeric, numbers, numbers_numeric)
    found = repeated_tail(shape.text, min_repeats=least, min_chars=0, max_period=len(shape.text) // least)
    if found is None:
        return None
    period, covered = found
    span = shape.text[-period:]
    per_copy = span.count(_PLACEHOLDER)
    if per_copy == 0:
        return None  # the same characters each time: the exact rule's
    repeats = covered // period
    values = shape.numbers[-repeats * per_copy :]
    counting = _counting_copies(values, per_copy)
    if not any(c.isalpha() for c in span):
        # Numbers and punctuation alone are a list of numbers: counting to 400, the first 100
        # primes and 60 sums one after another are legitimate.
        if counting >= counter_numeric:
            rule, copies = "counter", counting
        elif repeats >= numbers_numeric and counting < repeats / 2:
            rule, copies = "numbers", repeats
        else:
            return None
    elif counting >= counter:
        rule, copies = "counter", counting
    elif repeats >= numbers:
        rule, copies = "numbers", repeats
    else:
        return None
    if rule == "numbers" and _a_derivation(span, values, per_copy):
        return None
    return rule, _fill(span, values[-per_copy:]), copies, covered + sum(len(x) - 1 for x in values)


#: A counting span of many characters is a loop in fewer copies: ``_LONG_COUNTER_CHARS`` of them, and
#: at least ``_LONG_COUNTER_COPIES``. The real model wrote a class of 170 characters 63 times over,
#: its name's number counting (``QueueDataStruct56``, ``57``, ...): at the ``counter`` rule's copies
#: it fits no window, and ran to the cap.
_LONG_COUNTER_CHARS = 2048
_LONG_COUNTER_COPIES = 8


def long_counter_loop(shape: Shape, *, counter: int) -> tuple[str, str, int, int] | None:
    """``shape_loop``'s (rule, span, repeats, chars) of a ``counter`` loop of a span too long for
    ``counter`` copies to fit the window: copies of words and numbers whose numbers count, over
    ``_LONG_COUNTER_CHARS``."""
    found = repeated_tail(shape.text, min_repeats=_LONG_COUNTER_COPIES, min_chars=_LONG_COUNTER_CHARS,
                          max_period=len(shape.text) // _LONG_COUNTER_COPIES)  # fmt: skip
    # A span whose ``counter`` copies fit the window is ``shape_loop``'s to judge.
    if found is None or found[0] * counter <= len(shape.text):
        return None
    period, covered = found
    span = shape.text[-period:]
    per_copy = span.count(_PLACEHOLDER)
    if per_copy == 0 or not any(c.isalpha() for c in span):
        return None  # the exact rule's, or a list of numbers (the numeric thresholds')
    values = shape.numbers[-(covered // period) * per_copy :]
    counting = _counting_copies(values, per_copy)
    if counting < max(_LONG_COUNTER_COPIES, -(-_LONG_COUNTER_CHARS // period)):
        return None
    return "counter", _fill(span, values[-per_copy:]), counting, covered + sum(len(x) - 1 for x in values)


#: The last copies a ``numbers`` loop is judged on, and how many of them must hold arithmetic for
#: the copies to be a derivation, not a loop.
_JUDGED_COPIES = 16
_DERIVED_COPIES = 8


def _a_derivation(span: str, values: list[str], per_copy: int) -> bool:
    """Whether the last copies of ``span`` (``values`` their numbers) are worked arithmetic.

    The copies are read a line each where the span holds a line's end (the span ends wherever the
    text does): each copy is then the same text from check to check, and judged once.
    """
    start = span.find("\n") + 1
    if start:
        moved = span.count(_PLACEHOLDER, 0, start)
        span, values = span[start:] + span[:start], values[moved : len(values) - per_copy + moved]
    values = values[-(_JUDGED_COPIES + 1) * per_copy :]
    copies = [_fill(span, values[i : i + per_copy]) for i in range(0, len(values), per_copy)]
    return derived_copies(copies, values, per_copy) >= _DERIVED_COPIES


def _counting_copies(numbers: list[str], per_copy: int) -> int:
    """How many copies at the end have each number move by its own constant step, one at least not 0.

    Read from the end, each number once, until a copy breaks the count (or a number is too long).
    """
    copies = len(numbers) // per_copy
    if copies < 2 or any(len(x) > _MAX_DIGITS for x in numbers[-2 * per_copy :]):
        return 0
    last = len(numbers) - per_copy
    # Decimal: exact for at most _MAX_DIGITS characters, decimals included.
    steps = [Decimal(numbers[last + j]) - Decimal(numbers[last - per_copy + j]) for j in range(per_copy)]
    if not any(steps):
        return 0
    copy = copies - 2
    while copy > 0:
        base = copy * per_copy
        earlier = numbers[base - per_copy : base]
        if any(len(x) > _MAX_DIGITS for x in earlier):
            break
        if any(Decimal(numbers[base + j]) - Decimal(earlier[j]) != steps[j] for j in range(per_copy)):
            break
        copy -= 1
    return copies - copy


def _fill(span: str, numbers: list[str]) -> str:
    """The span as written, its placeholders given back their numbers."""
    pieces = span.split(_PLACEHOLDER)
    return "".join(p + n for p, n in zip(pieces, numbers)) + pieces[-1]
