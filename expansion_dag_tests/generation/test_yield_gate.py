"""The yield gate against simulated servers over real HTTP: a misconfigured fleet's shard stops within
its first answers, naming the cause and the fix, keeping every answer; a healthy one runs on."""

import pytest

from expansion_dag.core import FAILED, Identity, ShardAborted, load_tokenizer
from expansion_dag.generation import AnswerYield, Server, WorkItem, YieldGate, generate_shard
from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag.store import CompletionStore
from expansion_dag.training import ROW, AnswerJudge
from expansion_dag_tests.helpers import default_sampling, default_engine, default_training, one_mode

SHARD = "shard-00"
SLOTS = 4
GATE = 16
PROMPTS = 80
SIM = dict(port=0, max_running_requests=SLOTS, ttft_s=0.001, token_latency_s=0.0001, output_median_tokens=60)
IDENTITY = Identity(model=SimServerConfig().model_name, simulated=True, fingerprint="gate-test")
#: The bundled Qwen3 template, thinking on (its default): every answer must carry reasoning.
IDENTITIES = one_mode(IDENTITY)


def work(n: int, cap: int) -> list[WorkItem]:
    return [
        WorkItem(
            key=IDENTITY.key(f"p{i:04d}"), prompt_id=f"p{i:04d}", source="s",
            messages=[{"role": "user", "content": f"Tell me fact number {i}."}],
            prompt_tokens=16, max_tokens=cap, expected_output_tokens=60,
        )
        for i in range(n)
    ]


def run(tmp_path, sim: dict, cap: int = 3000):
    """The shard's report (or the abort that carries it) and every record it wrote."""
    store = CompletionStore(tmp_path)
    judge = AnswerJudge(load_tokenizer(), default_training(), IDENTITIES)
    config = default_engine(
        backoff_initial_s=0.01, progress_interval_s=3600,
        yield_gate=YieldGate(min_yield=0.5, answers=GATE, max_output_tokens=cap),
    )
    with SimulatedFleet([SimServerConfig(**SIM, **sim)]) as fleet, store.writer(SHARD) as writer:
        try:
            outcome = generate_shard(
                work(PROMPTS, cap), [Server(fleet.urls[0], SLOTS)], writer=writer, model=IDENTITY.model,
                sampling=default_sampling(), config=config, judge=judge,
            )
        except ShardAborted as exc:
            outcome = exc
    return outcome, [*store.records(SHARD), *store.records(SHARD, status=FAILED)]


@pytest.mark.parametrize(
    ("sim", "cap", "cause"),
    [
        (dict(answer_defect="no_reasoning"), 3000,
         "answers carry no reasoning while the chat template asks for thinking: launch SGLang with "
         "--reasoning-parser qwen3, or set chat_template_kwargs.enable_thinking: false"),
        (dict(answer_defect="think_tag_in_content", reasoning_parser="qwen3"), 3000,
         "answers leave <think> or </think> in the answer's content: launch SGLang with the model's own reasoning parser"),
        (dict(reasoning_parser="qwen3"), 24, "answers were cut at max_output_tokens 24: raise it"),
        (dict(answer_defect="empty", reasoning_parser="qwen3"), 3000,
         "answers came back with an empty content: check that the server's --reasoning-parser is the model's"),
    ],
    ids=["no-reasoning", "think-tags-in-content", "cap-truncates", "empty"],
)
def test_a_misconfigured_fleet_stops_at_the_gate_naming_cause_and_fix_and_keeps_its_answers(tmp_path, sim, cap, cause):
    outcome, records = run(tmp_path, sim, cap)
    assert isinstance(outcome, ShardAborted), "the shard ran to its end"
    message = str(outcome)
    assert message.startswith("yield gate: ") and cause in message
    assert "not on the server" in message
    report = outcome.report
    # Stopped within the gate's answers (and those already in flight), far before the shard's end.
    assert GATE <= report.answer_yield.judged <= GATE + SLOTS + 2 < PROMPTS
    assert report.answer_yield.gate_state == "stopped" and report.answer_yield.share < 0.5
    # Every answer the shard got is in the store, and no server failure was recorded.
    assert len(records) == report.done == report.answer_yield.judged and report.failed == 0


def test_a_healthy_fleet_passes_the_gate_and_counts_its_rows(tmp_path):
    outcome, records = run(tmp_path, dict(reasoning_parser="qwen3"))
    assert not isinstance(outcome, ShardAborted), str(outcome)
    assert outcome.answer_yield.gate_state == "passed"
    assert outcome.answer_yield.judged == outcome.done == PROMPTS == len(records)
    judge = AnswerJudge(load_tokenizer(), default_training(), IDENTITIES)
    assert outcome.answer_yield.rows == sum(judge(r) == ROW for r in records) > PROMPTS / 2


def test_the_yield_reads_rows_first_then_reasons_most_common_first():
    answers = AnswerYield()
    for verdict in [ROW] * 96 + ["truncated"] * 3 + ["degenerate"] + ["folded"] * 5:
        answers.count(verdict)
    assert answers.summary() == "rows 96%; truncated 3%; degenerate 1%"
    assert (answers.judged, answers.rows) == (100, 96)  # an earlier turn is its conversation's, not an answer


def test_the_gate_judges_once_when_its_answers_are_in():
    answers = AnswerYield()
    gate = YieldGate(min_yield=0.5, answers=4, max_output_tokens=None)
    for _ in range(3):
        answers.count("empty")
        assert answers.gate(gate) is None  # too few answers to judge
    answers.count(ROW)
    assert answers.gate(gate).startswith("yield gate: 1 of 4 answers would become training rows (25%, under min_yield 50%): 3 of 4")
    assert answers.gate(gate) is None and answers.gate_state == "stopped"


@pytest.mark.parametrize(("field", "value"), [("min_yield", 1.5), ("min_yield", -0.1), ("answers", 0)])
def test_a_gate_setting_out_of_range_is_refused_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        YieldGate(**{"min_yield": 0.5, "answers": 4, "max_output_tokens": None, field: value})
