"""A mix of generation modes in the training set: each prompt's answer taken only under the mode
the mix draws it into, rendered and gated with that mode's settings, each mode accounted apart."""

import json

import pytest

from expansion_dag.core import Identity, ModeIdentities, ModeMix, load_tokenizer
from expansion_dag.training import check_round_trip, expected_renders, manifest_markdown, sample_rows
from expansion_dag_tests.helpers import default_sampling, default_training
from expansion_dag_tests.training.test_training_set_conversations import build, turn_records

PROMPTS = 400
REASONING = "Let me add.\nDone."


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer()


def mix(thinking: float, direct: float) -> ModeIdentities:
    """Thinking on and off, weighted."""
    spec = [
        {"name": "thinking", "weight": thinking},
        {"name": "direct", "weight": direct, "chat_template_kwargs": {"enable_thinking": False}},
    ]
    return ModeIdentities(ModeMix.of(spec, default_sampling(), seed=7), "Qwen/Qwen3-8B", simulated=False)


def answer(prompt_id: str, identity: Identity, mode: str, **fields):
    """A completion of ``prompt_id`` as the mode's server answers: reasoning only with thinking on."""
    return {
        "key": identity.key(prompt_id), "prompt_id": prompt_id, "source": "src", "mode": mode,
        "messages": [{"role": "user", "content": f"What is {prompt_id} plus one?"}],
        "content": f"{prompt_id} plus one.", "reasoning_content": REASONING if mode == "thinking" else None,
        "finish_reason": "stop", "completion_tokens": 12, "status": "ok", **fields,
    }


def answers(ids: ModeIdentities, n: int = PROMPTS):
    """Each prompt answered under the mode the mix draws it into."""
    return [answer(f"p{i:04d}", ids.for_prompt(f"p{i:04d}"), ids.mix.assign(f"p{i:04d}").name) for i in range(n)]


def written(tokenizer, row):
    return tokenizer.backend_tokenizer.decode(
        [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m], skip_special_tokens=False
    )


def test_each_row_is_rendered_with_its_modes_kwargs_and_the_manifest_shows_the_shares(qwen3, tmp_path):
    ids = mix(0.6, 0.4)
    records = answers(ids)
    manifest, rows = build(records, qwen3, tmp_path / "ts", ids)
    assert manifest.samples == PROMPTS and not any(manifest.left_out.values())
    modes = {r["prompt_id"]: r["mode"] for r in records}
    for row in rows:
        think = f"<think>\n{REASONING}\n</think>\n\n" if modes[row["id"]] == "thinking" else ""
        assert written(qwen3, row) == f"{think}{row['id']} plus one.<|im_end|>"
        # Thinking off: the empty think block is the server's generation prompt, untrained.
        assert ("<think>\n\n</think>" in qwen3.decode(row["input_ids"])) == (modes[row["id"]] == "direct")
    counts = {m: sum(v == m for v in modes.values()) for m in ("thinking", "direct")}
    for name, share in (("thinking", 0.6), ("direct", 0.4)):
        entry = manifest.modes[name]
        assert entry["share"] == share and entry["samples"] == counts[name]
        assert entry["sample_share"] == round(counts[name] / PROMPTS, 4)
        assert abs(entry["sample_share"] - share) < 3 * (share * (1 - share) / PROMPTS) ** 0.5  # sampling error
        assert entry["fingerprint"] == ids.by_mode[name].fingerprint
        assert entry["assistant_tokens"] == sum(sum(r["loss_mask"]) for r in rows if modes[r["id"]] == name)
        assert json.loads(entry["settings"]["chat_template_kwargs_json"]) == (
            {} if name == "thinking" else {"enable_thinking": False})
    # One fingerprint names the whole mix; the card and the summary show each mode.
    assert manifest.identity["fingerprint"] not in {i.fingerprint for i in ids.identities}
    card = (tmp_path / "ts" / "README.md").read_text()
    assert "## Generation modes" in card and "| direct | 0.400 |" in card and "thinking on and off" in card
    assert f"| thinking | 0.600 | {manifest.modes['thinking']['sample_share']:.3f} |" in manifest_markdown(manifest)
    rows = sample_rows(tmp_path / "ts", 16)
    assert check_round_trip(rows, expected_renders(records, qwen3, default_training(), identities=ids), qwen3).ok


def test_the_thinking_gates_are_each_modes(qwen3, tmp_path):
    ids = mix(0.5, 0.5)
    by_mode = {}
    for i in range(40):
        by_mode.setdefault(ids.mix.assign(f"p{i:04d}").name, f"p{i:04d}")
    wrong = [
        # Each mode's answer carrying the other mode's reasoning (or lack of it).
        answer(by_mode["thinking"], ids.by_mode["thinking"], "thinking", reasoning_content=None),
        answer(by_mode["direct"], ids.by_mode["direct"], "direct", reasoning_content=REASONING),
    ]
    manifest, rows = build(wrong, qwen3, tmp_path / "ts", ids)
    assert rows == [] and manifest.left_out["reasoning_missing"] == manifest.left_out["reasoning_unexpected"] == 1


def test_a_changed_mix_leaves_out_the_answers_of_prompts_whose_mode_changed(qwen3, tmp_path):
    before, after = mix(0.6, 0.4), mix(0.3, 0.7)
    records = answers(before)
    moved = {r["prompt_id"] for r in records if after.mix.assign(r["prompt_id"]).name != r["mode"]}
    # Only prompts between the old and the new boundary move, all of them from thinking to direct.
    assert 0 < len(moved) < PROMPTS and {before.mix.assign(p).name for p in moved} == {"thinking"}
    manifest, rows = build(records, qwen3, tmp_path / "ts", after)
    assert manifest.left_out["other_mode"] == len(moved) and manifest.left_out["other_identity"] == 0
    assert {r["id"] for r in rows} == {r["prompt_id"] for r in records} - moved
    # Not this mix's work: their tokens count neither as generated nor as kept.
    assert manifest.output_tokens == manifest.output_tokens_in_set == 12 * (PROMPTS - len(moved))
    # Once the moved prompts are answered under their new mode, the set is whole again.
    regenerated = [r for r in answers(after) if r["prompt_id"] in moved]
    manifest, rows = build([*records, *regenerated], qwen3, tmp_path / "again", after)
    assert manifest.samples == PROMPTS and manifest.left_out["other_mode"] == len(moved)


def test_a_conversation_takes_its_mode_from_its_conversation_id(qwen3, tmp_path):
    ids = mix(0.5, 0.5)
    cids = [f"conv{i}" for i in range(6)]
    records = [r for cid in cids for r in turn_records(ids, thinking=ids.mix.assign(cid).name == "thinking", cid=cid)]
    manifest, rows = build(records, qwen3, tmp_path / "ts", ids)
    assert sorted(r["id"] for r in rows) == cids and manifest.conversation_turns_folded == 12
    assert sum(m["samples"] for m in manifest.modes.values()) == 6
