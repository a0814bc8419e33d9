"""Secrets stay out of what others can read: a launched server's command line (any user of the machine
reads it with ``ps``), its log from the first line, the completion records, the run's logs and
metadata. Launched SGLang servers read the key from a file only this user can read, removed once
they are ready; vLLM servers from their environment."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest

from expansion_dag.config import SIMULATOR_LAUNCH_COMMAND
from expansion_dag.core import FleetError
from expansion_dag.defs import SHARD_KEYS
from expansion_dag.defs.assets import budgeted_prompts, completions, shard_prompts
from expansion_dag.defs.resources import FleetResource
from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag_tests.helpers import command_lines_holding, prompt_frame, prompts_asset, resources
from expansion_dag_tests.ports import free_ports

KEY = "sk-launch-7d1e0c94a2"
#: Shows, in the server's log before it starts, the mode of the file it was handed and what it says.
SHOWS_ITS_KEY_FILE = "sh -c 'stat -c \"key file mode %a\" {api_key_file} && cat {api_key_file} && exec \"$0\" \"$@\"' "


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
def test_a_launched_server_gets_its_key_off_its_command_line_and_out_of_its_log(tmp_path, monkeypatch, backend):
    monkeypatch.setenv("SGLANG_API_KEY", KEY)
    [port] = free_ports(1)
    command = SIMULATOR_LAUNCH_COMMAND + (" --backend vllm" if backend == "vllm" else "")
    fleet = FleetResource(
        mode="launch", backend=backend, launch_command=command, num_servers=1, base_port=port,
        state_dir=str(tmp_path), startup_timeout_s=60, slots_override=4 if backend == "vllm" else None,
    )
    if backend == "sglang":
        fleet = FleetResource(**{**fleet.model_dump(), "launch_command": SHOWS_ITS_KEY_FILE + fleet.command()})
    try:
        # The probe fails unless the server wants the key, and answers with the one it was given.
        info = fleet.provision()
        record = (tmp_path / f"server-{port}.json").read_text()
        pid = json.loads(record)["pid"]
        assert KEY not in record  # the launch command it keeps names the key's file, never the key
        assert Path(f"/proc/{pid}").exists() and info.servers[0].backend == backend
        assert command_lines_holding(KEY) == []
        assert not list(tmp_path.glob("*.key.yaml"))  # read at start-up, then removed
    finally:
        assert fleet.stop() == [pid]
    log = (tmp_path / f"server-{port}.log").read_text()
    assert KEY not in log and "fired up and ready to roll" in log
    if backend == "sglang":
        assert log.startswith('key file mode 600\napi-key: "***"\n')  # masked from the first line


def test_a_launch_command_that_puts_the_key_on_the_command_line_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_API_KEY", KEY)
    [port] = free_ports(1)
    for placed in ("--api-key {api_key}", "--api-key=sk-written-in-the-file"):
        fleet = FleetResource(mode="launch", launch_command=f"{SIMULATOR_LAUNCH_COMMAND} {placed}",
                              num_servers=1, base_port=port, state_dir=str(tmp_path))
        with pytest.raises(FleetError, match=r"puts the API key on the server's command line, where every user"):
            fleet.provision()
    assert not list(tmp_path.glob("server-*.json"))  # nothing was started


def test_a_servers_password_is_in_no_record_log_or_metadata(tmp_path, instance):
    password = "hunter2-pw"
    frame = prompt_frame([f"Explain idea number {i} in a few words." for i in range(6)])
    sim = SimServerConfig(port=0, max_running_requests=4, ttft_s=0.0, token_latency_s=0.0001, output_median_tokens=20)
    with SimulatedFleet([sim] * len(SHARD_KEYS)) as fleet:
        urls = [u.replace("http://", f"http://ops:{password}@") for u in fleet.urls]
        res = resources(urls, tmp_path)
        assets = [prompts_asset(frame), budgeted_prompts, shard_prompts, completions]
        runs = [dg.materialize(assets, resources=res, instance=instance, selection=["prompts", "budgeted_prompts"])]
        runs += [dg.materialize(assets, resources=res, instance=instance, partition_key=key,
                                selection=["shard_prompts", "completions"]) for key in SHARD_KEYS]
    assert all(r.success for r in runs)
    store = res["storage"].completion_store()
    records = [r for key in SHARD_KEYS for r in store.records(key)]
    assert len(records) == frame.height and {r["server"] for r in records} <= set(fleet.urls)
    assert password not in "".join(path.read_text() for path in (tmp_path / "completions").rglob("*.jsonl"))
    logs = [entry.user_message for run in runs for entry in instance.all_logs(run.run_id)]
    assert any(fleet.urls[0] in message for message in logs) and not any(password in m for m in logs)
    metadata = [m.metadata for run in runs for node in ("budgeted_prompts", "completions")
                for m in run.asset_materializations_for_node(node)]
    assert fleet.urls[0] in json.dumps([{k: str(v.value) for k, v in m.items()} for m in metadata], default=str)
    assert password not in json.dumps([{k: str(v.value) for k, v in m.items()} for m in metadata], default=str)
