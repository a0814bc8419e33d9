"""When the loop detector's rules (``expansion_dag.servers.loops.degeneration``) call a text a loop."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LoopThresholds:
    """When each rule calls the text a loop; the rules are in ``expansion_dag.servers.loops.degeneration``.

    The span rule's fields are the run configuration's (``generation.loop_*``): given, never assumed here.
    """

    #: The shortest span counted (1: a run of one character, e.g. endless newlines, counts too); a
    #: run of a shorter span is not counted as a run of its multiples either.
    min_span_chars: int
    #: Back-to-back copies of the span, the first included.
    min_repeats: int
    #: The repeated region must cover at least this many characters: short runs ("| --- | --- |",
    #: "ha ha ha", a row of "=") are formatting, not a loop.
    min_loop_chars: int
    #: How far back a check looks; the longest span found is ``window_chars // min_repeats``.
    window_chars: int
    #: New characters between checks.
    check_every_chars: int = 64
    #: ``counter``: copies of a span whose numbers all count by constant steps; a span of numbers
    #: and punctuation alone (a list of numbers) needs ``counter_repeats_numeric``.
    counter_repeats: int = 64
    counter_repeats_numeric: int = 512
    #: ``numbers``: copies of a span whose numbers change in any way (not mostly counting, for a
    #: span of numbers and punctuation alone: ``numbers_repeats_numeric``).
    numbers_repeats: int = 96
    numbers_repeats_numeric: int = 128
    #: ``cycle``: the last ``cycle_lines`` lines hold at most ``cycle_distinct`` different lines.
    cycle_lines: int = 48
    cycle_distinct: int = 6
    #: ``resaid``: ``resaid_sentences`` sentences in a row (of ``resaid_min_words`` words at least)
    #: each share ``resaid_similarity`` of their words with one of the ``resaid_lookback`` before.
    resaid_sentences: int = 16
    resaid_similarity: float = 0.8
    resaid_min_words: int = 6
    resaid_lookback: int = 48

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
        for name in ("counter_repeats", "counter_repeats_numeric", "numbers_repeats", "numbers_repeats_numeric", "cycle_lines"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name} must be at least 2, got {getattr(self, name)}")
        if not 1 <= self.cycle_distinct < self.cycle_lines:
            raise ValueError(f"cycle_distinct must be within [1, cycle_lines), got {self.cycle_distinct}")
        for name in ("resaid_sentences", "resaid_min_words", "resaid_lookback"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0.0 < self.resaid_similarity <= 1.0:
            raise ValueError(f"resaid_similarity must be within (0, 1], got {self.resaid_similarity}")
