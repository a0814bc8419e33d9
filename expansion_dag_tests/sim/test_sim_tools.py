"""Tools in simulated requests: rendered and counted as each server does, refused where it refuses
them, and answered with tool calls, raw or parsed, by a share of prompts."""

import json

import pytest

from expansion_dag import servers
from expansion_dag.core import count_tokens
from expansion_dag.sim import SimServerConfig
from expansion_dag_tests.helpers import WEATHER_TOOL

TOOLS = [
    WEATHER_TOOL,
    {"type": "function", "function": {"name": "now", "description": "The time.", "parameters": {"type": "object"}}},
]
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]},
    {"role": "tool", "content": '{"temperature": 21}'},
    {"role": "user", "content": "And tomorrow?"},
]


def template_count(tokenizer, messages, tools, kwargs=None):
    """The bundled Qwen3 tokenizer's count: apply_chat_template(messages, tools=...)."""
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **(kwargs or {}))
    return count_tokens(tokenizer, [text])[0]


def server(fast, backend, **changes):
    vllm = {"backend": "vllm", "served_model_name": "m"} if backend == "vllm" else {}
    return fast(**vllm, **changes)


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
@pytest.mark.parametrize("messages", [CONVERSATION[:2], CONVERSATION], ids=["first-turn", "with-tool-turns"])
def test_prompt_tokens_count_the_tools_as_the_template_renders_them(start_fleet, fast, chat, tokenizer, backend, messages):
    parser = "hermes" if backend == "vllm" else None
    fleet = start_fleet(server(fast, backend, tool_call_parser=parser, enable_auto_tool_choice=bool(parser)))
    dialect = servers.dialect_for(backend)
    tools = servers.request_tools(TOOLS)
    body = chat(fleet.urls[0], messages, tools=tools, tool_choice="auto", max_tokens=50).json()
    expected = template_count(tokenizer, messages, servers.template_tools(TOOLS, dialect))
    assert body["usage"]["prompt_tokens"] == expected
    if backend == "vllm":  # exactly the tools as sent
        assert expected == template_count(tokenizer, messages, tools)
    else:  # SGLang 0.5.23 renders its own "defer_loading": null too
        assert expected > template_count(tokenizer, messages, tools)


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
def test_earlier_tool_calls_are_rendered_with_their_arguments_as_objects(start_fleet, fast, chat, tokenizer, backend):
    """Both servers parse an earlier call's JSON text into an object: its spacing does not count."""
    fleet = start_fleet(server(fast, backend))
    counts = set()
    for arguments in ('{"city":"Paris"}', '{"city": "Paris"}'):
        call = {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        messages = [*CONVERSATION[:2], {**CONVERSATION[2], "tool_calls": [call]}, *CONVERSATION[3:]]
        counts.add(chat(fleet.urls[0], messages, max_tokens=10).json()["usage"]["prompt_tokens"])
    assert counts == {template_count(tokenizer, CONVERSATION, None)}
    broken = {"type": "function", "function": {"name": "get_weather", "arguments": "{city"}}
    response = chat(fleet.urls[0], [*CONVERSATION[:2], {**CONVERSATION[2], "tool_calls": [broken]}], max_tokens=10)
    # SGLang refuses it; vLLM renders {} in its place.
    assert response.status_code == (400 if backend == "sglang" else 200)


def test_with_thinking_off_the_count_still_has_the_tools(start_fleet, fast, chat, tokenizer):
    fleet = start_fleet(fast())
    off = {"enable_thinking": False}
    body = chat(fleet.urls[0], CONVERSATION[:2], tools=TOOLS, chat_template_kwargs=off, max_tokens=50).json()
    assert body["usage"]["prompt_tokens"] == template_count(
        tokenizer, CONVERSATION[:2], servers.template_tools(TOOLS, servers.SGLANG), off
    )


def test_sglang_tool_choice_none_takes_the_tools_out_of_the_prompt(start_fleet, fast, chat, prompt_tokens):
    fleet = start_fleet(fast())
    body = chat(fleet.urls[0], CONVERSATION[:2], tools=TOOLS, tool_choice="none", max_tokens=10).json()
    assert body["usage"]["prompt_tokens"] == prompt_tokens(CONVERSATION[:2])


def test_vllm_without_a_tool_parser_refuses_auto_and_renders_the_tools_with_none(start_fleet, fast, chat, tokenizer):
    fleet = start_fleet(server(fast, "vllm"), server(fast, "vllm", tool_call_parser="hermes"))
    for url in fleet.urls:  # a parser without --enable-auto-tool-choice is no parser
        for fields in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
            response = chat(url, CONVERSATION[:2], **fields)
            assert response.status_code == 400
            assert response.json()["error"]["message"].startswith('"auto" tool choice requires --enable-auto-tool-choice')
        body = chat(url, CONVERSATION[:2], tools=TOOLS, tool_choice="none", max_tokens=10).json()
        assert body["usage"]["prompt_tokens"] == template_count(tokenizer, CONVERSATION[:2], servers.request_tools(TOOLS))


def test_vllm_refuses_an_empty_tools_list_and_a_tool_choice_without_tools(start_fleet, fast, chat):
    fleet = start_fleet(server(fast, "vllm", tool_call_parser="hermes", enable_auto_tool_choice=True))
    assert "`tools` must not be an empty array" in chat(fleet.urls[0], tools=[]).json()["error"]["message"]
    assert "`tools` must be set" in chat(fleet.urls[0], tool_choice="auto").json()["error"]["message"]


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
def test_forced_tool_choices_are_refused_by_the_simulator(start_fleet, fast, chat, backend):
    fleet = start_fleet(server(fast, backend, tool_call_parser="hermes", enable_auto_tool_choice=True))
    named = {"type": "function", "function": {"name": "now"}}
    for choice in ("required", named):
        response = chat(fleet.urls[0], CONVERSATION[:2], tools=TOOLS, tool_choice=choice)
        assert response.status_code == 400 and "simulator" in response.text


def test_a_share_of_prompts_answer_with_a_raw_tool_call_of_a_request_tool(start_fleet, fast, chat, tokenizer):
    fleet = start_fleet(fast(tool_call_share=0.5))
    calls = 0
    for i in range(40):
        messages = [{"role": "user", "content": f"Question {i}: what is the weather?"}]
        body = chat(fleet.urls[0], messages, tools=TOOLS, max_tokens=400).json()
        choice = body["choices"][0]
        content = choice["message"]["content"]
        assert body["usage"]["completion_tokens"] == count_tokens(tokenizer, [content])[0]
        if "<tool_call>" in content:
            calls += 1
            assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
            raw = content.split("<tool_call>\n", 1)[1]
            assert raw.endswith("\n</tool_call>")
            call = json.loads(raw.removesuffix("\n</tool_call>"))
            assert call["name"] in {"get_weather", "now"} and isinstance(call["arguments"], dict)
            # The same prompt calls again, the same way.
            assert chat(fleet.urls[0], messages, tools=TOOLS, max_tokens=400).json()["choices"][0]["message"]["content"] == content
    assert 10 <= calls <= 30
    no_tools = chat(fleet.urls[0], max_tokens=400).json()["choices"][0]["message"]["content"]
    assert "<tool_call>" not in no_tools


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
@pytest.mark.parametrize("reasoning_parser", [None, "qwen3"])
def test_a_server_with_a_tool_parser_answers_parsed_calls_plain_and_streamed(
    start_fleet, fast, chat, tokenizer, backend, reasoning_parser
):
    fleet = start_fleet(
        server(
            fast,
            backend,
            tool_call_parser="hermes",
            enable_auto_tool_choice=True,
            tool_call_share=1.0,
            reasoning_parser=reasoning_parser,
        )
    )
    dialect = servers.dialect_for(backend)
    body = chat(fleet.urls[0], CONVERSATION[:2], tools=TOOLS, tool_choice="auto", max_tokens=400).json()
    plain = servers.parse_chat_completion(body, dialect)
    assert plain.finish_reason == "tool_calls" and servers.finish_error(plain) is None
    assert "<tool_call>" not in plain.content
    (call,) = plain.tool_calls
    assert call["function"]["name"] in {"get_weather", "now"}
    assert isinstance(json.loads(call["function"]["arguments"]), dict)
    # The tokens are those of the raw output: the thinking, then the call as the model wrote it.
    raw_call = f'<tool_call>\n{{"name": "{call["function"]["name"]}", "arguments": {call["function"]["arguments"]}}}\n</tool_call>'
    thinking = f"<think>\n{plain.reasoning}\n</think>\n\n" if plain.reasoning is not None else plain.content
    assert plain.completion_tokens == count_tokens(tokenizer, [thinking + raw_call])[0]

    stream = chat(
        fleet.urls[0], CONVERSATION[:2], tools=TOOLS, max_tokens=400, stream=True, stream_options={"include_usage": True}
    )
    streamed = servers.parse_chat_stream(stream.content.split(b"\n"), dialect)
    assert [c["function"] for c in streamed.tool_calls] == [call["function"]]
    assert (streamed.finish_reason, streamed.content, streamed.completion_tokens) == (
        "tool_calls",
        plain.content,
        plain.completion_tokens,
    )


def test_a_tool_call_that_would_not_fit_leaves_the_answer_cut(start_fleet, fast, chat):
    fleet = start_fleet(fast(tool_call_share=1.0, tool_call_parser="qwen25"))
    choice = chat(fleet.urls[0], CONVERSATION[:2], tools=TOOLS, max_tokens=5).json()["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]


def test_server_info_reports_the_tool_call_parser(start_fleet, fast, client):
    fleet = start_fleet(fast(tool_call_parser="qwen25"), fast())
    assert [client.get(f"{u}/server_info").json()["tool_call_parser"] for u in fleet.urls] == ["qwen25", None]


def test_vllm_auto_tool_choice_needs_a_parser_at_launch():
    with pytest.raises(ValueError, match="enable_auto_tool_choice requires tool_call_parser"):
        SimServerConfig(backend="vllm", enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_share"):
        SimServerConfig(tool_call_share=1.5)
