"""Token ids from the simulated servers: where each real server puts them, plain and streamed, and
only to a request that asks a server able to return them."""

from __future__ import annotations

import json

import pytest

from expansion_dag_tests.helpers import WEATHER_TOOL

SGLEXT = {"return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True}
THINKING = {"max_tokens": 200}


def events(response) -> list[dict]:
    """The JSON chunks of a streamed answer, in order."""
    lines = [line[5:].strip() for line in response.text.splitlines() if line.startswith("data:")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def test_sglang_returns_both_ids_in_the_response_sglext(start_fleet, fast, chat, prompt_tokens):
    url = start_fleet(fast(reasoning_parser="qwen3")).urls[0]
    body = chat(url, **THINKING, **SGLEXT).json()
    sglext, usage = body["sglext"], body["usage"]
    assert len(sglext["input_ids"]) == usage["prompt_tokens"] == prompt_tokens()
    assert [len(ids) for ids in sglext["output_ids"]] == [usage["completion_tokens"]]  # one list a choice
    # Each field is asked for on its own, and neither unless asked.
    assert set(chat(url, **THINKING, return_output_ids_in_sglext=True).json()["sglext"]) == {"output_ids"}
    assert "sglext" not in chat(url, **THINKING).json()


def test_sglang_streams_the_ids_once_in_a_chunk_of_no_choices_before_the_usage(start_fleet, fast, chat):
    url = start_fleet(fast(reasoning_parser="qwen3", stream_interval=4)).urls[0]
    plain = chat(url, **THINKING, **SGLEXT).json()
    chunks = events(chat(url, **THINKING, **SGLEXT, stream=True, stream_options={"include_usage": True}))
    with_ids = [i for i, c in enumerate(chunks) if "sglext" in c]
    assert with_ids == [len(chunks) - 2] and chunks[-2]["choices"] == [] and "usage" in chunks[-1]
    assert chunks[-2]["sglext"] == plain["sglext"]


def test_vllm_returns_prompt_ids_on_the_response_and_output_ids_on_the_choice(start_fleet, fast, chat):
    url = start_fleet(fast(backend="vllm", reasoning_parser="qwen3", stream_interval=4)).urls[0]
    model = {"model": fast().model_name}
    plain = chat(url, **THINKING, **model, return_token_ids=True).json()
    output_ids = plain["choices"][0]["token_ids"]
    assert len(plain["prompt_token_ids"]) == plain["usage"]["prompt_tokens"]
    assert len(output_ids) == plain["usage"]["completion_tokens"]
    chunks = events(chat(url, **THINKING, **model, return_token_ids=True, stream=True))
    # The first chunk carries the prompt's ids, every choice chunk the ids new in it.
    assert chunks[0]["prompt_token_ids"] == plain["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [i for c in chunks[1:] for i in c["choices"][0]["token_ids"]] == output_ids
    unasked = chat(url, **THINKING, **model).json()
    assert unasked["prompt_token_ids"] is None and unasked["choices"][0]["token_ids"] is None


def test_the_answer_ids_decode_to_the_raw_answer_thinking_and_content(start_fleet, fast, chat, tokenizer):
    """As a real server's sampled ids are those it detokenized into the text: a training set built
    from a simulated fleet decodes to its answers. (Canonical ids: that a client keeps the server's
    rather than tokenizing the text again is proved by test_training_set_ids.py and the real engines.)"""
    url = start_fleet(fast(reasoning_parser="qwen3")).urls[0]
    body = chat(url, **THINKING, **SGLEXT).json()
    message, ids = body["choices"][0]["message"], body["sglext"]["output_ids"][0]
    assert body["choices"][0]["finish_reason"] == "stop" and message["reasoning_content"] and message["content"]
    raw = f"<think>\n{message['reasoning_content']}\n</think>\n\n{message['content']}"
    assert tokenizer.decode(ids) == raw and ids == tokenizer.encode(raw, add_special_tokens=False)
    assert len(ids) == body["usage"]["completion_tokens"]
    # Without thinking, the content alone; the same answer is the same ids.
    plain = chat(url, max_tokens=50, chat_template_kwargs={"enable_thinking": False}, **SGLEXT).json()
    ids = plain["sglext"]["output_ids"][0]
    assert tokenizer.decode(ids) == plain["choices"][0]["message"]["content"]
    assert len(ids) == plain["usage"]["completion_tokens"]
    again = chat(url, max_tokens=50, chat_template_kwargs={"enable_thinking": False}, **SGLEXT).json()
    assert again["sglext"] == plain["sglext"]


def test_a_parsed_tool_calls_ids_decode_to_the_call_as_the_model_wrote_it(start_fleet, fast, chat, tokenizer):
    url = start_fleet(fast(tool_call_share=1.0, tool_call_parser="qwen25", reasoning_parser="qwen3")).urls[0]
    body = chat(url, tools=[WEATHER_TOOL], max_tokens=400, **SGLEXT).json()
    message, ids = body["choices"][0]["message"], body["sglext"]["output_ids"][0]
    (call,) = message["tool_calls"]
    function = call["function"]
    name, arguments = function["name"], function["arguments"]
    raw_call = f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'
    raw = f"<think>\n{message['reasoning_content']}\n</think>\n\n{message['content'] or ''}{raw_call}"
    assert tokenizer.decode(ids) == raw and len(ids) == body["usage"]["completion_tokens"]


@pytest.mark.parametrize("config", [dict(token_ids=False), dict(version="0.5.19"), dict(backend="vllm", token_ids=False)])
def test_a_server_without_ids_ignores_the_request_for_them(start_fleet, fast, chat, config):
    url = start_fleet(fast(**config)).urls[0]
    body = chat(url, max_tokens=20, **SGLEXT, return_token_ids=True, model=fast(**config).model_name).json()
    assert "sglext" not in body and body.get("prompt_token_ids") is None
    assert body["choices"][0].get("token_ids") is None


def test_a_skewed_prompt_count_is_as_many_prompt_ids(start_fleet, fast, chat, prompt_tokens):
    for skew in (3, -3):
        url = start_fleet(fast(prompt_token_skew=skew)).urls[0]
        assert len(chat(url, max_tokens=1, **SGLEXT).json()["sglext"]["input_ids"]) == prompt_tokens() + skew
