"""Spotting a degenerate answer while it is generated: a span repeated back to back until the cap.

A model stuck in a loop emits the same span again and again, exactly: the end of its text becomes
periodic. Legitimate repetition (a markdown table, a list, code with repeated lines, step-by-step
arithmetic) repeats a *shape*, with cells, items, names and numbers that change; its exact period
breaks within a few lines. So the test is: does the text end with one span repeated back to back at
least ``min_repeats`` times, covering at least ``min_loop_chars`` characters?

Characters, not tokens: the client sees text, and a token loop is a character loop.

Cost: the check runs every ``check_every_chars`` new characters and looks only at the last
``window_chars``. Candidate periods are the distances back to earlier occurrences of the text's
last few characters (``str.rfind``, in C), and each candidate is one slice comparison, so a check
costs microseconds, not a scan of every period.

Known limit: an answer that is *meant* to be one span repeated many times (a 40 x 40 matrix of
zeros, "all work and no play" a hundred times) reads as a loop; such answers are rare and poor
training data anyway. The shipped corpus of legitimate repetitive answers
(``expansion_dag_tests/data/repetitive_answers.jsonl.gz``, built by
``expansion_dag/servers/repetitive_corpus.py``) shows what does not trip it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LoopThresholds:
    """When a repeated span counts as a loop; see the module docstring."""

    #: The shortest span counted (1: a run of one character, e.g. endless newlines, counts too); a
    #: run of a shorter span is not counted as a run of its multiples either.
    min_span_chars: int = 1
    #: Back-to-back copies of the span, the first included.
    min_repeats: int = 4
    #: The repeated region must cover at least this many characters: short runs ("| --- | --- |",
    #: "ha ha ha", a row of "=") are formatting, not a loop.
    min_loop_chars: int = 1200
    #: How far back a check looks; the longest span found is ``window_chars // min_repeats``.
    window_chars: int = 8192
    #: New characters between checks.
    check_every_chars: int = 64

    def __post_init__(self) -> None:
        if self.min_span_chars < 1:
            raise ValueError(f"min_span_chars must be at least 1, got {self.min_span_chars}")
        if self.min_repeats < 2:
            raise ValueError(f"min_repeats must be at least 2, got {self.min_repeats}")
        if self.check_every_chars < 1:
            raise ValueError(f"check_every_chars must be at least 1, got {self.check_every_chars}")
        if self.window_chars < max(self.min_loop_chars, self.min_repeats * self.min_span_chars):
            raise ValueError(
                f"window_chars ({self.window_chars}) must hold min_loop_chars ({self.min_loop_chars}) "
                f"and min_repeats x min_span_chars"
            )

    @property
    def max_span_chars(self) -> int:
        return self.window_chars // self.min_repeats


@dataclass(frozen=True)
class Loop:
    """A detected loop: the repeated span and how much of the text's end it covers."""

    span: str
    repeats: int
    chars: int


#: Characters at the text's end whose earlier occurrences propose the candidate periods.
_PROBE_CHARS = 8


def find_loop(text: str, thresholds: LoopThresholds) -> Loop | None:
    """The loop ``text`` ends with, or None; looks only at the last ``window_chars``."""
    t = thresholds
    tail = text[-t.window_chars :]
    n = len(tail)
    if n < t.min_loop_chars:
        return None
    probe = tail[-_PROBE_CHARS:]
    # Each earlier occurrence of the probe ending at distance p is a candidate period p; the
    # nearest occurrences come first, so the shortest period (the span itself) is found first.
    end = n - 1
    while True:
        start = tail.rfind(probe, 0, end)
        if start < 0:
            return None
        period = n - len(probe) - start
        end = start + len(probe) - 1
        if period > t.max_span_chars:
            return None
        need = max(t.min_loop_chars, t.min_repeats * period)
        if need > n:
            continue
        region = tail[-need:]
        if region[period:] == region[:-period]:
            if period < t.min_span_chars:
                return None  # a run of a span too short to count (its multiples are the same run)
            covered = _covered(tail, period, need)
            return Loop(span=tail[-period:], repeats=covered // period, chars=covered)


def _covered(tail: str, period: int, known: int) -> int:
    """How far back from the end ``tail`` keeps the period (at least ``known``)."""
    covered = known - known % period  # whole copies of the last span
    while covered + period <= len(tail) and tail[-covered - period : -covered] == tail[-period:]:
        covered += period
    return covered


class LoopDetector:
    """Fed the text of one stream as it arrives; says once it ends in a loop.

    It keeps only the last ``window_chars``: the caller keeps the whole text.
    """

    def __init__(self, thresholds: LoopThresholds):
        self._thresholds = thresholds
        self._tail = ""
        self._pending: list[str] = []
        self._unchecked = 0
        self.loop: Loop | None = None

    def feed(self, delta: str) -> Loop | None:
        """Add ``delta``; the loop once one is found (and from then on), else None."""
        if not delta or self.loop is not None:
            return self.loop
        self._pending.append(delta)
        self._unchecked += len(delta)
        if self._unchecked >= self._thresholds.check_every_chars:
            self._unchecked = 0
            self._tail = (self._tail + "".join(self._pending))[-self._thresholds.window_chars :]
            self._pending = []
            self.loop = find_loop(self._tail, self._thresholds)
        return self.loop
