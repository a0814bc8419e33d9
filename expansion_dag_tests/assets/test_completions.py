"""The generation stage through Dagster, against simulated servers over real HTTP."""

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
