"""The output tokens still to come, learned from the run's answers: the time to finish rests on them.

A replay runs recorded or drawn answer lengths through the real queue on a clock of its own: each
slot decodes a token a second, the queue hands out the longest expected answer first, each answer
that ends teaches the lengths. At chosen shares of the prompts done, the work the queue says is
left, plus the tokens already made, is set beside the run's true total. Nothing is timed.
"""

import gzip
import heapq
import json
import math
import random
from pathlib import Path

import pytest

from expansion_dag.generation import (
    AnswerLengths,
    Progress,
    PromptQueue,
    Server,
    SpeedMeter,
    Turn,
    WorkItem,
    generate_shard,
)
from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag.store import CompletionStore
from expansion_dag_tests.helpers import default_engine, default_sampling

DATA = Path(__file__).parents[1] / "data" / "real_model_answers.jsonl.gz"
MODEL = SimServerConfig().model_name
SAMPLING = default_sampling()


def item(i: int, source: str, prior: int, cap: int = 100_000, turn: Turn | None = None, text: str = "question") -> WorkItem:
    return WorkItem(
        key=f"k{i}", prompt_id=f"p{i:05d}", source=source, messages=[{"role": "user", "content": f"{text} {i}"}],
        prompt_tokens=20, max_tokens=cap, expected_output_tokens=prior, turn=turn,
    )


def cap(record: dict) -> int:
    """The cap a recorded answer was asked with (``real_model_answers.md``)."""
    if record["finish_reason"] == "length":
        return record["completion_tokens"]
    return {"study-1": 2048, "study-2": 3072, "bench-44": 4096}.get(record["id"].split("#")[0], 1500)


def replay(answers: list[tuple[str, int, int]], slots: int, at: list[float], prior: int, texts: list[str] | None = None):
    """Per share in ``at`` of ``answers`` (source, length, cap), asked by ``texts``: (the run's total
    said: tokens made + the queue's work left, the total a mean of ended answers alone gives, the
    true total)."""
    texts = texts or ["question"] * len(answers)
    items = [item(i, source, prior, cap, text=text) for i, ((source, _, cap), text) in enumerate(zip(answers, texts))]
    length = {it.key: min(cap, n) for it, (_, n, cap) in zip(items, answers)}
    queue, meter = PromptQueue(items), SpeedMeter(slots)
    running: list[tuple[float, str, WorkItem, float]] = []
    now, done, made = 0.0, 0, 0
    said = {}
    marks = sorted(at)
    truth = sum(length.values())

    def start() -> None:
        while len(running) < slots and len(queue):
            taken = queue.take()
            queue.opened(taken)
            stream = meter.sent(now, streamed=True)
            stream.output(now)
            queue.decoding(taken, stream)
            heapq.heappush(running, (now + length[taken.key], taken.key, taken, now))

    start()
    while running:
        now, _, ended, _ = heapq.heappop(running)
        queue.learn(ended, length[ended.key])
        queue.settled(ended)
        done, made = done + 1, made + length[ended.key]
        start()
        while marks and done >= marks[0] * len(items):
            so_far = sum(now - began for _, _, _, began in running)
            left = queue.work_left(1.0, now, slots)
            naive = made + (len(items) - done) * made / done
            said[marks.pop(0)] = (made + so_far + left.tokens, naive, truth)
    return said


@pytest.mark.parametrize("prior", [300, 3000], ids=["prior-3x-low", "prior-3x-high"])
def test_running_answers_as_lower_bounds_undo_the_survivors_bias_of_the_first_answers(prior):
    # Long-tailed lengths (lognormal, sigma 1.2, mean ~830 tokens) and a prior wrong by 3x either
    # way: the first answers to end are the short ones, so their mean is far too low.
    rng = random.Random(7)
    answers = [("chat", max(1, int(rng.lognormvariate(6.0, 1.2))), 100_000) for _ in range(3000)]
    said = replay(answers, slots=128, at=[0.1, 0.25, 0.5], prior=prior)
    for share, (estimate, naive, truth) in said.items():
        assert naive < 0.8 * truth, share  # the survivors' mean: 20% low or worse
        assert estimate == pytest.approx(truth, rel=0.15), share


@pytest.mark.parametrize("factor", [0.5, 2.0], ids=["prior-2x-low", "prior-2x-high"])
def test_a_level_the_words_learned_from_the_first_answers_does_not_move_the_total(factor):
    # Four sources of long-tailed lengths (lognormal, sigma 1.2) and their priors wrong by 2x, the
    # prompts' words shared by each source's prompts: learned against a mean that moves while the
    # first answers to end are the short ones, the words say a level, not a length. The queued
    # prompts' expectations count relative to those of the prompts taken, whose answers the learned
    # lengths are: the level cancels (before, the total was said 57-70% too high at a quarter).
    rng = random.Random(5)
    medians = {"alpaca": 150, "math": 300, "code": 500, "chat": 700}
    sources = [list(medians)[i % 4] for i in range(4000)]
    answers = [(s, max(1, int(rng.lognormvariate(math.log(medians[s]), 1.2))), 4096) for s in sources]
    texts = [f"[{s}] Question {i}: say something about topic" for i, s in enumerate(sources)]
    mean = sum(min(n, cap) for _, n, cap in answers) / len(answers)
    said = replay(answers, slots=72, at=[0.1, 0.25, 0.5], prior=round(mean * factor), texts=texts)
    errors = {share: round(estimate / truth - 1, 3) for share, (estimate, _, truth) in said.items()}
    assert abs(errors[0.25]) < 0.15 and abs(errors[0.5]) < 0.1, errors


def test_once_few_answers_are_left_the_end_is_the_longest_slots_load_not_the_tokens_over_all_slots():
    lengths = AnswerLengths()
    for n in (200, 400, 800, 1600, 3200) * 10:
        lengths.observe("code", 20, n)
    queue = PromptQueue([item(i, "code", 1000, cap=100_000) for i in range(3)], lengths)
    meter = SpeedMeter(16)
    taken = queue.take()
    queue.opened(taken)
    stream = meter.sent(0.0, streamed=True)
    stream.output(0.0)
    queue.decoding(taken, stream)
    left = queue.work_left(1.0, 3000.0, 16)  # one answer 3,000 tokens in, two queued, 16 slots
    running = left.running_tokens
    each = (left.tokens - running) / 2
    # Three answers on 16 slots: each on a slot of its own, the last to end the one with most to go.
    assert left.drain_tokens == pytest.approx(max(running, each))
    assert left.drain_tokens > 3 * left.tokens / 16


def test_on_a_real_models_recorded_answers_the_total_is_near_in_every_order():
    # 240 answers of SmolLM2-135M on vLLM's CPU build (code, maths, explanations, lists; a third of
    # them loops run to their cap), in three orders, on the 16 slots the issue ran, with the
    # configured 1,024 tokens a source as the prior (about right on average, wrong for each source).
    recorded = [json.loads(line) for line in gzip.open(DATA, "rt")]
    for seed in (1, 2, 3):
        answers = [(r["kind"], r["completion_tokens"], cap(r)) for r in recorded]
        random.Random(seed).shuffle(answers)
        said = replay(answers, slots=16, at=[0.1, 0.25, 0.5], prior=1024)
        errors = {share: (abs(estimate / truth - 1), abs(naive / truth - 1)) for share, (estimate, naive, truth) in said.items()}
        # At a tenth, survivorship is most of the error: the ended answers' mean is far lower.
        assert errors[0.1][0] < errors[0.1][1] - 0.1, (seed, errors)
        # Later, what is left is each source's few answers of a heavy-tailed mix (loops at the cap
        # or not): near, within 30%, for every order.
        assert errors[0.25][0] < 0.3 and errors[0.5][0] < 0.3, (seed, errors)


def test_the_cap_bounds_the_rest_of_a_running_answer_and_later_turns_count():
    lengths = AnswerLengths()
    for _ in range(50):
        lengths.observe("code", 20, 4000)
    capped = item(0, "code", 1000, cap=2000)
    turn = Turn("c1", 1, 3, rest=())
    conversation = item(1, "code", 1000, cap=5000, turn=turn)
    queue = PromptQueue([capped, conversation], lengths)
    meter = SpeedMeter(2)
    for it in (queue.take(), queue.take()):
        queue.opened(it)
        stream = meter.sent(0.0, streamed=True)
        stream.output(0.0)
        queue.decoding(it, stream)
    left = queue.work_left(1.0, 1500.0, 2)  # 1,500 tokens each so far
    assert (left.queued, left.running, left.learned) == (0, 2, 50)
    # The capped answer has at most 500 to go; the conversation's answer some 2,500 and two more
    # turns at about 4,000 each: ~11,000, never the 2 x 4,000 of two fresh answers alone.
    assert 9_000 < left.tokens < 13_500
    assert "learned from 50 answers" in left.basis()


def test_a_runs_progress_carries_the_work_left_from_its_queue_to_zero_at_its_end(tmp_path):
    sim = SimServerConfig(port=0, max_running_requests=4, ttft_s=0.0, token_latency_s=0.0005, output_sigma=1.0,
                          output_median_tokens=200)
    config = default_engine(canary=False, progress_interval_s=0.05)
    items = [
        WorkItem(key=SAMPLING.key(f"p{i}", MODEL), prompt_id=f"p{i}", source="chat",
                 messages=[{"role": "user", "content": f"Question {i}."}], prompt_tokens=20, max_tokens=2000,
                 expected_output_tokens=1000)
        for i in range(60)
    ]
    reports: list[Progress] = []
    with SimulatedFleet([sim]) as fleet, CompletionStore(tmp_path).writer("shard-00") as writer:
        generate_shard(items, [Server(fleet.urls[0], 4)], writer=writer, model=MODEL, sampling=SAMPLING,
                       config=config, on_progress=reports.append)
    midway = [p.work for p in reports if p.work is not None and p.work.running and p.work.learned]
    assert midway, "no report while answers ran"
    assert midway[0].queued + midway[0].running <= 60 and "learned from" in midway[0].basis()
    last = reports[-1].work
    assert last is not None and (last.tokens, last.queued, last.running, last.learned) == (0, 0, 0, 60)
