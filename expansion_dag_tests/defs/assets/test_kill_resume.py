"""SIGKILL the run of a shard at random points, re-materialize it: every prompt ends once."""

import collections
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl

from expansion_dag.core import ENDINGS, base_prompt_id
from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag.store import CompletionStore
from expansion_dag_tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[3]
DAGSTER = str(Path(sys.executable).parent / "dagster")
SHARD = "shard-00"
#: The kill moments' seed: the same draws on every run, so a failure replays; KILL_SEED tries others.
KILL_SEED = 46


def dagster(args, env, **kw):
    # One process per run: the kill hits the run itself, and no step subprocess start-up is paid.
    in_process = Path(env["DAGSTER_HOME"]) / "in_process.yaml"
    in_process.write_text("execution:\n  config:\n    in_process: {}\n")
    return subprocess.Popen(
        [DAGSTER, *args, "-m", "expansion_dag.definitions", "-c", str(in_process)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # the run's step processes are in its group: kill them all
        **kw,
    )


def attached_env(tmp_path: Path, fleet: SimulatedFleet) -> dict[str, str]:
    """A fresh Dagster home and storage, the production profile attached to the simulated fleet."""
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "EXPANSION_"))},
        "DAGSTER_HOME": str(home),
        "EXPANSION_PROFILE": "production",
        "EXPANSION_FLEET_URLS": ",".join(fleet.urls),
        "EXPANSION_STORAGE": str(tmp_path / "storage"),
    }


def lines_in(store_dir: Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in store_dir.glob("seg-*.jsonl"))


def test_sigkill_at_random_points_then_resume_gives_every_prompt_once(tmp_path):
    seed = int(os.environ.get("KILL_SEED", KILL_SEED))
    rng = random.Random(seed)
    config = SimServerConfig(port=0, max_running_requests=8, ttft_s=0.01, token_latency_s=0.004,
                             output_median_tokens=150, output_sigma=0.6)
    with SimulatedFleet([config, config]) as fleet:
        env = attached_env(tmp_path, fleet)
        prepare = dagster(["job", "execute", "-j", "prepare_job"], env)
        assert prepare.wait(timeout=240) == 0, prepare.stdout.read()[-3000:]
        shard = pl.read_parquet(tmp_path / "storage" / "assets" / "budgeted_prompts.parquet").filter(
            pl.col("shard") == SHARD
        )
        store_dir = tmp_path / "storage" / "completions" / SHARD

        kills = 0
        for _ in range(3):
            run = dagster(["asset", "materialize", "--select", "shard_prompts,completions", "--partition", SHARD], env)
            start_lines = lines_in(store_dir)
            # Wait for this run to write something, then kill it a random moment later.
            wait_for(lambda: lines_in(store_dir) > start_lines or run.poll() is not None, "the run to write", 120)
            time.sleep(rng.uniform(0.0, 1.5))
            if run.poll() is not None:
                break
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
            kills += 1

        final = dagster(["asset", "materialize", "--select", "shard_prompts,completions", "--partition", SHARD], env)
        output = final.communicate(timeout=300)[0]
        assert final.returncode == 0, f"seed {seed}: " + output[-3000:]

    store = CompletionStore(tmp_path / "storage" / "completions")
    scan = store.scan(SHARD)
    records = list(store.latest_records(shards=[SHARD]))
    assert kills >= 1, f"seed {seed}: the shard finished before any kill"
    assert scan.duplicates == 0, f"seed {seed}"
    # Every prompt answered once; a conversation once a turn, to its last turn unless its content
    # ended it (a cut turn: the only failures there may be).
    turns = {
        row["prompt_id"]: 1 if row["conversation"] is None else sum(m["role"] == "assistant" for m in row["conversation"])
        for row in shard.iter_rows(named=True)
    }
    answered = collections.Counter(base_prompt_id(r) for r in records if r["status"] == "ok")
    ended = {base_prompt_id(r) for r in records if r["status"] != "ok"}
    assert all(r["error"] in ENDINGS for r in records if r["status"] != "ok"), f"seed {seed}"
    assert set(answered) == set(turns), f"seed {seed}"
    assert all(answered[p] == n or p in ended for p, n in turns.items()), f"seed {seed}"
    assert sum(answered.values()) == len(scan.done)


def test_interrupting_a_run_cancels_in_flight_requests_and_keeps_what_finished(tmp_path):
    """What terminating a run from the UI does: the step is interrupted mid-shard."""
    config = SimServerConfig(port=0, max_running_requests=8, ttft_s=0.01, token_latency_s=0.01,
                             output_median_tokens=150, output_sigma=0.3)
    with SimulatedFleet([config, config]) as fleet:
        env = attached_env(tmp_path, fleet)
        assert dagster(["job", "execute", "-j", "prepare_job"], env).wait(timeout=240) == 0
        store_dir = tmp_path / "storage" / "completions" / SHARD
        run = dagster(["asset", "materialize", "--select", "shard_prompts,completions", "--partition", SHARD], env)
        wait_for(lambda: lines_in(store_dir) >= 10, "the run to write 10 completions", 120)
        run.send_signal(signal.SIGINT)
        output = run.communicate(timeout=60)[0]
        stats = fleet.stats(0)

    store = CompletionStore(tmp_path / "storage" / "completions")
    scan = store.scan(SHARD)
    assert run.returncode != 0, output[-3000:]
    assert stats["aborted"] >= 1, output[-2000:]  # in-flight requests were cancelled at the server
    assert stats["num_running"] == 0
    assert len(scan.done) >= 10 and scan.torn_lines == 0 and scan.duplicates == 0
    assert len(list(store.records(SHARD))) == len(scan.done)
    # The shard's lease went with the run: the next run of the shard starts at once.
    assert not (tmp_path / "storage" / "leases" / f"{SHARD}.json").exists()
