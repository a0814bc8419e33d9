"""The loop detector: a real model's loops stopped early by the rule that describes them, counting
loops included; no false stop on the real model's legitimate answers or on the shipped corpus of
repetitive answers."""

import collections
import gzip
import json
import random
from pathlib import Path

import pytest

from expansion_dag.core import RequestError
from expansion_dag.servers import (
    LOOP_RULES,
    VLLM,
    DegenerateError,
    LoopDetector,
    find_loop,
    loop_cut,
    parse_chat_stream,
)
from expansion_dag_tests.data.make_repetitive_corpus import CORPUS_PATH, corpus_bytes, looping_answers
from expansion_dag_tests.helpers import loop_thresholds, repetitive_answers

DEFAULT = loop_thresholds()
#: SmolLM2-135M-Instruct's answers, labelled by a person: ``loop`` (with the rule that describes
#: it) or ``legitimate``; how they were made and judged: ``real_model_answers.md`` beside it.
REAL_ANSWERS = Path(__file__).resolve().parents[1] / "data" / "real_model_answers.jsonl.gz"


def first_stop(text, thresholds=DEFAULT, piece=7):
    """Where a detector fed ``text`` in small deltas, as a stream arrives, stops it, and the loop
    (None, None: never)."""
    detector = LoopDetector(thresholds)
    for i in range(0, len(text), piece):
        if loop := detector.feed(text[i : i + piece]):
            return i + piece, loop
    return None, None


def real_answers(label):
    with gzip.open(REAL_ANSWERS, "rt", encoding="utf-8") as f:
        answers = [json.loads(line) for line in f]
    return [a for a in answers if a["label"] == label]


# --- a real model's answers ------------------------------------------------------------------


def test_the_real_model_fixture_holds_loops_of_every_rule_and_legitimate_repetition():
    loops, legitimate = real_answers("loop"), real_answers("legitimate")
    rules = collections.Counter(a["rule"] for a in loops)
    assert set(rules) == set(LOOP_RULES)
    assert rules["counter"] >= 2
    assert len(legitimate) >= 100
    # Legitimate answers that repeat a shape: tables, numbered lists, step-by-step sums, tests.
    assert sum(a["repetitive"] for a in legitimate) >= 30


#: Deltas of about the 64 tokens of a streamed event (the fleet's default ``stream_interval``), at 3 characters a token.
EVENT_CHARS = 192
#: Those of 256 tokens, the events the loops' rules were labelled with: which rule sees a loop
#: first depends on when it looks.
LABELLED_EVENT_CHARS = 768


@pytest.mark.parametrize("answer", real_answers("loop"), ids=lambda a: f"{a['id']}-{a['rule']}")
def test_a_real_model_loop_is_stopped_by_the_rule_that_describes_it(answer):
    stop, loop = first_stop(answer["content"], piece=LABELLED_EVENT_CHARS)
    assert loop is not None and loop.rule == answer["rule"]
    assert first_stop(answer["content"], piece=EVENT_CHARS)[1] is not None  # and in the default's events


def test_the_real_model_loops_that_ran_to_the_cap_are_stopped_early():
    capped = [a for a in real_answers("loop") if a["finish_reason"] == "length"]
    read = [min(1.0, first_stop(a["content"], piece=EVENT_CHARS)[0] / len(a["content"])) for a in capped]
    # Most of their text never generated: what the stops save (a loop that starts late in the
    # answer is seen late, a few of them only by its end).
    assert sum(read) / len(read) < 0.45 and sum(r < 1 for r in read) >= 0.9 * len(read)


def test_the_text_before_a_real_model_loop_holds_no_second_copy_of_it():
    kept = streamed = 0
    for answer in real_answers("loop"):
        stop, loop = first_stop(answer["content"], piece=EVENT_CHARS)
        text = answer["content"][:stop]  # what the client had when it stopped the stream
        cut = loop_cut(text, loop)
        # No loop the rules see is kept, fed as it was streamed or whole.
        assert first_stop(text[:cut], piece=EVENT_CHARS) == (None, None), answer["id"]
        assert find_loop(text[:cut], DEFAULT) is None, answer["id"]
        if loop.rule == "exact":
            # Cut after the first copy: the text after the cut is that copy again.
            period = len(loop.span)
            assert text[cut - period : cut] == text[cut : cut + period], answer["id"]
            assert text[cut - 2 * period : cut - period] != text[cut - period : cut], answer["id"]
        kept, streamed = kept + cut, streamed + len(text)
    # What the model wrote before its loops: about half of what was streamed (issue 51 measured half).
    assert 0.3 < kept / streamed < 0.8


def test_no_legitimate_real_model_answer_is_stopped():
    stopped = {a["id"]: first_stop(a["content"], piece=EVENT_CHARS)[1] for a in real_answers("legitimate")}
    assert {k: v for k, v in stopped.items() if v is not None} == {}


# --- the shipped corpus ----------------------------------------------------------------------


def test_the_shipped_corpus_is_what_the_generator_makes_and_holds_every_kind():
    assert CORPUS_PATH.read_bytes() == corpus_bytes()
    corpus = repetitive_answers()
    assert len(corpus) >= 2000
    kinds = collections.Counter(a["kind"] for a in corpus)
    assert set(kinds) == {"table", "list", "code", "arithmetic", "reasoning", "lyrics", "derivation"}
    assert min(kinds.values()) >= 300


def test_no_legitimate_repetitive_answer_is_stopped():
    stopped = [a["id"] for a in repetitive_answers() if first_stop(a["text"])[0] is not None]
    assert stopped == []


def test_every_looping_answer_is_stopped_soon_after_its_loop_starts():
    for answer in looping_answers():
        stop, loop = first_stop(answer["text"])
        assert stop is not None, answer["id"]
        lag = stop - answer["loop_starts_at"]
        # The loop must cover min_chars (or min_repeats spans) before it counts, plus one check.
        assert lag <= max(2 * DEFAULT.min_chars, DEFAULT.min_repeats * 400) + DEFAULT.check_every_chars, answer["id"]
        assert stop < len(answer["text"]) / 4, answer["id"]


# --- each rule -------------------------------------------------------------------------------


def test_the_loop_found_names_its_rule_its_span_and_how_much_it_covers():
    text = "We start here. " + "Wait, let me reconsider the problem from the start. " * 60
    loop = find_loop(text, DEFAULT)
    assert loop.rule == "exact"
    assert loop.span == "Wait, let me reconsider the problem from the start. "
    assert loop.repeats == 60
    assert loop.chars == 60 * len(loop.span)
    assert loop.describe() == "rule exact: a span of 52 characters repeated 60 times back to back"


def test_a_short_run_is_formatting_and_the_thresholds_decide_what_is_long():
    separators = "Results\n" + "=" * 80 + "\n" + "| --- " * 40 + "|\n"
    assert find_loop(separators, DEFAULT) is None
    chorus = "Oh the river, carry me home\n" * 5
    assert find_loop(chorus, DEFAULT) is None
    assert find_loop(chorus, loop_thresholds(min_chars=100, min_repeats=4)) is not None
    # A span shorter than min_span_chars is not counted, however long its run.
    assert find_loop("ab" * 1000, loop_thresholds(min_span_chars=3)) is None
    assert find_loop("ab" * 1000, loop_thresholds(min_span_chars=2)) is not None


#: The counting loops the issue saw run to the cap, each from its start: (first copy, next copy).
ISSUE_COUNTERS = [
    lambda i: f"2A^{i}/3 + ",
    lambda i: f"max(game[{i}]), ",
    lambda i: f"n + {i}, ",
    lambda i: f"{6971 + 10 * (i - 1)}, ",
]


@pytest.mark.parametrize("copy", ISSUE_COUNTERS, ids=["power", "index", "sum", "numbers alone"])
def test_a_counting_loop_is_stopped_as_a_counter_soon_after_it_needs(copy):
    text = "Let me write the terms out.\n\n" + "".join(copy(i) for i in range(1, 2000))
    stop, loop = first_stop(text)
    assert loop.rule == "counter"
    assert loop.span in text and loop.repeats >= DEFAULT.counter_repeats
    numbers_alone = not any(c.isalpha() for c in copy(1))
    need = DEFAULT.counter_repeats_numeric if numbers_alone else DEFAULT.counter_repeats
    # Stopped once it holds the copies the rule needs, give or take a check and a partial copy.
    seen = len("Let me write the terms out.\n\n" + "".join(copy(i) for i in range(1, need + 3)))
    assert stop <= seen + DEFAULT.check_every_chars + 7


def test_a_counter_whose_copies_carry_a_run_of_wandering_length_is_still_a_counter():
    # As the real model wrote it: the run of I's grows and shrinks while the number counts.
    text = "Each numeral adds its value.\n" + "".join(f"If it's a `MMGXL{'I' * (48 + i % 5)}`, it adds {i}. " for i in range(1, 300))
    stop, loop = first_stop(text)
    assert loop.rule == "counter" and loop.repeats >= DEFAULT.counter_repeats


def test_a_block_of_code_whose_one_number_counts_is_a_counter_loop():
    # As the real model wrote it (bench_real_model.py, 64-token events, p0045: run to the cap of
    # 4,096 tokens, 63 copies): a class of 170 characters again and again, its name's number counting.
    block = ("class QueueDataStruct{}:\n    def __init__(self):\n        self.queue = QueueDataStruct()\n\n"
             "    def enqueue(self, item1, item2):\n        self.queue.enqueue(item1)\n        self.queue.enqueue(item2)\n\n\n")
    text = "```python\n" + "".join(block.format(i) for i in range(1, 64))
    stop, loop = first_stop(text, piece=EVENT_CHARS)
    assert loop.rule == "counter" and stop < len(text) / 3
    # Its row keeps a few copies at most (where the count began is read off the text's shape), no loop.
    cut = loop_cut(text[:stop], loop)
    assert cut < 4 * len(block) and first_stop(text[:cut], piece=EVENT_CHARS) == (None, None)
    # Ten such classes (1,700 characters) are an answer's.
    assert first_stop("".join(block.format(i) for i in range(1, 11)), piece=EVENT_CHARS) == (None, None)


def test_counting_that_a_legitimate_answer_does_is_left_alone():
    counting = "Counting: " + ", ".join(str(i) for i in range(1, 401)) + "."
    table = "\n".join(f"7 x {i} = {7 * i}" for i in range(1, 41))
    tests = "\n".join(f"    assert add({i}, {i}) == {2 * i}" for i in range(50))
    for text in (counting, table, tests):
        for piece in (EVENT_CHARS, 1500):  # events of 64 tokens (the default) and of 256+, as streamed
            assert first_stop(text, piece=piece) == (None, None)


def test_a_span_whose_numbers_change_without_counting_is_stopped_by_the_numbers_rule():
    text = "So\n" + "".join(f"(x^{100 + 20 * i + i % 3} - x^{10 + i % 5} + 27x)^2 = " for i in range(200))
    stop, loop = first_stop(text)
    assert loop.rule == "numbers" and loop.repeats >= DEFAULT.numbers_repeats
    # Fewer copies than the rule needs: Fibonacci line by line is an answer.
    fibonacci, a, b = [], 0, 1
    for i in range(2, 60):
        fibonacci.append(f"F({i}) = F({i - 1}) + F({i - 2}) = {b} + {a} = {a + b}")
        a, b = b, a + b
    assert first_stop("\n".join(fibonacci)) == (None, None)


def test_a_number_cut_between_two_deltas_is_read_whole():
    text = "Let me write the terms out.\n\n" + "".join(f"n + {i}, " for i in range(1, 400))
    by_char, by_piece = first_stop(text, piece=1), first_stop(text, piece=7)
    for stop, loop in (by_char, by_piece):
        assert loop.rule == "counter" and loop.span in text and loop.repeats >= DEFAULT.counter_repeats
    # Both stop at the same check, give or take the piece that carries it past.
    assert abs(by_char[0] - by_piece[0]) <= DEFAULT.check_every_chars


def test_a_few_lines_recurring_in_any_order_are_a_cycle():
    lines = ["if ((i + j) % i == 0) {", "continue;", "}", "if ((i + j) % j == 0) {"]
    rng = random.Random(3)  # no span repeats back to back
    text = "int main() {\n" + "\n".join("    " + rng.choice(lines) for _ in range(80)) + "\n"
    stop, loop = first_stop(text)
    assert loop.rule == "cycle" and loop.repeats == DEFAULT.cycle_lines
    assert set(lines) <= set(loop.span.split("\n"))


def test_sentences_said_again_in_other_words_are_resaid():
    days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
    text = "Tom reads every day.\n" + "\n".join(
        f"Tom reads {1 + k % 2} page on {days[k % 7]}, so he reads {1 + k % 2} + 1 = {2 + k % 2} pages." for k in range(40)
    )
    stop, loop = first_stop(text)
    assert loop.rule == "resaid" and loop.repeats == DEFAULT.resaid_sentences


def test_text_that_never_ends_a_sentence_is_not_resaid():
    # Stretches of 2,000 characters drawn from the same 200 words share most of them; a
    # run-on "sentence" cut for its length is no sentence said again (the simulator writes such text).
    rng = random.Random(11)
    words = sorted({"".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 6))) for _ in range(200)})
    text = " ".join(rng.choices(words, k=12_000))
    for piece in (EVENT_CHARS, 1500):  # events of 64 tokens (the default) and of 256+, as streamed
        assert first_stop(text, piece=piece) == (None, None)


def test_an_answer_of_one_long_number_is_read_without_error():
    # Its shape stays empty until the number ends (a random model on SGLang wrote such answers).
    digits = "".join(random.Random(2).choices("0123456789", k=6000))
    assert first_stop(digits) == (None, None)
    stop, loop = first_stop("7" * 6000)
    assert loop.rule == "exact" and loop.span == "7" and stop < 1000


def test_the_detector_keeps_only_its_window_and_stays_stopped():
    detector = LoopDetector(loop_thresholds(window_chars=2048))
    rng = random.Random(5)
    words = "apple river stone cloud garden window market engine paper signal forest bridge".split()
    for _ in range(2000):
        assert detector.feed(" ".join(rng.choices(words, k=rng.randint(3, 9))) + "\n") is None
    loop = None
    for _ in range(200):
        loop = detector.feed("again and again\n") or loop
    assert loop is not None and loop.span == "again and again\n"
    assert detector.feed("something new entirely") is loop


def test_a_stopped_stream_says_which_rule_stopped_it():
    text = "".join(f"#define MAX_NAME {i}\n" for i in range(1, 400))
    lines = [
        b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text[i : i + 40]}}]}).encode()
        for i in range(0, len(text), 40)
    ]
    with pytest.raises(DegenerateError) as caught:
        parse_chat_stream(lines, VLLM, DEFAULT)
    error = caught.value
    assert isinstance(error, RequestError) and error.rule == error.loop.rule == "counter"
    assert "rule counter: a span repeated" in error.message and error.loop.span in text


@pytest.mark.parametrize(
    "bad",
    [
        dict(min_span_chars=0), dict(min_repeats=1), dict(check_every_chars=0), dict(window_chars=100),
        dict(counter_repeats=1), dict(numbers_repeats=0), dict(cycle_distinct=48), dict(resaid_similarity=0),
        dict(resaid_sentences=0),
    ],
)
def test_thresholds_that_cannot_work_are_refused(bad):
    with pytest.raises(ValueError):
        loop_thresholds(**bad)


def test_worked_arithmetic_is_left_alone_where_the_same_shape_with_arithmetic_that_fails_is_a_loop():
    # The real model's numbers loop (study-2#18) against a recurrence worked out, line for line
    # alike in shape: what the copies state holds in the one, by chance only in the other.
    rng = random.Random(8)
    wandering = "".join(f"a({n}) = {n + 1} + {n + 2} = {rng.randint(100, 999)}, " for n in range(1, 400))
    stop, loop = first_stop(wandering)
    assert loop.rule == "numbers"
    worked, a, b = [], 1, 1
    for n in range(3, 400):
        worked.append(f"a({n}) = ({a} + {b}) mod 1000 = {(a + b) % 1000}, ")
        a, b = b, (a + b) % 1000
    assert first_stop("".join(worked)) == (None, None)
    # A table of a schedule states no equation: each row's balance is the last one's less its principal.
    balance, rows = 90_000.0, []
    for month in range(1, 361):
        interest = round(balance * 0.004, 2)
        principal = round(480.34 - interest, 2)
        rows.append(f"| {month} | {interest:.2f} | {principal:.2f} | {round(balance - principal, 2):.2f} |")
        balance = round(balance - principal, 2)
    assert first_stop("\n".join(rows)) == (None, None)


def test_long_multiplication_by_a_digit_1_is_not_resaid():
    # Each digit times 1 says a sentence like the one ten digits before; the sentences are steps.
    digits = "".join(random.Random(4).choices("0123456789", k=60))
    text = "\n".join(f"{d} × 1 = {d}, plus carry 0 makes {d}: write {d}, carry 0." for d in reversed(digits))
    assert first_stop(text) == (None, None)
