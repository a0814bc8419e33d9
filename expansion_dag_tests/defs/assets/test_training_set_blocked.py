"""A shard that failed a blocking check keeps the training set from being built, naming the shard and
the check, until a run of that shard passes: through Dagster, against simulated servers over real HTTP."""

import dagster as dg
import pyarrow.parquet as pq
import pytest

from expansion_dag.defs import SHARD_KEYS
from expansion_dag.defs.assets import budgeted_prompts, completions, shard_prompts, training_set
from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag.training import data_files
from expansion_dag_tests.defs.assets.test_completions import FAST_SIM, prompts_asset, run_pipeline, small_frame


def test_a_shard_failing_a_blocking_check_blocks_the_training_set_until_a_run_of_it_passes(tmp_path, instance):
    frame = small_frame()
    # shard-00's server rejects a third of its requests: far over max_failure_rate (1%).
    rejecting = SimServerConfig(**FAST_SIM, fail_rate=1 / 3, fail_status=400)
    healthy = SimServerConfig(**FAST_SIM)
    with SimulatedFleet([rejecting] + [healthy] * (len(SHARD_KEYS) - 1)) as fleet:
        results, res = run_pipeline(frame, fleet.urls, tmp_path, instance)
        assert [key for key in SHARD_KEYS if not results[key].success] == ["shard-00"]
        assets = [prompts_asset(frame), budgeted_prompts, shard_prompts, completions, training_set]
        with pytest.raises(dg.Failure, match="blocked by the failed checks of shard-00: failure_rate") as blocked:
            dg.materialize(assets, resources=res, instance=instance, selection=["training_set"])
        assert blocked.value.metadata["blocked_by"].value == ["shard-00: failure_rate"]
        assert not res["storage"].path("training_set").exists()

        # The server mended, the shard's next run sends what failed and passes: the set is built.
        fleet.restart(0, config=healthy)
        assert dg.materialize(assets, resources=res, instance=instance, partition_key="shard-00",
                              selection=["shard_prompts", "completions"]).success
        assert dg.materialize(assets, resources=res, instance=instance, selection=["training_set"]).success
    ids = pq.read_table(data_files(res["storage"].path("training_set")), columns=["id"])["id"].to_pylist()
    assert sorted(ids) == frame["prompt_id"].to_list()
