"""Rows from the ids the server ran and sampled (issue 38), with Qwen3's real tokenizer: the row is
those ids, whatever the text re-tokenizes to; a record without ids is re-tokenized and says so; the
difference re-tokenizing would make is measured; ids that disagree with the text follow one rule."""

import json

import pytest

from expansion_dag.core import (
    IDS_LEFT_OUT,
    OUTPUT_IDS,
    PROMPT_IDS,
    load_tokenizer,
    pack,
    render_prompts,
    unpack,
)
from expansion_dag.servers import find_loop, loop_cut
from expansion_dag.training import (
    LOOP_ROW,
    AnswerJudge,
    BuildTrace,
    build_training_set,
    check_round_trip,
    expected_renders,
    sample_rows,
)
from expansion_dag_tests.helpers import default_training, loop_thresholds, one_mode
from expansion_dag_tests.training import test_training_set_conversations as conversations
from expansion_dag_tests.training.test_training_set import (
    MODEL,
    build,
    decode,
    record,
    server_prompt_ids,
    written,
)

REASONING = "Let me see.\nFine."
#: The word the model "sampled" one character a token: the same text, ids a re-tokenization never gives.
SPELLED = "Fine"


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer()


def encode(tokenizer, text):
    return tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids


def sampled(tokenizer, rec, *, spelled=SPELLED, text=None):
    """The ids a server sampled for ``rec``'s answer (thinking on): its raw text, the word ``spelled``
    one character a token (none: canonical), and the end-of-turn token the server stopped at."""
    raw = text or (f"<think>\n{rec['reasoning_content']}\n</think>\n\n{rec['content']}" if rec["reasoning_content"] else rec["content"])
    head, word, tail = raw.partition(spelled) if spelled else (raw, "", "")
    ids = encode(tokenizer, head) + [i for char in word for i in encode(tokenizer, char)] + encode(tokenizer, tail)
    return ids + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def with_ids(tokenizer, rec, output_ids, prompt_ids=None, kwargs=None):
    """``rec`` as a server that returns ids leaves it: the prompt as it rendered it (with the
    mode's ``kwargs``), the sampled ids."""
    prompt_ids = server_prompt_ids(tokenizer, rec, kwargs) if prompt_ids is None else prompt_ids
    return {**rec, PROMPT_IDS: pack(prompt_ids), OUTPUT_IDS: pack(output_ids), "completion_tokens": len(output_ids)}


def test_a_row_is_the_servers_ids_and_the_mask_exactly_the_sampled_ones(qwen3, tmp_path):
    rec = record(1, reasoning=REASONING)
    output_ids = sampled(qwen3, rec)
    formats = ["parquet", "specforge-pretokenized", "specforge-conversations"]
    manifest, [row] = build([with_ids(qwen3, rec, output_ids)], qwen3, tmp_path, formats=formats)
    prompt_ids, newline = server_prompt_ids(qwen3, rec), encode(qwen3, "\n")
    assert row["input_ids"] == prompt_ids + output_ids + newline
    assert row["loss_mask"] == [0] * len(prompt_ids) + [1] * len(output_ids) + [0]
    assert (row["ids_from"], row["ids_match_text"]) == ("server", True)
    # The same text as the re-tokenized row would decode to, in other ids: the row keeps the sampled ones.
    _, [text_row] = build([rec], qwen3, tmp_path, "text")
    assert decode(qwen3, row["input_ids"]) == decode(qwen3, text_row["input_ids"])
    assert row["input_ids"] != text_row["input_ids"] and text_row["ids_from"] == "retokenized"
    assert written(qwen3, row) == written(qwen3, text_row)
    # The trainers' pre-tokenized file carries the exact ids; the conversations file stays text.
    [line] = [json.loads(x) for x in (tmp_path / "ts" / "pretokenized.jsonl").read_text().splitlines()]
    assert line == {"id": "p0001", "input_ids": row["input_ids"], "loss_mask": row["loss_mask"]}
    [conversation] = [json.loads(x) for x in (tmp_path / "ts" / "conversations.jsonl").read_text().splitlines()]
    assert conversation["conversations"][-1]["content"].endswith(rec["content"])
    assert manifest.ids_from == {"server": 1, "retokenized": 0} and manifest.ids_text_differs == 0
    card = (tmp_path / "ts" / "README.md").read_text()
    assert "1 of 1 rows are the ids the server ran and sampled" in card
    assert "`conversations.jsonl` is text" in card


def test_the_difference_re_tokenizing_would_make_is_measured(qwen3, tmp_path):
    records = [record(i, reasoning=REASONING) for i in range(3)]
    spelled = [with_ids(qwen3, r, sampled(qwen3, r)) for r in records]
    canonical = [with_ids(qwen3, r, sampled(qwen3, r, spelled=None)) for r in records]
    manifest, _ = build(spelled, qwen3, tmp_path, "spelled")
    measured = manifest.retokenization
    # "Fine": one token re-tokenized, four sampled: 4 tokens differ in each row.
    assert (measured["rows_measured"], measured["rows_differing"]) == (3, 3)
    assert (measured["tokens_differing_sum"], measured["tokens_differing_max"]) == (12, 4)
    assert measured["prompt_rows_differing"] == 0 and "first 32 rows" in measured["sample"]
    manifest, _ = build(canonical, qwen3, tmp_path, "canonical")
    assert manifest.retokenization["rows_differing"] == manifest.retokenization["tokens_differing_sum"] == 0
    # A server that renders the prompt otherwise (here: one token more) drifts, id by id.
    drifted = [with_ids(qwen3, records[0], sampled(qwen3, records[0], spelled=None),
                        prompt_ids=encode(qwen3, "\n") + server_prompt_ids(qwen3, records[0]))]
    manifest, [row] = build(drifted, qwen3, tmp_path, "drifted")
    measured = manifest.retokenization
    assert (measured["prompt_rows_differing"], measured["prompt_tokens_differing_max"]) == (1, 1)
    assert (measured["rows_differing"], measured["tokens_differing_sum"]) == (1, 1)
    assert "differ from their re-tokenization" in (tmp_path / "drifted" / "README.md").read_text()


def test_without_ids_or_with_partial_ids_the_row_is_re_tokenized_and_says_so(qwen3, tmp_path):
    rec = record(1, reasoning=REASONING)
    partial = with_ids(qwen3, rec, sampled(qwen3, rec))
    partial["completion_tokens"] += 3  # the stream lost ids: fewer ids than the server counted
    left_out = {**rec, IDS_LEFT_OUT: "the server returned no prompt_ids"}
    _, [plain] = build([rec], qwen3, tmp_path, "plain")
    for name, records, reason in (("none", [rec], "no_ids"), ("partial", [partial], "ids_incomplete"),
                                  ("left-out", [left_out], "ids_incomplete")):
        manifest, [row] = build(records, qwen3, tmp_path, name)
        assert (row["input_ids"], row["loss_mask"]) == (plain["input_ids"], plain["loss_mask"])
        assert (row["ids_from"], row["ids_match_text"]) == ("retokenized", None)
        assert manifest.ids_from == {"server": 0, "retokenized": 1}
        assert manifest.retokenized_because == {reason: 1}
        assert manifest.retokenization["rows_measured"] == 0


def test_ids_that_do_not_decode_to_the_text_win_and_the_row_says_so(qwen3, tmp_path):
    records = [record(i, reasoning=REASONING, content="It is 2.") for i in (1, 2)]
    rewritten = sampled(qwen3, records[0], text=f"<think>\n{REASONING}\n</think>\n\nIt is 3.")
    # Whitespace around </think> is the reasoning parser's to strip: not a disagreement.
    stripped = sampled(qwen3, records[1], text=f"<think>\n\n{REASONING}\n\n</think>\n\n\nIt is 2.")
    manifest, rows = build([with_ids(qwen3, records[0], rewritten), with_ids(qwen3, records[1], stripped)],
                           qwen3, tmp_path, min_length=1)
    assert [r["input_ids"][-len(rewritten) - 1 : -1] for r in rows] == [rewritten, stripped]
    assert [(r["ids_from"], r["ids_match_text"]) for r in rows] == [("server", False), ("server", True)]
    assert manifest.ids_text_differs == 1
    assert "1 of them do not decode to the text the server returned" in (tmp_path / "ts" / "README.md").read_text()


def test_an_answer_cut_without_an_end_of_turn_gets_the_templates(qwen3, tmp_path):
    rec = record(1, reasoning=REASONING, finish_reason="length")
    output_ids = sampled(qwen3, rec)[:-1]
    _, [row] = build([with_ids(qwen3, rec, output_ids)], qwen3, tmp_path, drop_truncated=False)
    im_end = qwen3.convert_tokens_to_ids("<|im_end|>")
    assert row["input_ids"][-len(output_ids) - 2 :] == output_ids + [im_end] + encode(qwen3, "\n")
    assert row["loss_mask"][-2:] == [1, 0]


def stopped_loop(tokenizer, i, content):
    """The failure record of an answer the client stopped as a loop (``content`` as streamed, no
    end of turn), with the ids a vLLM server streamed with it and where its loop began."""
    loop = find_loop(content, loop_thresholds())
    rec = record(i, content=content, reasoning=REASONING)
    for name in ("finish_reason", "completion_tokens", "prompt_tokens", "latency_s"):
        del rec[name]
    output_ids = sampled(tokenizer, rec, spelled=None)[:-1]
    rec |= {
        "status": "failed", "error": "degenerate", "outcome": "content", "loop_rule": loop.rule,
        "loop_span": loop.span, "loop_cut": loop_cut(content, loop), "streamed_tokens": len(output_ids),
        PROMPT_IDS: pack(server_prompt_ids(tokenizer, rec)), OUTPUT_IDS: pack(output_ids),
    }
    return rec, output_ids


def test_a_stopped_loops_text_before_the_loop_is_a_row_of_the_sampled_ids_cut_on_a_token(qwen3, tmp_path):
    span = "Wait, let me reconsider the problem from the start. "
    rec, output_ids = stopped_loop(qwen3, 1, "First, add the two numbers: 7 + 5 = 12. " + span * 12)
    manifest, rows = build([rec, record(2, reasoning=REASONING)], qwen3, tmp_path)
    row, whole = (next(r for r in rows if r["id"] == i) for i in ("p0001", "p0002"))
    prompt_ids = server_prompt_ids(qwen3, rec)
    kept = row["input_ids"][len(prompt_ids) :]
    # The sampled ids up to the end of the loop's first copy, as they are: no end of turn after them.
    assert row["input_ids"][: len(prompt_ids)] == prompt_ids and kept == output_ids[: len(kept)]
    assert row["loss_mask"] == [0] * len(prompt_ids) + [1] * len(kept)
    text = decode(qwen3, kept)
    said = f"<think>\n{REASONING}\n</think>\n\n{rec['content'][: rec['loop_cut']]}"
    assert said.startswith(text) and len(text) >= len(said) - 1 and text.count("Wait, let me reconsider") == 1
    assert (row["truncated"], row["loop_rule"], row["ids_from"], row["ids_match_text"]) == ("loop", "exact", "server", True)
    # Counted apart: the manifest and the card; a whole answer beside it is marked as none.
    assert manifest.samples == 2 and manifest.loop_rows == {"exact": 1} and manifest.left_out["degenerate"] == 0
    assert whole["truncated"] is None and whole["loop_rule"] is None
    assert "1 of the samples (50.0%) are answers cut before a loop" in (tmp_path / "ts" / "README.md").read_text()
    judge = AnswerJudge(qwen3, default_training(), one_mode(MODEL))
    assert judge(rec) == LOOP_ROW and judge.kept_tokens(rec) == len(kept)
    # loop_prefix: drop leaves the loop out whole, as before.
    dropped, rows = build([rec], qwen3, tmp_path, "dropped", loop_prefix="drop")
    assert rows == [] and dropped.left_out["degenerate"] == 1 and dropped.loop_rows == {}
    assert AnswerJudge(qwen3, default_training(loop_prefix="drop"), one_mode(MODEL))(rec) == "degenerate"


def test_a_stopped_loop_without_ids_is_a_row_of_its_text(qwen3, tmp_path):
    rec, _ = stopped_loop(qwen3, 1, "First, add the two numbers. " + "Then check it again. " * 30)
    no_ids = {k: v for k, v in rec.items() if k not in (PROMPT_IDS, OUTPUT_IDS)}  # SGLang sends none before the end
    manifest, [row] = build([no_ids], qwen3, tmp_path)
    assert row["ids_from"] == "retokenized" and row["truncated"] == "loop"
    # The text rendered by the template, which closes the turn (no ids say where the model stopped).
    assert "First, add the two numbers. Then check it again" in decode(qwen3, row["input_ids"])
    assert decode(qwen3, row["input_ids"]).count("check it again") == 1
    # A loop from the first word keeps its first copy: what the model wrote once.
    at_once, _ = stopped_loop(qwen3, 2, "Then check it again. " * 30)
    _, [row] = build([at_once], qwen3, tmp_path, "at-once")
    assert decode(qwen3, row["input_ids"]).count("check it again") == 1


def test_dropped_reasoning_is_re_tokenized_since_no_one_sampled_that_sequence(qwen3, tmp_path):
    rec = record(1, reasoning=REASONING)
    manifest, [row] = build([with_ids(qwen3, rec, sampled(qwen3, rec))], qwen3, tmp_path, reasoning="drop")
    assert row["ids_from"] == "retokenized" and REASONING not in decode(qwen3, row["input_ids"])
    assert manifest.retokenized_because == {"reasoning_dropped": 1}


def test_round_trip_checks_rows_from_ids_against_their_records(qwen3, tmp_path):
    records = [with_ids(qwen3, r, sampled(qwen3, r)) for r in (record(i, reasoning=REASONING) for i in range(4))]
    records.append(record(9))  # and one without ids, beside them
    records.append(stopped_loop(qwen3, 10, "First, add them. " + "Wait, let me reconsider the problem. " * 15)[0])
    config = default_training()
    trace = BuildTrace()
    build_training_set(records, qwen3, config, tmp_path / "ts", identities=one_mode(MODEL), trace=trace)
    expected = expected_renders(records, qwen3, config, identities=one_mode(MODEL))
    rows = sample_rows(tmp_path / "ts", 6)
    assert len(rows) == 6 and trace.renders == expected and check_round_trip(rows, expected, qwen3).ok
    shifted = dict(rows[0], loss_mask=[0] + rows[0]["loss_mask"][:-1])
    swapped = dict(rows[1], input_ids=[rows[1]["input_ids"][0] + 1] + rows[1]["input_ids"][1:])
    assert check_round_trip([shifted, swapped], expected, qwen3).failed == 2


def conversation_with_ids(tokenizer, ids, *, prompt_ids=None):
    """The hermes conversation of the conversations tests, every turn with the ids its server returned:
    each turn's prompt as the server rendered it, each answer with its reasoning, "clear" spelled."""
    kwargs = ids.mix.modes[0].chat_template_kwargs
    out = []
    for rec in conversations.turn_records(ids, thinking=True):
        [prompt] = render_prompts(tokenizer, [rec["messages"]], kwargs, tools=[rec["tools"]])
        out.append(with_ids(tokenizer, rec, sampled(tokenizer, rec, spelled="clear"), encode(tokenizer, prompt)))
    if prompt_ids is not None:
        out[-1][PROMPT_IDS] = pack(prompt_ids)
    return out


def server_ids(rec):
    return unpack(rec[PROMPT_IDS]), unpack(rec[OUTPUT_IDS])


def test_a_conversations_earlier_turns_are_the_servers_rendering_in_the_last_prompt(qwen3, tmp_path):
    ids = conversations.identities()
    records = conversation_with_ids(qwen3, ids)
    manifest, [row] = conversations.build(records, qwen3, tmp_path / "ts", ids)
    last = records[-1]
    prompt_ids, output_ids = server_ids(last)
    # The last turn's context as the server ran it, then what it sampled: turn 2's own sampled ids
    # (its reasoning) are not in the row, its rendering in turn 3's prompt is.
    assert row["input_ids"] == prompt_ids + output_ids + encode(qwen3, "\n") and row["ids_from"] == "server"
    earlier = [f"{conversations.ANSWERS[0]}<|im_end|>", f"{last['messages'][-2]['content']}<|im_end|>"]
    assert conversations.trained_runs(qwen3, row) == [*earlier, decode(qwen3, output_ids)]
    assert conversations.REASONING not in decode(qwen3, row["input_ids"][: len(prompt_ids)])
    # Re-tokenized, the last answer's spelled word differs; the prompt is the client's own render.
    measured = manifest.retokenization
    assert (measured["rows_differing"], measured["prompt_rows_differing"]) == (1, 0)
    assert measured["tokens_differing_max"] >= len("clear")


def test_a_conversation_whose_server_prompt_is_not_the_clients_render_is_re_tokenized(qwen3, tmp_path):
    """Its earlier turns cannot be found in the server's prompt: the row is the text's, and says why."""
    ids = conversations.identities()
    records = conversation_with_ids(qwen3, ids)
    other = encode(qwen3, "<|im_start|>system\nAnother prompt.<|im_end|>\n") + server_ids(records[-1])[0]
    manifest, [row] = conversations.build(conversation_with_ids(qwen3, ids, prompt_ids=other), qwen3, tmp_path / "ts", ids)
    _, [text_row] = conversations.build([{k: v for k, v in r.items() if k not in (PROMPT_IDS, OUTPUT_IDS)} for r in records],
                                        qwen3, tmp_path / "text", ids)
    assert row["ids_from"] == "retokenized" and row["input_ids"] == text_row["input_ids"]
    assert manifest.retokenized_because == {"prompt_not_located": 1} and manifest.left_out["render_mismatch"] == 0
