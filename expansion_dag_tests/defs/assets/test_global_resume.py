"""Resume is global: after a kill, a change of shard count and of priors, no prompt is sent twice.

The shard count is read when the code loads (``EXPANSION_SHARDS``), so each layout runs in its own
process: this file, run as ``python -m expansion_dag_tests.defs.assets.test_global_resume``, is that
process (prepare, every shard in turn, then optionally the training set, on one Dagster instance).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq

from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag.store import CompletionStore
from expansion_dag.training import Manifest, data_files
from expansion_dag_tests.helpers import prompt_frame

ROOT = Path(__file__).resolve().parents[3]
SOURCES = ("alpha", "beta", "gamma")
PROMPTS = 96


def frame() -> pl.DataFrame:
    return prompt_frame(
        [f"Question {i}: describe item {i} in a sentence or two." for i in range(PROMPTS)],
        [SOURCES[i % 3] for i in range(PROMPTS)],
    )


def drive(spec: dict) -> None:
    """One layout's runs, in this process (``EXPANSION_SHARDS`` set by the caller)."""
    import dagster as dg

    from expansion_dag.defs import SHARD_KEYS
    from expansion_dag.defs.assets import budgeted_prompts, completions, shard_prompts, training_set
    from expansion_dag_tests.defs.assets.test_completions import prompts_asset
    from expansion_dag_tests.helpers import resources

    res = resources(spec["urls"][: len(SHARD_KEYS)], spec["root"], drop_truncated=False,
                    expected_output_by_source=spec["priors"])
    assets = [prompts_asset(frame()), budgeted_prompts, shard_prompts, completions, training_set]
    with dg.DagsterInstance.get() as instance:
        assert dg.materialize(assets, resources=res, instance=instance, selection=["prompts", "budgeted_prompts"]).success
        for key in SHARD_KEYS:
            assert dg.materialize(assets, resources=res, instance=instance, partition_key=key,
                                  selection=["shard_prompts", "completions"]).success
        if spec["training_set"]:
            assert dg.materialize(assets, resources=res, instance=instance, selection=["training_set"]).success


def layout(tmp_path: Path, shards: int, spec: dict) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "EXPANSION_"))}
    env.update(DAGSTER_HOME=str(tmp_path / "home"), EXPANSION_SHARDS=str(shards))
    return subprocess.Popen(
        [sys.executable, "-m", "expansion_dag_tests.defs.assets.test_global_resume", json.dumps(spec)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )


def lines_in(store_dir: Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in store_dir.glob("*/seg-*.jsonl"))


def requests(fleet: SimulatedFleet, n: int) -> int:
    """Chat requests but the weights probes (the only greedy ones: ``helpers.prompts_answered``)."""
    return sum(sum((s := fleet.stats(i))["chat_requests_by_status"].values()) - s["greedy_requests"] for i in range(n))


def settle(fleet: SimulatedFleet, n: int) -> None:
    """Wait until the killed run's requests have left the servers (finished or aborted)."""
    deadline = time.monotonic() + 30
    while any(fleet.stats(i)["num_running"] or fleet.stats(i)["num_waiting"] for i in range(n)):
        assert time.monotonic() < deadline, "the simulators kept working after the run was killed"
        time.sleep(0.05)


def test_after_a_kill_and_a_new_layout_each_prompt_is_sent_once_and_trained_once(tmp_path):
    (tmp_path / "home").mkdir()
    config = SimServerConfig(port=0, max_running_requests=4, ttft_s=0.0, token_latency_s=0.002,
                             output_median_tokens=60, output_sigma=0.3)
    store_dir = tmp_path / "storage" / "completions"
    with SimulatedFleet([config] * 4) as fleet:
        spec = {"urls": fleet.urls, "root": str(tmp_path / "storage"), "priors": {}, "training_set": False}
        first = layout(tmp_path, 4, spec)
        deadline = time.monotonic() + 180
        while lines_in(store_dir) < PROMPTS // 3 and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert first.poll() is None, "the 4-shard run ended before it was killed: " + first.stdout.read()[-3000:]
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        settle(fleet, 4)
        store = CompletionStore(store_dir)
        done_before = {r["prompt_id"]: shard for shard in store.shards() for r in store.records(shard)}
        sent_before = requests(fleet, 4)

        changed = {"priors": {"alpha": 40, "beta": 900, "gamma": 3000}, "training_set": True}
        second = layout(tmp_path, 3, {**spec, **changed})
        output = second.communicate(timeout=300)[0]
        assert second.returncode == 0, output[-3000:]
        sent_after = requests(fleet, 4)

    budget = pl.read_parquet(tmp_path / "storage" / "assets" / "budgeted_prompts.parquet")
    assert sorted(budget["shard"].unique()) == ["shard-00", "shard-01", "shard-02"]
    moved = [p for p, shard in zip(budget["prompt_id"], budget["shard"]) if done_before.get(p, shard) != shard]
    assert 0 < len(done_before) < PROMPTS
    assert moved, "no finished prompt changed shard: the new layout proves nothing"
    # Only the prompts without a completion were sent, wherever their completion was written.
    assert sent_after - sent_before == PROMPTS - len(done_before)
    assert CompletionStore(store_dir).scan().duplicates == 0
    ids = pq.read_table(data_files(tmp_path / "storage" / "training_set"), columns=["id"])["id"].to_pylist()
    assert sorted(ids) == sorted(frame()["prompt_id"].to_list())
    assert Manifest.read(tmp_path / "storage" / "training_set").simulated is True


if __name__ == "__main__":
    drive(json.loads(sys.argv[1]))
