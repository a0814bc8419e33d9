"""Each output of the training set, fed to the trainers' own loading code, gives the Parquet set's rows.

The sets' rows are the ids their (canonical) server ran and sampled; the conversations files are
text, rendered and tokenized again by the trainers, which here gives the same ids.

SpecForge 0.2.0 (``prepare_prompt_tasks``, what ``specforge train`` calls on ``data.prompts_path``
and ``data.train_data_path``) and speculators 0.9.0 (``prepare-data``, conversations rendered by a
real vLLM ``/v1/chat/completions/render``) read two sets built from the same answers: one with
thinking on and the project's mask convention, one with thinking off and the newline after the
end-of-turn token trained. Row by row, token ids and masks must equal the Parquet set's, or differ
by exactly what the dataset card documents for that trainer (``training.config.SPECFORGE_RENDERS`` and ``SPECULATORS_RENDERS``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from expansion_dag.core import Identity, as_upath, load_tokenizer
from expansion_dag.store import BuildClaim
from expansion_dag.training import (
    FORMATS,
    Manifest,
    build_training_set,
    data_files,
    publishing,
    specforge_template,
)
from expansion_dag_tests.helpers import LEASE_TIMEOUT_S, default_training, one_mode
from expansion_dag_tests.store.test_lease import Said
from expansion_dag_tests.trainers.conftest import consume
from expansion_dag_tests.training import test_training_set_conversations as conversations
from expansion_dag_tests.training.test_training_set_ids import sampled, with_ids

MODEL = Identity(model="Qwen/Qwen3-8B", simulated=False, fingerprint="trainers-test")
#: What SpecForge's qwen3 templates put first in a conversation that has no system message.
SPECFORGE_SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
MAX_LENGTH = 4096
PROMPTS = [
    ("You are terse.", "What is 17 * 23?"),
    (None, "Écris une phrase sur la mer 🌊, puis traduis-la."),
    (None, "Write a Python function that reverses a list.\nKeep it short."),
    ("Answer in JSON.", 'Give {"a": 1} with a doubled.'),
    (None, "Name three prime numbers."),
]
ANSWERS = [
    "17 * 23 = 391.",
    "La mer brille 🌊.\n\nThe sea shines.",
    "```python\ndef reverse(xs):\n    return xs[::-1]\n```",
    '{"a": 2}',
    "2, 3 and 5.",
]
REASONING = "Let me think.\nStep one: read the question.\nStep two: answer it."


def records(thinking: bool, tokenizer) -> list[dict[str, Any]]:
    """The answers, each with the ids its server ran and sampled: the rows and the pre-tokenized
    files are those ids."""
    out = []
    for i, ((system, user), answer) in enumerate(zip(PROMPTS, ANSWERS)):
        prompt_id = f"p{i:03d}"
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        out.append({
            "key": MODEL.key(prompt_id), "prompt_id": prompt_id, "source": f"src{i % 2}", "messages": messages,
            "content": answer, "reasoning_content": REASONING if thinking else None, "finish_reason": "stop",
            "completion_tokens": 40, "status": "ok",
        })
    kwargs = {} if thinking else {"enable_thinking": False}
    return [with_ids(tokenizer, r, sampled(tokenizer, r, spelled=None), kwargs=kwargs) for r in out]


@dataclass
class Consumed:
    """A set as built, and what each trainer made of each of its outputs."""

    thinking: bool
    newline_trained: bool
    parquet: list[dict[str, Any]]
    specforge_pretokenized: list[dict[str, Any]]
    specforge_conversations: list[dict[str, Any]]
    speculators_pretokenized: list[dict[str, Any]]
    speculators_conversations: list[dict[str, Any]]


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer()


@pytest.fixture(scope="module")
def consumed(tmp_path_factory, qwen3, render_server) -> dict[str, Consumed]:
    """Both sets, and one run of the trainers over all of their outputs."""
    tmp = tmp_path_factory.mktemp("trainers")
    sets = {"thinking": (True, False), "no-thinking": (False, True)}
    jobs, built = [], {}
    for name, (thinking, newline) in sets.items():
        config = default_training(
            formats=tuple(FORMATS), train_newline_after_end_of_turn=newline, max_length=MAX_LENGTH,
        )
        identities = one_mode(MODEL, {} if thinking else {"enable_thinking": False})
        # Published as a run publishes it; the trainers are given the set's stable path, the link.
        root = as_upath(str(tmp / name))
        with (BuildClaim(root, timeout_s=LEASE_TIMEOUT_S, run_id=name, log=Said(), local_dir=tmp / "machine") as claim,
              publishing(root, claim=claim, keep=1, scratch=tmp / "scratch", log=Said()) as version):
            manifest = build_training_set(records(thinking, qwen3), qwen3, config, version.directory,
                                          identities=identities)
        out = tmp / name / "training_set"
        assert manifest.samples == manifest.ids_from["server"] == len(PROMPTS), manifest.left_out
        built[name] = (out, manifest)
        pretokenized, conversations = str(out / "pretokenized.jsonl"), str(out / "conversations.jsonl")
        jobs += [
            {"consumer": "specforge", "data": pretokenized, "max_length": MAX_LENGTH},
            {"consumer": "specforge", "data": conversations, "max_length": MAX_LENGTH,
             "chat_template": specforge_template(thinking)},
            {"consumer": "speculators", "data": pretokenized, "max_length": MAX_LENGTH},
            {"consumer": "speculators", "data": conversations, "max_length": MAX_LENGTH,
             "render_endpoint": render_server.url},
        ]
    rows = iter(consume(jobs, tmp))
    return {
        name: Consumed(thinking, newline, pq.read_table(data_files(built[name][0])).to_pylist(), *(next(rows) for _ in range(4)))
        for name, (thinking, newline) in sets.items()
    }


def assert_rows_equal(got: list[dict[str, Any]], expected: list[dict[str, Any]], qwen3, what: str) -> None:
    """The same rows, whatever the order (both trainers shuffle): ids, and the mask of each."""
    by_ids = {tuple(r["input_ids"]): [int(m) for m in r["loss_mask"]] for r in expected}
    assert len(by_ids) == len(expected) == len(got), f"{what}: {len(got)} rows for {len(expected)}"
    for row in got:
        ids = tuple(row["input_ids"])
        text = qwen3.backend_tokenizer.decode(list(ids), skip_special_tokens=False)
        assert ids in by_ids, f"{what}: token ids no row of the set has:\n{text!r}"
        differ = [i for i, (a, b) in enumerate(zip(row["loss_mask"], by_ids[ids])) if a != b]
        assert not differ, f"{what}: masks differ at {differ} of {text!r}"


def trained(row: dict[str, Any], start: int, end: int) -> dict[str, Any]:
    return {**row, "loss_mask": row["loss_mask"][:start] + [1] * (end - start) + row["loss_mask"][end:]}


def newline_trained(row: dict[str, Any]) -> dict[str, Any]:
    """The tokens after the end-of-turn token (Qwen3's newline), trained."""
    last = max(i for i, m in enumerate(row["loss_mask"]) if m)
    return trained(row, last + 1, len(row["input_ids"]))


def empty_think_block_trained(row: dict[str, Any], qwen3) -> dict[str, Any]:
    """The empty think block the template adds to the generation prompt with thinking off, trained."""
    first = row["loss_mask"].index(1)
    think = qwen3.convert_tokens_to_ids("<think>")
    start = max(i for i in range(first) if row["input_ids"][i] == think)
    return trained(row, start, first)


def specforge_system_prompt(row: dict[str, Any], qwen3) -> dict[str, Any]:
    """SpecForge's default system prompt put first, untrained, where the conversation has none."""
    if qwen3.decode(row["input_ids"][:3]) == "<|im_start|>system\n":
        return row
    system = qwen3.encode(SPECFORGE_SYSTEM, add_special_tokens=False)
    return {"input_ids": system + row["input_ids"], "loss_mask": [0] * len(system) + row["loss_mask"]}


@pytest.mark.parametrize("name", ["thinking", "no-thinking"])
def test_pretokenized_rows_are_taken_unchanged_by_both_trainers(consumed, qwen3, name):
    built = consumed[name]
    assert_rows_equal(built.specforge_pretokenized, built.parquet, qwen3, "SpecForge data.prompts_path")
    assert_rows_equal(built.speculators_pretokenized, built.parquet, qwen3, "speculators prepare-data")


@pytest.mark.parametrize("name", ["thinking", "no-thinking"])
def test_specforge_renders_the_conversations_with_only_its_documented_differences(consumed, qwen3, name):
    built = consumed[name]
    expected = [specforge_system_prompt(row, qwen3) for row in built.parquet]
    if not built.newline_trained:
        expected = [newline_trained(row) for row in expected]
    # With thinking off its qwen3-instruct template leaves the empty think block untrained, as the set does.
    assert_rows_equal(built.specforge_conversations, expected, qwen3, f"SpecForge {specforge_template(built.thinking)}")


@pytest.mark.parametrize("name", ["thinking", "no-thinking"])
def test_speculators_renders_the_conversations_with_only_its_documented_differences(consumed, qwen3, name):
    built = consumed[name]
    expected = built.parquet if built.newline_trained else [newline_trained(row) for row in built.parquet]
    if not built.thinking:
        expected = [empty_think_block_trained(row, qwen3) for row in expected]
    assert_rows_equal(built.speculators_conversations, expected, qwen3, "speculators prepare-data --render-endpoint")


def test_the_mask_convention_is_what_the_manifest_and_the_card_say(consumed, tmp_path, qwen3):
    # The no-thinking set trains the newline: nothing but the think block left between it and speculators.
    assert all(row["loss_mask"][-1] == 1 for row in consumed["no-thinking"].parquet)
    assert all(row["loss_mask"][-1] == 0 for row in consumed["thinking"].parquet)
    manifest = build_training_set(
        records(True, qwen3), qwen3, default_training(formats=("parquet", "speculators-pretokenized")), tmp_path / "ts",
        identities=one_mode(MODEL),
    )
    assert manifest == Manifest.read(tmp_path / "ts")
    assert manifest.outputs == {"parquet": ["part-00000.parquet"], "speculators-pretokenized": ["pretokenized.jsonl"]}
    assert sorted(p.name for p in Path(tmp_path / "ts").iterdir()) == [
        "README.md", "manifest.json", "part-00000.parquet", "pretokenized.jsonl"
    ]
    assert "newline the template writes after the end-of-turn token is not trained" in manifest.mask_convention


def test_specforge_reads_a_tool_conversation_with_only_its_documented_differences(tmp_path, qwen3):
    """Tools as JSON text and parsed tool calls, read by SpecForge's own parser: the same ids, and
    the mask differs only by the newline after each turn's end-of-turn token, which SpecForge trains."""
    ids = conversations.identities()
    out = tmp_path / "ts"
    records = conversations.turn_records(ids, parsed_call=True)
    build_training_set(records, qwen3, default_training(max_length=MAX_LENGTH), out, identities=ids)
    job = {"consumer": "specforge", "data": str(out / "conversations.jsonl"), "max_length": MAX_LENGTH,
           "chat_template": specforge_template(True)}
    [got] = consume([job], tmp_path)
    [row] = pq.read_table(data_files(out)).to_pylist()
    mask = row["loss_mask"]
    after_turns = [i for i in range(1, len(mask)) if mask[i - 1] and not mask[i]]
    assert len(after_turns) == 3
    expected = {**row, "loss_mask": [1 if i in after_turns else m for i, m in enumerate(mask)]}
    assert_rows_equal(got, [expected], qwen3, "SpecForge tool conversations")
