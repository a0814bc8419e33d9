"""The generation stage through Dagster, against simulated servers over real HTTP."""

import collections

import dagster as dg
import polars as pl

from expansion_dag.assets.budget import budgeted_prompts, shard_prompts
from expansion_dag.assets.completions import completions
from expansion_dag.partitions import SHARD_KEYS
from expansion_dag.resources.storage import StorageResource
from expansion_dag.sim.config import SimServerConfig
from expansion_dag.sim.fleet import SimulatedFleet
from expansion_dag.tokenizer import count_prompt_tokens, load_tokenizer
from expansion_dag_tests.helpers import prompt_frame, resources


def prompts_asset(frame: pl.DataFrame) -> dg.AssetsDefinition:
    @dg.asset(name="prompts", io_manager_key="parquet_io")
    def prompts() -> pl.DataFrame:
        return frame

    return prompts


def run_pipeline(frame, urls, root, instance, **settings):
    res = resources(urls, root, **settings)
    assets = [prompts_asset(frame), budgeted_prompts, shard_prompts, completions]
    assert dg.materialize(assets, resources=res, instance=instance, selection=["prompts", "budgeted_prompts"]).success
    results = {
        key: dg.materialize(
            assets, resources=res, instance=instance, partition_key=key,
            selection=["shard_prompts", "completions"], raise_on_error=False,
        )
        for key in SHARD_KEYS
    }
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


def latest_check(instance, name, partition):
    records = instance.event_log_storage.get_asset_check_execution_history(
        dg.AssetCheckKey(dg.AssetKey("completions"), name), limit=10
    )
    for record in records:
        evaluation = record.event.dagster_event.event_specific_data if record.event else None
        if evaluation is not None and getattr(evaluation, "partition", None) in (partition, None):
            return evaluation
    raise AssertionError(f"no evaluation of {name}")


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
        run_pipeline(frame, fleet.urls, tmp_path, instance, temperature=0.7)
        first = latest_check(instance, "configuration_unchanged", "shard-00")
        sent_before = sum(fleet.stats(i)["completed"] for i in range(len(SHARD_KEYS)))
        results, res = run_pipeline(frame, fleet.urls, tmp_path, instance, temperature=0.3)
        sent_after = sum(fleet.stats(i)["completed"] for i in range(len(SHARD_KEYS)))
    assert first.passed
    drift = latest_check(instance, "configuration_unchanged", "shard-00")
    assert not drift.passed
    assert drift.severity == dg.AssetCheckSeverity.WARN
    assert "settings.temperature: 0.7 -> 0.3" in drift.metadata["changes"].value
    # The new temperature answers every prompt again: nothing old was silently reused.
    assert sent_after - sent_before == frame.height
    assert all(r.success for r in results.values())


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
    slow = dict(FAST_SIM, token_latency_s=0.001)  # a shard of a few seconds: idle servers get polled
    frame = small_frame(240)
    with SimulatedFleet([SimServerConfig(**slow)] * len(SHARD_KEYS)) as fleet:
        served = {}
        for spill in (True, False):
            res = resources(fleet.urls, tmp_path / str(spill), spill_to_idle_servers=spill)
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
    assert served[False].keys() == {fleet.urls[0]}
    assert len(served[True]) > 1, "the idle servers were not used"
    assert sum(served[True].values()) == sum(served[False].values())
