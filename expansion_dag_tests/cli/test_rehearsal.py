"""The full-scale rehearsal script (bench/bench_rehearsal.py), run small: its accounting, not its speed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_rehearsal.py"
PROMPTS = 2000
# The module's one run (prepare, 8 shards, the training set) is set up by its first test.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    work = tmp_path_factory.mktemp("rehearsal")
    out = work / "result.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--prompts", str(PROMPTS), "--work-dir", str(work / "run"), "--json", str(out)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    log = work / "run" / "rehearsal.log"
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + (log.read_text()[-3000:] if log.exists() else "")
    return json.loads(out.read_text())


def test_every_prompt_is_completed_failed_or_set_aside(rehearsal):
    accounting = rehearsal["accounting"]
    assert accounting["prompts_selected"] == PROMPTS  # the catalog's quotas give exactly what was asked
    assert accounting["budgeted"] + accounting["set_aside_by_budget"] == PROMPTS
    assert accounting["completed"] + accounting["failed"] == accounting["budgeted"]
    assert accounting["neither"] == 0
    assert sum(accounting["failed_by_reason"].values()) == accounting["failed"]


def test_training_rows_are_exactly_the_completions_that_pass_the_policy(rehearsal):
    accounting = rehearsal["accounting"]
    assert accounting["training_rows_in_files"] == accounting["manifest_samples"] == accounting["completions_passing_policy"]
    assert 0 < accounting["completions_passing_policy"] <= accounting["completed"]
    # The manifest's reasons are those recounted from the store, reason by reason.
    recounted = accounting["left_out_recounted"]
    assert {k: v for k, v in accounting["left_out_manifest"].items() if v} == {k: v for k, v in recounted.items() if v}


def test_the_result_says_it_is_simulated_and_measures_every_stage(rehearsal):
    assert rehearsal["simulated"] is True and rehearsal["manifest"]["simulated"] is True
    assert set(rehearsal["stages"]) == {"prepare", "generate", "training_set"}
    assert all(stage["wall_s"] > 0 and stage["bytes_written"] > 0 for stage in rehearsal["stages"].values())
    # The output model is calibrated on the reference run: about 2,710 tokens per completion.
    per_completion = rehearsal["manifest"]["output_tokens"] / rehearsal["accounting"]["completed"]
    assert 2200 < per_completion < 3200
    assert 0 < rehearsal["manifest"]["useful_token_share"] <= 1
    # The engine's own CPU, from each shard's metadata, is a part of the shard processes' CPU.
    engine, accounting = rehearsal["stages"]["generate"]["engine"], rehearsal["accounting"]
    assert engine["shards"] == 8 and engine["requests"] == accounting["completed"] + accounting["failed"]
    assert 0 < engine["client_cpu_s"] < rehearsal["stages"]["generate"]["cpu_s"]


def test_a_shard_run_learns_from_every_completion_through_the_digests(rehearsal):
    reads = rehearsal["store_reads"]
    # Each completion of the store is learned from once, read from the segments' digests.
    assert reads["answers_learned"] == rehearsal["accounting"]["completed"]
    assert 0 < reads["shard_completions"] < reads["answers_learned"]
    assert all(reads[f"{label}_s"] > 0 for label in ("whole_records", "digests_built", "digests_kept"))
