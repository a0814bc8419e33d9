"""One shard, one sender, whoever starts the second run: two `expansion-dag run` at once, a CLI run
and a Dagster run of one shard, a run SIGKILLed mid-shard and the next one (on a local root and on
S3). Every prompt reaches a server once, by the servers' own counts; the store holds no duplicate.

To hold the first run mid-shard while the second one starts, the first is stopped (SIGSTOP: a
process stuck but alive) once it holds the shards' leases, and let go once the second has said
that it waits: the overlap is certain, whatever the machine's speed.
"""

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import dagster as dg
import polars as pl
import pytest
import yaml

from expansion_dag.core import as_upath
from expansion_dag.defs import SHARD_KEYS
from expansion_dag.defs.assets import budgeted_prompts, completions, shard_prompts
from expansion_dag.defs.resources import StorageResource
from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag.store import LEASES, CompletionStore, conditional_file
from expansion_dag_tests.defs.assets.test_completions import (
    FAST_SIM,
    evaluation_of,
    prompts_asset,
    small_frame,
)
from expansion_dag_tests.defs.assets.test_kill_resume import dagster
from expansion_dag_tests.helpers import answered_prompts, requests_per_prompt, resources, wait_for

EXPANSION_DAG = str(Path(sys.executable).parent / "expansion-dag")
#: Answers of about a second each on 4 slots: a shard lasts seconds, long enough to be held mid-way.
SLOW_SIM = SimServerConfig(port=0, max_running_requests=4, ttft_s=0.0, token_latency_s=0.02, output_median_tokens=50)
#: A few prompts and tool conversations, from the bundled samples.
CATALOG = {
    "seed": 0,
    "local_root": "bundled",
    "defaults": {"split": "train"},
    "sources": [
        {"name": "infinity_instruct", "hub_id": "BAAI/Infinity-Instruct", "config": "0625",
         "local_path": "infinity_instruct/{config}/*.parquet", "extractor": "infinity_instruct", "quota": 14},
        {"name": "hermes_fc", "hub_id": "NousResearch/hermes-function-calling-v1", "config": "func_calling",
         "local_path": "hermes_function_calling/{config}.json", "extractor": "hermes_function_calling",
         "conversation": True, "quota": 4},
    ],
}


def run_config(tmp_path: Path, urls: list[str], root: str) -> Path:
    (tmp_path / "catalog.yaml").write_text(yaml.safe_dump(CATALOG))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "fleet": {"mode": "attach", "urls": urls},
        "catalog": str(tmp_path / "catalog.yaml"),
        # A timeout no test reaches: a take-over here is the dead process's, at once.
        "storage": {"root": root, "local_dir": str(tmp_path / "machine"), "lease_timeout_s": 3600},
        "generation": {"backoff_initial_s": 0.01},
    }))
    return path


def environment(tmp_path: Path, config: Path, home: str = ".dagster_home") -> dict[str, str]:
    """A process's environment: the run configuration, and the Dagster instance in ``tmp_path / home``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "EXPANSION_"))}
    (tmp_path / home).mkdir(exist_ok=True)
    return {**env, "EXPANSION_CONFIG": str(config), "DAGSTER_HOME": str(tmp_path / home)}


def start_cli(tmp_path: Path, config: Path, name: str) -> tuple[subprocess.Popen, Path]:
    """`expansion-dag run` in its own process group, its output in a file read while it runs, its
    Dagster instance its own (a run stopped in a write to a shared SQLite one would hold the other)."""
    out = tmp_path / f"{name}.log"
    process = subprocess.Popen([EXPANSION_DAG, "run", "--config", str(config)], cwd=tmp_path,
                               env=environment(tmp_path, config, home=f"{name}-home"), stdout=out.open("w"),
                               stderr=subprocess.STDOUT, start_new_session=True)
    return process, out


def reading(process: subprocess.Popen) -> Callable[[], str]:
    """The output of a `dagster` command so far, read by a thread so that its pipe never fills."""
    lines: list[str] = []

    def read() -> None:
        for line in process.stdout:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    return lambda: "".join(lines)


def holders(root: str) -> dict[str, str]:
    """The run id holding each shard's lease now."""
    found = {}
    for shard in SHARD_KEYS:
        seen = conditional_file(as_upath(root) / LEASES / f"{shard}.json").read()
        if seen is not None:
            found[shard] = json.loads(seen.data)["run_id"]
    return found


def requests(fleet: SimulatedFleet) -> int:
    """Generation requests the servers received: answered, refused, or closed by the client; the
    weights probes (the only greedy ones: ``helpers.prompts_answered``) left out."""
    stats = [fleet.stats(i) for i in range(len(fleet.urls))]
    return sum(sum(s["chat_requests_by_status"].values()) + s["aborted"] - s["greedy_requests"] for s in stats)


def every_request_answered_once(root: str, tmp_path: Path, shards=SHARD_KEYS) -> int:
    """Each budgeted prompt answered once (a conversation once a turn) and no key twice; the records."""
    store = CompletionStore(as_upath(root) / "completions", local_dir=tmp_path / "machine")
    with (as_upath(root) / "assets" / "budgeted_prompts.parquet").open("rb") as fh:
        budgeted = pl.read_parquet(fh)
    expected = requests_per_prompt(budgeted.filter(pl.col("shard").is_in(list(shards))))
    records = [r for shard in shards for r in store.records(shard)]
    assert store.scan().duplicates == 0 and not store.scan().failed
    assert answered_prompts(records) == expected
    return len(records)


def stopped_while(process: subprocess.Popen, until) -> None:
    """Hold ``process``'s group stopped (alive, silent) until ``until()`` holds."""
    os.killpg(process.pid, signal.SIGSTOP)
    try:
        wait_for(until, "the second sender to say it waits", timeout_s=300)
    finally:
        os.killpg(process.pid, signal.SIGCONT)


def test_two_cli_runs_at_once_send_every_prompt_once_and_the_second_says_who_holds_the_shards(tmp_path):
    root = str(tmp_path / "storage")
    with SimulatedFleet([SLOW_SIM, SLOW_SIM]) as fleet:
        config = run_config(tmp_path, fleet.urls, root)
        first, _ = start_cli(tmp_path, config, "first")
        held = wait_for(lambda: len(holders(root)) == 2 and holders(root), "the first run to hold both shards", 300)
        second, second_log = start_cli(tmp_path, config, "second")
        stopped_while(first, lambda: all(f"{s} is being generated by run {run} on host" in second_log.read_text()
                                         for s, run in held.items()))
        assert first.wait(timeout=540) == 0, (tmp_path / "first.log").read_text()[-3000:]
        assert second.wait(timeout=540) == 0, second_log.read_text()[-3000:]
        sent = requests(fleet)
    assert sent == every_request_answered_once(root, tmp_path)
    assert holders(root) == {}  # both released


def test_a_cli_run_and_a_dagster_run_of_one_shard_send_every_prompt_once(tmp_path):
    root = str(tmp_path / "storage")
    with SimulatedFleet([SLOW_SIM, SLOW_SIM]) as fleet:
        config = run_config(tmp_path, fleet.urls, root)
        cli, _ = start_cli(tmp_path, config, "cli")
        held = wait_for(lambda: holders(root).get("shard-00"), "the CLI run to hold shard-00", 300)
        # A Dagster instance of its own, as another host's (see start_cli).
        ui = dagster(["asset", "materialize", "--select", "shard_prompts,completions", "--partition", "shard-00"],
                     environment(tmp_path, config, home="other-host"))
        output = reading(ui)
        stopped_while(cli, lambda: f"shard-00 is being generated by run {held} on host" in output())
        assert cli.wait(timeout=540) == 0, (tmp_path / "cli.log").read_text()[-3000:]
        assert ui.wait(timeout=540) == 0, output()[-3000:]
        sent = requests(fleet)
    assert sent == every_request_answered_once(root, tmp_path)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_run_sigkilled_mid_shard_is_taken_over_at_once_and_no_answer_is_stored_twice(where, tmp_path, request):
    root = str(tmp_path / "storage") if where == "local" else f"s3://{request.getfixturevalue('bucket')}/storage"
    written = tmp_path / ("storage" if where == "local" else "machine")  # a local root, or the spool
    with SimulatedFleet([SLOW_SIM, SLOW_SIM]) as fleet:
        env = environment(tmp_path, run_config(tmp_path, fleet.urls, root))
        prepare = dagster(["job", "execute", "-j", "prepare_job"], env)
        prepared = reading(prepare)
        assert prepare.wait(timeout=300) == 0, prepared()[-3000:]
        shard = ["asset", "materialize", "--select", "shard_prompts,completions", "--partition", "shard-00"]
        killed = dagster(shard, env)
        reading(killed)
        wait_for(lambda: any(p.read_bytes().count(b"\n") for p in written.rglob("seg-*.jsonl")),
                 "the run's first answer", 300)
        holder = holders(root)["shard-00"]
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
        # The lease is still the killed run's: nobody released it.
        assert holders(root) == {"shard-00": holder}
        after = dagster(shard, env)
        output = after.communicate(timeout=300)[0]
    assert after.returncode == 0, output[-3000:]
    assert f"took over the lease {as_upath(root) / LEASES / 'shard-00.json'} from run {holder}" in output
    assert "on this machine is gone" in output
    every_request_answered_once(root, tmp_path, shards=["shard-00"])


def budgeted(fleet: SimulatedFleet, tmp_path: Path, instance) -> tuple[dict, list]:
    """A few prompts budgeted into shards, in process: the resources and assets to run a shard with."""
    res = resources(fleet.urls, tmp_path)
    assets = [prompts_asset(small_frame()), budgeted_prompts, shard_prompts, completions]
    prepared = dg.materialize(assets, resources=res, instance=instance, selection=["prompts", "budgeted_prompts"])
    assert prepared.success
    return res, assets


def test_told_not_to_wait_a_run_fails_at_once_naming_the_holder(tmp_path, instance):
    with SimulatedFleet([SimServerConfig(**FAST_SIM)] * len(SHARD_KEYS)) as fleet:
        res, assets = budgeted(fleet, tmp_path, instance)
        res["storage"] = StorageResource(root=str(tmp_path), when_shard_busy="fail")
        with res["storage"].shard_lease("shard-00", run_id="run-holding", log=dg.get_dagster_logger()):
            result = dg.materialize(assets, resources=res, instance=instance, partition_key="shard-00",
                                    selection=["shard_prompts", "completions"], raise_on_error=False)
        assert requests(fleet) == 0
    assert not result.success
    [failure] = [e for e in result.all_events if e.is_step_failure]
    message = failure.event_specific_data.error.cause.message  # the step's error: ShardBusy
    assert "shard-00 is being generated by run run-holding on host" in message and "not waiting" in message


def test_an_answer_stored_twice_is_a_warning_check_with_its_count(tmp_path, instance):
    with SimulatedFleet([SimServerConfig(**FAST_SIM)] * len(SHARD_KEYS)) as fleet:
        res, assets = budgeted(fleet, tmp_path, instance)

        def materialize_shard():
            result = dg.materialize(assets, resources=res, instance=instance, partition_key="shard-00",
                                    selection=["shard_prompts", "completions"])
            assert result.success
            return evaluation_of(result, "no_duplicate_completions")

        clean = materialize_shard()
        # What two senders of one shard leave: a second segment answering a key again.
        folder = tmp_path / "completions" / "shard-00"
        [segment] = folder.glob("seg-*.jsonl")
        first_line = segment.read_bytes().splitlines(keepends=True)[0]
        (folder / "seg-99990101T000000-0-dup-000001.jsonl").write_bytes(first_line)
        doubled = materialize_shard()
    assert clean.passed and clean.metadata["duplicate_completions"].value == 0
    assert not doubled.passed and doubled.severity == dg.AssetCheckSeverity.WARN
    assert doubled.metadata["duplicate_completions"].value == 1
