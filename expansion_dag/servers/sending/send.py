"""Sending a request: one attempt (:func:`send_chat`), and a prompt's whole exchange with a server
(:func:`generate`) with its retries.

:func:`generate` retries transient errors and unfinished answers with backoff, waits out a full
queue without using an attempt (both in one stamina retry context, whose hook tells them apart:
:class:`Patience`), retries a context-length 400 once with the server's own prompt count, and
returns an :class:`Exchange`. A content outcome (a loop, a finished answer) is never retried here.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import httpx
import pydantic_core
import stamina

from expansion_dag.core import (
    BadResponseError,
    ContextCappedError,
    ContextLengthError,
    ContextMismatchError,
    DeadlineError,
    QueueFullError,
    RequestError,
    TransientError,
    error_from_exception,
)
from expansion_dag.servers.dialects import Dialect
from expansion_dag.servers.loops import LoopThresholds
from expansion_dag.servers.transport import read_body
from expansion_dag.servers.wire import (
    Answer,
    AnswerIdentity,
    ChatRequest,
    ChatStream,
    as_text,
    error_from_status,
    finish_error,
    parse_chat_completion,
    wire_limit,
)


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How often one prompt is tried on one server (the run configuration's values: the engine's
    ``EngineConfig.retry_policy``)."""

    attempts: int
    wait_initial_s: float
    wait_max_s: float
    wait_jitter_s: float
    #: Retry a context-length 400 once, with max_tokens from the server's own prompt count.
    context_retry: bool
    #: Tokens kept free when max_tokens is recomputed.
    margin: int
    min_output_tokens: int
    #: How long a prompt may wait on a full queue (backpressure, which uses no attempt), from its
    #: first queue-full answer, before the last one is its error; 0: at once (a borrowed server).
    backpressure_wait_s: float


@dataclass(frozen=True)
class Deadline:
    """How long one attempt may take, from its send (None: no bound but the per-read timeout).

    Only what the answer says counts: SSE comments and keep-alives move neither bound.
    """

    #: Until a streamed answer's first text (the canary's: a server that accepts and says nothing).
    first_output_s: float | None = None
    #: Until the answer's end.
    total_s: float | None = None


@dataclass(frozen=True)
class Exchange:
    """What became of one prompt on one server: an answer or the last error, never both."""

    answer: Answer | None
    error: RequestError | None
    attempts: int
    #: The max_tokens of the last attempt (lower than asked after a context retry).
    max_tokens: int


async def send_chat(
    client: httpx.AsyncClient,
    url: str,
    request: ChatRequest,
    dialect: Dialect,
    thresholds: LoopThresholds | None = None,
    *,
    stream_interval: int,
    on_output: Callable[[], None] | None = None,
    identity: AnswerIdentity | None = None,
    deadline: Deadline | None = None,
) -> Answer:
    """One attempt: the complete answer, or the RequestError that says why there is none.

    A streamed request (``request.stream``) is read chunk by chunk; with ``thresholds``, a
    loop ends it at once: closing the response with the body unread closes the connection, which
    is how both servers learn to stop decoding. SGLang 0.5.23's stream generator is cancelled on
    disconnect, and ``TokenizerManager.generate_request`` (``except BaseException``:
    ``_release_req_states_on_failure``) aborts the request at the scheduler at once; the
    response's background ``create_abort_task`` (an abort by ``rid`` 2 s after the stream ends)
    is only its fallback. Its slot is free within a second of the close, no ``/abort_request``
    needed (proved against the real server, ``real_engine/test_sglang_streaming.py``). vLLM's
    generator is cancelled on disconnect and ``AsyncLLM.generate`` aborts the request at once
    (proved against the real engine, ``real_engine/test_vllm_streaming.py``).

    ``stream_interval``: the server's tokens per streamed event, to count a stopped answer's
    tokens. ``on_output`` is called once the stream carries generated text, not at the 200: an
    error can still come as an event in the stream (``ChatStream`` raises it) before any text.
    ``identity``: what the answer must say of itself (:class:`AnswerIdentity`); ``deadline``: how
    long it may take (:class:`Deadline`), a :class:`DeadlineError` past it. An answer is also held
    to the size its ``max_tokens`` allows (``OversizedError``, the stream closed there).
    """
    if deadline is None or (deadline.total_s is None and (deadline.first_output_s is None or not request.stream)):
        return await _send(client, url, request, dialect, thresholds, stream_interval, on_output, identity)
    sent = asyncio.get_running_loop().time()
    waiting = request.stream and deadline.first_output_s is not None  # for the first text
    bound_s = deadline.first_output_s if waiting else deadline.total_s
    try:
        async with asyncio.timeout_at(None if bound_s is None else sent + bound_s) as scope:

            def output() -> None:
                nonlocal waiting, bound_s
                waiting, bound_s = False, deadline.total_s  # the first text came: only the end's deadline now
                scope.reschedule(None if bound_s is None else sent + bound_s)
                if on_output is not None:
                    on_output()

            return await _send(client, url, request, dialect, thresholds, stream_interval, output, identity)
    except TimeoutError as exc:
        if not scope.expired():
            raise
        what = "no text" if waiting else "no end of the answer"
        raise DeadlineError(f"{what} within {bound_s:g} s of the request", status=None) from exc


async def _post(client: httpx.AsyncClient, url: str, request: ChatRequest) -> httpx.Response:
    """The response to ``request``, its headers read and its body left for the caller to read and
    close. The body is encoded by pydantic's Rust encoder: a sixth of ``json.dumps``'s CPU on prompts
    of non-ASCII text."""
    body = pydantic_core.to_json(request.body())
    sent = client.build_request("POST", url, content=body, headers={"Content-Type": "application/json"})
    return await client.send(sent, stream=True)


async def _send(
    client: httpx.AsyncClient,
    url: str,
    request: ChatRequest,
    dialect: Dialect,
    thresholds: LoopThresholds | None,
    stream_interval: int,
    on_output: Callable[[], None] | None,
    identity: AnswerIdentity | None,
) -> Answer:
    if not request.stream:
        return await _send_plain(client, url, request, dialect, identity)
    try:
        response = await _post(client, f"{url}/v1/chat/completions", request)
        try:
            if response.status_code != 200:
                body = await read_body(response, limit=wire_limit(request.max_tokens))
                raise error_from_status(response.status_code, as_text(body))
            stream = ChatStream(
                dialect, thresholds, stream_interval=stream_interval, max_tokens=request.max_tokens, identity=identity
            )
            async for data in response.aiter_bytes():
                loop = stream.feed(data)
                if loop is not None:
                    raise stream.degenerate(loop)
                if on_output is not None and stream.chunks:
                    on_output()
                    on_output = None
            loop = stream.end()
            if loop is not None:
                raise stream.degenerate(loop)
        finally:
            await response.aclose()
    except httpx.HTTPError as exc:
        raise error_from_exception(exc) from exc
    answer = stream.answer()
    error = finish_error(answer)
    if error is not None:
        raise error
    return answer


async def _send_plain(
    client: httpx.AsyncClient, url: str, request: ChatRequest, dialect: Dialect, identity: AnswerIdentity | None
) -> Answer:
    try:
        response = await _post(client, f"{url}/v1/chat/completions", request)
        try:
            data = await read_body(response, limit=wire_limit(request.max_tokens))
        finally:
            await response.aclose()
    except httpx.HTTPError as exc:
        raise error_from_exception(exc) from exc
    if response.status_code != 200:
        raise error_from_status(response.status_code, as_text(data))
    try:
        body = json.loads(data)
    except ValueError as exc:
        raise BadResponseError(f"not a chat completion: {as_text(data[:200])}", status=200) from exc
    answer = parse_chat_completion(body, dialect, identity)
    error = finish_error(answer)
    if error is not None:
        raise error
    return answer


class Patience:
    """Whether a prompt's failed attempt is sent again (stamina's backoff hook): a transient error
    or an unfinished answer while the policy's attempts last; a full queue, which spends none, while
    less than ``backpressure_wait_s`` has passed since its first queue-full answer."""

    def __init__(self, policy: RetryPolicy):
        self._policy = policy
        #: Attempts that count against the policy: backpressure spends none.
        self._spent = 0
        self._full_since: float | None = None

    def __call__(self, exc: Exception) -> bool:
        if isinstance(exc, QueueFullError):
            now = time.monotonic()
            if self._full_since is None:
                self._full_since = now
            return now - self._full_since < self._policy.backpressure_wait_s
        if isinstance(exc, TransientError):
            self._spent += 1
            return self._spent < self._policy.attempts
        return False


async def generate(
    client: httpx.AsyncClient,
    url: str,
    request: ChatRequest,
    dialect: Dialect,
    policy: RetryPolicy,
    *,
    on_retry: Callable[[str], None] | None = None,
    thresholds: LoopThresholds | None = None,
    stream_interval: int,
    on_output: Callable[[], None] | None = None,
    identity: AnswerIdentity | None = None,
    deadline: Deadline | None = None,
    context_length: int | None = None,
) -> Exchange:
    """Send ``request`` until it has a complete answer or the policy gives up.

    Transient errors and unfinished answers are retried with exponential backoff and jitter, up to
    ``policy.attempts``; a full queue (backpressure) is waited out, slower each time, without using
    an attempt, for up to about ``policy.backpressure_wait_s`` (:class:`Patience`). ``on_retry``
    hears the kind of each error that caused a retry (``context_length`` for the one retry with a
    smaller ``max_tokens``). ``thresholds``: stop a streamed answer that loops
    (:class:`DegenerateError`, not retried); ``stream_interval``, ``on_output``: ``send_chat``'s
    (``on_output`` called at most once an attempt), ``identity``, ``deadline``: each attempt's.

    ``context_length``: the probed one. A context-length 400 that names another is no prompt's
    trouble but the probe's: :class:`ContextMismatchError`, never retried. An answer of the smaller
    retry that ends at ``length`` is cut by the server's cap, not the budget's: a
    :class:`ContextCappedError`, which a re-run asks again.
    """
    attempts = 0
    max_tokens = request.max_tokens
    patience = Patience(policy)

    async def with_backoff(body: ChatRequest) -> Answer:
        nonlocal attempts
        last: RequestError | None = None
        async for attempt in stamina.retry_context(
            on=patience,
            attempts=None,
            timeout=None,
            wait_initial=policy.wait_initial_s,
            wait_max=policy.wait_max_s,
            wait_jitter=policy.wait_jitter_s,
        ):
            if last is not None and on_retry is not None:
                on_retry(last.kind)
            with attempt:
                attempts += 1
                try:
                    return await send_chat(
                        client, url, body, dialect, thresholds, stream_interval=stream_interval,
                        on_output=on_output, identity=identity, deadline=deadline,
                    )
                except RequestError as exc:
                    last = exc
                    raise
        raise AssertionError("unreachable: stamina re-raises the last error")

    try:
        try:
            answer = await with_backoff(request)
        except ContextLengthError as exc:
            said = exc.overflow.context_length if exc.overflow is not None else None
            if said is not None and context_length is not None and said != context_length:
                raise ContextMismatchError(
                    f"the server refused the request over a context of {said} tokens, but it was probed at "
                    f"{context_length}: every budget for it is wrong (its words: {exc.message})",
                    status=exc.status,
                ) from exc
            if exc.overflow is None or not policy.context_retry:
                raise
            # The server counted the prompt differently: trust its count, once.
            budget = exc.overflow.context_length - exc.overflow.prompt_tokens - policy.margin
            if budget < policy.min_output_tokens:
                raise
            if on_retry is not None:
                on_retry(exc.kind)
            max_tokens = min(max_tokens, budget)
            answer = await with_backoff(replace(request, max_tokens=max_tokens))
            if answer.finish_reason == "length":
                raise ContextCappedError(
                    f"the answer ended at length under the server's cap of {max_tokens} tokens (asked: "
                    f"{request.max_tokens}): not the answer budgeted, so not final",
                    status=200,
                )
    except RequestError as error:
        return Exchange(None, error, attempts, max_tokens)
    return Exchange(answer, None, attempts, max_tokens)
