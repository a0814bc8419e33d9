"""Per-prompt budgets from exact token counts, and shards balanced on expected work."""

import json

import polars as pl
import pytest

from expansion_dag.core import count_prompt_tokens, load_tokenizer, render_prompts
from expansion_dag.prompts import (
    PROMPT_OVER_INPUT_LIMIT,
    PROMPT_TOO_LONG,
    budget_prompts,
    extract_prompts,
    load_catalog,
    load_source,
)
from expansion_dag_tests.helpers import default_budget

MESSAGES = pl.List(pl.Struct({"role": pl.String, "content": pl.String}))


def prompt_frame(texts, sources=None):
    return pl.DataFrame(
        {
            "prompt_id": [f"p{i:04d}" for i in range(len(texts))],
            "source": sources or ["src"] * len(texts),
            "messages": [[{"role": "user", "content": t}] for t in texts],
        },
        schema={"prompt_id": pl.String, "source": pl.String, "messages": MESSAGES},
    )


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_prompt_tokens_are_counted_as_the_server_counts_them(tokenizer):
    frame = prompt_frame(["What is 2 + 2?", "Write a poem about the sea " * 20])
    result = budget_prompts(frame, tokenizer, context_length=8192, num_shards=1, config=default_budget())
    expected = [
        len(tokenizer.apply_chat_template(m, tokenize=True, add_generation_prompt=True, return_dict=False))
        for m in frame["messages"].to_list()
    ]
    assert result.prompts.sort("prompt_id")["prompt_tokens"].to_list() == expected


def test_chat_template_arguments_change_the_count(tokenizer):
    frame = prompt_frame(["Hello there"])
    plain = budget_prompts(frame, tokenizer, context_length=8192, num_shards=1, config=default_budget())
    no_think = budget_prompts(
        frame, tokenizer, context_length=8192, num_shards=1,
        config=default_budget(chat_template_kwargs={"enable_thinking": False}),
    )
    # Qwen3 appends an empty <think></think> block when thinking is off: the server counts it.
    assert no_think.prompts["prompt_tokens"][0] == plain.prompts["prompt_tokens"][0] + 4


def test_a_cap_at_the_context_length_still_leaves_every_request_inside_the_window(tokenizer):
    frame = prompt_frame(["word " * n for n in (30, 100, 300)])
    config = default_budget(max_output_tokens=8192, margin=16)
    result = budget_prompts(frame, tokenizer, context_length=8192, num_shards=2, config=config)
    rows = result.prompts
    assert (rows["prompt_tokens"] + rows["max_tokens"] <= 8192 - 16).all()
    assert rows["max_tokens"].to_list() == [8192 - 16 - p for p in rows["prompt_tokens"].to_list()]


def test_the_cap_wins_when_it_is_smaller(tokenizer):
    result = budget_prompts(
        prompt_frame(["hi"]), tokenizer, context_length=32768, num_shards=1,
        config=default_budget(max_output_tokens=4096),
    )
    assert result.prompts["max_tokens"].to_list() == [4096]


def test_prompts_that_cannot_fit_the_minimum_answer_are_set_aside_with_a_reason(tokenizer):
    frame = prompt_frame(["short question", "long " * 1000])
    config = default_budget(min_output_tokens=256, max_output_tokens=1024)
    result = budget_prompts(frame, tokenizer, context_length=1200, num_shards=1, config=config)
    assert result.prompts["prompt_id"].to_list() == ["p0000"]
    assert result.set_aside["prompt_id"].to_list() == ["p0001"]
    assert result.set_aside["reason"].to_list() == [PROMPT_TOO_LONG]
    assert "min_output_tokens 256" in result.set_aside["detail"][0]


def test_prompts_over_the_servers_input_limit_are_set_aside_though_the_context_has_room(tokenizer):
    # SGLang's max_req_input_len follows the KV cache too: a 600-token prompt in a 32k context is
    # still refused by a server whose limit is 500, so it is never sent.
    frame = prompt_frame(["short question", "long " * 600])
    result = budget_prompts(frame, tokenizer, context_length=32768, num_shards=1, config=default_budget(),
                            max_prompt_tokens=500)
    assert result.prompts["prompt_id"].to_list() == ["p0000"]
    assert result.set_aside["reason"].to_list() == [PROMPT_OVER_INPUT_LIMIT]
    assert "input limit of 500" in result.set_aside["detail"][0]


def test_shards_are_balanced_on_expected_tokens_not_rows(tokenizer):
    # Every fourth prompt is long: dealing rows out in turn would put all of them on one shard.
    texts = ["essay " * 1500 if i % 4 == 0 and i < 32 else "ok?" for i in range(100)]
    config = default_budget(expected_output_tokens=200, max_output_tokens=4096, min_output_tokens=16)
    result = budget_prompts(prompt_frame(texts), tokenizer, context_length=8192, num_shards=4, config=config)
    stats = result.shard_stats()
    assert stats["shard"].to_list() == ["shard-00", "shard-01", "shard-02", "shard-03"]
    assert result.balance() < 1.05
    long_per_shard = result.prompts.filter(pl.col("prompt_tokens") > 1000).group_by("shard").len()["len"]
    assert sorted(long_per_shard.to_list()) == [2, 2, 2, 2]


def test_shard_assignment_is_the_same_on_every_run(tokenizer):
    frame = prompt_frame([f"question number {i} " * (i % 7 + 1) for i in range(60)])
    first = budget_prompts(frame, tokenizer, context_length=8192, num_shards=3, config=default_budget())
    again = budget_prompts(frame.sample(fraction=1.0, shuffle=True, seed=3), tokenizer, context_length=8192, num_shards=3,
                           config=default_budget())
    assert first.prompts.select("prompt_id", "shard").equals(again.prompts.select("prompt_id", "shard"))


def test_per_source_expected_output_drives_expected_work(tokenizer):
    frame = prompt_frame(["same prompt a", "same prompt b"], sources=["chat", "code"])
    config = default_budget(expected_output_by_source={"code": 3000}, expected_output_tokens=100)
    rows = budget_prompts(frame, tokenizer, context_length=8192, num_shards=1, config=config).prompts
    work = dict(zip(rows["source"], rows["expected_tokens"] - rows["prompt_tokens"]))
    assert work == {"chat": 100, "code": 3000}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_output_tokens": 0}, "max_output_tokens must be positive"),
        ({"min_output_tokens": 0}, "min_output_tokens must be positive"),
        ({"min_output_tokens": 500, "max_output_tokens": 100}, "exceeds max_output_tokens"),
        ({"margin": -1}, "margin must not be negative"),
    ],
)
def test_invalid_budget_settings_say_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        default_budget(**kwargs)


def test_a_context_too_small_for_any_answer_is_refused(tokenizer):
    with pytest.raises(ValueError, match="leaves no room"):
        budget_prompts(prompt_frame(["x"]), tokenizer, context_length=100, num_shards=1, config=default_budget())


def test_counting_matches_the_shared_tokenizer_helper(tokenizer):
    frame = prompt_frame(["alpha", "beta gamma"])
    counts = count_prompt_tokens(tokenizer, frame["messages"].to_list())
    result = budget_prompts(frame, tokenizer, context_length=8192, num_shards=1, config=default_budget())
    assert result.prompts.sort("prompt_id")["prompt_tokens"].to_list() == counts


@pytest.fixture(scope="module")
def hermes_conversations(tmp_path_factory):
    """The bundled hermes sample's conversation prompts, as the prompts stage gives them."""
    spec = load_catalog("samples").source("hermes_fc")
    raw = pl.from_arrow(load_source(spec, cache_dir=tmp_path_factory.mktemp("hf-cache")).data.table)
    return extract_prompts(raw, source=spec.name, extractor=spec.extractor, conversation=True).prompts


def test_a_prompt_with_tools_is_counted_with_them_in_the_template(tokenizer, hermes_conversations):
    prompts = hermes_conversations
    result = budget_prompts(prompts, tokenizer, context_length=8192, num_shards=1, config=default_budget())
    rows = result.prompts.filter(pl.col("tools").is_not_null())
    assert rows.height >= 10
    for row in rows.iter_rows(named=True):
        ids = tokenizer.apply_chat_template(
            row["messages"], tools=json.loads(row["tools"]), add_generation_prompt=True, return_dict=False
        )
        assert row["prompt_tokens"] == len(ids)
    # The tools are rendered by the template, and they are what makes the count.
    without = count_prompt_tokens(tokenizer, rows["messages"].to_list())
    assert all(a > b + 50 for a, b in zip(rows["prompt_tokens"], without, strict=True))
    # Every input column goes on: the conversation stages read them.
    assert {"conversation", "tools", "row_index"} <= set(result.prompts.columns)


def test_each_mode_counts_with_its_own_template_arguments(tokenizer, hermes_conversations):
    prompts = hermes_conversations.head(6)
    modes = prompts.with_columns(mode=pl.Series(["on", "off"] * 3))
    config = default_budget(
        chat_template_kwargs_by_mode={"on": {"enable_thinking": True}, "off": {"enable_thinking": False}}
    )
    counted = budget_prompts(modes, tokenizer, context_length=8192, num_shards=1, config=config).prompts
    for row in counted.iter_rows(named=True):
        ids = tokenizer.apply_chat_template(
            row["messages"],
            tools=json.loads(row["tools"]) if row["tools"] else None,
            add_generation_prompt=True,
            return_dict=False,
            enable_thinking=row["mode"] == "on",
        )
        assert row["prompt_tokens"] == len(ids), row["mode"]
    on = budget_prompts(prompts, tokenizer, context_length=8192, num_shards=1, config=default_budget()).prompts
    off = counted.filter(pl.col("mode") == "off").join(on, on="prompt_id", suffix="_on")
    # Thinking off adds the empty <think></think> block the server counts.
    assert (off["prompt_tokens"] == off["prompt_tokens_on"] + 4).all() and off.height == 3
    stranger = modes.with_columns(mode=pl.lit("other"))
    with pytest.raises(ValueError, match=r"no chat_template_kwargs for mode 'other' \(modes configured: on, off"):
        budget_prompts(stranger, tokenizer, context_length=8192, num_shards=1, config=config)


def test_rendering_gives_each_conversation_its_own_tools(tokenizer):
    conversations = [[{"role": "user", "content": f"question {i}"}] for i in range(4)]
    weather = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    stocks = [{"type": "function", "function": {"name": "stocks", "parameters": {"type": "object"}}}]
    tools = [None, weather, stocks, None]
    rendered = render_prompts(tokenizer, conversations, {"enable_thinking": False}, tools=tools)
    assert rendered == [
        tokenizer.apply_chat_template(
            c, tools=t, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        for c, t in zip(conversations, tools, strict=True)
    ]
    assert '"name": "weather"' in rendered[1] and '"name": "stocks"' in rendered[2]
    assert "<tools>" not in rendered[0] + rendered[3]
    plain = render_prompts(tokenizer, conversations)
    assert plain == render_prompts(tokenizer, conversations, tools=[None] * 4)
    with pytest.raises(ValueError, match="3 tool lists for 4 conversations"):
        render_prompts(tokenizer, conversations, tools=tools[:3])
