"""The project's exceptions, split by blast radius, and the one place httpx errors are mapped.

- ``RequestError``: one request failed. It becomes a failure record (prompt id, status, message)
  and the shard goes on. Its ``retryable`` flag decides whether it is retried with backoff.
- ``ShardAborted``: the shard cannot go on (the canary failed, the circuit breaker opened, the
  server is gone). Everything finished so far stays in the store.
- ``FleetError``: provisioning or probing the servers failed; nothing was sent.

Errors are classified by status code and exception type, never by searching message text. The
context-length 400 is the one message whose numbers are parsed, by ``parse_context_error``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import httpx

#: Statuses that say "try again later": the request may succeed on a retry.
RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class ExpansionError(Exception):
    """Base of every error this project raises on purpose."""


class FleetError(ExpansionError):
    """The fleet could not be provisioned or probed."""


class FleetMismatchError(FleetError):
    """Servers of one fleet disagree on something every request depends on."""


class ServerUnreachableError(FleetError):
    """A server did not answer at all (refused, reset, timed out)."""


class ServerStartError(FleetError):
    """A server did not become ready in time; the message quotes its last log lines."""


class ShardAborted(ExpansionError):
    """The shard stopped early; finished completions are kept, ``report`` says what happened."""

    def __init__(self, message: str, *, report: object = None):
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class ContextOverflow:
    """Numbers parsed from SGLang's context-length 400."""

    context_length: int
    requested_total: int
    prompt_tokens: int
    completion_tokens: int


class RequestError(ExpansionError):
    """One request failed; recorded as a failure record, the shard goes on."""

    #: Short, stable name of the failure kind, used in metadata and failure records.
    kind = "request_error"
    retryable = False

    def __init__(self, message: str, *, status: int | None = None, overflow: ContextOverflow | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.overflow = overflow

    @property
    def signature(self) -> tuple[str, int | None]:
        """What makes two failures 'the same way' for the circuit breaker."""
        return (self.kind, self.status)


class TransientError(RequestError):
    """Connection trouble, timeouts, 429 and 5xx: worth retrying with backoff."""

    kind = "transient"
    retryable = True


class ConnectError(TransientError):
    kind = "connect"


class TimeoutError_(TransientError):
    kind = "timeout"


class RejectedError(RequestError):
    """A 4xx the server will answer the same way again: recorded, not retried."""

    kind = "rejected"


class ContextLengthError(RejectedError):
    """The server's context check refused the request (prompt + max_tokens over the context)."""

    kind = "context_length"


class BadResponseError(RequestError):
    """A 200 whose body is not a chat completion."""

    kind = "bad_response"


_SGLANG_OVERFLOW = re.compile(
    r"maximum context length of (?P<c>\d+) tokens\. You requested a total of (?P<m>\d+) tokens: "
    r"(?P<x>\d+) tokens from the input messages and (?P<y>\d+) tokens for the completion"
)
# Messages that also mean "over the context" but carry no numbers a retry could use.
_SGLANG_PROMPT_TOO_LONG = re.compile(r"The input \(\d+ tokens\) is longer than the model's context length")
_SGLANG_MAX_TOO_LARGE = re.compile(r"max_completion_tokens is too large")
_VLLM_CONTEXT = re.compile(r"maximum context length is \d+ tokens|cannot be greater than max_model_len")


def parse_context_error(message: str) -> ContextOverflow | None:
    """The numbers of SGLang's prompt + max_tokens overflow message, or None for other texts."""
    match = _SGLANG_OVERFLOW.search(message)
    if match is None:
        return None
    return ContextOverflow(
        context_length=int(match["c"]),
        requested_total=int(match["m"]),
        prompt_tokens=int(match["x"]),
        completion_tokens=int(match["y"]),
    )


def _is_context_message(message: str) -> bool:
    return bool(
        _SGLANG_PROMPT_TOO_LONG.search(message)
        or _SGLANG_MAX_TOO_LARGE.search(message)
        or _VLLM_CONTEXT.search(message)
    )


def server_message(response: httpx.Response) -> str:
    """The error text a server put in its body: SGLang's flat shape, vLLM's nested one, or raw text."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    if isinstance(body, dict):
        message = body.get("message")
        error = body.get("error")
        if message is None and isinstance(error, dict):
            message = error.get("message")
        if message is None and isinstance(error, str):
            message = error
        if message is not None:
            return str(message)[:2000]
    return str(body)[:500]


def error_from_response(response: httpx.Response) -> RequestError:
    """Map a non-2xx response to the most specific request error."""
    status = response.status_code
    message = server_message(response)
    if status in RETRYABLE_STATUSES:
        return TransientError(message, status=status)
    if status == 400:
        overflow = parse_context_error(message)
        if overflow is not None or _is_context_message(message):
            return ContextLengthError(message, status=status, overflow=overflow)
    return RejectedError(message, status=status)


def error_from_exception(exc: httpx.HTTPError) -> RequestError:
    """Map an httpx transport exception to the project's request errors (see the test of each)."""
    message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, (httpx.UnsupportedProtocol, httpx.LocalProtocolError)):
        return RejectedError(message)  # our own request is malformed: a retry sends the same
    if isinstance(exc, httpx.TimeoutException):
        return TimeoutError_(message)
    if isinstance(exc, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
        return ConnectError(message)
    if isinstance(exc, httpx.TransportError):
        return TransientError(message)
    return RejectedError(message)
