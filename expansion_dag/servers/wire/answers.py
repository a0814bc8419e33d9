"""Answers and errors off the wire: what a server's body means, whoever sent the request.

- answers: :func:`parse_chat_completion` reads a 200 body into an :class:`.protocol.Answer`
  (content, reasoning, tool calls, and the prompt's and the answer's token ids where the dialect
  returns them: :attr:`Dialect.token_ids`); a field of the wrong type is the request's
  ``BadResponseError`` (``protocol.checked_answer``); :func:`finish_error` tells a complete
  answer from partial text;
- errors: :func:`error_from_status` turns an error response into one of
  ``expansion_dag.core.errors``' request errors, reading a context-length 400's numbers
  (:func:`parse_context_error`) for the one retry that uses them.
"""

from __future__ import annotations

import json
import re

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
from expansion_dag.servers.wire.protocol import (
    COMPLETE_FINISHES,
    Answer,
    AnswerIdentity,
    Usage,
    checked_answer,
    id_array,
    quote,
    sglext_ids,
)
from expansion_dag.servers.wire.tools import tool_call


def parse_chat_completion(body: object, dialect: Dialect, identity: AnswerIdentity | None = None) -> Answer:
    """Read a 200 body; BadResponseError when it is not a chat completion, or a field read has
    another type (``protocol.checked_answer``); OtherModelError when it names another model than
    ``identity``'s.

    Token ids, where the dialect returns them: SGLang's in the response's ``sglext``
    (``input_ids``, ``output_ids[0]``), vLLM's in its ``prompt_token_ids`` and the choice's
    ``token_ids``.
    """
    try:
        if identity is not None:
            identity.check(body.get("model"), body.get("metadata"))  # type: ignore[union-attr]
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
        elif dialect.token_ids == "return_token_ids":
            prompt_ids, output_ids = id_array(body.get("prompt_token_ids")), id_array(choice.get("token_ids"))  # type: ignore[union-attr]
        return checked_answer(
            content=message["content"],
            reasoning=reasoning,
            finish_reason=choice.get("finish_reason"),
            usage=Usage.read(usage),
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
