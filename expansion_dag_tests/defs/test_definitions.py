"""The code location loads, as `dagster dev` and the README load it."""

import json
import subprocess
import sys
from pathlib import Path

import dagster as dg

from expansion_dag.definitions import defs
from expansion_dag.defs import SHARD_KEYS
from expansion_dag.sim import SimServerConfig, SimulatedFleet

ROOT = Path(__file__).resolve().parents[2]


def test_the_asset_graph_has_the_five_stages_in_order():
    graph = defs.resolve_asset_graph()
    groups = {key.to_user_string(): graph.get(key).group_name for key in graph.get_all_asset_keys()}
    assert set(groups.values()) == {"sources", "prompts", "budget", "generation", "training"}
    raw = sorted(k for k, g in groups.items() if g == "sources")
    assert raw == sorted(f"raw_{s}" for s in
                         ["infinity_instruct", "webinstructsub", "codefeedback", "metamathqa", "hermes_fc", "agentinstruct"])
    assert graph.get(dg.AssetKey("prompts")).parent_keys == {dg.AssetKey(k) for k in raw}
    assert graph.get(dg.AssetKey("completions")).parent_keys == {dg.AssetKey("shard_prompts")}
    # Every dependency declared: the set reads what the prompts were budgeted for from the budget,
    # and takes the parts a shard's run built.
    assert graph.get(dg.AssetKey("training_set_parts")).parent_keys == {
        dg.AssetKey("completions"), dg.AssetKey("budgeted_prompts")
    }
    assert graph.get(dg.AssetKey("training_set")).parent_keys == {
        dg.AssetKey("completions"), dg.AssetKey("budgeted_prompts"), dg.AssetKey("training_set_parts")
    }


def test_generation_is_partitioned_by_shard():
    graph = defs.resolve_asset_graph()
    for name in ("shard_prompts", "completions", "training_set_parts"):
        assert graph.get(dg.AssetKey(name)).partitions_def.get_partition_keys() == SHARD_KEYS
    assert SHARD_KEYS == ["shard-00", "shard-01"]


def test_checks_sit_beside_the_assets_they_watch():
    checks = {(k.asset_key.to_user_string(), k.name) for k in defs.resolve_asset_graph().asset_check_keys}
    assert {
        ("shard_prompts", "ids_unique"), ("shard_prompts", "no_empty_prompt"), ("shard_prompts", "fits_context"),
        ("completions", "failure_rate"), ("completions", "no_context_length_rejections"),
        ("completions", "truncation_rate"), ("completions", "budget_drift"), ("completions", "configuration_unchanged"),
        ("completions", "no_duplicate_completions"),
        ("training_set", "loss_mask_not_empty"), ("training_set", "within_context_length"), ("training_set", "round_trip"),
    } <= checks


def test_dagster_validates_the_workspace():
    result = subprocess.run(
        [str(Path(sys.executable).parent / "dagster"), "definitions", "validate", "-w", "workspace.yaml"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "All code locations passed validation" in result.stderr + result.stdout


def test_launchpad_config_for_a_resource_overrides_only_the_fields_it_names():
    from expansion_dag.config import parse_config
    from expansion_dag.definitions import resources_for
    from expansion_dag.defs.resources import FleetResource, GenerationSettings

    seen = {}

    @dg.asset
    def resources_seen(fleet: FleetResource, settings: GenerationSettings):
        seen.update(fleet=fleet.model_dump(), settings=settings.model_dump(), slots=[s.slots for s in fleet.info.servers])

    run_config = {"resources": {"fleet": {"config": {"slots_override": 16}},
                                "settings": {"config": {"backoff_initial_s": 0.05}}}}
    # A run provisions the fleet as it starts (the resource's lifecycle): attached servers are probed.
    with SimulatedFleet([SimServerConfig(port=0)] * 2) as fleet:
        config = parse_config({"generation": {"temperature": 0.25}}, where="run.yaml",
                              env={"EXPANSION_PROFILE": "production", "EXPANSION_FLEET_URLS": ",".join(fleet.urls)})
        assert dg.materialize([resources_seen], resources=resources_for(config), run_config=run_config).success
    assert (seen["fleet"]["mode"], seen["fleet"]["urls"], seen["fleet"]["slots_override"]) == ("attach", fleet.urls, 16)
    assert seen["slots"] == [16, 16]  # the override reached the probe
    assert (seen["settings"]["temperature"], seen["settings"]["backoff_initial_s"]) == (0.25, 0.05)


def test_the_shard_lease_settings_reach_the_storage_resource():
    from expansion_dag.config import parse_config
    from expansion_dag.definitions import resources_for

    config = parse_config({"storage": {"lease_timeout_s": 30, "when_shard_busy": "fail"}}, where="run.yaml", env={})
    storage = resources_for(config)["storage"]
    assert (storage.lease_timeout_s, storage.when_shard_busy) == (30, "fail")


def test_every_job_run_carries_the_resolved_configuration_without_secrets(monkeypatch):
    from expansion_dag.definitions import CONFIG_DIGEST_TAG, CONFIG_FILE_TAG, CONFIG_TAG

    monkeypatch.setenv("SGLANG_API_KEY", "key-that-must-not-leak")
    for job in ("prepare_job", "generate_job", "training_set_job"):
        tags = defs.resolve_job_def(job).tags
        assert tags[CONFIG_FILE_TAG].endswith("default.yaml")
        assert len(tags[CONFIG_DIGEST_TAG]) == 12
        recorded = json.loads(tags[CONFIG_TAG])
        assert recorded["generation"]["temperature"] == 0.7 and recorded["fleet"]["api_key_env"] == "SGLANG_API_KEY"
        assert "key-that-must-not-leak" not in tags[CONFIG_TAG]
