"""The chat API's wire format as this client speaks it: one typed structure for each thing it sends
or reads, and the checks that make a wrong shape the server's fault.

- sent: :class:`ChatRequest`, the body of ``POST /v1/chat/completions`` (:meth:`ChatRequest.body`),
  its tools as :class:`Tool` definitions;
- read: :class:`Answer`, a whole chat completion, plain or put together from a stream;
  :class:`ChatChunk`, one streamed event; :class:`Usage`, the server's counts; the tool calls an
  answer carries (:class:`ToolCall`, in OpenAI form, as records and the next turn's messages keep
  them) and their streamed pieces (:class:`ToolCallDelta`).

A field of the wrong type (content that is not text, a count that is not an integer, a finish
reason no server sends) is a ``BadResponseError`` of that request naming the field
(:func:`checked_answer`, :meth:`Usage.read`): the server's fault, never an exception that ends a
worker. Where each server puts a field (the reasoning's name, the token ids) is its dialect's row.

The simulator (``expansion_dag/sim/``) reads these shapes its own way and never with these types:
a misreading shared by both would pass every test that pits one against the other.
"""

from __future__ import annotations

import array
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NotRequired, TypedDict

from expansion_dag.core import BadResponseError, OtherModelError, OversizedError, SamplingSettings

#: Finish reasons of a complete answer; anything else (``abort``, ...) is partial text. A server
#: with a tool-call parser ends an answer that calls tools with ``tool_calls``: SGLang when it
#: stopped naturally (``serving_chat._process_tool_calls``), vLLM whenever calls were parsed in a
#: plain answer (``chat_completion_full_generator``; a streamed one only after a ``stop``).
COMPLETE_FINISHES = frozenset({"stop", "length", "tool_calls"})
#: Finish reasons that end partial text: SGLang's ``abort`` (its protocol also names
#: ``content_filter`` and ``function_call``), vLLM's ``abort``, ``error`` and ``repetition``
#: (``v1/engine.FINISH_REASON_STRINGS``), and ``unknown``, said here of an answer that named none.
#: Any other value is no answer this client can read.
PARTIAL_FINISHES = frozenset({"abort", "content_filter", "function_call", "error", "repetition", "unknown"})

#: The most characters one token decodes to, with a wide margin: the longest token of the test
#: model's vocabulary (SmolLM2's, whitespace and dash runs) is 81 characters, and an answer's tokens
#: average about 4. An answer with more text than its tokens could hold is the server's fault
#: (:func:`text_limit`): a usage that understates it, or a stream past its ``max_tokens``.
MAX_CHARS_PER_TOKEN = 256
#: Characters allowed beyond that count: a few tokens' worth, for an answer of almost none.
TEXT_SLACK_CHARS = 4096
#: Bytes a stream may carry per token of its ``max_tokens``, beyond its text: each event's JSON
#: (about 300 bytes from vLLM with its ids and usage at one token an event), and a fixed allowance
#: for the prompt's ids sent once (a million-token prompt's as JSON).
WIRE_BYTES_PER_TOKEN = 1024
WIRE_SLACK_BYTES = 8 << 20


def text_limit(tokens: int) -> int:
    """The most characters ``tokens`` tokens can be (see :data:`MAX_CHARS_PER_TOKEN`)."""
    return tokens * MAX_CHARS_PER_TOKEN + TEXT_SLACK_CHARS


def wire_limit(max_tokens: int) -> int:
    """The most bytes an answer of at most ``max_tokens`` tokens takes on the wire, plain or streamed."""
    return max_tokens * (MAX_CHARS_PER_TOKEN + WIRE_BYTES_PER_TOKEN) + WIRE_SLACK_BYTES


@dataclass(frozen=True, slots=True)
class AnswerIdentity:
    """What an answer must say of itself to be the expected model's (None: not checked).

    vLLM names its served model in every answer and chunk (``model``); SGLang echoes the request's
    ``model``, which proves nothing, but a plain answer carries its weights' ``metadata.weight_version``
    ("default" when unset). An answer naming another is the server's (a router's) fault:
    :class:`OtherModelError`.
    """

    model: str | None = None
    weight_version: str | None = None

    def check(self, model: object, metadata: object) -> None:
        """Raise OtherModelError when ``model`` or ``metadata.weight_version``, where sent, is another's."""
        if self.model is not None and model is not None and model != self.model:
            raise OtherModelError(f"the answer came from model {quote(model, 80)}, not {self.model!r}", status=200)
        if self.weight_version is not None and isinstance(metadata, dict):
            version = metadata.get("weight_version")
            if version is not None and version != self.weight_version:
                raise OtherModelError(
                    f"the answer came from weights {quote(version, 80)}, not {self.weight_version!r}", status=200
                )


# --- tools ---------------------------------------------------------------------------------------


class FunctionDefinition(TypedDict):
    name: str
    description: str | None
    #: A JSON schema.
    parameters: dict[str, Any] | None
    strict: NotRequired[bool]


class Tool(TypedDict):
    """A tool definition as a request carries it (``tools.request_tools``)."""

    type: Literal["function"]
    function: FunctionDefinition


class ToolFunction(TypedDict):
    name: str
    #: JSON text, as both servers send it.
    arguments: str


class ToolCall(TypedDict):
    """A call a server's tool-call parser found, in OpenAI form (``tools.tool_call``)."""

    id: NotRequired[str]
    type: Literal["function"]
    function: ToolFunction


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One streamed piece of a tool call: the call's ``index``; its first piece carries its ``id``
    and function ``name``, the later ones fragments of ``arguments`` (``tools.ToolCallDeltas``)."""

    index: int | None
    id: str | None
    name: str | None
    arguments: str | None


# --- requests ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ChatRequest:
    """The body of ``POST /v1/chat/completions``: the fields SGLang and vLLM both read, and those of
    one dialect (``stream_interval``, the token ids). A field that is unset is not sent."""

    model: str
    messages: Sequence[Mapping[str, Any]]
    max_tokens: int
    #: The sampler's fields and the chat template's arguments, sent as they are.
    sampling: SamplingSettings
    #: Server-sent events, with the usage in a last chunk (``stream_options.include_usage``).
    stream: bool = False
    #: The tokens so far in every chunk of a stream (``stream_options.continuous_usage_stats``).
    continuous_usage: bool = False
    #: Tokens per streamed event, where the dialect takes it per request.
    stream_interval: int | None = None
    tools: tuple[Tool, ...] = ()
    #: Sent with the tools only.
    tool_choice: str | None = None
    #: How the prompt's and the answer's token ids are asked for (``Dialect.token_ids``).
    token_ids: Literal["sglext", "return_token_ids"] | None = None

    def body(self) -> dict[str, Any]:
        """The JSON body as sent."""
        sampling = self.sampling
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages,
            "max_tokens": self.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "min_p": sampling.min_p,
            "repetition_penalty": sampling.repetition_penalty,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if sampling.chat_template_kwargs:
            body["chat_template_kwargs"] = sampling.chat_template_kwargs
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
            if self.continuous_usage:
                body["stream_options"]["continuous_usage_stats"] = True
            if self.stream_interval is not None:
                body["stream_interval"] = self.stream_interval
        if self.tools:
            body["tools"] = list(self.tools)
            body["tool_choice"] = self.tool_choice
        if self.token_ids == "sglext":
            body["return_input_ids_in_sglext"] = True
            body["return_output_ids_in_sglext"] = True
        elif self.token_ids == "return_token_ids":
            body["return_token_ids"] = True
        return body


# --- answers -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Usage:
    """A completion's ``usage``: the server's own counts."""

    prompt_tokens: int | None
    completion_tokens: int

    @classmethod
    def read(cls, usage: Mapping[str, Any]) -> Usage:
        """The counts of a ``usage`` object; KeyError without ``completion_tokens``, BadResponseError
        naming a count that is not one."""
        prompt_tokens = usage.get("prompt_tokens")
        return cls(
            prompt_tokens=None if prompt_tokens is None else count_field(prompt_tokens, "usage.prompt_tokens"),
            completion_tokens=count_field(usage["completion_tokens"], "usage.completion_tokens"),
        )


@dataclass(frozen=True)
class Answer:
    """One chat completion as the client reads it."""

    content: str
    reasoning: str | None
    #: Exactly as the server said ("unknown" if absent).
    finish_reason: str
    #: The server's own ``usage.prompt_tokens``.
    prompt_tokens: int | None
    completion_tokens: int
    #: The calls a server's tool-call parser found; None when it parsed none (no parser: any
    #: ``<tool_call>`` text stays in ``content``).
    tool_calls: list[ToolCall] | None = None
    #: The ids the server ran the prompt as, and those it sampled (uint32 arrays: 4 bytes an id
    #: while the answer waits to be recorded); None where it returned none (see ``Dialect.token_ids``).
    prompt_ids: array.array | None = None
    output_ids: array.array | None = None


def checked_answer(
    *,
    content: object,
    reasoning: object,
    finish_reason: object,
    usage: Usage,
    tool_calls: list[ToolCall] | None = None,
    prompt_ids: array.array | None = None,
    output_ids: array.array | None = None,
) -> Answer:
    """An :class:`Answer` of the fields as a server sent them (plain or streamed), each of the type
    the client reads; BadResponseError naming the first that is not, or when the text is more than
    its usage's tokens could hold (:func:`text_limit`)."""
    finish = text_field(finish_reason, "finish_reason") or "unknown"
    if finish not in COMPLETE_FINISHES and finish not in PARTIAL_FINISHES:
        known = ", ".join(sorted(COMPLETE_FINISHES | PARTIAL_FINISHES))
        raise BadResponseError(f"finish_reason {finish[:60]!r} is none a server sends ({known})", status=200)
    text = text_field(content, "the answer's content") or ""
    thinking = text_field(reasoning, "the answer's reasoning")
    chars = len(text) + len(thinking or "")
    if chars > text_limit(usage.completion_tokens):
        raise OversizedError(
            f"usage.completion_tokens says {usage.completion_tokens} tokens for {chars:,} characters of text",
            status=200,
        )
    return Answer(
        content=text,
        reasoning=thinking,
        finish_reason=finish,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        tool_calls=tool_calls,
        prompt_ids=prompt_ids,
        output_ids=output_ids,
    )


@dataclass(frozen=True, slots=True)
class ChatChunk:
    """One streamed event (``stream.parse_chunk``): a piece of the answer, from its choice's delta,
    or what ends the stream, in a chunk without a choice (the usage, SGLang's token ids); or an
    error the server sent in the stream."""

    content: str | None = None
    reasoning: str | None = None
    finish_reason: str | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()
    #: The tokens so far, where a choice's chunk carries its usage (``continuous_usage``).
    tokens_so_far: int | None = None
    #: The whole answer's counts, in a chunk without a choice.
    usage: Usage | None = None
    #: The prompt's ids, and the answer's: this piece's (vLLM) or all of them at the end (SGLang).
    prompt_ids: array.array | None = None
    output_ids: array.array | None = None
    #: The HTTP status an error event stands for; None: no error.
    error_status: int | None = None


# --- fields --------------------------------------------------------------------------------------


def id_array(value: object) -> array.array | None:
    """Token ids as the server sent them (a JSON list of ints), or None when it sent none;
    TypeError or OverflowError when they are not ids."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise TypeError(f"token ids are not a list: {type(value).__name__}")
    return array.array("I", value)


def sglext_ids(sglext: object) -> tuple[array.array | None, array.array | None]:
    """SGLang's ``sglext``: ``input_ids`` (the prompt) and ``output_ids``, one list a choice."""
    if sglext is None:
        return None, None
    outputs = sglext.get("output_ids")  # type: ignore[attr-defined]
    return id_array(sglext.get("input_ids")), id_array(outputs[0] if outputs else None)  # type: ignore[attr-defined]


def text_field(value: object, where: str) -> str | None:
    """A text field of an answer as sent (None: absent); BadResponseError when it is not text."""
    if value is None or isinstance(value, str):
        return value
    raise BadResponseError(f"{where} is {_kind(value)}, not text: {quote(value, 120)}", status=200)


def count_field(value: object, where: str) -> int:
    """A token count as sent; BadResponseError unless it is a whole number of at least 0."""
    if type(value) is int and value >= 0:
        return value
    raise BadResponseError(f"{where} is {quote(value, 60)} ({_kind(value)}), not a token count", status=200)


def _kind(value: object) -> str:
    return "null" if value is None else f"a {type(value).__name__}"


def as_text(data: bytes) -> str:
    """A body's bytes as text for a message, whatever their encoding."""
    return data.decode("utf-8", errors="replace")


def quote(body: object, limit: int) -> str:
    """A body's first ``limit`` characters as JSON (or its repr), for a message."""
    try:
        text = json.dumps(body)
    except (TypeError, ValueError):
        text = repr(body)
    return text[:limit]
