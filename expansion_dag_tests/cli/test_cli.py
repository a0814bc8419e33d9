"""README command (1): `expansion-dag run` on a fresh folder, the way a new user runs it, and with
a run configuration file a user edited."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import datasets
import httpx
import pytest
import yaml

from expansion_dag.core import fleet_state_dir, pid_alive
from expansion_dag.servers import ServerRecord
from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag.store import CompletionStore
from expansion_dag.training import Manifest
from expansion_dag_tests.helpers import assert_the_demo_runs_succeeded
from expansion_dag_tests.ports import free_port

EXPANSION_DAG = str(Path(sys.executable).parent / "expansion-dag")


def clean_env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "EXPANSION_"))}
    return {**env, **{k: str(v) for k, v in extra.items()}}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    work = tmp_path_factory.mktemp("fresh")
    port = free_port(2)
    env = clean_env(EXPANSION_SIM_BASE_PORT=port)
    result = subprocess.run(
        [EXPANSION_DAG, "run"],
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
    # The demo's answers come from the simulator, and the summary says so.
    assert "training set (built from SIMULATED answers: not training data):" in result.stdout


def test_the_runs_are_in_the_dagster_instance(demo):
    work, _, _ = demo
    with dg.DagsterInstance.from_config(str(work / ".dagster_home")) as instance:
        assert_the_demo_runs_succeeded(instance)
        assert instance.get_latest_materialization_event(dg.AssetKey("training_set")) is not None


def test_the_demo_stops_the_simulated_fleet_it_launched(demo):
    _, port, result = demo
    assert "stopped 2 launched server(s)" in result.stdout
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health")


def test_the_demo_shows_the_fleets_progress_in_one_place_and_no_progress_bars(demo):
    _, _, result = demo
    assert "run configuration: " in result.stdout and "default.yaml" in result.stdout
    # Not a terminal: plain lines, each with every shard, no escape codes.
    progress = [line for line in result.stdout.splitlines() if line.startswith("progress: ")]
    assert progress and all("shard-00" in line and "shard-01" in line for line in progress)
    assert "\x1b[" not in result.stdout
    assert any("/s ETA " in line or " done " in line for line in progress), progress
    assert any(line.startswith("retries: ") for line in result.stdout.splitlines())
    # No bar from datasets or tqdm, no per-retry warning, no per-shard progress log line.
    assert "it/s]" not in result.stderr and "%|" not in result.stderr
    assert "retry" not in result.stderr.lower()


def test_the_demo_plans_with_no_throughput_then_measures_its_speed_and_says_when_it_will_end(demo):
    _, _, result = demo
    lines = result.stdout.splitlines()
    # The plan cannot know the speed of servers that have answered nothing: it says how the run will.
    assert "  time: no throughput yet: measured in the run's first minute from the tokens each server streams" in result.stdout
    speeds = [line for line in lines if line.startswith("speed: ") and " output tokens/s per server " in line]
    assert speeds, lines
    assert all("(simulator: not a GPU figure) measured on 2 server(s) [shard-0" in line for line in speeds)
    assert ": time to finish " in speeds[-1] and "GPU-hours for this run's prompts; the plan had no throughput" in speeds[-1]
    # The tokens left rest on what the answers taught, and say so.
    assert "'s tokens left: learned from " in speeds[-1] and " running at least their tokens so far" in speeds[-1]
    [said] = [line for line in lines if line.startswith("speed: said at ")]
    assert ", the shards would end at " in said and "; they ended at " in said


def test_a_dry_run_mirrors_a_real_fleet_on_simulators_in_its_own_storage(tmp_path):
    from expansion_dag.sim import SimServerConfig, SimulatedFleet

    # Stand-ins for a real fleet: the dry run only probes them. SGLang 0.5.8 returns no token ids,
    # so neither do the simulators mirroring it, and the rows are re-tokenized as the real run's would be.
    real = SimServerConfig(
        port=0, context_length=4096, max_running_requests=12, model_path="org/served-model", version="0.5.8"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "EXPANSION_"))}
    env["EXPANSION_SIM_BASE_PORT"] = str(free_port(2))
    with SimulatedFleet([real, real]) as fleet:
        result = subprocess.run(
            [str(Path(sys.executable).parent / "expansion-dag"), "dry-run", "--mirror", ",".join(fleet.urls)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540,
        )
        probed_by_dry_run = fleet.stats(0)["chat_requests_by_status"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "context 4096, slots [12], sglang 0.5.8 (token ids not returned" in result.stdout
    assert "SIMULATED servers with those settings, as sglang 0.5.8" in result.stdout
    manifest = Manifest.read(tmp_path / "storage-dry-run" / "training_set")
    assert manifest.samples > 0 and manifest.ids_from == {"server": 0, "retokenized": manifest.samples}
    assert manifest.retokenized_because == {"no_ids": manifest.samples}
    assert probed_by_dry_run == {}  # the real fleet got no generation request
    home = tmp_path / ".dagster_home"
    assert (tmp_path / "storage-dry-run" / "training_set" / "manifest.json").exists()
    assert not (tmp_path / "storage").exists()
    with dg.DagsterInstance.from_config(str(home)) as instance:
        event = instance.get_latest_materialization_event(dg.AssetKey("budgeted_prompts"))
        assert event.asset_materialization.metadata["context_length"].value == 4096
        assert "simulated" in event.asset_materialization.metadata["context_length_source"].value


def test_a_dry_run_mirrors_a_vllm_fleet_with_the_slots_its_configuration_gives():
    """vLLM reports no slots: the dry run probes the real servers with the configured ``fleet.slots``,
    as the run itself does, instead of failing on the probe the run would pass."""
    from expansion_dag.cli import mirrored_fleet
    from expansion_dag.config import parse_config

    config = parse_config({"fleet": {"backend": "vllm", "slots": 24}}, where="my-run.yaml", env={})
    with SimulatedFleet([SimServerConfig(port=0, backend="vllm", max_running_requests=24)]) as fleet:
        real = mirrored_fleet(config, fleet.urls, backend=None, api_key=None)
    assert [(s.backend, s.slots, s.slots_source) for s in real.servers] == [("vllm", 24, "configured: fleet.slots")]


#: Values a user edits in the file; the requests the fleet receives must carry them.
EDITED = {"temperature": 0.41, "max_output_tokens": 320, "chat_template_kwargs": {"enable_thinking": False}}


def write_config(path: Path, document: dict) -> Path:
    path.write_text(yaml.safe_dump(document))
    return path


def test_run_with_an_edited_file_sends_its_settings_to_its_fleet(tmp_path):
    fast = SimServerConfig(port=0, max_running_requests=16, ttft_s=0.0, token_latency_s=0.0002, output_median_tokens=60)
    with SimulatedFleet([fast, fast]) as fleet:
        config = write_config(tmp_path / "my-run.yaml", {
            "fleet": {"mode": "attach", "urls": fleet.urls},
            "storage": {"root": "my-storage"},
            # A throughput far above the simulators': the run's own measurement says the plan is off.
            "generation": {**EDITED, "backoff_initial_s": 0.01, "progress_interval_s": 0.5,
                           "plan_output_tokens_per_s": 10_000_000.0},
        })
        result = subprocess.run([EXPANSION_DAG, "run", "--config", str(config)], cwd=tmp_path, env=clean_env(),
                                capture_output=True, text=True, timeout=540)
        sent = [fleet.stats(i) for i in range(2)]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"run configuration: {config}" in result.stdout
    assert "at 10,000,000 output tokens/s each [setting: generation.plan_output_tokens_per_s; decode only]" in result.stdout
    assert "; the plan's 10,000,000 tokens/s is off by -" in result.stdout
    for stats in sent:
        assert stats["completed"] > 40
        request = stats["last_chat_request"]
        assert request["temperature"] == EDITED["temperature"]
        assert request["chat_template_kwargs"] == EDITED["chat_template_kwargs"]
        assert 0 < request["max_tokens"] <= EDITED["max_output_tokens"]
    assert (tmp_path / "my-storage" / "training_set" / "manifest.json").exists()
    with dg.DagsterInstance.from_config(str(tmp_path / ".dagster_home")) as instance:
        runs = instance.get_runs()
        assert len(runs) == 4 and {r.tags["expansion/config_file"] for r in runs} == {str(config)}
        record = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("completions"), asset_partitions=["shard-00"]), limit=1
        ).records[0]
        effective = record.asset_materialization.metadata["effective_config"].value
        assert effective["settings"]["temperature"] == EDITED["temperature"]
        assert effective["fleet_resource"]["urls"] == fleet.urls
        assert effective["run_configuration"]["file"] == str(config)
        # The shard's progress reached the instance while it ran, as observations.
        observed = instance.fetch_observations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("completions"), asset_partitions=["shard-00"]), limit=1
        ).records
        assert observed and observed[0].asset_observation.metadata["total"].value > 0


def sent(fleet: SimulatedFleet) -> tuple[int, int]:
    """(generation requests, answers made to loop) the fleet has had so far: answered, refused, or
    closed by the client (a stopped loop); the weights probes (the only greedy requests, which may
    loop too: ``helpers.prompts_answered``) left out."""
    stats = [fleet.stats(i) for i in range(len(fleet.urls))]
    requests = sum(sum(s["chat_requests_by_status"].values()) + s["aborted"] - s["greedy_requests"] for s in stats)
    return requests, sum(s["loops"] - s["greedy_loops"] for s in stats)


def test_a_fleet_whose_model_loops_on_a_tenth_of_prompts_finishes_and_asks_no_answer_twice(tmp_path):
    """A real model's behaviour: a tenth of the prompts loop every time they are asked, lengths follow
    the prompts' words, the servers' queues are bounded. Run, run again, then ask the loops again."""
    model = SimServerConfig(port=0, max_running_requests=8, max_queued_requests=4, ttft_s=0.0, token_latency_s=0.0002,
                            output_median_tokens=60, output_word_sigma=0.8, looping_prompt_share=0.1)
    with SimulatedFleet([model, model]) as fleet:
        config = write_config(tmp_path / "loops.yaml", {
            "fleet": {"mode": "attach", "urls": fleet.urls},
            "generation": {"backoff_initial_s": 0.01, "progress_interval_s": 0.5},
        })

        def run(*flags):
            result = subprocess.run([EXPANSION_DAG, "run", "--config", str(config), *flags], cwd=tmp_path,
                                    env=clean_env(), capture_output=True, text=True, timeout=540)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            return sent(fleet)

        first_requests, loops = run()
        assert loops > 5, "no prompt looped: the test proves nothing"
        # Every prompt has its final answer: the second run sends nothing at all.
        assert run() == (first_requests, loops)
        # Asked for, the loops (and only they) are sent again, and loop again.
        again_requests, again_loops = run("--retry-outcomes", "degenerate")
    assert again_loops == 2 * loops and again_requests == first_requests + loops
    store = CompletionStore(tmp_path / "storage" / "completions")
    latest = list(store.latest_records())
    assert sum(r["status"] == "failed" and r["error"] == "degenerate" for r in latest) == loops
    # The training set holds every other answer, and of each loop at most the text before it, cut
    # and counted apart (loop_prefix: keep); here none: the simulator's loops carry no reasoning
    # while its model thinks, and a conversation's turn keeps none, so each is left out as a loop.
    manifest = json.loads((tmp_path / "storage" / "training_set" / "manifest.json").read_text())
    assert manifest["left_out"]["degenerate"] + sum(manifest["loop_rows"].values()) == loops
    assert manifest["left_out"]["failed"] == 0
    # (A conversation's earlier turns are in its one row, folded.)
    folded = manifest["conversation_turns_folded"]
    assert manifest["samples"] == len(latest) - sum(manifest["left_out"].values()) - folded > 0


@pytest.mark.parametrize(
    "document, expected",
    [
        ({"generation": {"temprature": 0.5}}, "generation.temprature: unknown key (did you mean 'temperature'?)"),
        ({"fleet": {"shards": "eight"}}, "fleet.shards: Input should be a valid integer"),
    ],
)
def test_a_bad_file_stops_the_run_naming_the_key_and_the_file(tmp_path, document, expected):
    config = write_config(tmp_path / "bad.yaml", document)
    result = subprocess.run([EXPANSION_DAG, "run", "--config", str(config)], cwd=tmp_path, env=clean_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert str(config) in result.stderr and expected in result.stderr
    assert not (tmp_path / ".dagster_home").exists()  # nothing ran


def test_a_missing_file_is_an_error_not_the_default(tmp_path):
    result = subprocess.run([EXPANSION_DAG, "run", "--config", "nowhere.yaml"], cwd=tmp_path, env=clean_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "nowhere.yaml': no such file" in result.stderr


def slow_simulators(tmp_path: Path, port: int, extra: str = "") -> Path:
    """The demo's fleet, slowed down (a request takes seconds) so a run is still generating when signalled."""
    command = ("{python} -m expansion_dag.sim --model-path {model_path} --host {host} --port {port} "
               "--context-length {context_length} --max-running-requests 4 --token-latency-ms 100 "
               "--output-median-tokens 100 " + extra)
    return write_config(tmp_path / "slow.yaml", {
        "fleet": {"launch": {"command": command, "base_port": port}},
        "storage": {"root": str(tmp_path / "storage"), "local_dir": str(tmp_path / "local")},
        "generation": {"backoff_initial_s": 0.01, "max_attempts": 1},
    })


def fleet_records(tmp_path: Path) -> list[ServerRecord]:
    """The records of the servers launched for ``slow_simulators``' root, kept outside it."""
    state = Path(fleet_state_dir(str(tmp_path / "storage"), str(tmp_path / "local")))
    return [ServerRecord.read(p) for p in sorted(state.glob("server-*.json"))]


def launched_pids(tmp_path: Path) -> list[int]:
    return [record.pid for record in fleet_records(tmp_path)]


def generating(tmp_path: Path) -> bool:
    return any(p.stat().st_size for p in (tmp_path / "storage" / "completions").rglob("*.jsonl"))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signalled_run_stops_the_servers_it_launched(tmp_path, signum):
    port = free_port(2)
    config = slow_simulators(tmp_path, port)
    process = subprocess.Popen([EXPANSION_DAG, "run", "--config", str(config)], cwd=tmp_path, env=clean_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        # The servers are up and the shards are generating on them.
        while not (len(launched_pids(tmp_path)) == 2 and generating(tmp_path)):
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "the run never started generating"
            time.sleep(0.5)
        pids = launched_pids(tmp_path)
        assert all(pid_alive(pid) for pid in pids)
        process.send_signal(signum)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 128 + signum, output[-3000:]
    assert f"interrupted by {signal.Signals(signum).name}" in output
    assert "stopped 2 launched server(s)" in output
    # A stopped server that the machine's init has yet to reap is a zombie, not a server: the
    # launcher's own test of life says so (an os.kill(pid, 0) still finds it).
    assert not [pid for pid in pids if pid_alive(pid)]
    # The shards' leases went with their runs: the next run starts at once.
    assert not list((tmp_path / "storage" / "leases").glob("*.json"))
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health")


def test_a_failed_run_stops_the_servers_it_launched(tmp_path):
    port = free_port(2)
    config = slow_simulators(tmp_path, port, extra="--fail-rate 1.0")  # every generation request fails
    result = subprocess.run([EXPANSION_DAG, "run", "--config", str(config)], cwd=tmp_path, env=clean_env(),
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 shard(s) failed" in result.stdout
    assert "stopped 2 launched server(s)" in result.stdout
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health")
