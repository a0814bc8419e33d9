"""A source that cannot be loaded fails its own asset, and only its own."""

import os

import dagster as dg

from expansion_dag.defs.assets import build_prompts_asset, build_raw_dataset_assets
from expansion_dag.defs.resources import ParquetIOManager, StorageResource
from expansion_dag.prompts import load_catalog

CATALOG = """
seed: 0
local_root: bundled
sources:
  - name: metamathqa
    extractor: metamathqa
    local_path: metamathqa/MetaMathQA-395K.json
  - name: codefeedback
    extractor: codefeedback
    local_path: codefeedback/CodeFeedback-Filtered-Instruction.jsonl
  - name: gated
    extractor: infinity_instruct
    hub_id: BAAI/Infinity-Instruct
    config: "0625"
"""


def test_an_unloadable_source_fails_alone_naming_itself_without_the_token(tmp_path, instance, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_value_123")
    path = tmp_path / "catalog.yaml"
    path.write_text(CATALOG)
    catalog = load_catalog(str(path))
    assets = [*build_raw_dataset_assets(catalog), build_prompts_asset(catalog)]
    resources = {"storage": StorageResource(root=str(tmp_path)), "parquet_io": ParquetIOManager(root=str(tmp_path))}
    result = dg.materialize(assets, resources=resources, instance=instance, raise_on_error=False)

    assert not result.success
    materialized = {e.asset_key.to_user_string() for e in result.get_asset_materialization_events()}
    assert materialized == {"raw_metamathqa", "raw_codefeedback"}
    [failure] = [e for e in result.all_events if e.is_step_failure]
    assert failure.step_key == "raw_gated"
    message = failure.event_specific_data.error.cause.message
    assert "gated" in message and "BAAI/Infinity-Instruct" in message
    for run in instance.get_runs():
        for entry in instance.all_logs(run.run_id):
            assert "hf_secret_token_value_123" not in entry.to_json()
    # What loaded is kept: the working sources' rows are on disk for the next run.
    assert os.path.exists(tmp_path / "assets" / "raw_metamathqa.parquet")
