"""The plan: expected output and truncation from the store's answers or the configured estimates,
time at a throughput, and what cannot be planned said while the rest is still planned."""

import json
from pathlib import Path

import polars as pl
import pytest

from expansion_dag.generation import MIN_OBSERVED, Observed, Throughput, make_plan
from expansion_dag.servers import SGLANG, parse_gen_throughput

FIXTURES = Path(__file__).parents[1] / "contract" / "fixtures" / "sglang"  # the contract suite's, read off the wheel


def prompts(n: int, source: str = "alpaca", cap: int = 500) -> pl.DataFrame:
    return pl.DataFrame({"source": [source] * n, "prompt_tokens": [40] * n, "max_tokens": [cap] * n})


def answers(lengths: list[int], source: str = "alpaca", cap: int = 10_000) -> Observed:
    """The store's answers of one source, each cut where it reached ``cap``."""
    observed = Observed(owns=lambda record: True)
    records = [
        {"status": "ok", "source": source, "completion_tokens": min(n, cap), "finish_reason": "length" if n >= cap else "stop"}
        for n in lengths
    ]
    list(observed.reading(records))
    return observed


def plan_of(frame: pl.DataFrame, observed: Observed, *, tokens_per_s: float | None = 1000.0, servers: int = 2):
    return make_plan(frame, observed, lambda source: 300, servers=servers,
                     throughput=Throughput(tokens_per_s, "setting"), simulated=True, drop_truncated=True)


def test_the_stores_answers_say_what_a_prompt_will_cost_and_how_often_it_is_cut():
    # Answers of 1..1000 tokens; prompts budgeted 500: half are cut, the rest average 250.
    plan = plan_of(prompts(10), answers(list(range(1, 1001))))
    [source] = plan.sources
    assert source.basis == "learned from 1,000 answers in the store"
    assert source.truncated_share == pytest.approx(0.501, abs=0.001)
    assert plan.output_tokens == pytest.approx(10 * (0.499 * 250 + 0.501 * 500), rel=0.01)
    assert plan.rows == 5  # cut answers are left out of the training set
    # 3,750 output tokens at 1,000 tokens/s on each of 2 servers.
    assert plan.gpu_hours == pytest.approx(plan.output_tokens / 1000 / 3600) and plan.wall_s == pytest.approx(plan.output_tokens / 2000)


def test_an_answer_cut_at_a_lower_cap_says_nothing_about_a_higher_one():
    # An earlier run cut every answer at 200: a prompt now budgeted 100 is cut for sure, one budgeted
    # 500 is unknown from them, so the configured estimate stands.
    observed = answers([400] * MIN_OBSERVED, cap=200)
    assert plan_of(prompts(4, cap=100), observed).truncated_share == 1.0
    assert plan_of(prompts(4, cap=100), observed).output_tokens == 400


def test_without_the_stores_answers_the_configured_estimate_is_used_and_said():
    plan = plan_of(prompts(100, source="new"), answers([50] * MIN_OBSERVED, source="alpaca"))
    [source] = plan.sources
    assert source.basis.startswith("configured: 300 tokens")
    # A mean of 300 spread lognormally (median 182), cut at 500: about 230 out, some cut.
    assert 200 < plan.output_tokens / 100 < 260 and 0.05 < source.truncated_share < 0.2
    text = "\n".join(plan.lines())
    assert "[configured: 300 tokens, spread assumed]" in text and "(simulator)" in text


@pytest.mark.parametrize(
    ("frame", "tokens_per_s", "said"),
    [
        (prompts(0), 1000.0, "the catalog yields no prompts"),
        (prompts(10), 0.0, "a throughput of 0 output tokens/s (setting)"),
    ],
)
def test_what_cannot_be_planned_is_said_and_the_rest_still_printed(frame, tokens_per_s, said):
    plan = plan_of(frame, answers(list(range(1, 101))), tokens_per_s=tokens_per_s)
    lines = plan.lines()
    assert f"  cannot plan: {said}" in "\n".join(lines)
    assert lines[0].startswith(f"plan: {frame.height:,} prompts to send")
    assert any(line.startswith("  disk: store +") for line in lines)
    assert any(line.startswith("  time:") for line in lines) == bool(tokens_per_s)


def test_with_no_throughput_the_plan_says_how_the_run_will_know_its_time_and_gpu_hours():
    plan = plan_of(prompts(10), answers(list(range(1, 101))), tokens_per_s=None)
    text = "\n".join(plan.lines())
    assert "cannot plan" not in text
    assert "  time: no throughput yet: measured in the run's first minute from the tokens each server streams" in text
    assert text.endswith("then the time to finish and the GPU-hours are printed and kept up to date [setting]")
    assert plan.figures()["plan_gpu_hours"] == plan.figures()["plan_wall_s"] == "measured in the run's first minute"


def test_a_known_throughput_is_planned_with_and_the_run_checks_it():
    [time_line] = [line for line in plan_of(prompts(10), answers([100] * MIN_OBSERVED)).lines() if "time:" in line]
    assert "at 1,000 output tokens/s each [setting; decode only]" in time_line
    assert time_line.endswith("the run measures its own speed in its first minute and says if this is off by over 25%")


def test_a_busy_sglang_server_says_its_throughput_in_v1_loads():
    body = json.loads((FIXTURES / "loads.json").read_text())["body"]
    assert parse_gen_throughput(body, SGLANG) == pytest.approx(2950.4)
    assert parse_gen_throughput({"loads": []}, SGLANG) is None


def test_a_loop_stopped_early_counts_in_the_plan_at_the_tokens_it_streamed():
    observed = answers([100] * 20)
    list(observed.reading([{"status": "failed", "error": "degenerate", "source": "alpaca", "streamed_tokens": 2200}] * 5))
    plan = plan_of(prompts(10), observed)
    [source] = plan.sources
    assert source.basis == "learned from 25 answers in the store"
    # 20 answers of 100 tokens and 5 loops cut at 500 (the prompts' cap) of their 2,200.
    assert plan.output_tokens == pytest.approx(10 * (20 * 100 + 5 * 500) / 25, rel=0.01)
