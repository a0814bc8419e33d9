"""The generation stage through Dagster, against simulated servers over real HTTP."""

import collections
from pathlib import Path

import dagster as dg
import polars as pl
import pyarrow.parquet as pq
import pytest

from expansion_dag.config import DEFAULT_STREAM_INTERVAL
from expansion_dag.core import Identity, count_prompt_tokens, load_tokenizer
from expansion_dag.defs import SHARD_KEYS
from expansion_dag.defs.assets import budgeted_prompts, completions, shard_prompts, training_set
from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag.training import data_files
from expansion_dag_tests.helpers import prompt_frame, prompts_answered, prompts_asset, resources


def run_pipeline(frame, urls, root, instance, *, training=False, **settings):
    """Prepare, every shard, and (``training``) the training set; returns the shards' and the set's results."""
    res = resources(urls, root, **settings)
    assets = [prompts_asset(frame), budgeted_prompts, shard_prompts, completions, training_set]
    assert dg.materialize(assets, resources=res, instance=instance, selection=["prompts", "budgeted_prompts"]).success
    results = {
        key: dg.materialize(
            assets, resources=res, instance=instance, partition_key=key,
            selection=["shard_prompts", "completions"], raise_on_error=False,
        )
        for key in SHARD_KEYS
    }
    if training:
        results["training_set"] = dg.materialize(
            assets, resources=res, instance=instance, selection=["training_set"], raise_on_error=False
        )
    return results, res


def test_the_8192_incident_cannot_happen(tmp_path, instance):
    """Servers at --context-length 8192, a cap of 8192, prompts of 35 to 322 tokens: all served."""
    words = [27 + (314 - 27) * i // 59 for i in range(60)]
    frame = prompt_frame([" ".join(["word"] * n) for n in words])
    counts = count_prompt_tokens(load_tokenizer(), frame["messages"].to_list())
    assert (min(counts), max(counts)) == (35, 322)

    config = SimServerConfig(port=0, context_length=8192, max_running_requests=8, ttft_s=0.0,
                             token_latency_s=0.00005, output_median_tokens=2000, output_sigma=1.5)
    with SimulatedFleet([config] * len(SHARD_KEYS)) as fleet:
        results, res = run_pipeline(frame, fleet.urls, tmp_path, instance, max_output_tokens=8192)
        stats = [fleet.stats(i) for i in range(len(SHARD_KEYS))]

    assert all(r.success for r in results.values())
    assert sum(s["chat_requests_by_status"].get("400", 0) for s in stats) == 0
    assert max(s["max_requested_total_tokens"] for s in stats) <= 8192
    assert sum(s["context_exceeded"] for s in stats) == 0
    store = res["storage"].completion_store()
    generated = sorted(r["prompt_id"] for key in SHARD_KEYS for r in store.records(key))
    assert generated == frame["prompt_id"].to_list()
    # Long answers got the room the window allows, not a conservative cap.
    assert max(r["completion_tokens"] for key in SHARD_KEYS for r in store.records(key)) > 4096


FAST_SIM = dict(port=0, max_running_requests=4, ttft_s=0.0, token_latency_s=0.0001, output_median_tokens=60)


def small_frame(n=24):
    return prompt_frame([f"Question {i}: explain topic number {i} in a few words." for i in range(n)])


def completion_records(res):
    store = res["storage"].completion_store()
    return [r for key in SHARD_KEYS for r in store.records(key)]


def evaluation_of(result, name):
    """The evaluation of check ``name`` in a run's result."""
    [evaluation] = [e for e in result.get_asset_check_evaluations() if e.check_name == name]
    return evaluation


def test_a_shard_whose_server_is_down_runs_on_a_healthy_one_and_says_so(tmp_path, instance):
    with SimulatedFleet([SimServerConfig(**FAST_SIM)] * len(SHARD_KEYS)) as fleet:
        res = resources(fleet.urls, tmp_path)
        assets = [prompts_asset(small_frame()), budgeted_prompts, shard_prompts, completions]
        assert dg.materialize(assets, resources=res, instance=instance, selection=["prompts", "budgeted_prompts"]).success
        fleet.kill(0)
        result = dg.materialize(assets, resources=res, instance=instance, partition_key="shard-00",
                                selection=["shard_prompts", "completions"])
    assert result.success
    [materialization] = [m for m in result.asset_materializations_for_node("completions")]
    assert materialization.metadata["server_is_fallback"].value is True
    assert materialization.metadata["server"].value == fleet.urls[1]
    records = list(res["storage"].completion_store().records("shard-00"))
    assert records and {r["server"] for r in records} == {fleet.urls[1]}


def test_changed_settings_are_named_and_do_not_reuse_old_completions(tmp_path, instance):
    frame = small_frame()
    with SimulatedFleet([SimServerConfig(**FAST_SIM)] * len(SHARD_KEYS)) as fleet:
        before, _ = run_pipeline(frame, fleet.urls, tmp_path, instance, temperature=0.7)
        first = evaluation_of(before["shard-00"], "configuration_unchanged")
        sent_before = sum(prompts_answered(fleet.stats(i)) for i in range(len(SHARD_KEYS)))
        # The outputs written change nothing generated: not a drift.
        results, res = run_pipeline(frame, fleet.urls, tmp_path, instance, training=True, temperature=0.3,
                                    drop_truncated=False, training_formats=["parquet", "speculators-pretokenized"])
        sent_after = sum(prompts_answered(fleet.stats(i)) for i in range(len(SHARD_KEYS)))
    assert first.passed
    drift = evaluation_of(results["shard-00"], "configuration_unchanged")
    assert not drift.passed
    assert drift.severity == dg.AssetCheckSeverity.WARN
    assert "settings.temperature: 0.7 -> 0.3" in drift.metadata["changes"].value
    # The new temperature answers every prompt again: nothing old was silently reused.
    assert sent_after - sent_before == frame.height
    assert all(r.success for r in results.values())
    # The training set takes the new answers only, one per prompt, and names the old ones it left out.
    out_dir = res["storage"].path("training_set")
    ids = pq.read_table(data_files(out_dir), columns=["id"])["id"].to_pylist()
    assert sorted(ids) == frame["prompt_id"].to_list()
    [materialization] = results["training_set"].asset_materializations_for_node("training_set")
    assert materialization.metadata["left_out"].value["other_identity"] == frame.height
    [(label, count)] = materialization.metadata["left_out_other_identities"].value.items()
    assert count == frame.height and label.startswith("Qwen/Qwen3-8B (simulator) [settings ")
    assert materialization.metadata["simulated"].value is True
    assert "SIMULATED" in materialization.metadata["summary"].value
    assert "training_formats" not in drift.metadata["changes"].value
    # The outputs the configuration chose, named in the metadata, and the card beside them.
    # The set is built in parts, one a segment: each shard's new answers are a parquet file of their
    # own, and the old answers' parts, with no rows, none.
    shards = [f"part-{i:05d}.parquet" for i in range(len(SHARD_KEYS))]
    assert materialization.metadata["outputs"].value == {
        "parquet": shards, "speculators-pretokenized": ["pretokenized.jsonl"]
    }
    assert sorted(p.name for p in Path(out_dir).iterdir()) == [
        "README.md", "manifest.json", *shards, "pretokenized.jsonl"
    ]
    card = (Path(out_dir) / "README.md").read_text()
    assert card == materialization.metadata["dataset_card"].value
    assert "**SIMULATED**" in card and f"| other identity: {label} | {frame.height} |" in card
    # Each command runs as it is written (the simulator's model name quoted for the shell).
    assert "speculators prepare-data --model 'Qwen/Qwen3-8B (simulator)' --data $PWD/pretokenized.jsonl" in card


def test_a_simulated_run_is_refused_in_a_store_of_real_completions(tmp_path, instance):
    real = Identity(model="Qwen/Qwen3-8B", simulated=False, fingerprint="production-settings")
    res = resources([], tmp_path)
    res["storage"].completion_store().registry.register(real)  # what a production run leaves behind
    with SimulatedFleet([SimServerConfig(**FAST_SIM)] * len(SHARD_KEYS)) as fleet:
        res = resources(fleet.urls, tmp_path)
        assets = [prompts_asset(small_frame()), budgeted_prompts, shard_prompts, completions]
        result = dg.materialize(assets, resources=res, instance=instance, raise_on_error=False,
                                selection=["prompts", "budgeted_prompts"])
        sent = sum(fleet.stats(i)["completed"] for i in range(len(SHARD_KEYS)))
    assert not result.success and sent == 0
    [failure] = [e for e in result.all_events if e.is_step_failure]
    error = failure.event_specific_data.error.cause
    message = error.message
    assert error.cls_name == "MixedStoreError"
    assert str(tmp_path / "completions") in message and "holds real completions (Qwen/Qwen3-8B)" in message


def test_the_api_key_reaches_the_servers_but_never_logs_or_metadata(tmp_path, instance, monkeypatch):
    secret = "sk-test-4f9a1c2e7b"
    monkeypatch.setenv("SGLANG_API_KEY", secret)
    with SimulatedFleet([SimServerConfig(**FAST_SIM, api_key=secret)] * len(SHARD_KEYS)) as fleet:
        results, res = run_pipeline(small_frame(), fleet.urls, tmp_path, instance)
    assert all(r.success for r in results.values())
    assert len(completion_records(res)) == 24
    for run in instance.get_runs():
        for entry in instance.all_logs(run.run_id):
            assert secret not in entry.to_json()


def test_a_vllm_fleet_is_probed_and_served_with_exact_budgets(tmp_path, instance):
    config = SimServerConfig(**{**FAST_SIM, "backend": "vllm", "context_length": 2048, "output_median_tokens": 3000})
    with SimulatedFleet([config] * len(SHARD_KEYS)) as fleet:
        res = resources(fleet.urls, tmp_path, fleet={"backend": "vllm", "slots_override": 4},
                        max_output_tokens=4096, min_output_tokens=64)
        assets = [prompts_asset(small_frame()), budgeted_prompts, shard_prompts, completions]
        assert dg.materialize(assets, resources=res, instance=instance, selection=["prompts", "budgeted_prompts"]).success
        for key in SHARD_KEYS:
            assert dg.materialize(assets, resources=res, instance=instance, partition_key=key,
                                  selection=["shard_prompts", "completions"]).success
        stats = [fleet.stats(i) for i in range(len(SHARD_KEYS))]
    records = completion_records(res)
    assert len(records) == 24
    # vLLM would cut an over-budget answer silently; exact budgets keep every request in the window.
    assert all(r["local_prompt_tokens"] + r["max_tokens"] <= 2048 for r in records)
    assert max(s["max_requested_total_tokens"] for s in stats) <= 2048
    # An answer cut at its budget got all of it: the window was not silently shortened.
    cut = [r for r in records if r["finish_reason"] == "length"]
    assert cut and all(r["completion_tokens"] == r["max_tokens"] for r in cut)


def test_a_shard_still_queued_borrows_idle_servers_and_lists_them(tmp_path, instance):
    # A shard of several seconds: idle servers are polled each second, and borrowed once three
    # readings in a row find them idle.
    slow = dict(FAST_SIM, token_latency_s=0.003)
    frame = small_frame(240)
    with SimulatedFleet([SimServerConfig(**slow)] * len(SHARD_KEYS)) as fleet:
        served = {}
        for spill in (True, False):
            # The other servers' shards are not in this run: no owner to wait for before borrowing.
            res = resources(fleet.urls, tmp_path / str(spill), spill_to_idle_servers=spill, owner_wait_s=0)
            assets = [prompts_asset(frame), budgeted_prompts, shard_prompts, completions]
            assert dg.materialize(assets, resources=res, instance=instance, selection=["prompts", "budgeted_prompts"]).success
            result = dg.materialize(assets, resources=res, instance=instance, partition_key="shard-00",
                                    selection=["shard_prompts", "completions"])
            [materialization] = result.asset_materializations_for_node("completions")
            records = list(res["storage"].completion_store().records("shard-00"))
            served[spill] = collections.Counter(r["server"] for r in records)
            borrowed = sum(n for url, n in served[spill].items() if url != fleet.urls[0])
            assert materialization.metadata["requests_on_idle_servers"].value == borrowed
            assert materialization.metadata["completions_total"].value == len(records) == sum(served[spill].values())
            # The client's own CPU, start-up apart, per request it sent. ``client_cpu_s`` is shown to
            # 0.01 s, the per-request figure from the unrounded time: they agree within that rounding.
            cpu_s, sent = (materialization.metadata[k].value for k in ("client_cpu_s", "sent_this_run"))
            per_request = materialization.metadata["client_cpu_ms_per_request"].value
            assert cpu_s > 0 and per_request == pytest.approx(1000 * cpu_s / sent, abs=1000 * 0.005 / sent + 0.001)
    assert served[False].keys() == {fleet.urls[0]}
    assert len(served[True]) > 1, "the idle servers were not used"
    assert sum(served[True].values()) == sum(served[False].values())


def test_waste_figures_and_the_learned_order_are_in_each_shards_metadata(tmp_path, instance):
    """Night 1 on a fleet that loops on a quarter of its answers: the shards say what was generated,
    kept and wasted. Night 2, new prompts, no typed priors: the order comes from night 1's answers."""
    looping = SimServerConfig(**{**FAST_SIM, "output_median_tokens": 100}, loop_rate=0.25, output_sigma=0.2,
                              output_median_by_marker=(("[long]", 300), ("[short]", 20)))

    def night(n):
        sources = ["long", "short"] * 12
        texts = [f"[{s}] Night {n}: explain topic number {i} in a few words." for i, s in enumerate(sources)]
        return prompt_frame(texts, sources).with_columns(pl.format("n{}-{}", pl.lit(n), "prompt_id").alias("prompt_id"))

    with SimulatedFleet([looping] * len(SHARD_KEYS)) as fleet:
        first, res = run_pipeline(night(1), fleet.urls, tmp_path, instance)
        metadata = [r.asset_materializations_for_node("completions")[0].metadata for r in first.values()]
        records = completion_records(res)
        second, _ = run_pipeline(night(2), fleet.urls, tmp_path, instance)
        learned = [r.asset_materializations_for_node("completions")[0].metadata for r in second.values()]

    def total(name):
        return sum(m[name].value for m in metadata)

    stopped = sum(m["requests_by_outcome"].value.get("degenerate", 0) for m in metadata)
    assert stopped == 6  # a quarter of 24 answers looped, each stopped and recorded
    # Loops are the model's doing: far above max_failure_rate (1%), they fail no shard.
    assert all(r.success for r in first.values())
    assert sum(m["degenerate_total"].value for m in metadata) == 6
    assert sum(m["degenerate_by_rule"].value.get("exact", 0) for m in metadata) == 6  # the simulator's loops are exact
    assert total("output_tokens_kept") == sum(r["completion_tokens"] for r in records) > 0
    assert total("output_tokens_generated") > total("output_tokens_kept")
    for m in metadata:
        generated, kept = m["output_tokens_generated"].value, m["output_tokens_kept"].value
        assert m["useful_token_share"].value == round(kept / generated, 4)
        dropped = m["dropped_slot_seconds_by_reason"].value
        assert set(dropped) == ({"degenerate"} if m["requests_by_outcome"].value.get("degenerate") else set())
    # The first shard of the first night has nothing to learn from (later ones learn from it).
    assert metadata[0]["answer_lengths_learned_from_store"].value == 0
    assert "typed prior" in metadata[0]["expected_answer_lengths"].value

    # Night 2 starts from night 1's 18 kept answers: long prompts expected long, short ones short.
    assert learned[0]["answer_lengths_learned_from_store"].value == 18
    rows = [line.split(" | ") for m in learned for line in m["expected_answer_lengths"].value.splitlines()[2:]]
    assert rows and all("answers (source" in row[4] for row in rows)
    expected = {row[0].strip("| "): int(row[3]) for row in rows}
    # The typed prior (the same for both) is only where the estimates started.
    assert expected["long"] > 2 * expected["short"]


def test_a_server_streaming_finer_than_configured_is_named_in_a_warning(tmp_path, instance):
    """An attached SGLang server streams at its launch setting: the shard says what it found."""

    def shard_run(interval, root):
        with SimulatedFleet([SimServerConfig(**FAST_SIM, stream_interval=interval)] * len(SHARD_KEYS)) as fleet:
            res = resources(fleet.urls, root)
            assets = [prompts_asset(small_frame(8)), budgeted_prompts, shard_prompts, completions]
            assert dg.materialize(assets, resources=res, instance=instance, selection=["prompts", "budgeted_prompts"]).success
            result = dg.materialize(assets, resources=res, instance=instance, partition_key="shard-00",
                                    selection=["shard_prompts", "completions"])
        [materialization] = result.asset_materializations_for_node("completions")
        warnings = [e.user_message for e in instance.all_logs(result.run_id) if "token(s) an event" in e.user_message]
        metadata = materialization.metadata
        assert metadata["stream_interval_set_by"].value == "server launch"  # SGLang's: no request changes it
        assert metadata["stream_interval"].value == metadata["effective_config"].value["fleet"]["stream_interval"]
        return metadata["stream_interval"].value, warnings

    interval, warnings = shard_run(1, tmp_path / "a")
    assert interval == 1 and len(warnings) == 1 and f"--stream-interval {DEFAULT_STREAM_INTERVAL}" in warnings[0]
    assert shard_run(DEFAULT_STREAM_INTERVAL, tmp_path / "b") == (DEFAULT_STREAM_INTERVAL, [])
