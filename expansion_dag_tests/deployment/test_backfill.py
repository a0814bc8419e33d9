"""A backfill of every shard launched the way the UI launches it, through `dagster dev` and its
daemon; shard-01's server dies mid-shard; after a restart, "re-execute from failure" completes it
without sending any prompt twice. The scenario itself is the `ui_pipeline` fixture (conftest.py).
"""

import polars as pl
import pytest

from expansion_dag.core import ENDINGS, base_prompt_id
from expansion_dag.store import CompletionStore
from expansion_dag.training import Manifest
from expansion_dag_tests.helpers import answered_prompts, requests_per_prompt

pytestmark = pytest.mark.timeout(600)


def runs_by_partition(backfill: dict) -> dict[str, list[str]]:
    runs: dict[str, list[str]] = {}
    for run in backfill["runs"]:
        partition = next(t["value"] for t in run["tags"] if t["key"] == "dagster/partition")
        runs.setdefault(partition, []).append(run["status"])
    return runs


def shard_01_prompts(storage) -> dict[str, int]:
    """shard-01's prompts, each with its requests (a conversation's turns, or one)."""
    budgeted = pl.read_parquet(storage / "assets" / "budgeted_prompts.parquet")
    return requests_per_prompt(budgeted.filter(pl.col("shard") == "shard-01"))


def test_the_server_died_in_the_middle_of_its_shard(ui_pipeline):
    assert 0 < ui_pipeline.done_at_kill < sum(shard_01_prompts(ui_pipeline.storage).values())


def test_the_backfill_fails_only_the_shard_whose_server_died(ui_pipeline):
    first = ui_pipeline.first_backfill
    assert first["status"] == "COMPLETED_FAILED"
    assert runs_by_partition(first) == {"shard-00": ["SUCCESS"], "shard-01": ["FAILURE"]}
    assert ui_pipeline.after_first["materializedPartitions"] == ["shard-00"]
    assert ui_pipeline.after_first["failedPartitions"] == ["shard-01"]


def test_re_execution_from_failure_runs_only_the_failed_shard_and_completes_every_shard(ui_pipeline):
    second = ui_pipeline.second_backfill
    assert second["status"] == "COMPLETED_SUCCESS"
    assert runs_by_partition(second) == {"shard-01": ["SUCCESS"]}
    assert sorted(ui_pipeline.after_second["materializedPartitions"]) == ["shard-00", "shard-01"]
    assert ui_pipeline.after_second["failedPartitions"] == []
    assert ui_pipeline.training_run == "SUCCESS"


def test_the_set_assembles_the_parts_each_shards_own_run_built(ui_pipeline):
    parts = ui_pipeline.parts_backfill
    assert parts["status"] == "COMPLETED_SUCCESS"
    assert runs_by_partition(parts) == {"shard-00": ["SUCCESS"], "shard-01": ["SUCCESS"]}
    manifest = Manifest.read(ui_pipeline.storage / "training_set")
    assert manifest.parts["built"] == 0 and manifest.parts["reused"] == manifest.parts["parts"] >= 2


def test_the_failed_shard_holds_each_of_its_prompts_exactly_once(ui_pipeline):
    store = CompletionStore(ui_pipeline.storage / "completions")
    scan = store.scan("shard-01")
    records = list(store.records("shard-01"))
    assert scan.duplicates == 0
    # Every request once: each prompt's, or each turn of a conversation, unless its content ended it.
    ended = {base_prompt_id(r) for r in store.latest_records(shards=["shard-01"]) if r["status"] != "ok"}
    assert all(r["error"] in ENDINGS for r in store.latest_records(shards=["shard-01"]) if r["status"] != "ok")
    expected = shard_01_prompts(ui_pipeline.storage)
    answered = answered_prompts(records)
    assert set(answered) == set(expected)
    assert all(answered[p] == n or p in ended for p, n in expected.items())
    # No fallback: every answer came from the shard's own server, before and after its restart.
    assert {r["server"] for r in records} == {ui_pipeline.urls[1]}


def test_the_re_execution_reused_the_completions_of_the_failed_run(ui_pipeline):
    data = ui_pipeline.dev.graphql(
        "query($k: AssetKeyInput!, $p: [String!]!) { assetNodeOrError(assetKey: $k) { ... on AssetNode { "
        "latestMaterializationByPartition(partitions: $p) { metadataEntries { label "
        "... on IntMetadataEntry { intValue } } } } } }",
        k={"path": ["completions"]},
        p=["shard-01"],
    )
    (materialization,) = data["assetNodeOrError"]["latestMaterializationByPartition"]
    metadata = {e["label"]: e.get("intValue") for e in materialization["metadataEntries"]}
    assert metadata["completed_before_this_run"] >= ui_pipeline.done_at_kill
    assert metadata["completions_total"] == len(shard_01_prompts(ui_pipeline.storage))
    assert metadata["duplicate_lines_ignored"] == 0


def test_each_shard_shows_its_own_checks_on_its_own_partition(ui_pipeline):
    """As the UI reads them: shard-01's failure rate failed on its failed step, shard-00's passed."""
    checks = ui_pipeline.checks_after_first
    assert checks["failure_rate"]["blocking"] and checks["no_context_length_rejections"]["blocking"]
    assert checks["failure_rate"]["failedPartitions"] == ["shard-01"]
    assert checks["failure_rate"]["succeededPartitions"] == ["shard-00"]
    # Each partition's result came from that shard's own run of the first backfill.
    runs = {run["runId"]: next(t["value"] for t in run["tags"] if t["key"] == "dagster/partition")
            for run in ui_pipeline.first_backfill["runs"]}  # fmt: skip
    first = [e for e in ui_pipeline.dev.check_executions("completions", "failure_rate") if e["runId"] in runs]
    assert sorted((e["partition"], runs[e["runId"]], e["evaluation"]["success"]) for e in first) == [
        ("shard-00", "shard-00", True), ("shard-01", "shard-01", False),
    ]


def test_the_training_set_is_blocked_by_the_failed_shard_and_says_which(ui_pipeline):
    status, errors = ui_pipeline.blocked_training
    assert status == "FAILURE"
    assert any("blocked by the failed checks of shard-01: failure_rate" in message for message in errors), errors


def test_the_backfill_of_the_failed_partition_turns_its_check_green_on_its_new_materialization(ui_pipeline):
    checks = ui_pipeline.checks_after_second
    assert sorted(checks["failure_rate"]["succeededPartitions"]) == ["shard-00", "shard-01"]
    assert checks["failure_rate"]["failedPartitions"] == []
    [rerun] = [run["runId"] for run in ui_pipeline.second_backfill["runs"]]
    latest = [e for e in ui_pipeline.dev.check_executions("completions", "failure_rate") if e["partition"] == "shard-01"][0]
    assert (latest["runId"], latest["evaluation"]["success"]) == (rerun, True)
