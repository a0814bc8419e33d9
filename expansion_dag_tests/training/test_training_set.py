"""The tokenized training set: masks, left-out policy, determinism, atomicity, streaming, export."""

import base64
import json
import re
import struct
import weakref
import zlib

import datasets
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from expansion_dag.core import Identity, bundled_qwen3_path, load_tokenizer, render_prompts
from expansion_dag.training import (
    LEFT_OUT_REASONS,
    BuildTrace,
    Manifest,
    build_training_set,
    check_round_trip,
    data_files,
    expected_renders,
    manifest_markdown,
    sample_rows,
)
from expansion_dag_tests.helpers import default_training, one_mode

SYSTEM = "You are terse."
#: The identity every test record is written under unless a test says otherwise.
MODEL = Identity(model="Qwen/Qwen3-8B", simulated=False, fingerprint="current-settings")
SIMULATED = Identity(model="Qwen/Qwen3-8B (simulator)", simulated=True, fingerprint="simulated-settings")
# A ChatML template like Qwen2.5's (no think block), and one that renders reasoning its own way.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_REASONING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<reasoning>{{ m.reasoning_content }}</reasoning>{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def record(i, *, content=None, reasoning="Let me see.\nFine.", source=None, identity=MODEL, **fields):
    """A completion record as store.py writes it, under ``identity``."""
    return {
        "key": identity.key(f"p{i:04d}"),
        "prompt_id": f"p{i:04d}",
        "source": source or f"src{i % 2}",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Question {i}: what is {i} + {i}?"},
        ],
        "content": f"It is {2 * i}. Ça fait {2 * i} 🙂" if content is None else content,
        "reasoning_content": reasoning,
        "finish_reason": "stop",
        "prompt_tokens": 30,
        "completion_tokens": 20,
        "local_prompt_tokens": 30,
        "max_tokens": 1000,
        "server": "http://s0",
        "latency_s": 1.0,
        "attempts": 1,
        "status": "ok",
        **fields,
    }


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer()


@pytest.fixture(scope="module")
def qwen_chatml():
    """Qwen's vocabulary with a ChatML template: the answer follows ``assistant\\n`` directly."""
    tokenizer = AutoTokenizer.from_pretrained(bundled_qwen3_path())
    tokenizer.chat_template = CHATML
    return tokenizer


@pytest.fixture(scope="module")
def tiny():
    """A byte-level BPE trained here, wrapped with a ChatML template that renders reasoning."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(["what is the answer to the question? It is simple."] * 50, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=CHATML_REASONING, eos_token="<|im_end|>"
    )


def build(records, tokenizer, tmp_path, name="ts", chat_template_kwargs=None, **config):
    out = tmp_path / name
    identities = one_mode(MODEL, chat_template_kwargs)
    manifest = build_training_set(records, tokenizer, default_training(**config), out, identities=identities)
    return manifest, pq.read_table(data_files(out)).to_pylist()


def decode(tokenizer, ids):
    return tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=False)


def written(tokenizer, row):
    """The text of the masked tokens, and whether they form one run."""
    ones = "".join(map(str, row["loss_mask"]))
    contiguous = re.fullmatch(r"0*1+0*", ones) is not None
    masked = [i for i, m in zip(row["input_ids"], row["loss_mask"]) if m]
    return decode(tokenizer, masked), contiguous


def server_prompt_ids(tokenizer, rec, kwargs=None):
    text = render_prompts(tokenizer, [rec["messages"]], kwargs)[0]
    return tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids


def test_qwen3_mask_covers_exactly_what_the_assistant_wrote(qwen3, tmp_path):
    records = [record(i) for i in range(4)]
    manifest, rows = build(records, qwen3, tmp_path)
    assert manifest.samples == 4 and [r["id"] for r in rows] == [r["prompt_id"] for r in records]
    im_end = qwen3.convert_tokens_to_ids("<|im_end|>")
    for rec, row in zip(records, rows):
        assistant = f"<think>\nLet me see.\nFine.\n</think>\n\n{rec['content']}<|im_end|>"
        prompt = (
            f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
            f"<|im_start|>user\n{rec['messages'][1]['content']}<|im_end|>\n<|im_start|>assistant\n"
        )
        assert decode(qwen3, row["input_ids"]) == prompt + assistant + "\n"
        assert written(qwen3, row) == (assistant, True)
        # System, user and header tokens are the server's prompt ids, all 0; then the answer,
        # ending with <|im_end|>; the template's newline after it is 0.
        first = row["loss_mask"].index(1)
        assert row["input_ids"][:first] == server_prompt_ids(qwen3, rec)
        assert decode(qwen3, row["input_ids"][:first]) == prompt
        assert row["input_ids"][-2] == im_end and row["loss_mask"][-2:] == [1, 0]
        assert row["length"] == len(row["input_ids"]) == len(row["loss_mask"])


def test_reasoning_drop_and_the_empty_think_block(qwen3, tmp_path):
    rec = record(1)
    _, [thinking_on] = build([rec], qwen3, tmp_path, "on", reasoning="drop")
    _, [thinking_off] = build(
        [record(1, reasoning=None)], qwen3, tmp_path, "off", reasoning="drop",
        chat_template_kwargs={"enable_thinking": False},
    )
    for row in (thinking_on, thinking_off):
        assert "Let me see" not in decode(qwen3, row["input_ids"])
    # Qwen3 renders an empty think block on the last turn either way; only with thinking off is
    # it part of the generation prompt, as the server sent it.
    assert written(qwen3, thinking_on)[0] == f"<think>\n\n</think>\n\n{rec['content']}<|im_end|>"
    assert written(qwen3, thinking_off)[0] == f"{rec['content']}<|im_end|>"
    first = thinking_off["loss_mask"].index(1)
    assert thinking_off["input_ids"][:first] == server_prompt_ids(
        qwen3, rec, {"enable_thinking": False}
    )


def test_quality_gates_count_each_answer_they_leave_out(qwen3, qwen_chatml, tmp_path):
    gates = ("empty", "think_tag_in_content", "reasoning_missing", "reasoning_unexpected")
    records = [
        record(0),
        record(1, content=""),
        # A parser left a tag in the content; a think block never closed (no parser split it).
        record(2, content="It is 4.</think>"),
        record(3, content="<think>\nstill thinking, then cut", reasoning=None),
        record(4, reasoning=None),  # thinking on, yet no reasoning
        record(5, reasoning=""),
    ]
    manifest, rows = build(records, qwen3, tmp_path, "on")
    assert [r["id"] for r in rows] == ["p0000"]
    assert {g: manifest.left_out[g] for g in gates} == {
        "empty": 1, "think_tag_in_content": 2, "reasoning_missing": 2, "reasoning_unexpected": 0
    }
    assert "| reasoning_missing | 2 |" in manifest_markdown(manifest)
    # Thinking off: reasoning is what must not be there (kept or dropped, the model thought).
    for policy in ("keep", "drop"):
        manifest, rows = build(
            records, qwen3, tmp_path, f"off-{policy}", reasoning=policy,
            chat_template_kwargs={"enable_thinking": False},
        )
        assert sorted(r["id"] for r in rows) == ["p0004", "p0005"]
        assert {g: manifest.left_out[g] for g in gates} == {
            "empty": 1, "think_tag_in_content": 2, "reasoning_missing": 0, "reasoning_unexpected": 1
        }
    # A template with no thinking switch sets no reasoning rule; the other gates still hold.
    manifest, rows = build(records, qwen_chatml, tmp_path, "chatml", reasoning="drop")
    assert sorted(r["id"] for r in rows) == ["p0000", "p0004", "p0005"]
    assert manifest.left_out["reasoning_missing"] == manifest.left_out["reasoning_unexpected"] == 0


def test_inline_think_block_is_split_like_a_reasoning_parser_would(qwen3, tmp_path):
    inline = record(1, content="<think>\nLet me see.\nFine.\n</think>\n\nIt is 2.", reasoning=None)
    parsed = record(1, content="It is 2.")
    _, [a] = build([inline], qwen3, tmp_path, "a")
    _, [b] = build([parsed], qwen3, tmp_path, "b")
    _, [dropped] = build([inline], qwen3, tmp_path, "c", reasoning="drop")
    assert a["input_ids"] == b["input_ids"] and a["loss_mask"] == b["loss_mask"]
    assert "Let me see" not in decode(qwen3, dropped["input_ids"])


def test_left_out_records_are_counted_by_reason(qwen3, tmp_path):
    records = [
        record(0),
        record(1, finish_reason="length"),
        record(2, content=""),
        record(3, content=" \n "),
        {**record(4, reasoning="only thoughts"), "content": None},
        record(5, content="<think>\nall thinking</think>\n", reasoning=None),
        {"key": MODEL.key("p0006"), "prompt_id": "p0006", "source": "src0", "status": "failed", "error": "http"},
        record(7, content="word " * 400),
        {**record(8, content="ok", reasoning="k"), "messages": [{"role": "user", "content": "?"}]},
        record(9),
    ]
    manifest, rows = build(records, qwen3, tmp_path, max_length=200, min_length=20)
    assert [r["id"] for r in rows] == ["p0000", "p0009"]
    assert manifest.left_out == {
        "other_identity": 0, "other_mode": 0, "failed": 1, "degenerate": 0, "conversation_ended": 0,
        "unfinished": 0, "truncated": 1, "empty": 4,
        "too_long": 1, "too_short": 1, "think_tag_in_content": 0, "reasoning_missing": 0,
        "reasoning_unexpected": 0, "render_mismatch": 0,
    }
    assert list(manifest.left_out) == list(LEFT_OUT_REASONS)
    # Kept when asked to; and min_length == max_length leaves only samples of exactly that length.
    manifest, rows = build(
        records, qwen3, tmp_path, "kept", max_length=200, min_length=200, drop_truncated=False
    )
    assert manifest.left_out["truncated"] == 0 and manifest.left_out["too_short"] == 4
    assert manifest.samples == 0 and rows == []


def test_manifest_says_what_share_of_the_generated_tokens_reached_the_set(qwen3, tmp_path):
    records = [
        record(0, completion_tokens=100),
        record(1, completion_tokens=300, finish_reason="length"),  # truncated: generated, not kept
        # A degenerate answer stopped mid-stream: its streamed tokens were generated too.
        {"key": MODEL.key("p0002"), "prompt_id": "p0002", "source": "src0", "status": "failed",
         "error": "degenerate", "streamed_chunks": 100},
        record(3, completion_tokens=999, identity=SIMULATED),  # another identity's: not this set's work
    ]
    trace = BuildTrace()
    manifest = build_training_set(records, qwen3, default_training(), tmp_path / "ts", identities=one_mode(MODEL), trace=trace)
    assert (manifest.output_tokens, manifest.output_tokens_in_set, manifest.useful_token_share) == (500, 100, 0.2)
    # The nightly table's figures come from the same pass.
    assert trace.completion_tokens == {"p0000": 100, "p0001": 300} and trace.failed == {"p0002"}


def test_manifest_totals_match_the_rows(qwen3, tmp_path):
    records = [record(i, content="x" * (i * 37 % 300 + 1)) for i in range(40)]
    manifest, rows = build(records, qwen3, tmp_path, chunk_rows=7, rows_per_file=15)
    lengths = sorted(r["length"] for r in rows)
    assert manifest.samples == 40 and manifest.tokens == sum(lengths)
    assert manifest.assistant_tokens == sum(sum(r["loss_mask"]) for r in rows)
    per = manifest.tokens_per_sample
    assert (per["p50"], per["p90"], per["p99"], per["max"]) == (
        lengths[19], lengths[35], lengths[39], lengths[39]
    )
    assert per["mean"] == round(sum(lengths) / 40, 2)
    assert manifest.by_source == {
        s: {"samples": 20, "tokens": sum(r["length"] for r in rows if r["source"] == s)}
        for s in ("src0", "src1")
    }
    assert sum(manifest.histogram["counts"]) == 40 and manifest.histogram["start"] == lengths[0]
    assert [(f["name"], f["rows"]) for f in manifest.files] == [
        ("part-00000.parquet", 15), ("part-00001.parquet", 15), ("part-00002.parquet", 10),
    ]
    assert Manifest.read(tmp_path / "ts") == manifest
    assert manifest.config["chunk_rows"] == 7


def test_same_records_give_byte_identical_files(qwen3, tmp_path):
    records = [record(i) for i in range(25)]
    formats = ["parquet", "specforge-conversations", "specforge-pretokenized"]
    build(records, qwen3, tmp_path, "a", chunk_rows=4, rows_per_file=10, formats=formats)
    build(records, qwen3, tmp_path, "b", chunk_rows=4, rows_per_file=10, formats=formats)
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == ["README.md", "conversations.jsonl", "manifest.json"] + [
        f"part-0000{i}.parquet" for i in range(3)
    ] + ["pretokenized.jsonl"]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_loads_with_datasets_parquet(qwen3, tmp_path):
    manifest, rows = build([record(i) for i in range(9)], qwen3, tmp_path, rows_per_file=4)
    loaded = datasets.load_dataset(
        "parquet", data_files=data_files(tmp_path / "ts"), split="train",
        cache_dir=str(tmp_path / "hf-cache"),
    )
    assert loaded.num_rows == manifest.samples == 9
    assert loaded.features["input_ids"].feature.dtype == "int32"
    assert loaded.features["loss_mask"].feature.dtype == "uint8"
    assert loaded.to_list() == rows


def test_round_trip_check_passes_and_catches_corruption(qwen3, tmp_path):
    records = [record(i) for i in range(12)]
    config = default_training(rows_per_file=5, chunk_rows=4)
    build_training_set(records, qwen3, config, tmp_path / "ts", identities=one_mode(MODEL))
    rows = sample_rows(tmp_path / "ts", 6)
    assert [r["id"] for r in rows] == ["p0000", "p0002", "p0004", "p0006", "p0008", "p0010"]
    expected = expected_renders(iter(records), qwen3, config, identities=one_mode(MODEL))
    result = check_round_trip(rows, expected, qwen3)
    assert result.ok and (result.checked, result.passed, result.failing_ids) == (6, 6, [])
    # The build's own trace holds the same renders: the asset's round trip needs no second pass.
    trace = BuildTrace()
    build_training_set(records, qwen3, config, tmp_path / "again", identities=one_mode(MODEL), trace=trace)
    assert trace.renders == expected

    shifted = dict(rows[1], loss_mask=[0] + rows[1]["loss_mask"][:-1])  # mask one token late
    swapped = dict(rows[2], input_ids=[rows[2]["input_ids"][0] + 1] + rows[2]["input_ids"][1:])
    stranger = dict(rows[3], id="nobody")
    miscounted = dict(rows[4], length=rows[4]["length"] + 1)
    result = check_round_trip([rows[0], shifted, swapped, stranger, miscounted], expected, qwen3)
    assert not result.ok
    assert (result.checked, result.passed, result.failed, result.missing) == (5, 1, 3, 1)
    assert result.failing_ids == ["p0002", "p0004", "nobody", "p0008"]
    # Rendered under other settings, the same rows no longer match.
    dropped = default_training(reasoning="drop")
    assert check_round_trip(rows, expected_renders(records, qwen3, dropped, identities=one_mode(MODEL)), qwen3).failed == 6
    # A row is only right when it comes from the set's own identity.
    assert check_round_trip(rows, expected_renders(records, qwen3, config, identities=one_mode(SIMULATED)), qwen3).missing == 6


def test_conversations_jsonl_matches_the_tokenized_set(qwen3, tmp_path):
    records = [record(0), record(1, finish_reason="length"), record(2, content="word " * 400)]
    config = default_training(max_length=200)
    manifest = build_training_set(records, qwen3, config, tmp_path / "ts", identities=one_mode(MODEL))
    assert manifest.outputs["specforge-conversations"] == ["conversations.jsonl"]
    lines = [json.loads(x) for x in (tmp_path / "ts" / "conversations.jsonl").read_text().splitlines()]
    # Exactly the Parquet set's samples: the cut answer and the over-long one are left out of both.
    assert manifest.samples == len(lines) == 1
    [line] = lines
    assert line == {
        "id": "p0000",
        "conversations": [
            *records[0]["messages"],
            {
                "role": "assistant",
                "content": f"<think>\nLet me see.\nFine.\n</think>\n\n{records[0]['content']}",
            },
        ],
    }
    # A trainer rendering the conversation with Qwen3's template gets the tokenized set's text.
    [row] = pq.read_table(data_files(tmp_path / "ts")).to_pylist()
    rendered = qwen3.apply_chat_template(line["conversations"], tokenize=False)
    assert rendered == decode(qwen3, row["input_ids"])


def test_the_newline_after_the_end_of_turn_is_trained_when_configured(qwen3, tmp_path):
    records = [record(i) for i in range(4)]
    formats = ["parquet", "specforge-pretokenized"]
    default, untrained = build(records, qwen3, tmp_path, "default", formats=formats)
    manifest, rows = build(records, qwen3, tmp_path, "trained", formats=formats, train_newline_after_end_of_turn=True)
    newline = qwen3.encode("\n", add_special_tokens=False)
    for before, after in zip(untrained, rows):
        assert before["input_ids"] == after["input_ids"] and before["input_ids"][-1:] == newline
        assert before["loss_mask"][-1] == 0 and after["loss_mask"] == before["loss_mask"][:-1] + [1]
        assert written(qwen3, after) == (written(qwen3, before)[0] + "\n", True)
    assert manifest.assistant_tokens == default.assistant_tokens + len(records)
    assert "is trained (mask 1)" in manifest.mask_convention and "not trained" in default.mask_convention
    # The trainers' JSONL holds exactly the Parquet rows, and the round trip checks the convention.
    lines = [json.loads(x) for x in (tmp_path / "trained" / "pretokenized.jsonl").read_text().splitlines()]
    assert lines == [{k: r[k] for k in ("id", "input_ids", "loss_mask")} for r in rows]
    config = default_training(train_newline_after_end_of_turn=True)
    assert check_round_trip(rows, expected_renders(records, qwen3, config, identities=one_mode(MODEL)), qwen3).ok
    assert check_round_trip(untrained, expected_renders(records, qwen3, config, identities=one_mode(MODEL)), qwen3).failed == 4


def test_formats_are_checked(qwen3):
    with pytest.raises(ValueError, match="'parquet' among them"):
        default_training(formats=["specforge-pretokenized"])
    with pytest.raises(ValueError, match="formats must name some of"):
        default_training(formats=["parquet", "megatron"])
    assert default_training(formats=["speculators-pretokenized", "parquet", "parquet"]).formats == (
        "parquet", "speculators-pretokenized"
    )


def test_second_template_masks_its_own_reasoning_format(tiny, tmp_path):
    rec = record(3, content="It is simple.", reasoning="what is it?")
    _, [row] = build([rec], tiny, tmp_path, min_length=1)
    assistant = "<reasoning>what is it?</reasoning>It is simple.<|im_end|>"
    assert decode(tiny, row["input_ids"]) == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        f"<|im_start|>user\n{rec['messages'][1]['content']}<|im_end|>\n"
        f"<|im_start|>assistant\n{assistant}\n"
    )
    assert written(tiny, row) == (assistant, True)
    assert row["loss_mask"][-1] == 0


def test_answer_starting_with_whitespace_keeps_the_servers_prompt_ids(qwen_chatml, tmp_path):
    rec = record(1, content=" \nfoo", reasoning=None)
    _, [row] = build([rec], qwen_chatml, tmp_path, min_length=1)
    prompt_ids = server_prompt_ids(qwen_chatml, rec)
    assert row["input_ids"][: len(prompt_ids)] == prompt_ids
    answer = row["length"] - len(prompt_ids) - 1
    assert row["loss_mask"] == [0] * len(prompt_ids) + [1] * answer + [0]
    assert written(qwen_chatml, row) == (" \nfoo<|im_end|>", True)
    # Tokenized whole, the render merges the header's newline with the answer's first characters:
    # offsets alone could not split that token between prompt and answer.
    whole = qwen_chatml.backend_tokenizer.encode(
        decode(qwen_chatml, row["input_ids"]), add_special_tokens=False
    )
    assert whole.ids[: len(prompt_ids)] != prompt_ids


def test_template_that_ignores_reasoning_is_refused_when_reasoning_is_kept(qwen_chatml, tmp_path):
    with pytest.raises(ValueError, match="does not render the assistant's reasoning_content"):
        build([record(1)], qwen_chatml, tmp_path)
    _, [row] = build([record(1)], qwen_chatml, tmp_path, reasoning="drop")
    assert written(qwen_chatml, row)[0] == f"{record(1)['content']}<|im_end|>"


def test_records_are_streamed_in_bounded_chunks(qwen3, tmp_path):
    class Tracked(dict):  # a dict that can be weakly referenced, to see when it is freed
        pass

    alive = peak = produced = 0

    def released():
        nonlocal alive
        alive -= 1

    def stream(n):
        nonlocal alive, peak, produced
        for i in range(n):
            rec = Tracked(record(i))
            weakref.finalize(rec, released)
            alive += 1
            produced += 1
            peak = max(peak, alive)
            yield rec
            del rec  # the generator itself lets go before making the next one

    manifest, _ = build(stream(50), qwen3, tmp_path, chunk_rows=4, rows_per_file=1000)
    assert produced == manifest.samples == 50
    assert peak == 4


def test_failed_build_leaves_the_previous_set_untouched(qwen3, tmp_path):
    build([record(i) for i in range(3)], qwen3, tmp_path)
    before = {p.name: p.read_bytes() for p in (tmp_path / "ts").iterdir()}

    def breaks():
        yield from (record(i) for i in range(10))
        raise RuntimeError("store went away")

    with pytest.raises(RuntimeError, match="store went away"):
        build(breaks(), qwen3, tmp_path, chunk_rows=4)
    assert {p.name: p.read_bytes() for p in (tmp_path / "ts").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ts"]
    with pytest.raises(RuntimeError):
        build(breaks(), qwen3, tmp_path, "fresh", chunk_rows=4)
    assert not (tmp_path / "fresh").exists()


def test_rebuild_replaces_the_previous_set(qwen3, tmp_path):
    build([record(i) for i in range(30)], qwen3, tmp_path, rows_per_file=10)
    manifest, rows = build([record(0)], qwen3, tmp_path, rows_per_file=10)
    names = sorted(p.name for p in (tmp_path / "ts").iterdir())
    assert names == ["README.md", "conversations.jsonl", "manifest.json", "part-00000.parquet"]
    assert manifest.samples == len(rows) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ts"]


def test_empty_set_still_loads(qwen3, tmp_path):
    manifest, rows = build([record(0, content="")], qwen3, tmp_path)
    assert manifest.samples == 0 and rows == [] and manifest.histogram["counts"] == []
    markdown = manifest_markdown(manifest)
    assert "**0 samples**" in markdown and "data:image" not in markdown


def read_png(data):
    """(width, height, rows of palette indices), checking the signature and every chunk's CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body)
        chunks[kind] = body
        pos += 12 + length
    width, height = struct.unpack(">II", chunks[b"IHDR"][:8])
    raw = zlib.decompress(chunks[b"IDAT"])
    rows = [raw[y * (width + 1) : (y + 1) * (width + 1)] for y in range(height)]
    assert all(r[0] == 0 for r in rows)
    return width, height, [r[1:] for r in rows]


def test_manifest_markdown_has_a_histogram_picture_and_tables(qwen3, tmp_path):
    records = [record(i, content="y" * (50 if i < 6 else 900)) for i in range(8)]
    manifest, _ = build(records, qwen3, tmp_path)
    markdown = manifest_markdown(manifest)
    assert "| src0 | 4 |" in markdown and "| src1 | 4 |" in markdown
    assert "| too_long | 0 |" in markdown
    pattern = r"!\[tokens per sample\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)"
    [encoded] = re.findall(pattern, markdown)
    width, height, pixels = read_png(base64.b64decode(encoded))
    counts = manifest.histogram["counts"]
    assert (width, height) == (8 * len(counts), 120) and (counts[0], counts[-1]) == (6, 2)
    column = [row[0] for row in pixels[:-1]]  # the first bar, above the axis row
    assert column == [1] * len(column)  # the tallest bin fills the height
    last = [row[width - 8] for row in pixels[:-1]]
    assert last.count(1) == round(119 * 2 / 6)
    assert [row[8] for row in pixels[:-1]] == [0] * 119  # an empty bin draws nothing


@pytest.mark.parametrize(
    "fields",
    [
        {"reasoning": "maybe"},
        {"min_length": 10, "max_length": 5},
        {"chunk_rows": 0},
        {"rows_per_file": True},
        {"drop_truncated": "yes"},
        {"chunk_rows": 1 << 20, "max_length": 1 << 12},
    ],
)
def test_config_is_validated(fields):
    with pytest.raises(ValueError):
        default_training(**fields)


def test_only_the_current_identity_and_finished_answers_are_taken(qwen3, tmp_path):
    warmer = Identity(model="Qwen/Qwen3-8B", simulated=False, fingerprint="temperature-0.9")
    records = [
        record(0),
        record(0, identity=warmer, content="Another answer to the same prompt."),
        record(1, identity=SIMULATED),
        record(2, identity=SIMULATED),
        record(3, finish_reason="abort"),
        record(4, finish_reason="unknown"),
        record(5, finish_reason="length"),
        {**record(6), "key": "written-by-an-unknown-run"},
        record(7),
    ]
    known = {i.fingerprint: i for i in (MODEL, SIMULATED, warmer)}
    manifest = build_training_set(
        records, qwen3, default_training(drop_truncated=False), tmp_path / "ts", identities=one_mode(MODEL), known=known
    )
    rows = pq.read_table(data_files(tmp_path / "ts")).to_pylist()
    assert [r["id"] for r in rows] == ["p0000", "p0005", "p0007"]  # one answer per prompt
    assert decode(qwen3, rows[0]["input_ids"]).count("It is 0.") == 1
    assert manifest.left_out["other_identity"] == 4 and manifest.left_out["unfinished"] == 2
    assert manifest.other_identities == {
        SIMULATED.label: 2, warmer.label: 1, "unregistered identity": 1,
    }
    assert manifest.identity == MODEL.to_dict() and manifest.simulated is False
    markdown = manifest_markdown(manifest)
    assert "Qwen/Qwen3-8B (simulator) [settings simulated-settings] | 2 |" in markdown
    assert "SIMULATED" not in markdown


def test_a_set_built_from_simulated_answers_says_so(qwen3, tmp_path):
    records = [record(i, identity=SIMULATED) for i in range(3)] + [record(9)]
    manifest = build_training_set(records, qwen3, default_training(), tmp_path / "ts", identities=one_mode(SIMULATED))
    assert manifest.samples == 3 and manifest.left_out["other_identity"] == 1
    assert Manifest.read(tmp_path / "ts").simulated is True
    assert json.loads((tmp_path / "ts" / "manifest.json").read_text())["identity"]["model"].endswith("(simulator)")
    assert manifest_markdown(manifest).startswith("**Built from SIMULATED completions**")
