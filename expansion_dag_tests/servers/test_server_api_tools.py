"""Tools in requests and tool calls in answers: the bodies sent, and the calls read back from plain
and streamed answers in each server's shape (see expansion_dag/servers/wire/tools.py for the facts)."""

import json

import pytest

from expansion_dag import servers
from expansion_dag.core import BadResponseError, count_tokens, load_tokenizer
from expansion_dag.servers import SGLANG, VLLM, finish_error, parse_chat_completion, parse_chat_stream
from expansion_dag_tests.helpers import default_sampling

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
#: A Hermes source's tool: its fields in another order than the servers render them.
TOOL = {
    "type": "function",
    "function": {
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "name": "get_weather",
        "description": "The forecast for a city.",
    },
}
SENT = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The forecast for a city.",
        "parameters": TOOL["function"]["parameters"],
    },
}


def request(**kwargs):
    """The body sent for ``MESSAGES`` with ``kwargs``."""
    return servers.chat_request("m", MESSAGES, 100, default_sampling(), **kwargs).body()


def test_a_request_with_tools_sends_them_in_one_form_with_its_tool_choice():
    body = request(tools=[TOOL], tool_choice="none")
    assert body["tools"] == [SENT]
    assert list(body["tools"][0]["function"]) == ["name", "description", "parameters"]
    assert body["tool_choice"] == "none"
    assert request(tools=[TOOL])["tool_choice"] == "auto"


@pytest.mark.parametrize("tools", [None, []])
def test_a_request_without_tools_sends_neither_field(tools):
    # vLLM refuses ``tools: []`` (check_tool_usage).
    body = request(tools=tools)
    assert "tools" not in body and "tool_choice" not in body


def test_request_tools_fill_absent_fields_and_keep_strict_only_when_set():
    bare = {"type": "function", "function": {"name": "now", "strict": None, "unknown": 1}}
    strict = {"type": "function", "function": {"name": "now", "strict": True}}
    assert servers.request_tools([bare, strict]) == [
        {"type": "function", "function": {"name": "now", "description": None, "parameters": None}},
        {"type": "function", "function": {"name": "now", "description": None, "parameters": None, "strict": True}},
    ]


@pytest.mark.parametrize(
    ("dialect", "parser", "choice"),
    [
        (SGLANG, None, "auto"),  # "none" would take the tools out of SGLang's prompt
        (SGLANG, "qwen25", "auto"),
        (VLLM, None, "none"),  # "auto" is a 400 without --enable-auto-tool-choice
        (VLLM, "hermes", "auto"),
    ],
)
def test_the_tool_choice_renders_the_tools_and_is_never_refused(dialect, parser, choice):
    assert servers.tool_choice_for(dialect, parser) == choice


def test_template_tools_are_what_each_server_renders():
    assert servers.template_tools([TOOL], VLLM) == [SENT]
    assert servers.template_tools([TOOL], SGLANG) == [{**SENT, "defer_loading": None}]
    tokenizer = load_tokenizer()

    def count(tools):
        text = tokenizer.apply_chat_template(MESSAGES, tools=tools, tokenize=False, add_generation_prompt=True)
        return count_tokens(tokenizer, [text])[0]

    # SGLang 0.5.23's prompt is longer by its '"defer_loading": null' per tool.
    assert count(servers.template_tools([TOOL], SGLANG)) > count(servers.template_tools([TOOL], VLLM))


# --- answers ---------------------------------------------------------------------------------------

CALL = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
USAGE = {"prompt_tokens": 150, "completion_tokens": 20}


def test_a_plain_sglang_answer_with_tool_calls():
    message = {
        "role": "assistant",
        "content": "",
        "reasoning_content": None,
        "tool_calls": [{"id": "call_1", "index": 0, "type": "function", "function": CALL}],
    }
    body = {"choices": [{"index": 0, "message": message, "finish_reason": "tool_calls", "matched_stop": None}], "usage": USAGE}
    answer = parse_chat_completion(body, SGLANG)
    assert answer.tool_calls == [{"id": "call_1", "type": "function", "function": CALL}]
    assert (answer.content, answer.finish_reason) == ("", "tool_calls")
    assert finish_error(answer) is None


def test_a_plain_vllm_answer_with_tool_calls_and_null_content():
    message = {
        "role": "assistant",
        "content": None,
        "reasoning": None,
        "tool_calls": [
            {"id": "chatcmpl-tool-1", "type": "function", "function": CALL},
            {"id": "chatcmpl-tool-2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
        ],
    }
    body = {"choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}], "usage": USAGE}
    answer = parse_chat_completion(body, VLLM)
    assert [c["function"]["name"] for c in answer.tool_calls] == ["get_weather", "now"]
    assert answer.content == ""


def test_arguments_sent_as_an_object_are_kept_as_json_text():
    # SGLang's FunctionResponse.arguments may be an object.
    message = {"content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"city": "Zürich"}}}]}
    body = {"choices": [{"message": message, "finish_reason": "tool_calls"}], "usage": USAGE}
    call = parse_chat_completion(body, SGLANG).tool_calls[0]
    assert call == {"type": "function", "function": {"name": "f", "arguments": '{"city": "Zürich"}'}}


def test_an_answer_without_tool_calls_has_none():
    for tool_calls in (None, []):
        message = {"content": "<tool_call>\n{}\n</tool_call>", "tool_calls": tool_calls}
        body = {"choices": [{"message": message, "finish_reason": "stop"}], "usage": USAGE}
        assert parse_chat_completion(body, SGLANG).tool_calls is None


def test_a_tool_call_without_a_name_is_not_a_chat_completion():
    message = {"content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}
    with pytest.raises(BadResponseError):
        parse_chat_completion({"choices": [{"message": message}], "usage": USAGE}, SGLANG)


def sse(chunks):
    return [f"data: {json.dumps(c)}".encode() for c in chunks] + [b"data: [DONE]"]


def _chunk(delta, finish=None):
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_streamed_sglang_tool_calls_are_put_together():
    """SGLang: the first delta of a call has its id, name and empty arguments; later ones null id
    and name and fragments of the arguments (``_process_tool_call_stream``)."""

    def piece(index, call_id, name, arguments):
        fn = {"name": name, "arguments": arguments}
        call = {"id": call_id, "index": index, "type": "function", "function": fn}
        return _chunk({"role": None, "content": None, "reasoning_content": None, "tool_calls": [call]})

    chunks = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": "Let me look."}),
        piece(0, "call_a", "get_weather", ""),
        piece(0, None, None, '{"city": '),
        piece(0, None, None, '"Paris"}'),
        piece(1, "call_b", "now", ""),
        piece(1, None, None, "{}"),
        _chunk({}, "tool_calls"),
        {"choices": [], "usage": USAGE},
    ]
    answer = parse_chat_stream(sse(chunks), SGLANG)
    assert answer.tool_calls == [
        {"id": "call_a", "type": "function", "function": CALL},
        {"id": "call_b", "type": "function", "function": {"name": "now", "arguments": "{}"}},
    ]
    assert (answer.content, answer.finish_reason) == ("Let me look.", "tool_calls")
    assert finish_error(answer) is None


def test_streamed_vllm_tool_calls_are_put_together():
    """vLLM's Hermes parser: ``DeltaToolCall(index, type, id, function={name})`` first, then
    ``{index, function: {arguments}}`` diffs (``hermes_tool_parser.py``)."""
    chunks = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": None, "tool_calls": [{"id": "t1", "type": "function", "index": 0, "function": {"name": "get_weather"}}]}),
        _chunk({"content": None, "tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]}),
        _chunk({}, "tool_calls"),
        {"choices": [], "usage": USAGE},
    ]
    answer = parse_chat_stream(sse(chunks), VLLM)
    assert answer.tool_calls == [{"id": "t1", "type": "function", "function": CALL}]


def test_a_streamed_tool_call_that_never_got_its_name_is_a_bad_response():
    chunks = [
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}),
        _chunk({}, "tool_calls"),
        {"choices": [], "usage": USAGE},
    ]
    with pytest.raises(BadResponseError, match="tool call"):
        parse_chat_stream(sse(chunks), VLLM)


def test_a_stream_without_tool_calls_has_none():
    chunks = [_chunk({"content": "hi"}), _chunk({}, "stop"), {"choices": [], "usage": USAGE}]
    assert parse_chat_stream(sse(chunks), VLLM).tool_calls is None
