"""README command (1): `expansion-dag run` on a fresh folder, the way a new user runs it."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import dagster as dg
import datasets
import httpx
import pytest


def free_port_pair():
    # Two consecutive free ports for the two simulated servers.
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    work = tmp_path_factory.mktemp("fresh")
    port = free_port_pair()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "EXPANSION_"))}
    env["EXPANSION_SIM_BASE_PORT"] = str(port)
    result = subprocess.run(
        [str(Path(sys.executable).parent / "expansion-dag"), "run"],
        cwd=work, env=env, capture_output=True, text=True, timeout=540,
    )
    return work, port, result


def test_the_demo_materializes_every_asset_and_every_shard(demo):
    work, _, result = demo
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for line in ("prepare_job run", "generate_job[shard-00] run", "generate_job[shard-01] run", "training_set_job run"):
        assert any(l.startswith(line) and l.endswith("success") for l in result.stdout.splitlines()), line
    files = sorted((work / "storage" / "training_set").glob("part-*.parquet"))
    assert files
    rows = datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train")
    assert rows.num_rows > 100
    assert {"input_ids", "loss_mask"} <= set(rows.column_names)
    assert all(0 < sum(m) < len(m) for m in rows["loss_mask"][:20])


def test_the_runs_are_in_the_dagster_instance(demo):
    work, _, _ = demo
    with dg.DagsterInstance.from_config(str(work / ".dagster_home")) as instance:
        runs = instance.get_runs()
        assert sorted(r.job_name for r in runs) == ["generate_job", "generate_job", "prepare_job", "training_set_job"]
        assert all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs)
        for shard in ("shard-00", "shard-01"):
            records = instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=dg.AssetKey("completions"), asset_partitions=[shard]), limit=1
            ).records
            assert records and records[0].asset_materialization.metadata["completions_total"].value > 40
        assert instance.get_latest_materialization_event(dg.AssetKey("training_set")) is not None


def test_the_demo_stops_the_simulated_fleet_it_launched(demo):
    _, port, result = demo
    assert "stopped 2 launched server(s)" in result.stdout
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health")


def test_a_dry_run_mirrors_a_real_fleet_on_simulators_in_its_own_storage(tmp_path):
    from expansion_dag.sim.config import SimServerConfig
    from expansion_dag.sim.fleet import SimulatedFleet

    # Stand-ins for a real fleet: the dry run only probes them.
    real = SimServerConfig(port=0, context_length=4096, max_running_requests=12, model_path="org/served-model")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "EXPANSION_"))}
    env["EXPANSION_SIM_BASE_PORT"] = str(free_port_pair())
    with SimulatedFleet([real, real]) as fleet:
        result = subprocess.run(
            [str(Path(sys.executable).parent / "expansion-dag"), "dry-run", "--mirror", ",".join(fleet.urls)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540,
        )
        probed_by_dry_run = fleet.stats(0)["chat_requests_by_status"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "context 4096, slots [12]" in result.stdout and "SIMULATED" in result.stdout
    assert probed_by_dry_run == {}  # the real fleet got no generation request
    home = tmp_path / ".dagster_home"
    assert (tmp_path / "storage-dry-run" / "training_set" / "manifest.json").exists()
    assert not (tmp_path / "storage").exists()
    with dg.DagsterInstance.from_config(str(home)) as instance:
        event = instance.get_latest_materialization_event(dg.AssetKey("budgeted_prompts"))
        assert event.asset_materialization.metadata["context_length"].value == 4096
        assert "simulated" in event.asset_materialization.metadata["context_length_source"].value
