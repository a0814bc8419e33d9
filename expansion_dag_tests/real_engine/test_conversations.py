"""Conversations with tools, regenerated turn by turn, in a mix of two generation modes, on a real vLLM.

The bundled Hermes function-calling sample (a catalog of it alone) through Dagster as a user runs it:
prepare, generate, training set, against vLLM's CPU build serving the tiny model at a context of
``ROOMY_CONTEXT_LENGTH`` (the suite's 256 holds no prompt with tools). What vLLM itself says is the
check: its ``usage.prompt_tokens`` for every turn (the conversation so far, the tools rendered by
its own template path from the ``tools`` the client sent) against the budget's count, and its
request counter against the records. The tiny model's answers are random text (tool calls
included, if any): the path, the budgets, the masks and the mix are what is tested.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import yaml

from expansion_dag.core import (
    OK,
    OUTPUT_IDS,
    ModeMix,
    base_prompt_id,
    load_tokenizer,
    unpack,
)
from expansion_dag.store import CompletionStore
from expansion_dag.training import Manifest
from expansion_dag_tests.helpers import default_sampling, closed_turn, masked_runs
from expansion_dag_tests.real_engine.conftest import API_KEY_ENV, SETTINGS, SLOTS
from expansion_dag_tests.real_engine.support import PIPELINE_PROBES, Deployment, VllmServer, run_pipeline

SHARD = "shard-00"
#: Two temperatures, drawn half and half (thinking stays off: a random model writes no reasoning).
MIX = [{"name": "warm", "weight": 0.5, "temperature": 1.0}, {"name": "cool", "weight": 0.5, "temperature": 0.8}]
CATALOG = {
    "seed": 0,
    "local_root": "bundled",  # the package's samples
    "sources": [{
        "name": "hermes_fc",
        "hub_id": "NousResearch/hermes-function-calling-v1",
        "config": ["func_calling_singleturn", "func_calling", "glaive_func_calling"],
        "local_path": "hermes_function_calling/{config}.json",
        "extractor": "hermes_function_calling",
        "conversation": True,
    }],
}


@pytest.fixture(scope="module")
def run(roomy_vllm_server: VllmServer, tmp_path_factory, figures) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-conversations")
    catalog = tmp / "catalog.yaml"
    catalog.write_text(yaml.safe_dump(CATALOG))
    settings = {**SETTINGS, "modes": json.dumps(MIX)}
    config = {"resources": {"fleet": {"config": {"slots_override": SLOTS}}, "settings": {"config": settings}}}
    deployment = Deployment.create(tmp, roomy_vllm_server, config, API_KEY_ENV)
    deployment.env["EXPANSION_CATALOG"] = str(catalog)
    before = roomy_vllm_server.metrics()
    run_pipeline(deployment, roomy_vllm_server, SHARD)
    storage = Path(deployment.storage)
    records = list(CompletionStore(storage / "completions").latest_records())
    measured = figures["vllm-conversations"]
    ok = [r for r in records if r["status"] == OK]
    measured.update(
        conversations=len({base_prompt_id(r) for r in records}),
        turn_requests=len(ok),
        tool_call_text_answers=sum("<tool_call>" in (r.get("content") or "") for r in ok),
        drift=dict(collections.Counter(r["prompt_tokens"] - r["local_prompt_tokens"] for r in ok)),
    )
    return {
        "records": records,
        "budgeted": pl.read_parquet(storage / "assets" / "budgeted_prompts.parquet"),
        "rows": pl.read_parquet(sorted((storage / "training_set").glob("part-*.parquet"))).to_dicts(),
        "manifest": Manifest.read(storage / "training_set"),
        "received": roomy_vllm_server.received(before, roomy_vllm_server.metrics()),
        "figures": measured,
    }


def test_every_turn_is_one_request_counted_by_vllm_exactly_as_budgeted(run):
    ok = [r for r in run["records"] if r["status"] == OK]
    turns = {
        row["prompt_id"]: sum(m["role"] == "assistant" for m in row["conversation"])
        for row in run["budgeted"].iter_rows(named=True)
    }
    assert max(turns.values()) >= 3, run["figures"]  # tool results and follow-up questions
    # One request a turn, each answered once: vLLM counted no more requests than the store holds
    # (and the weights probes).
    assert run["received"] == len(ok) + PIPELINE_PROBES, run["figures"]
    answered = collections.Counter(r["conversation_id"] for r in ok)
    ended = {r["conversation_id"] for r in run["records"] if r["status"] != OK}
    assert set(answered) == set(turns)
    assert all(answered[c] == n or c in ended for c, n in turns.items()), run["figures"]
    for record in ok:
        # vLLM's own count of the conversation so far with the tools: the budget's, to the token.
        assert record["prompt_tokens"] == record["local_prompt_tokens"], run["figures"]
        assert record["local_prompt_tokens"] + record["max_tokens"] <= 4096 - 16
        assert record["turn"] == 1 or any(m["role"] == "assistant" for m in record["messages"])


def test_each_conversation_is_one_row_trained_on_every_regenerated_turn(run):
    last = {r["conversation_id"]: r for r in run["records"] if r["status"] == OK and r["turn"] == r["turns"]}
    assert {row["id"] for row in run["rows"]} == set(last)
    assert run["manifest"].conversations == len(last)
    tokenizer = load_tokenizer()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for row in run["rows"]:
        record = last[row["id"]]
        answers = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        runs = masked_runs(row["input_ids"], row["loss_mask"])
        # The last turn is exactly the ids vLLM sampled (closed by the end of turn where it stopped
        # at none); the earlier ones are its rendering of them in the last prompt.
        sampled = unpack(record[OUTPUT_IDS])
        assert row["ids_from"] == "server" and runs[-1] == closed_turn(sampled, tokenizer.all_special_ids, im_end)
        assert [tokenizer.decode(run_) for run_ in runs[:-1]] == [answer + "<|im_end|>" for answer in answers]
    # A random model samples far from the canonical split: re-tokenizing would change rows, and the
    # manifest's measurement sees it.
    manifest = run["manifest"]
    assert manifest.ids_from == {"server": len(run["rows"]), "retokenized": 0}
    assert manifest.retokenization["rows_differing"] > 0


def test_the_mix_draws_each_conversation_into_one_mode_and_the_manifest_counts_each(run):
    mix = ModeMix.of(MIX, default_sampling())
    for record in run["records"]:
        assert record["mode"] == mix.assign(record["conversation_id"]).name
    rows_by_mode = collections.Counter(mix.assign(row["id"]).name for row in run["rows"])
    modes = run["manifest"].modes
    assert {name: m["samples"] for name, m in modes.items()} == {name: rows_by_mode[name] for name in modes}
    assert set(modes) == {"warm", "cool"}
