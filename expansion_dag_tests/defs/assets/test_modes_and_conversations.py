"""Mixes of generation modes and conversations regenerated turn by turn, through Dagster against
simulated servers over real HTTP."""

import collections
import json

import polars as pl
import pyarrow.parquet as pq
import pytest

from expansion_dag.core import OUTPUT_IDS, ModeMix, load_tokenizer, unpack
from expansion_dag.defs import SHARD_KEYS
from expansion_dag.prompts import extract_prompts, package_dir
from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag.training import Manifest, data_files
from expansion_dag_tests.defs.assets.test_completions import (
    FAST_SIM,
    completion_records,
    run_pipeline,
    small_frame,
)
from expansion_dag_tests.helpers import default_sampling, masked_runs, prompts_answered

THINKING_MIX = [
    {"name": "thinking", "weight": 0.6, "chat_template_kwargs": {"enable_thinking": True}},
    {"name": "direct", "weight": 0.4, "chat_template_kwargs": {"enable_thinking": False}},
]
EVEN_MIX = [{**THINKING_MIX[0], "weight": 0.5}, {**THINKING_MIX[1], "weight": 0.5}]


def sent(fleet) -> int:
    return sum(prompts_answered(fleet.stats(i)) for i in range(len(SHARD_KEYS)))


def test_a_mix_of_two_modes_gives_each_prompt_its_drawn_mode_and_a_changed_mix_regenerates_only_the_moved(
    tmp_path, instance
):
    frame = small_frame(120)
    mix = ModeMix.of(THINKING_MIX, default_sampling())
    drawn = dict(zip(frame["prompt_id"], mix.names(frame["prompt_id"].to_list())))
    # Servers with Qwen3's reasoning parser: thinking answers come back with their reasoning apart.
    with SimulatedFleet([SimServerConfig(**FAST_SIM, reasoning_parser="qwen3")] * len(SHARD_KEYS)) as fleet:
        results, res = run_pipeline(frame, fleet.urls, tmp_path, instance, training=True, drop_truncated=False,
                                    modes=json.dumps(THINKING_MIX))
        first = sent(fleet)
        even = ModeMix.of(EVEN_MIX, default_sampling()).names(frame["prompt_id"].to_list())
        moved = sum(drawn[p] != m for p, m in zip(frame["prompt_id"], even))
        again, _ = run_pipeline(frame, fleet.urls, tmp_path, instance, training=True, drop_truncated=False,
                                modes=json.dumps(EVEN_MIX))
        second = sent(fleet) - first

    assert all(r.success for r in results.values()) and all(r.success for r in again.values())
    assert first == frame.height
    # Each answer was asked in its prompt's mode: thinking answers carry reasoning, direct ones none.
    records = completion_records(res)
    by_mode = collections.Counter(r["mode"] for r in records if r["prompt_id"] in drawn and r["mode"] == drawn[r["prompt_id"]])
    assert sum(by_mode.values()) == frame.height
    assert all(bool(r["reasoning_content"]) == (r["mode"] == "thinking") for r in records)
    # The changed mix asked only the prompts that moved to the other mode.
    assert 0 < moved < frame.height and second == moved
    [set_] = again["training_set"].asset_materializations_for_node("training_set")
    assert set_.metadata["left_out"].value["other_mode"] == moved
    out_dir = res["storage"].path("training_set")
    ids = pq.read_table(data_files(out_dir), columns=["id"])["id"].to_pylist()
    assert sorted(ids) == sorted(frame["prompt_id"].to_list())
    # The manifest accounts for each mode apart: the configured share and the rows it got.
    modes = Manifest.read(out_dir).modes
    now = collections.Counter(even)
    assert {name: m["samples"] for name, m in modes.items()} == dict(now)
    assert {name: m["share"] for name, m in modes.items()} == {"thinking": 0.5, "direct": 0.5}


def hermes_conversations() -> pl.DataFrame:
    """The bundled Hermes function-calling sample, extracted as conversations (with tools)."""
    raw = pl.read_json(package_dir("samples") / "hermes_function_calling" / "func_calling.json")
    return extract_prompts(raw, source="hermes_fc", extractor="hermes_function_calling", conversation=True).prompts


@pytest.mark.parametrize("parser", [None, "qwen25"], ids=["raw-tool-call-text", "parsed-tool-calls"])
def test_hermes_conversations_are_regenerated_turn_by_turn_budgeted_and_masked_over_every_answer(
    tmp_path, instance, parser
):
    frame = hermes_conversations()
    turns = {row["prompt_id"]: sum(m["role"] == "assistant" for m in row["conversation"]) for row in frame.iter_rows(named=True)}
    assert max(turns.values()) >= 3  # a tool turn and a second question
    settings = dict(drop_truncated=False, chat_template_kwargs='{"enable_thinking": false}', max_output_tokens=256,
                    min_output_tokens=16)
    sim = SimServerConfig(**FAST_SIM, tool_call_parser=parser)
    with SimulatedFleet([sim] * len(SHARD_KEYS)) as fleet:
        results, res = run_pipeline(frame, fleet.urls, tmp_path, instance, training=True, **settings)
        asked = sent(fleet)
        again, _ = run_pipeline(frame, fleet.urls, tmp_path, instance, **settings)
        assert sent(fleet) == asked  # every conversation complete: a re-run asks nothing
    assert all(r.success for r in results.values()) and all(r.success for r in again.values())

    records = [r for r in completion_records(res) if r["status"] == "ok"]
    assert asked == len(records) == sum(turns.values())
    assert sorted({r["conversation_id"] for r in records}) == sorted(turns)
    for record in records:
        # The servers counted every turn's prompt, tools rendered, as the budget did; each its own budget.
        assert record["prompt_tokens"] == record["local_prompt_tokens"]
        assert record["max_tokens"] == min(256, sim.context_length - record["local_prompt_tokens"] - 16)
        assert record["tools"] and record["turns"] == turns[record["conversation_id"]]
    # The simulator calls tools too: as text, or parsed by the server's tool-call parser.
    calls = [r for r in records if "<tool_call>" in r["content"] or r.get("tool_calls")]
    assert calls and all(bool(r.get("tool_calls")) == (parser is not None) for r in calls)

    # One row per conversation, trained on exactly the regenerated turns.
    last = {r["conversation_id"]: r for r in records if r["turn"] == r["turns"]}
    rows = pq.read_table(data_files(res["storage"].path("training_set"))).to_pylist()
    assert sorted(row["id"] for row in rows) == sorted(turns)
    tokenizer = load_tokenizer()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for row in rows:
        record = last[row["id"]]
        answers = [m for m in record["messages"] if m["role"] == "assistant"] + [record]
        runs = masked_runs(row["input_ids"], row["loss_mask"])
        # The last turn is the ids the server sampled (the raw answer, parsed calls included),
        # closed by the end of turn; the earlier turns, the server's rendering of them in its prompt.
        assert row["ids_from"] == "server" and runs[-1] == unpack(record[OUTPUT_IDS]) + [im_end]
        decoded = [tokenizer.decode(run) for run in runs]
        assert len(decoded) == len(answers)
        for text, answer in zip(decoded, answers):
            # A parsed call is rendered back as the template writes it: <tool_call> JSON </tool_call>.
            calls = "".join(f'<tool_call>\n{{"name": "{c["function"]["name"]}"' for c in answer.get("tool_calls") or [])
            assert text.startswith(answer["content"] + ("\n" if answer["content"] and calls else "") + calls)
            assert text.endswith("<|im_end|>") and text.count("<|im_end|>") == 1
