"""Streamed chat completions: the same Answer as a plain body, loops cut off, errors in the stream."""

import asyncio
import json

import httpx
import pytest

from expansion_dag import servers
from expansion_dag.core import BadResponseError, ContextLengthError, TransientError
from expansion_dag.servers import (
    SGLANG,
    VLLM,
    ChatStream,
    DegenerateError,
    parse_chat_completion,
    parse_chat_stream,
)
from expansion_dag_tests.helpers import default_sampling, loop_thresholds, mock_client

URL = "http://gpu-0:30000"
THRESHOLDS = loop_thresholds()


def sse(chunks):
    """The bytes of an event stream, non-ASCII text as UTF-8 (as both servers send it)."""
    return ("".join(f"data: {json.dumps(c, ensure_ascii=False)}\n\n" for c in chunks) + "data: [DONE]\n\n").encode()


def stream_of(dialect, content_pieces, reasoning_pieces=(), finish="stop", usage=None, *, include_usage=True):
    """Chunks shaped as each server sends them (SGLang: delta.reasoning_content, vLLM: delta.reasoning)."""
    field = dialect.reasoning_fields[0]
    chunks = [{"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
    chunks += [{"choices": [{"index": 0, "delta": {field: r}, "finish_reason": None}]} for r in reasoning_pieces]
    chunks += [{"choices": [{"index": 0, "delta": {"content": c}, "finish_reason": None}]} for c in content_pieces]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    if include_usage:
        chunks.append({"choices": [], "usage": usage or {"prompt_tokens": 12, "completion_tokens": 7}})
    return sse(chunks)


def body_of(dialect, content, reasoning=None, finish="stop", usage=None):
    message = {"role": "assistant", "content": content, dialect.reasoning_fields[0]: reasoning}
    return {
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": usage or {"prompt_tokens": 12, "completion_tokens": 7},
    }


@pytest.mark.parametrize("dialect", [SGLANG, VLLM], ids=["sglang", "vllm"])
@pytest.mark.parametrize("finish", ["stop", "length"])
def test_a_stream_reads_as_the_same_answer_as_the_plain_body(dialect, finish):
    streamed = parse_chat_stream(
        stream_of(dialect, ["The ", "answer", " is 4."], ["Two", " plus two."], finish).splitlines(), dialect
    )
    plain = parse_chat_completion(body_of(dialect, "The answer is 4.", "Two plus two.", finish), dialect)
    assert streamed == plain
    assert streamed.reasoning == "Two plus two." and streamed.finish_reason == finish


def test_a_stream_without_its_usage_chunk_is_a_bad_response_naming_the_option():
    with pytest.raises(BadResponseError, match="include_usage"):
        parse_chat_stream(stream_of(SGLANG, ["hi"], include_usage=False).splitlines(), SGLANG)


def test_an_error_inside_the_stream_is_classified_as_its_code_says():
    sglang_error = {"object": "error", "message": "The input (9000 tokens) is longer than the model's context "
                    "length (8192 tokens).", "type": "BadRequestError", "param": None, "code": 400}
    with pytest.raises(ContextLengthError):
        parse_chat_stream(sse([sglang_error]).splitlines(), SGLANG)
    vllm_error = {"error": {"message": "engine dead", "type": "InternalServerError", "code": 500}}
    with pytest.raises(TransientError, match="engine dead"):
        parse_chat_stream(sse([vllm_error]).splitlines(), VLLM)


def test_a_looping_stream_raises_degenerate_with_its_text():
    pieces = ["Let me think. "] + ["Wait, I should check that again. "] * 200
    with pytest.raises(DegenerateError) as caught:
        parse_chat_stream(stream_of(VLLM, [], pieces).splitlines(), VLLM, THRESHOLDS)
    error = caught.value
    assert error.kind == "degenerate" and not error.retryable
    assert error.loop.span == "Wait, I should check that again. "
    assert error.reasoning.startswith("Let me think. Wait, I should check")
    assert error.chunks < 60  # stopped long before the 201 pieces were read
    # Without thresholds nothing is judged: the same stream is just an answer.
    whole = stream_of(VLLM, [], pieces, usage={"prompt_tokens": 12, "completion_tokens": 1400})
    assert parse_chat_stream(whole.splitlines(), VLLM).completion_tokens == 1400


def send(handler, request, dialect=SGLANG, thresholds=None):
    async def main():
        async with mock_client(handler) as client:
            return await servers.send_chat(client, URL, request, dialect, thresholds, stream_interval=1)

    return asyncio.run(main())


def test_streamed_and_plain_requests_over_http_give_the_same_answer():
    def handler(request):
        body = json.loads(request.content)
        if body.get("stream"):
            assert body["stream_options"] == {"include_usage": True}
            return httpx.Response(200, content=stream_of(SGLANG, ["x = 1\n"] * 5, ["think"]))
        return httpx.Response(200, json=body_of(SGLANG, "x = 1\n" * 5, "think"))

    messages = [{"role": "user", "content": "hi"}]
    plain = servers.chat_request("m", messages, 50, default_sampling())
    streamed = servers.chat_request("m", messages, 50, default_sampling(), stream=True)
    assert "stream" not in plain.body()
    assert send(handler, streamed, thresholds=THRESHOLDS) == send(handler, plain)


def test_a_loop_stops_reading_the_stream_and_an_error_status_is_classified():
    pulled = []

    async def endless():
        yield b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "Intro. "}}]}).encode() + b"\n\n"
        for i in range(5000):
            pulled.append(i)
            yield b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "Same again. "}}]}).encode() + b"\n\n"

    request = servers.chat_request("m", [], 8000, default_sampling(), stream=True)
    with pytest.raises(DegenerateError):
        send(lambda r: httpx.Response(200, content=endless()), request, thresholds=THRESHOLDS)
    assert len(pulled) < 200

    with pytest.raises(TransientError):
        send(lambda r: httpx.Response(503, json={"object": "error", "message": "The request queue is full."}), request)


def test_a_stream_cut_anywhere_reads_as_the_same_answer():
    """Network reads split lines, events and UTF-8 characters anywhere; the answer does not depend on where."""
    events = [
        {"choices": [{"index": 0, "delta": {"content": f" wörd{i} 数"}, "finish_reason": None}]} for i in range(50)
    ] + [{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
         {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 50}}]
    data = ("".join(f"data: {json.dumps(e, ensure_ascii=False)}\r\n\r\n" for e in events) + "data: [DONE]").encode()
    whole = ChatStream(SGLANG, stream_interval=1)
    assert whole.feed(data) is None and whole.end() is None
    for cut in (1, 7, 64):
        stream = ChatStream(SGLANG, stream_interval=1)
        for start in range(0, len(data), cut):
            assert stream.feed(data[start:start + cut]) is None
        stream.end()
        assert stream.answer() == whole.answer()
    assert whole.answer().content == "".join(f" wörd{i} 数" for i in range(50))
    assert whole.answer().completion_tokens == 50 and whole.answer().finish_reason == "stop"


def test_a_stopped_answers_tokens_are_the_servers_count_when_its_chunks_carry_one():
    """A vLLM that ignores ``stream_interval`` (older than the field) still streams every token; its
    continuous usage keeps the count of a stopped loop right instead of 256 tokens an event."""
    request = servers.chat_request("m", [{"role": "user", "content": "q"}], 500, default_sampling(),
                                      stream=True, stream_interval=256, continuous_usage=True)
    assert request.body()["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    events = [{"choices": [{"index": 0, "delta": {"content": " loop"}, "finish_reason": None}],
               "usage": {"prompt_tokens": 3, "completion_tokens": i + 1}} for i in range(400)]
    stream = ChatStream(VLLM, loop_thresholds(min_chars=200), stream_interval=256)
    loop = None
    for event in events:
        loop = loop or stream.feed_line(f"data: {json.dumps(event)}".encode())
    error = stream.degenerate(loop)
    assert error.tokens == error.chunks == len(error.content) // len(" loop") < 400
    # Without the server's count (SGLang), the interval rule: the first token alone, then 256 each.
    counted = ChatStream(SGLANG, stream_interval=256)
    for event in events[:3]:
        counted.feed_line(f"data: {json.dumps({'choices': event['choices']})}".encode())
    assert counted.streamed_tokens == 1 + 2 * 256
