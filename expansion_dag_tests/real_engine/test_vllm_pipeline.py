"""The whole pipeline through Dagster, with EXPANSION_BACKEND=vllm, against a real vLLM server.

The deployment is what a user writes for an attached vLLM fleet: the production profile, the
server's URL in EXPANSION_FLEET_URLS, the API key in the fleet's key variable, and run
configuration naming only the slots and the generation settings. On the bundled sample datasets:
probe, budgets, set-aside prompts, generation and the training set, each checked against what the
server itself says (its usage, its /tokenize, its request counters).
"""

from __future__ import annotations

import collections
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx
import polars as pl
import pytest

from expansion_dag.store import CompletionStore
from expansion_dag_tests.real_engine.conftest import RUN_CONFIG, SLOTS
from expansion_dag_tests.real_engine.support import Deployment, VllmServer, failure_report, installed_vllm_version

SHARD = "shard-00"
SETTINGS = RUN_CONFIG["resources"]["settings"]["config"]
MARGIN = 16  # GenerationSettings' default, left as it is


@dataclass
class Pipeline:
    deployment: Deployment
    budgeted: pl.DataFrame
    set_aside: pl.DataFrame
    records: list[dict[str, Any]]
    training_rows: pl.DataFrame
    #: What the server counted while the pipeline ran (its /metrics, after minus before).
    server_delta: dict[str, float]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, attach, vllm_server: VllmServer, figures) -> Pipeline:
    deployment = attach(tmp_path_factory.mktemp("pipeline"))
    before = vllm_server.metrics()
    started = time.monotonic()
    for step in (("job", "execute", "-j", "prepare_job"), deployment.generate_args(SHARD),
                 ("job", "execute", "-j", "training_set_job")):
        result = deployment.run(*step)
        if result.returncode != 0:
            pytest.fail(f"`dagster {' '.join(step)}` failed\n{failure_report(result, vllm_server)}")
    figures["pipeline_wall_s"] = round(time.monotonic() - started, 1)
    after = vllm_server.metrics()
    storage = deployment.storage
    return Pipeline(
        deployment=deployment,
        budgeted=pl.read_parquet(storage / "assets" / "budgeted_prompts.parquet"),
        set_aside=pl.read_parquet(storage / "set_aside" / "budgeted_prompts.parquet"),
        records=list(CompletionStore(storage / "completions").records(SHARD)),
        training_rows=pl.read_parquet(sorted((storage / "training_set").glob("part-*.parquet"))),
        server_delta={name: after[name] - before.get(name, 0.0) for name in after},
    )


def test_the_probe_reads_the_context_from_vllm_and_the_slots_from_configuration(pipeline, vllm_server):
    budget = pipeline.deployment.metadata("budgeted_prompts")
    assert budget["context_length"] == vllm_server.context_length
    assert "probed" in budget["context_length_source"] and "simulated" not in budget["context_length_source"]
    fleet = pipeline.deployment.metadata("completions", SHARD)["effective_config"]["fleet"]
    assert fleet["backend"] == "vllm"
    assert fleet["server_version"] == installed_vllm_version()
    assert fleet["context_length"] == vllm_server.context_length
    # vLLM reports no slot count: the configured one is used, and the metadata says so.
    assert fleet["slots"] == SLOTS
    assert "configured" in fleet["slots_source"]
    assert fleet["simulator"] is False


def test_local_prompt_counts_equal_vllms_usage_on_every_prompt(pipeline, figures):
    drift = collections.Counter(r["prompt_tokens"] - r["local_prompt_tokens"] for r in pipeline.records)
    figures["prompts_generated"] = len(pipeline.records)
    figures["drift_histogram"] = {str(d): n for d, n in sorted(drift.items())}
    assert len(pipeline.records) == pipeline.budgeted.height
    assert drift == {0: pipeline.budgeted.height}
    # The budgets were those counts: vLLM saw exactly the prompt tokens budgeted.
    assert pipeline.server_delta["vllm:prompt_tokens_total"] == pipeline.budgeted["prompt_tokens"].sum()
    passed, metadata = pipeline.deployment.check("budget_drift")
    assert passed
    assert metadata["drift_histogram"] == {"0": pipeline.budgeted.height}
    for row in pipeline.budgeted.iter_rows(named=True):
        assert row["prompt_tokens"] + row["max_tokens"] <= row["context_length"] - MARGIN


def test_prompts_over_the_context_are_set_aside_and_never_sent(pipeline, vllm_server, figures):
    context = vllm_server.context_length
    over = pipeline.set_aside.filter(pl.col("prompt_tokens") > context)
    figures["set_aside"] = {
        "total": pipeline.set_aside.height,
        "over_the_context": over.height,
        "leaving_too_little_room": pipeline.set_aside.height - over.height,
    }
    assert over.height >= 1
    assert set(pipeline.set_aside["reason"]) == {"prompt_too_long"}
    # Each left less than the minimum answer; every other prompt fits.
    assert (pipeline.set_aside["prompt_tokens"] + SETTINGS["min_output_tokens"] + MARGIN > context).all()
    assert set(pipeline.set_aside["prompt_id"]).isdisjoint(r["prompt_id"] for r in pipeline.records)
    # The server received one request per budgeted prompt and no other.
    assert pipeline.server_delta["vllm:request_success_total"] == pipeline.budgeted.height
    assert pipeline.server_delta["vllm:request_prompt_tokens_count"] == pipeline.budgeted.height
    assert pipeline.deployment.metadata("budgeted_prompts")["set_aside"] == pipeline.set_aside.height


def test_generation_runs_with_the_key_the_server_enforces(pipeline, vllm_server):
    request = {"model": str(vllm_server.model_dir), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert httpx.post(vllm_server.url + "/v1/chat/completions", json=request, timeout=30).status_code == 401
    wrong = {"Authorization": "Bearer not-the-key"}
    assert httpx.post(
        vllm_server.url + "/v1/chat/completions", json=request, headers=wrong, timeout=30
    ).status_code == 401
    # With the key every budgeted prompt got its answer, each cut at its own max_tokens or ended.
    assert {r["status"] for r in pipeline.records} == {"ok"}
    by_id = {r["prompt_id"]: r for r in pipeline.records}
    for row in pipeline.budgeted.iter_rows(named=True):
        record = by_id[row["prompt_id"]]
        assert record["max_tokens"] == row["max_tokens"] <= SETTINGS["max_output_tokens"]
        assert record["finish_reason"] in ("length", "stop")
        assert 0 < record["completion_tokens"] <= row["max_tokens"]
        assert record["server"] == vllm_server.url


def test_a_deployment_without_the_key_is_refused_naming_the_server(tmp_path, attach, vllm_server):
    deployment = attach(tmp_path)
    api_key_env = next(k for k, v in deployment.env.items() if v == vllm_server.api_key)
    env = {k: v for k, v in deployment.env.items() if k != api_key_env}
    result = deployment.prepare(env=env)
    assert result.returncode != 0
    assert "401" in result.stdout and vllm_server.url in result.stdout, result.stdout[-3000:]


def test_training_rows_start_with_the_ids_vllm_fed_the_model(pipeline, vllm_server, figures):
    rows = pipeline.training_rows
    by_id = {r["prompt_id"]: r for r in pipeline.records}
    figures["training_rows"] = rows.height
    left_out = json.loads((pipeline.deployment.storage / "training_set" / "manifest.json").read_text())["left_out"]
    figures["training_left_out"] = left_out
    # Truncated answers are kept (drop_truncated: false); a random model writes little else.
    assert not left_out.get("truncated")
    assert rows.height == len(pipeline.records) - sum(left_out.values())
    assert rows.height > 0.9 * len(pipeline.records)
    for row in rows.iter_rows(named=True):
        mask = row["loss_mask"]
        prompt_ids = row["input_ids"][: mask.index(1)]
        assert prompt_ids == vllm_server.tokenize(by_id[row["id"]]["messages"]), row["id"]
