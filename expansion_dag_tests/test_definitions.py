"""The code location loads, as `dagster dev` and the README load it."""

import subprocess
import sys
from pathlib import Path

import dagster as dg

from expansion_dag.definitions import defs
from expansion_dag.partitions import SHARD_KEYS

ROOT = Path(__file__).resolve().parent.parent


def test_the_asset_graph_has_the_five_stages_in_order():
    graph = defs.resolve_asset_graph()
    groups = {key.to_user_string(): graph.get(key).group_name for key in graph.get_all_asset_keys()}
    assert set(groups.values()) == {"sources", "prompts", "budget", "generation", "training"}
    raw = sorted(k for k, g in groups.items() if g == "sources")
    assert raw == sorted(f"raw_{s}" for s in
                         ["infinity_instruct", "webinstructsub", "codefeedback", "metamathqa", "hermes_fc", "agentinstruct"])
    assert graph.get(dg.AssetKey("prompts")).parent_keys == {dg.AssetKey(k) for k in raw}
    assert graph.get(dg.AssetKey("completions")).parent_keys == {dg.AssetKey("shard_prompts")}
    assert graph.get(dg.AssetKey("training_set")).parent_keys == {dg.AssetKey("completions")}


def test_generation_is_partitioned_by_shard():
    graph = defs.resolve_asset_graph()
    for name in ("shard_prompts", "completions"):
        assert graph.get(dg.AssetKey(name)).partitions_def.get_partition_keys() == SHARD_KEYS
    assert SHARD_KEYS == ["shard-00", "shard-01"]


def test_checks_sit_beside_the_assets_they_watch():
    checks = {(k.asset_key.to_user_string(), k.name) for k in defs.resolve_asset_graph().asset_check_keys}
    assert {
        ("shard_prompts", "ids_unique"), ("shard_prompts", "no_empty_prompt"), ("shard_prompts", "fits_context"),
        ("completions", "failure_rate"), ("completions", "no_context_length_rejections"),
        ("completions", "truncation_rate"), ("completions", "budget_drift"), ("completions", "configuration_unchanged"),
        ("training_set", "loss_mask_not_empty"), ("training_set", "within_context_length"), ("training_set", "round_trip"),
    } <= checks


def test_dagster_validates_the_workspace():
    result = subprocess.run(
        [str(Path(sys.executable).parent / "dagster"), "definitions", "validate", "-w", "workspace.yaml"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "All code locations passed validation" in result.stderr + result.stdout
