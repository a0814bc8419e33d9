"""Answers and errors off the wire: what a server's body means, whoever sent the request.

- answers: :func:`parse_chat_completion` reads a 200 body into an :class:`Answer` (content,
  reasoning, tool calls, and the prompt's and the answer's token ids where the dialect returns them:
  :attr:`Dialect.token_ids`); :func:`finish_error` tells a complete answer from partial text. A
  field of the wrong type (content that is not text, a count that is not an integer, a finish
  reason no server sends) is a ``BadResponseError`` of that request naming the field, plain or
  streamed (:func:`checked_answer`): the server's fault, never an exception that ends a worker;
- errors: :func:`error_from_status` turns an error response into one of
  ``expansion_dag.core.errors``' request errors, reading a context-length 400's numbers
  (:func:`parse_context_error`) for the one retry that uses them.
"""

from __future__ import annotations

import array
import json
import re
from dataclasses import dataclass
from typing import Any

from expansion_dag.core import (
    AuthError,
    BadResponseError,
    ContextLengthError,
    ContextOverflow,
    InputTooLong,
    QueueFullError,
    RejectedError,
    RequestError,
    TransientError,
    UnfinishedError,
)
from expansion_dag.servers.dialects import Dialect
from expansion_dag.servers.tools import tool_call

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
    #: The calls a server's tool-call parser found, in OpenAI form (``{"id", "type": "function",
    #: "function": {"name", "arguments": JSON text}}``); None when it parsed none (no parser: any
    #: ``<tool_call>`` text stays in ``content``).
    tool_calls: list[dict[str, Any]] | None = None
    #: The ids the server ran the prompt as, and those it sampled (uint32 arrays: 4 bytes an id
    #: while the answer waits to be recorded); None where it returned none (see ``Dialect.token_ids``).
    prompt_ids: array.array | None = None
    output_ids: array.array | None = None


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


def checked_answer(
    *,
    content: object,
    reasoning: object,
    finish_reason: object,
    prompt_tokens: object,
    completion_tokens: object,
    tool_calls: list[dict[str, Any]] | None = None,
    prompt_ids: array.array | None = None,
    output_ids: array.array | None = None,
) -> Answer:
    """An :class:`Answer` of the fields as a server sent them (plain or streamed), each of the type
    the client reads; BadResponseError naming the first that is not."""
    finish = text_field(finish_reason, "finish_reason") or "unknown"
    if finish not in COMPLETE_FINISHES and finish not in PARTIAL_FINISHES:
        known = ", ".join(sorted(COMPLETE_FINISHES | PARTIAL_FINISHES))
        raise BadResponseError(f"finish_reason {finish[:60]!r} is none a server sends ({known})", status=200)
    return Answer(
        content=text_field(content, "the answer's content") or "",
        reasoning=text_field(reasoning, "the answer's reasoning"),
        finish_reason=finish,
        prompt_tokens=None if prompt_tokens is None else count_field(prompt_tokens, "usage.prompt_tokens"),
        completion_tokens=count_field(completion_tokens, "usage.completion_tokens"),
        tool_calls=tool_calls,
        prompt_ids=prompt_ids,
        output_ids=output_ids,
    )


def parse_chat_completion(body: object, dialect: Dialect) -> Answer:
    """Read a 200 body; BadResponseError when it is not a chat completion, or a field read has
    another type (:func:`checked_answer`).

    Token ids, where the dialect returns them: SGLang's in the response's ``sglext``
    (``input_ids``, ``output_ids[0]``), vLLM's in its ``prompt_token_ids`` and the choice's
    ``token_ids``.
    """
    try:
        choice = body["choices"][0]  # type: ignore[index]
        message = choice["message"]
        usage = body["usage"]  # type: ignore[index]
        reasoning = next((message[f] for f in dialect.reasoning_fields if message.get(f) is not None), None)
        calls = [
            tool_call(c.get("id"), c["function"]["name"], c["function"].get("arguments"))
            for c in message.get("tool_calls") or ()
        ]
        prompt_ids = output_ids = None
        if dialect.token_ids == "sglext":
            prompt_ids, output_ids = sglext_ids(body.get("sglext"))  # type: ignore[union-attr]
        elif dialect.token_ids == "vllm":
            prompt_ids, output_ids = id_array(body.get("prompt_token_ids")), id_array(choice.get("token_ids"))  # type: ignore[union-attr]
        return checked_answer(
            content=message["content"],
            reasoning=reasoning,
            finish_reason=choice.get("finish_reason"),
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage["completion_tokens"],
            tool_calls=calls or None,
            prompt_ids=prompt_ids,
            output_ids=output_ids,
        )
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise BadResponseError(f"not a chat completion: {quote(body, 200)}", status=200) from exc


def finish_error(answer: Answer) -> RequestError | None:
    """None for a complete answer; an error of kind ``finish_<reason>`` for partial text."""
    if answer.finish_reason in COMPLETE_FINISHES:
        return None
    return UnfinishedError(
        f"the server ended the answer with finish_reason {answer.finish_reason!r} after "
        f"{answer.completion_tokens} tokens: partial text is never kept",
        finish_reason=answer.finish_reason,
    )


# --- errors --------------------------------------------------------------------------------------

#: Statuses that say "try again later": the request may succeed on a retry.
RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
#: Backpressure: the server is busy, not broken (SGLang's bounded queue, a rate limit). A 503 says
#: it only in its text; one without these words (shutting down, a failed health) is a fault.
_QUEUE_FULL = re.compile(r"request queue is full|waiting timeout", re.IGNORECASE)
_OVERFLOW = re.compile(
    r"maximum context length of (?P<c>\d+) tokens\. You requested a total of (?P<m>\d+) tokens: "
    r"(?P<x>\d+) tokens from the input messages and (?P<y>\d+) tokens for the completion"
)
#: Texts that mean "the prompt alone is over a limit", with the prompt's size and the limit.
_INPUT_TOO_LONG = (
    # SGLang tokenizer manager: prompt >= context.
    re.compile(r"The input \((?P<n>\d+) tokens\) is longer than the model's context length \((?P<m>\d+) tokens\)"),
    # SGLang scheduler: prompt >= max_req_input_len = min(context - 1, kv capacity - 1) - 5.
    re.compile(r"Input length \((?P<n>\d+) tokens\) exceeds the maximum allowed length \((?P<m>\d+) tokens\)"),
    # vLLM renderer.
    re.compile(
        r"maximum context length is (?P<m>\d+) tokens\. However, your prompt contains (?:at least )?"
        r"(?P<n>\d+) input tokens"
    ),
    # vLLM serving utilities.
    re.compile(r"Input length \((?P<n>\d+)\) exceeds model's maximum context length \((?P<m>\d+)\)"),
)
#: Other texts that mean "over the context" but carry no numbers a retry could use.
_CONTEXT_OTHER = re.compile(
    r"max_completion_tokens is too large"  # SGLang, with an explicit --context-length
    r"|cannot be greater than max_model_len"  # vLLM: max_tokens over the context
    r"|longer than the maximum model length of \d+"  # vLLM engine input check
    r"|maximum context length is \d+ tokens"  # vLLM: a prompt counted in characters
)


def parse_context_error(message: str) -> ContextOverflow | None:
    """The numbers of SGLang's prompt + max_tokens overflow message, or None for other texts."""
    match = _OVERFLOW.search(message)
    if match is None:
        return None
    return ContextOverflow(
        context_length=int(match["c"]),
        requested_total=int(match["m"]),
        prompt_tokens=int(match["x"]),
        completion_tokens=int(match["y"]),
    )


def server_message(body_text: str) -> str:
    """The error text a server put in its body: SGLang's flat shape, vLLM's nested one, or raw text."""
    try:
        body = json.loads(body_text)
    except ValueError:
        return body_text[:500]
    if isinstance(body, dict):
        message = body.get("message")
        error = body.get("error")
        if message is None and isinstance(error, dict):
            message = error.get("message")
        if message is None and isinstance(error, str):
            message = error
        if message is None:
            message = body.get("detail")  # FastAPI's own errors (a 404 route, a validation error)
        if message is not None:
            return str(message)[:2000]
    return body_text[:500]


def error_from_status(status: int, body_text: str) -> RequestError:
    """Classify an error response by its status and, for a 400, the server's words."""
    message = server_message(body_text) or f"HTTP {status}"
    if status == 429 or (status == 503 and _QUEUE_FULL.search(message)):
        return QueueFullError(message, status=status)
    if status in RETRYABLE_STATUSES:
        return TransientError(message, status=status)
    if status == 401:
        return AuthError(message, status=status)
    if status == 400:
        overflow = parse_context_error(message)
        if overflow is not None:
            return ContextLengthError(message, status=status, overflow=overflow)
        for pattern in _INPUT_TOO_LONG:
            match = pattern.search(message)
            if match is not None:
                too_long = InputTooLong(input_tokens=int(match["n"]), max_input_tokens=int(match["m"]))
                return ContextLengthError(message, status=status, input_too_long=too_long)
        if _CONTEXT_OTHER.search(message):
            return ContextLengthError(message, status=status)
    return RejectedError(message, status=status)


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
