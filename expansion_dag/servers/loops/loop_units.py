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

_WORDS = re.compile(r"\w+")
#: A sentence ends at a full stop, a question or exclamation mark before a space, or a line's end.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n")
_LINE_END = re.compile(r"\n")
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
        self._lines: collections.deque[str] = collections.deque(maxlen=cycle_lines)
        self._sentence = ""
        #: Word sets of the last sentences long enough to judge.
        self._said: collections.deque[frozenset[str]] = collections.deque(maxlen=resaid_lookback)
        #: The sentences, one after another, each nearly the same as an earlier one: how many, their characters.
        self._streak = 0
        self._streak_chars = 0

    def feed(self, delta: str) -> tuple[str, str, int, int] | None:
        """(rule, span, repeats, chars) once the text ends in a loop of lines or sentences."""
        found = self._feed_lines(delta)
        return self._feed_sentences(delta) or found

    def _feed_lines(self, delta: str) -> tuple[str, str, int, int] | None:
        complete, self._line, _ = _completed(self._line + delta, _LINE_END)
        found = None
        for line in complete:
            line = line.strip()
            if not line:
                continue
            self._lines.append(line)
            if len(self._lines) == self._lines.maxlen and found is None:
                counts = collections.Counter(self._lines)
                if len(counts) <= self._cycle_distinct:
                    span = "\n".join(line for line, _ in counts.most_common())
                    found = ("cycle", span, len(self._lines), sum(len(x) + 1 for x in self._lines))
        return found

    def _feed_sentences(self, delta: str) -> tuple[str, str, int, int] | None:
        complete, self._sentence, cut = _completed(self._sentence + delta, _SENTENCE_END)
        if cut:
            complete.pop()
            self._streak = self._streak_chars = 0
        found = None
        for sentence in complete:
            words = _WORDS.findall(sentence.lower())
            if len(words) < self._min_words:
                continue
            said = frozenset(words)
            if _said_before(said, self._said, self._similarity):
                self._streak += 1
                self._streak_chars += len(sentence) + 1
                if self._streak >= self._resaid_sentences and found is None:
                    found = ("resaid", sentence, self._streak, self._streak_chars)
            else:
                self._streak = self._streak_chars = 0
            self._said.append(said)
        return found


def _completed(text: str, end: re.Pattern[str]) -> tuple[list[str], str, bool]:
    """The units ``text`` completes, the unfinished rest, and whether the last unit is that rest,
    cut for its length."""
    *complete, rest = end.split(text)
    if len(rest) > _MAX_UNIT_CHARS:
        return [*complete, rest], "", True
    return complete, rest, False


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
