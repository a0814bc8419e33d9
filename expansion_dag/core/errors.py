"""The project's exceptions, split by blast radius, and the one place httpx exceptions are mapped.

- ``RequestError``: one request failed. It becomes a failure record (prompt id, status, message)
  and the shard goes on. Its ``retryable`` flag decides whether it is retried with backoff, its
  ``outcome`` whose fault it is (``expansion_dag.core.outcomes``: the server, the request, the
  model's answer, or the server's backpressure).
- ``ShardAborted``: the shard cannot go on (the canary failed, the circuit breaker opened, the
  server is gone). Everything finished so far stays in the store.
- ``FleetError``: provisioning or probing the servers failed; nothing was sent.

What a server's answer means (statuses, error texts, finish reasons) is read by
``expansion_dag.servers.answers``, in each server's dialect (``expansion_dag.servers.dialects``).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

import httpx


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


@dataclass(frozen=True)
class InputTooLong:
    """Numbers of a 400 that refuses the prompt alone (SGLang's ``max_req_input_len``, the context)."""

    input_tokens: int
    max_input_tokens: int


class RequestError(ExpansionError):
    """One request failed; recorded as a failure record, the shard goes on."""

    #: Short, stable name of the failure kind, used in metadata and failure records.
    kind = "request_error"
    retryable = False
    #: What the failure says something about (``expansion_dag.core.outcomes``): a 4xx is the request's.
    outcome = "request"

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
    outcome = "server"


class QueueFullError(TransientError):
    """The server's queue is full (SGLang's 503 "The request queue is full.", a 429): backpressure.

    Sent again once the sender has slowed down; it never uses up one of the prompt's attempts.
    """

    kind = "queue_full"
    outcome = "backpressure"


class ConnectError(TransientError):
    kind = "connect"


class TimeoutError_(TransientError):
    kind = "timeout"


class RejectedError(RequestError):
    """A 4xx the server will answer the same way again: recorded, not retried."""

    kind = "rejected"


class AuthError(RejectedError):
    """401: the key is missing or wrong; every other request will be refused the same way."""

    kind = "unauthorized"
    outcome = "server"  # the fleet's key or configuration, the same for every prompt


class ContextLengthError(RejectedError):
    """The server's context check refused the request (prompt + max_tokens over the context)."""

    kind = "context_length"

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        overflow: ContextOverflow | None = None,
        input_too_long: InputTooLong | None = None,
    ):
        super().__init__(message, status=status, overflow=overflow)
        self.input_too_long = input_too_long


class ContextCappedError(ContextLengthError):
    """An answer cut at a ``max_tokens`` the server forced (the retry after a context-length 400,
    with the server's own prompt count) ended at ``length``: it is not the answer the budget asked
    for, so it is not final; a re-run asks again."""

    kind = "context_capped"


class ContextMismatchError(RequestError):
    """A context-length 400 that names another context than the probe found: the server is not the
    one probed (or lied to the probe), so every budget for it is wrong. The shard stops."""

    kind = "context_mismatch"
    outcome = "server"


class DeadlineError(RequestError):
    """The answer's first text, or its end, did not come by its deadline (comments and keep-alives
    do not count). Not retried on that server: another try would hold the slot as long again."""

    kind = "deadline"
    outcome = "server"


class BadResponseError(RequestError):
    """A 200 whose body is not a chat completion."""

    kind = "bad_response"
    outcome = "server"


class OtherModelError(BadResponseError):
    """An answer that names another model (vLLM's ``model``) or other weights (SGLang's
    ``metadata.weight_version``) than the server's: a router sending part of the traffic elsewhere."""

    kind = "other_model"


class OversizedError(BadResponseError):
    """An answer with more text than its tokens could make: a stream past its ``max_tokens``
    (stopped there), or a usage that understates the text."""

    kind = "oversized"


class UnfinishedError(TransientError):
    """A 200 whose answer ended neither by ``stop`` nor by ``length`` (e.g. ``abort``): partial text.

    Retried like a transient error; when it persists, its kind names the finish (``finish_abort``).
    """

    def __init__(self, message: str, *, finish_reason: str):
        super().__init__(message, status=200)
        self.finish_reason = finish_reason
        self.kind = f"finish_{finish_reason}"


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


#: A folder that takes no more bytes: full, over its quota, read-only or not this user's.
UNWRITABLE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES})


def unwritable(exc: OSError, folder: str | os.PathLike[str], what: str, after: str) -> OSError:
    """``exc`` as a user reads it: ``what`` could not be written where, why, and the fix; ``after``:
    what a run started again does with what was written (the OS's own error names no folder)."""
    return OSError(
        exc.errno, f"{what} could not be written to {folder} ({exc.strerror or exc}): free space there or make it "
        f"writable, then run again; {after}"
    )
