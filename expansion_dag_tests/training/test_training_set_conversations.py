"""Regenerated conversations in the training set: one row per complete conversation, every
assistant turn trained and nothing else, with Qwen3's own template (tools, tool calls, think blocks)."""

import json

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from expansion_dag.core import (
    ModeIdentities,
    ModeMix,
    bundled_qwen3_path,
    load_tokenizer,
    render_prompts,
)
from expansion_dag.training import (
    BuildTrace,
    build_training_set,
    check_round_trip,
    data_files,
    expected_renders,
    sample_rows,
)
from expansion_dag_tests.helpers import default_sampling, default_training

CID = "conv0001"
SYSTEM = "You are a function calling AI model."
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}]
QUESTION = "What is the weather in Paris?"
TOOL_RESULT = '{"temperature": 18, "sky": "clear"}'
FOLLOW_UP = "And should I take an umbrella?"
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
ANSWERS = [CALL_TEXT, "It is 18 °C and clear in Paris.", "No, the sky is clear. 🌤"]
REASONING = "The user asks about rain.\nThe sky is clear."
#: What the user, the system and the tools say: never trained.
NOT_THE_ASSISTANTS = (SYSTEM, "get_weather\", \"description", QUESTION, TOOL_RESULT, FOLLOW_UP)


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer()


def identities(**kwargs) -> ModeIdentities:
    sampling = default_sampling(chat_template_kwargs_json=json.dumps(kwargs))
    return ModeIdentities(ModeMix.single(sampling), "Qwen/Qwen3-8B", simulated=False)


def turn_records(ids, *, thinking=True, parsed_call=False, finishes=("stop", "stop", "stop"), cid=CID):
    """The three turn records the engine writes for the conversation: system and tools, a question
    answered by a tool call, the tool's result answered in words, a follow-up answered last."""
    first = {"role": "assistant", "content": "", "tool_calls": [CALL]} if parsed_call else {
        "role": "assistant", "content": CALL_TEXT}
    requests = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        [{"role": "tool", "content": TOOL_RESULT}],
        [{"role": "assistant", "content": ANSWERS[1]}, {"role": "user", "content": FOLLOW_UP}],
    ]
    records, messages = [], []
    for k in range(3):
        messages = [*messages, *([first] if k == 1 else []), *requests[k]]
        turn_id = f"{cid}.t{k + 1}"
        answer = {"content": "", "tool_calls": [CALL]} if k == 0 and parsed_call else {"content": ANSWERS[k]}
        records.append({
            "key": ids.for_prompt(cid).key(turn_id), "prompt_id": turn_id, "conversation_id": cid,
            "turn": k + 1, "turns": 3, "tools": TOOLS, "prior_finish_reasons": list(finishes[:k]),
            "source": "hermes", "mode": "default", "messages": messages,
            "reasoning_content": REASONING if thinking else None, "finish_reason": finishes[k],
            "completion_tokens": 10 * (k + 1), "status": "ok", **answer,
        })
    return records


def build(records, tokenizer, out, ids, **config):
    manifest = build_training_set(records, tokenizer, default_training(**config), out, identities=ids)
    return manifest, pq.read_table(data_files(out)).to_pylist()


def decode(tokenizer, ids):
    return tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=False)


def trained_runs(tokenizer, row):
    """The text of each run of loss_mask 1, in order."""
    runs, current = [], []
    for token, mask in zip(row["input_ids"], row["loss_mask"]):
        if mask:
            current.append(token)
        elif current:
            runs.append(decode(tokenizer, current))
            current = []
    return runs + ([decode(tokenizer, current)] if current else [])


@pytest.mark.parametrize("parsed_call", [False, True], ids=["raw-tool-call", "parsed-tool-call"])
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_a_hermes_conversation_is_one_row_training_exactly_the_assistant_turns(qwen3, tmp_path, thinking, parsed_call):
    ids = identities() if thinking else identities(enable_thinking=False)
    records = turn_records(ids, thinking=thinking, parsed_call=parsed_call)
    manifest, [row] = build(records, qwen3, tmp_path / "ts", ids)
    assert row["id"] == CID and row["source"] == "hermes"
    assert (manifest.samples, manifest.conversations, manifest.conversation_turns_folded) == (1, 1, 2)
    # Earlier turns as the template renders history (no think block), the last with its reasoning
    # (thinking on) or after the empty think block of the generation prompt (thinking off).
    last = f"<think>\n{REASONING}\n</think>\n\n{ANSWERS[2]}" if thinking else ANSWERS[2]
    assert trained_runs(qwen3, row) == [f"{ANSWERS[0]}<|im_end|>", f"{ANSWERS[1]}<|im_end|>", f"{last}<|im_end|>"]
    # The row is the template's own render of the conversation, tools and all.
    final = {"role": "assistant", "content": ANSWERS[2], **({"reasoning_content": REASONING} if thinking else {})}
    full = qwen3.apply_chat_template(
        [*records[2]["messages"], final], tools=TOOLS, tokenize=False, **ids.mix.modes[0].chat_template_kwargs
    )
    text = decode(qwen3, row["input_ids"])
    assert text == full and "<tools>" in text and "<tool_response>\n" + TOOL_RESULT in text
    untrained = decode(qwen3, [t for t, m in zip(row["input_ids"], row["loss_mask"]) if not m])
    assert all(said in untrained for said in NOT_THE_ASSISTANTS)
    assert untrained.count("<|im_start|>assistant\n") == 3 and row["loss_mask"][-1] == 0
    # The last turn starts where the server's prompt for it ended.
    [prompt] = render_prompts(qwen3, [records[2]["messages"]], ids.mix.modes[0].chat_template_kwargs, tools=[TOOLS])
    prompt_ids = qwen3.backend_tokenizer.encode(prompt, add_special_tokens=False).ids
    assert row["loss_mask"][len(prompt_ids) - 1 : len(prompt_ids) + 1] == [0, 1]
    assert decode(qwen3, row["input_ids"][: len(prompt_ids)]) == prompt
    assert manifest.assistant_tokens == sum(row["loss_mask"])
    # Every turn's tokens were generated for the row.
    assert manifest.output_tokens == manifest.output_tokens_in_set == 60


def test_a_parsed_tool_call_gives_the_same_row_as_its_raw_text(qwen3, tmp_path):
    ids = identities()
    _, [raw] = build(turn_records(ids), qwen3, tmp_path / "raw", ids)
    _, [parsed] = build(turn_records(ids, parsed_call=True), qwen3, tmp_path / "parsed", ids)
    assert raw == parsed


def test_a_conversation_ending_in_a_tool_call_trains_it(qwen3, tmp_path):
    ids = identities(enable_thinking=False)
    records = turn_records(ids, thinking=False, parsed_call=True)
    last = {**records[0], "turns": 1, "finish_reason": "tool_calls"}
    _, [row] = build([last], qwen3, tmp_path / "ts", ids)
    assert trained_runs(qwen3, row) == [f"{CALL_TEXT}<|im_end|>"]


def test_the_newline_after_each_turn_is_trained_when_configured(qwen3, tmp_path):
    ids = identities()
    _, [default] = build(turn_records(ids), qwen3, tmp_path / "default", ids)
    _, [row] = build(turn_records(ids), qwen3, tmp_path / "trained", ids, train_newline_after_end_of_turn=True)
    assert row["input_ids"] == default["input_ids"]
    assert [run.endswith("<|im_end|>\n") for run in trained_runs(qwen3, row)] == [True] * 3
    assert sum(row["loss_mask"]) == sum(default["loss_mask"]) + 3


def test_round_trip_and_trace_cover_conversation_rows(qwen3, tmp_path):
    ids = identities()
    records = [*turn_records(ids), *turn_records(ids, cid="conv0002")]
    trace = BuildTrace()
    manifest = build_training_set(records, qwen3, default_training(), tmp_path / "ts", identities=ids, trace=trace)
    rows = sample_rows(tmp_path / "ts", 2)
    expected = expected_renders(records, qwen3, default_training(), identities=ids)
    assert manifest.samples == 2 and trace.renders == expected and set(expected) == {CID, "conv0002"}
    assert check_round_trip(rows, expected, qwen3).ok
    # Each turn's record counts for the nightly table under its own id.
    # By prompt, as a night takes them: a conversation's turns add up under its id.
    assert trace.completion_tokens == {CID: 10 + 20 + 30, "conv0002": 10 + 20 + 30}
    # One turn's mask moved into the tool's answer is caught.
    row = rows[0]
    start = row["loss_mask"].index(1)
    shifted = dict(row, loss_mask=row["loss_mask"][:start] + [0] + row["loss_mask"][start + 1 :])
    assert check_round_trip([shifted], expected, qwen3).failed == 1


def test_conversations_jsonl_carries_every_turn_and_the_tools(qwen3, tmp_path):
    ids = identities()
    records = turn_records(ids, parsed_call=True)
    manifest, [row] = build(records, qwen3, tmp_path / "ts", ids, formats=["parquet", "specforge-conversations"])
    [line] = [json.loads(x) for x in (tmp_path / "ts" / "conversations.jsonl").read_text().splitlines()]
    assert line["id"] == CID and json.loads(line["tools"]) == TOOLS
    assistants = [m for m in line["conversations"] if m["role"] == "assistant"]
    assert [m["content"] for m in assistants] == ["", ANSWERS[1], f"<think>\n{REASONING}\n</think>\n\n{ANSWERS[2]}"]
    assert assistants[0]["tool_calls"] == [CALL]
    # A trainer rendering it with Qwen3's template, as SpecForge does, gets the row's text.
    rendered = qwen3.apply_chat_template(line["conversations"], tools=json.loads(line["tools"]), tokenize=False)
    assert rendered == decode(qwen3, row["input_ids"])


def ended(record, prior):
    """The failed record the engine writes for a turn it does not ask, the one before ending with ``prior``."""
    fields = ("key", "prompt_id", "conversation_id", "turn", "turns", "tools", "source", "mode")
    return {**{k: record[k] for k in fields}, "status": "failed", "error": "turn_unfinished",
            "prior_finish_reasons": prior}


def test_an_unfinished_or_incomplete_conversation_is_left_out(qwen3, tmp_path):
    ids = identities()
    # Turn 2 cut at max_tokens: the engine does not ask turn 3.
    cut = turn_records(ids, finishes=("stop", "length", "stop"))
    cut[2] = ended(cut[2], ["stop", "length"])
    aborted = turn_records(ids, cid="conv0002", finishes=("abort", "stop", "stop"))[:2]
    aborted[1] = ended(aborted[1], ["abort"])
    unanswered = turn_records(ids, cid="conv0003")[:2]  # its last turn not back yet
    failed = turn_records(ids, cid="conv0004")
    failed[1] = {k: v for k, v in failed[1].items() if k not in ("content", "finish_reason")} | {"status": "failed"}
    manifest, rows = build([*cut, *aborted, *unanswered, *failed[:2]], qwen3, tmp_path / "ts", ids)
    assert rows == [] and manifest.conversation_turns_folded == 6
    assert {k: v for k, v in manifest.left_out.items() if v} == {"truncated": 1, "unfinished": 1, "failed": 1}
    # With cut answers kept, the engine goes on, and the whole conversation is a row.
    cut = turn_records(ids, finishes=("stop", "length", "stop"))
    manifest, rows = build(cut, qwen3, tmp_path / "cut", ids)
    assert rows == [] and manifest.left_out["truncated"] == 1
    manifest, rows = build(cut, qwen3, tmp_path / "kept", ids, drop_truncated=False)
    assert [r["id"] for r in rows] == [CID]


TURN_END_DIFFERS = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.role == 'assistant' and not loop.last %}<|endoftext|>{% else %}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_render_that_does_not_split_is_left_out_and_counted(tmp_path):
    """A template ending earlier turns unlike the last: the turn cannot be located, so the
    conversation is left out, and the single-turn answers beside it are kept."""
    tokenizer = AutoTokenizer.from_pretrained(bundled_qwen3_path())
    tokenizer.chat_template = TURN_END_DIFFERS
    ids = identities()
    records = turn_records(ids, thinking=False)
    single = {**records[0], "turns": 1, "prompt_id": "p1", "key": ids.for_prompt("p1").key("p1"),
              "conversation_id": None, "tools": None, "content": "Sunny."}
    manifest, rows = build([*records, single], tokenizer, tmp_path / "ts", ids, min_length=1)
    assert [r["id"] for r in rows] == ["p1"] and manifest.left_out["render_mismatch"] == 1


def test_a_prompt_read_past_the_datasets_own_answer_trains_only_the_models_answer(qwen3, tmp_path):
    """A first-turn source read up to a later user turn keeps the dataset's assistant text as context:
    that text is the dataset's, not the model's, so only the regenerated answer is trained."""
    ids = identities(enable_thinking=False)
    record = {
        "key": ids.for_prompt("p1").key("p1"), "prompt_id": "p1", "source": "infinity", "mode": "default",
        "messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "SOURCE ANSWER"},
                     {"role": "user", "content": FOLLOW_UP}],
        "content": ANSWERS[2], "reasoning_content": None, "finish_reason": "stop", "completion_tokens": 9,
        "status": "ok",
    }
    manifest, [row] = build([record], qwen3, tmp_path / "ts", ids)
    assert manifest.conversations == 0
    assert trained_runs(qwen3, row) == [f"{ANSWERS[2]}<|im_end|>"]
