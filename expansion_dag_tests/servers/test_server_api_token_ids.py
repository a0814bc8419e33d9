"""Token ids: asked of the servers that return them, read from plain and streamed bodies as each
server sends them, and packed into records only whole.

The bodies are shaped as the wheels serialize them: SGLang 0.5.23's ``ChatCompletionResponse``
and ``ChatCompletionStreamResponse`` with their response-level ``SglExt`` (``input_ids``,
``output_ids`` one list a choice; ``serving_chat._generate_chat_stream`` sends them once, in a chunk
of no choices before the usage), and vLLM 0.32's (``chat_completion/protocol.py``:
``prompt_token_ids`` on the response and on the first chunk, ``token_ids`` on each choice, a
streamed chunk's the new ones only).
"""

import array
import json

import pytest

from expansion_dag import core
from expansion_dag.core import BadResponseError
from expansion_dag.servers import (
    SGLANG,
    VLLM,
    chat_request,
    dialect_for,
    parse_chat_completion,
    parse_chat_stream,
)
from expansion_dag_tests.helpers import default_sampling

PROMPT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
OUTPUT = [785, 4226, 374, 220, 19, 13, 151645]


def sse(chunks):
    return [f"data: {json.dumps(c)}".encode() for c in chunks] + [b"data: [DONE]"]


def usage(completion_tokens=len(OUTPUT)):
    return {"prompt_tokens": len(PROMPT), "completion_tokens": completion_tokens, "total_tokens": 99}


def sglang_body(sglext):
    body = {
        "id": "x", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "The answer is 4.",
                     "reasoning_content": None}, "logprobs": None, "finish_reason": "stop", "matched_stop": 151645}],
        "usage": usage(), "metadata": {"weight_version": "default"},
    }
    return body | ({"sglext": sglext} if sglext is not None else {})


def vllm_body(prompt_ids, output_ids):
    return {
        "id": "chatcmpl-x", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "The answer is 4.", "reasoning": None},
                     "logprobs": None, "finish_reason": "stop", "stop_reason": None, "token_ids": output_ids}],
        "usage": usage(), "prompt_logprobs": None, "prompt_token_ids": prompt_ids,
    }


def sglang_stream(with_ids=True):
    head = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    chunks = [head | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    chunks += [head | {"choices": [{"index": 0, "delta": {"content": t}, "finish_reason": None}]} for t in ("The answer", " is 4.")]
    chunks.append(head | {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "matched_stop": 151645}]})
    if with_ids:
        chunks.append(head | {"choices": [], "usage": None, "sglext": {"input_ids": PROMPT, "output_ids": [OUTPUT]}})
    chunks.append(head | {"choices": [], "usage": usage()})
    return sse(chunks)


def vllm_stream():
    head = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    chunks = [head | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "prompt_token_ids": PROMPT}]
    chunks += [
        head | {"choices": [{"index": 0, "delta": {"content": "The answer"}, "token_ids": OUTPUT[:2]}]},
        head | {"choices": [{"index": 0, "delta": {"content": " is 4."}, "token_ids": OUTPUT[2:6]}]},
        head | {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "token_ids": OUTPUT[6:]}]},
        head | {"choices": [], "usage": usage()},
    ]
    return sse(chunks)


def ids_of(answer):
    return (None if answer.prompt_ids is None else answer.prompt_ids.tolist(),
            None if answer.output_ids is None else answer.output_ids.tolist())


def test_packed_ids_unpack_to_the_same_ids_across_the_whole_uint32_range():
    ids = [0, 1, 255, 151645, 2**32 - 1]
    assert core.unpack(core.pack(ids)) == ids
    assert core.unpack(core.pack(array.array("I", ids))) == ids
    assert core.unpack(core.pack([])) == []
    with pytest.raises(ValueError):
        core.unpack("AAA=")  # two bytes: not whole ids


def test_each_server_is_asked_for_ids_in_its_own_fields_and_an_older_sglang_is_not_asked():
    def asked(dialect, **kw):
        request = chat_request("m", [], 8, default_sampling(), token_ids=dialect.token_ids, **kw)
        return {k for k in request.body() if "ids" in k}

    both = {"return_input_ids_in_sglext", "return_output_ids_in_sglext"}
    assert asked(SGLANG) == both and asked(SGLANG, stream=True) == both
    assert asked(VLLM) == {"return_token_ids"} == asked(VLLM, stream=True)
    # The fields arrived in SGLang 0.5.20; the 0.5.19 wheel has neither.
    assert dialect_for("sglang", "0.5.20").token_ids == "sglext"
    for version in ("0.5.19", "0.5.7", "0.5.4"):
        assert asked(dialect_for("sglang", version)) == set()


@pytest.mark.parametrize("dialect", [SGLANG, VLLM], ids=["sglang", "vllm"])
def test_plain_and_streamed_answers_carry_the_same_ids(dialect):
    if dialect is SGLANG:
        plain = parse_chat_completion(sglang_body({"input_ids": PROMPT, "output_ids": [OUTPUT]}), dialect)
        streamed = parse_chat_stream(sglang_stream(), dialect)
    else:
        plain = parse_chat_completion(vllm_body(PROMPT, OUTPUT), dialect)
        streamed = parse_chat_stream(vllm_stream(), dialect)
    assert ids_of(plain) == ids_of(streamed) == (PROMPT, OUTPUT)
    assert plain == streamed and streamed.content == "The answer is 4."


def test_answers_without_ids_carry_none():
    assert ids_of(parse_chat_completion(sglang_body(None), SGLANG)) == (None, None)
    assert ids_of(parse_chat_stream(sglang_stream(with_ids=False), SGLANG)) == (None, None)
    assert ids_of(parse_chat_completion(vllm_body(None, None), VLLM)) == (None, None)
    # A dialect that cannot return ids reads none even where a body has some.
    old = dialect_for("sglang", "0.5.7")
    assert ids_of(parse_chat_completion(sglang_body({"input_ids": PROMPT, "output_ids": [OUTPUT]}), old)) == (None, None)


@pytest.mark.parametrize("bad", [[-1], [2**32], ["7"], {"0": 1}])
def test_ids_that_are_not_uint32_ids_are_a_bad_response(bad):
    with pytest.raises(BadResponseError):
        parse_chat_completion(vllm_body(PROMPT, bad), VLLM)
    with pytest.raises(BadResponseError):
        parse_chat_stream(sse([{"choices": [], "sglext": {"input_ids": PROMPT, "output_ids": [bad]}}]), SGLANG)


def test_a_record_keeps_ids_only_whole_and_says_why_it_left_them_out():
    fields = core.record_fields(PROMPT, OUTPUT, len(OUTPUT))
    assert core.unpack(fields[core.PROMPT_IDS]) == PROMPT
    assert core.unpack(fields[core.OUTPUT_IDS]) == OUTPUT
    assert core.record_fields(None, None, 7) == {}
    short = core.record_fields(PROMPT, OUTPUT[:-1], len(OUTPUT))
    assert short == {core.IDS_LEFT_OUT: "6 output ids for 7 completion tokens"}
    assert core.record_fields(None, OUTPUT, 7) == {core.IDS_LEFT_OUT: "the server returned no prompt_ids"}
