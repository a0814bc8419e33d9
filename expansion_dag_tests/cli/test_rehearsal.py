"""The reference run rehearsed small on the simulator, as ``bench/bench_rehearsal.py`` runs it at full
size: its inputs from ``expansion_dag_tests.workloads.rehearsal``, the command's own sequence
(``run_expansion``) in a process of its own. Its accounting, not its speed."""

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import polars as pl
import pyarrow.parquet as pq
import pytest
import yaml

from expansion_dag.cli import STAGES
from expansion_dag.config import load_config
from expansion_dag.core import OK, ModeIdentities, load_tokenizer
from expansion_dag.generation import ShardWork, learn, shard_figures
from expansion_dag_tests.workloads.rehearsal import MEAN_OUTPUT_TOKENS, write_config, write_sources
from expansion_dag.store import CompletionStore
from expansion_dag.training import Manifest, current_version, data_files
from expansion_dag_tests.ports import free_port

PROMPTS = 2000
SERVERS = 8
# The module's one run (prepare, 8 shards, the training set) is set up by its first test.
pytestmark = pytest.mark.timeout(900)
#: The run as ``expansion-dag run`` makes it, each step named as it ends with what the storage holds then.
RUN = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from expansion_dag.cli import run_expansion

    config, storage, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    ended = []

    def stage(name, step):
        result = step()
        ended.append([name, sorted(p.name for p in storage.iterdir())])
        return result

    status = run_expansion(config, stage=stage)
    out.write_text(json.dumps(ended))
    sys.exit(status)
""")


@dataclass
class Rehearsal:
    storage: Path
    home: Path  # the Dagster instance's
    stages: list
    store: CompletionStore
    manifest: Manifest
    identities: ModeIdentities
    budgeted: pl.DataFrame
    standing: list  # each budgeted prompt's latest record: a conversation's furthest turn's


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    work = tmp_path_factory.mktemp("rehearsal")
    inputs = write_sources(work / "sources", PROMPTS, 0, load_tokenizer().get_vocab())
    config = write_config(work, inputs["catalog"], servers=SERVERS, slots=72, base_port=free_port(SERVERS),
                          ttft_ms=1.0, token_latency_ms=1.0)  # fmt: skip
    storage = Path(yaml.safe_load(config.read_text())["storage"]["root"])
    storage.mkdir(parents=True)
    ended, home = work / "stages.json", work / "home"
    done = subprocess.run(
        [sys.executable, "-c", RUN, str(config), str(storage), str(ended)],
        cwd=work, env={**_clean_env(), "DAGSTER_HOME": str(home)}, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    store = CompletionStore(storage / "completions")
    manifest = Manifest.read(current_version(storage / "training_set"))
    mix = load_config(str(config)).generation.mix()
    identities = ModeIdentities(mix, manifest.identity["model"], manifest.simulated)
    budgeted = pl.read_parquet(storage / "assets" / "budgeted_prompts.parquet")
    keys = ShardWork(budgeted, identities, retry_outcomes=()).frontier_keys(store.latest_records(digest=True))
    standing = [r for r in store.latest_records(digest=True) if r["key"] in keys]
    assert len(standing) == len(keys), "a prompt has no record: it was neither answered nor failed"
    return Rehearsal(storage, home, json.loads(ended.read_text()), store, manifest, identities, budgeted, standing)


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "EXPANSION_"))}


def test_the_run_is_the_commands_three_steps_in_order_each_leaving_its_output(rehearsal):
    assert [name for name, _ in rehearsal.stages] == list(STAGES)
    held = {name: set(folders) for name, folders in rehearsal.stages}
    assert "assets" in held["prepare"] and "completions" not in held["prepare"]
    assert "completions" in held["generate"] and "training_set" not in held["generate"]
    assert "training_set" in held["training_set"]


def test_every_prompt_is_completed_failed_or_set_aside(rehearsal):
    prompts = pl.read_parquet(rehearsal.storage / "assets" / "prompts.parquet")
    set_aside = pl.read_parquet(rehearsal.storage / "set_aside" / "budgeted_prompts.parquet")
    assert prompts.height == PROMPTS  # the catalog's quotas give exactly what was asked
    assert rehearsal.budgeted.height + set_aside.height == PROMPTS
    assert len(rehearsal.standing) == rehearsal.budgeted.height
    assert all(r["status"] == OK or r.get("error") for r in rehearsal.standing), "a failure without its reason"


def test_training_rows_are_exactly_the_complete_answers(rehearsal):
    endings = Counter(r["finish_reason"] if r["status"] == OK else "failed" for r in rehearsal.standing)
    rows = sum(pq.read_metadata(path).num_rows for path in data_files(rehearsal.storage / "training_set"))
    assert rows == rehearsal.manifest.samples == endings["stop"] > 0
    # Every other answer is left out, and said so: here the answers cut at the cap.
    assert endings["length"] > 0, "no answer reached the cap: the rehearsal leaves nothing out"
    assert {k: v for k, v in rehearsal.manifest.left_out.items() if v} == {"truncated": endings["length"]}


def test_the_answers_average_the_reference_runs_length(rehearsal):
    manifest = rehearsal.manifest
    assert manifest.simulated is True
    assert 0.8 < manifest.output_tokens / len(rehearsal.standing) / MEAN_OUTPUT_TOKENS < 1.2
    assert 0 < manifest.useful_token_share <= 1


def test_each_shard_reports_every_request_it_sent(rehearsal):
    with dg.DagsterInstance.from_config(str(rehearsal.home)) as instance:
        records = instance.fetch_materializations(dg.AssetKey("completions"), limit=100).records
    metadata = [r.asset_materialization.metadata for r in records]
    assert len(metadata) == SERVERS
    assert sum(m["sent_this_run"].value for m in metadata) == len(rehearsal.standing)
    assert all(m["client_cpu_s"].value > 0 for m in metadata)


def test_a_shard_run_learns_from_every_completion_through_the_digests(rehearsal):
    owns, store = rehearsal.identities.owns, rehearsal.store
    completed = sum(r["status"] == OK for r in rehearsal.standing)
    assert learn(store.latest_records(digest=True), owns).answers == completed
    assert learn(store.latest_records(), owns).answers == completed  # each record's whole JSON: the same
    shard = rehearsal.budgeted.filter(pl.col("shard") == "shard-00")
    keys = ShardWork(shard, rehearsal.identities, retry_outcomes=()).frontier_keys(store.latest_records(digest=True))
    figures = shard_figures(store.latest_records(shards=["shard-00"], digest=True), keys, owns, store.scan().done)
    assert 0 < figures.ok == sum(r["status"] == OK for r in rehearsal.standing if r["key"] in keys) < completed
