"""The rules that read the text a line and a sentence at a time, for loops no single span repeats:

- ``cycle``: the last lines are a few lines recurring in any order (``if ((i + j) % i == 0)``,
  then ``% j``, then ``% i`` again, ... in code that never ends);
- ``resaid``: sentence after sentence says again, in nearly the same words, what an earlier one
  said (a paragraph re-said with a word changed here and there).

Each line and sentence is looked at once, when it is complete; the cost is per unit of text, not
per check.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterable

from expansion_dag.servers.loops.loop_derivation import states_arithmetic

_WORDS = re.compile(r"\w+")
#: A sentence ends at a full stop, a question or exclamation mark before a space, or a line's end.
#: (Captured: ``split`` keeps each end, so that where each unit begins is counted.)
_SENTENCE_END = re.compile(r"((?<=[.!?])\s+|\n)")
_LINE_END = re.compile(r"(\n)")
#: A line or sentence that runs longer is cut there: the unfinished one is never re-read whole for
#: every delta. A cut line is judged as it is; a cut "sentence" is no sentence: any two stretches of
#: 2,000 characters of one language share most of their words, so ``resaid`` would see them all as
#: one said again (text without a full stop: lists of words, code, the simulator's random words).
_MAX_UNIT_CHARS = 2000


class Units:
    """Fed the text as it arrives; ``feed`` says once a ``cycle`` or ``resaid`` rule holds."""

    def __init__(
        self, *, cycle_lines: int, cycle_distinct: int, resaid_sentences: int, resaid_similarity: float,
        resaid_min_words: int, resaid_lookback: int,
    ):
        """``cycle``: the last ``cycle_lines`` lines hold at most ``cycle_distinct`` different ones.
        ``resaid``: ``resaid_sentences`` sentences in a row (of ``resaid_min_words`` words at least)
        each share ``resaid_similarity`` of their words with one of the ``resaid_lookback`` before."""
        self._cycle_distinct = cycle_distinct
        self._resaid_sentences = resaid_sentences
        self._similarity = resaid_similarity
        self._min_words = resaid_min_words
        self._line = ""
        #: Where the unfinished line and sentence begin in the text fed so far.
        self._line_at = 0
        self._sentence_at = 0
        self._lines: collections.deque[str] = collections.deque(maxlen=cycle_lines)
        self._line_starts: collections.deque[int] = collections.deque(maxlen=cycle_lines)
        self._sentence = ""
        #: Word sets of the last sentences long enough to judge.
        self._said: collections.deque[frozenset[str]] = collections.deque(maxlen=resaid_lookback)
        #: The sentences, one after another, each nearly the same as an earlier one: how many, their characters.
        self._streak = 0
        self._streak_chars = 0
        self._streak_at = 0

    def feed(self, delta: str) -> tuple[str, str, int, int, int] | None:
        """(rule, span, repeats, chars, start) once the text ends in a loop of lines or sentences:
        ``start`` is where its first line or sentence begins in the text fed."""
        found = self._feed_lines(delta)
        return self._feed_sentences(delta) or found

    def _feed_lines(self, delta: str) -> tuple[str, str, int, int, int] | None:
        complete, self._line, rest_at, _ = _completed(self._line + delta, _LINE_END)
        found = None
        for line, at in complete:
            line = line.strip()
            if not line:
                continue
            self._lines.append(line)
            self._line_starts.append(self._line_at + at)
            if len(self._lines) == self._lines.maxlen and found is None:
                counts = collections.Counter(self._lines)
                if len(counts) <= self._cycle_distinct:
                    span = "\n".join(line for line, _ in counts.most_common())
                    found = ("cycle", span, len(self._lines), sum(len(x) + 1 for x in self._lines), self._line_starts[0])
        self._line_at += rest_at
        return found

    def _feed_sentences(self, delta: str) -> tuple[str, str, int, int, int] | None:
        complete, self._sentence, rest_at, cut = _completed(self._sentence + delta, _SENTENCE_END)
        if cut:
            complete.pop()
            self._streak = self._streak_chars = 0
        found = None
        for sentence, at in complete:
            words = _WORDS.findall(sentence.lower())
            if len(words) < self._min_words:
                continue
            said = frozenset(words)
            if _said_before(said, self._said, self._similarity):
                if _a_step_of_arithmetic(sentence, words):
                    continue  # read only when like an earlier one: most sentences are not
                if not self._streak:
                    self._streak_at = self._sentence_at + at
                self._streak += 1
                self._streak_chars += len(sentence) + 1
                if self._streak >= self._resaid_sentences and found is None:
                    found = ("resaid", sentence, self._streak, self._streak_chars, self._streak_at)
            else:
                self._streak = self._streak_chars = 0
            self._said.append(said)
        self._sentence_at += rest_at
        return found


def _a_step_of_arithmetic(sentence: str, words: list[str]) -> bool:
    """Mostly numbers, in an equation that holds (``7 × 1 = 7, plus carry 0 makes 7: write 7.``):
    a derivation's step, however like the steps before (each digit of a number times 1)."""
    return 2 * sum(w.isdigit() for w in words) > len(words) and states_arithmetic(sentence)


def _completed(text: str, end: re.Pattern[str]) -> tuple[list[tuple[str, int]], str, int, bool]:
    """The units ``text`` completes, each with where it begins in ``text``; the unfinished rest and
    where it begins; and whether the last unit is that rest, cut for its length."""
    *parts, rest = end.split(text)
    complete, at = [], 0
    for unit, separator in zip(parts[::2], parts[1::2]):
        complete.append((unit, at))
        at += len(unit) + len(separator)
    if len(rest) > _MAX_UNIT_CHARS:
        return [*complete, (rest, at)], "", len(text), True
    return complete, rest, at, False


def _said_before(said: frozenset[str], earlier: Iterable[frozenset[str]], similarity: float) -> bool:
    """Whether an earlier sentence shares at least ``similarity`` of the two's words (Jaccard)."""
    size = len(said)
    for other in earlier:
        # |a & b| / |a | b| >= s needs min/max of the sizes >= s: most pairs end here.
        small, large = (size, len(other)) if size <= len(other) else (len(other), size)
        if small < similarity * large:
            continue
        shared = len(said & other)
        if shared >= similarity * (size + len(other) - shared):
            return True
    return False
