"""A shard's yield through Dagster: what its metadata says its answers will give is what the training
set then takes; a misconfigured fleet's shard fails at the gate, keeping its answers, blaming no server."""

import dagster as dg
import pytest

from expansion_dag.defs import SHARD_KEYS
from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag_tests.defs.assets.test_completions import (
    FAST_SIM,
    completion_records,
    run_pipeline,
    small_frame,
)

#: Answers around the cap: some cut, so the yield has a reason to count besides rows.
SIM = {**FAST_SIM, "output_median_tokens": 70, "output_sigma": 0.3}


def materialization(result, asset: str) -> dict:
    [event] = [e for e in result.get_asset_materialization_events() if e.asset_key == dg.AssetKey(asset)]
    return event.materialization.metadata


def test_a_healthy_runs_yield_in_the_metadata_is_what_the_training_set_takes(tmp_path, instance):
    with SimulatedFleet([SimServerConfig(**SIM)] * len(SHARD_KEYS)) as fleet:
        results, _ = run_pipeline(small_frame(40), fleet.urls, tmp_path, instance, training=True,
                                  max_output_tokens=80, min_output_tokens=16, yield_gate_answers=8)
    shards = [materialization(results[key], "completions") for key in SHARD_KEYS]
    set_ = materialization(results.pop("training_set"), "training_set")
    assert all(s["yield_gate"].value == "passed" for s in shards)
    truncated = sum(s["answers_left_out_by_reason"].value.get("truncated", 0) for s in shards)
    assert truncated > 0, "no answer was cut: the yield counted nothing but rows"
    assert sum(s["answers_to_rows"].value for s in shards) == set_["samples"].value
    assert truncated == set_["left_out"].value["truncated"]
    assert all(s["answer_yield"].value.startswith("rows ") for s in shards)
    # The plan's figures for the shard's prompts beside what they did: the configured estimate (an
    # empty store), cut at the cap of 80, against the answers' own lengths.
    for s in shards:
        assert "| share cut at the cap |" in s["plan_against_actual"].value
        assert 0 < s["plan_output_tokens_per_answer"].value <= 80
        actual = s["output_tokens"].value / s["sent_this_run"].value
        assert s["actual_output_tokens_per_answer"].value == pytest.approx(actual, abs=0.05)
        # The run measured its own speed (the plan had none) and said when it would end, beside when it did.
        assert "| output tokens/s per server | no throughput |" in s["plan_against_actual"].value
        # Said to 0.1 s, as the progress shows it, against the run's time to 0.01 s: 0.05 s apart at most.
        said = s["speed_first_measured_at_s"].value
        assert 0 <= said <= s["elapsed_s"].value + 0.06 and s["speed_first_tokens_per_s_per_server"].value > 0
        estimate, error = s["speed_first_wall_estimate_s"].value, s["speed_first_wall_estimate_error"].value
        assert estimate == pytest.approx(s["elapsed_s"].value * (1 + error), abs=0.1)  # figures to 0.1 s
        # GPU-hours: the shard's own server's time, beside what the first measured speed said.
        assert s["gpu_hours"].value == pytest.approx(s["elapsed_s"].value / 3600, abs=1e-4)
        assert "speed_first_gpu_hours" in s  # a tiny run: 0.0000 hours to four places
    # While it ran, each shard's observations carried the tokens left, learned from its answers.
    for key in SHARD_KEYS:
        observed = [e.asset_observation_data.asset_observation.metadata for e in results[key].all_events
                    if e.event_type == dg.DagsterEventType.ASSET_OBSERVATION]
        bases = [o["tokens_left_basis"].value for o in observed if "tokens_left_basis" in o]
        bases = [b for b in bases if b]
        assert any(b.startswith("learned from ") for b in bases), bases
        assert observed[-1]["tokens_left"].value == 0


def test_a_fleet_answering_without_reasoning_fails_its_shards_at_the_gate_and_keeps_the_answers(tmp_path, instance):
    config = SimServerConfig(**FAST_SIM, answer_defect="no_reasoning")
    with SimulatedFleet([config] * len(SHARD_KEYS)) as fleet:
        results, res = run_pipeline(small_frame(40), fleet.urls, tmp_path, instance, yield_gate_answers=8)
    for key in SHARD_KEYS:
        assert not results[key].success
        [failure] = [e for e in results[key].all_events if e.is_step_failure]
        description = failure.event_specific_data.user_failure_data.description
        assert "yield gate: 0 of " in description and "--reasoning-parser qwen3" in description
        assert "completions are kept" in description
    # The answers it got are in the store: the training set's to judge, not lost.
    assert 16 <= len(completion_records(res)) < 40
