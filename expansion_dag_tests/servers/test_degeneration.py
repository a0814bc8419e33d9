"""The loop detector: no false stop on the shipped corpus of repetitive answers, every loop stopped early."""

import collections

import pytest

from expansion_dag import servers
from expansion_dag.servers import LoopDetector, LoopThresholds, find_loop

DEFAULT = LoopThresholds()


def first_stop(text, thresholds=DEFAULT, piece=7):
    """Where a detector fed ``text`` in small deltas, as a stream arrives, stops it (None: never)."""
    detector = LoopDetector(thresholds)
    for i in range(0, len(text), piece):
        if detector.feed(text[i : i + piece]):
            return i + piece
    return None


def test_the_shipped_corpus_is_what_the_generator_makes_and_holds_every_kind():
    assert servers.CORPUS_PATH.read_bytes() == servers.corpus_bytes()
    corpus = servers.read_corpus()
    assert len(corpus) >= 2000
    kinds = collections.Counter(a["kind"] for a in corpus)
    assert set(kinds) == {"table", "list", "code", "arithmetic", "reasoning", "lyrics"}
    assert min(kinds.values()) >= 300


def test_no_legitimate_repetitive_answer_is_stopped():
    stopped = [a["id"] for a in servers.read_corpus() if first_stop(a["text"]) is not None]
    assert stopped == []


def test_every_looping_answer_is_stopped_soon_after_its_loop_starts():
    for answer in servers.looping_answers():
        stop = first_stop(answer["text"])
        assert stop is not None, answer["id"]
        lag = stop - answer["loop_starts_at"]
        # The loop must cover min_loop_chars (or min_repeats spans) before it counts, plus one check.
        assert lag <= 2 * DEFAULT.min_loop_chars + DEFAULT.check_every_chars, answer["id"]
        assert stop < len(answer["text"]) / 4, answer["id"]


def test_the_loop_found_names_its_span_and_how_much_it_covers():
    text = "We start here. " + "Wait, let me reconsider the problem from the start. " * 60
    loop = find_loop(text, DEFAULT)
    assert loop.span == "Wait, let me reconsider the problem from the start. "
    assert loop.repeats == 60
    assert loop.chars == 60 * len(loop.span)


def test_a_short_run_is_formatting_and_the_thresholds_decide_what_is_long():
    separators = "Results\n" + "=" * 80 + "\n" + "| --- " * 40 + "|\n"
    assert find_loop(separators, DEFAULT) is None
    chorus = "Oh the river, carry me home\n" * 5
    assert find_loop(chorus, DEFAULT) is None
    assert find_loop(chorus, LoopThresholds(min_loop_chars=100, min_repeats=4)) is not None
    # A span shorter than min_span_chars is not counted, however long its run.
    assert find_loop("ab" * 1000, LoopThresholds(min_span_chars=3)) is None
    assert find_loop("ab" * 1000, LoopThresholds(min_span_chars=2)) is not None


def test_the_detector_keeps_only_its_window_and_stays_stopped():
    detector = LoopDetector(LoopThresholds(window_chars=2048))
    for i in range(2000):
        assert detector.feed(f"line {i} is different\n") is None
    loop = None
    for _ in range(200):
        loop = detector.feed("again and again\n") or loop
    assert loop is not None and loop.span == "again and again\n"
    assert detector.feed("something new entirely") is loop


@pytest.mark.parametrize(
    "bad", [dict(min_span_chars=0), dict(min_repeats=1), dict(check_every_chars=0), dict(window_chars=100)]
)
def test_thresholds_that_cannot_work_are_refused(bad):
    with pytest.raises(ValueError):
        LoopThresholds(**bad)
