"""Speaking to inference servers: probing, loads, and sending requests with their retries.

The behaviour stands here, apart from the wire shapes (``answers``, ``stream``, ``tools``) and from
the servers' differences (``dialects``):

- probing: :func:`read_server_facts` reads ``/v1/models`` and the server's own description
  (``/server_info``, or ``/get_server_info`` before SGLang 0.5.6), checks the version floor and
  picks the dialect; :func:`serves_without_key` tells whether a keyed server really wants its key;
- loads: :func:`read_idle_slots` reads ``/v1/loads`` (``/get_load`` before SGLang 0.5.8);
- generation: :func:`chat_request` builds a request (asking a server whose dialect can,
  :attr:`Dialect.token_ids`, for the prompt's and the answer's token ids) and :func:`generate`
  sends it, retries transient errors and unfinished answers with backoff (stamina), retries a
  context-length 400 once with the server's own prompt count, and returns an :class:`Exchange`.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import httpx
import stamina

from expansion_dag.core import (
    BadResponseError,
    ContextLengthError,
    FleetError,
    FleetMismatchError,
    QueueFullError,
    RequestError,
    ServerUnreachableError,
    TransientError,
    error_from_exception,
)
from expansion_dag.servers.answers import (
    Answer,
    as_text,
    error_from_status,
    finish_error,
    parse_chat_completion,
    quote,
)
from expansion_dag.servers.degeneration import LoopThresholds
from expansion_dag.servers.dialects import DIALECTS, SGLANG_MIN_VERSION, Dialect, dialect_for
from expansion_dag.servers.http_client import HttpClient, read_body, tls_context
from expansion_dag.servers.stream import ChatStream
from expansion_dag.servers.tools import request_tools

if TYPE_CHECKING:
    from expansion_dag.core import SamplingSettings


# --- loads ---------------------------------------------------------------------------------------


def parse_idle_slots(body: object, dialect: Dialect, slots: int | None = None) -> int | None:
    """Slots free beyond the queue, summed over ranks (negative when it queues); None if unknown.

    ``/v1/loads`` says each rank's slots; ``/get_load`` counts only requests, so ``slots`` (the
    probed figure) is needed to read it.
    """
    try:
        if dialect.loads_carry_slots:
            ranks = body["loads"]  # type: ignore[index]
            if not ranks:
                return None
            return sum(
                int(r["max_running_requests"]) - int(r["num_running_reqs"]) - int(r["num_waiting_reqs"])
                for r in ranks
            )
        if dialect.loads_path is None or slots is None or not body:
            return None
        # ``num_reqs`` already counts the waiting requests.
        return slots - sum(int(r["num_reqs"]) for r in body)  # type: ignore[union-attr]
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def parse_gen_throughput(body: object, dialect: Dialect) -> float | None:
    """Output tokens a second the server generates now (``/v1/loads``' ``gen_throughput``, summed
    over ranks); None where it does not say (``/get_load``, vLLM)."""
    if not dialect.loads_carry_slots:
        return None
    try:
        return sum(float(r["gen_throughput"]) for r in body["loads"]) if body["loads"] else None  # type: ignore[index]
    except (KeyError, IndexError, TypeError, ValueError):
        return None


async def read_idle_slots(
    client: HttpClient, url: str, dialect: Dialect, *, slots: int | None, timeout_s: float
) -> int | None:
    """:func:`parse_idle_slots` of the server's load now; None when it cannot say (never an error)."""
    if dialect.loads_path is None:
        return None
    try:
        response = await client.get(url + dialect.loads_path, timeout_s=timeout_s)
        if response.status_code != 200:
            return None
        return parse_idle_slots(response.json(), dialect, slots)
    except (httpx.HTTPError, ValueError):
        return None  # a helper that cannot say is simply not used


# --- probing -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerFacts:
    """What a server says about itself."""

    model: str
    model_path: str
    context_length: int
    #: Running-request slots; None when the server does not say (vLLM, SGLang < 0.5.8 on auto).
    slots: int | None
    #: The longest prompt the scheduler admits (SGLang); None when unknown.
    max_req_input_len: int | None
    version: str | None
    simulator: bool
    dialect: Dialect
    #: SGLang's ``--stream-interval`` (a ServerArgs field, so in its description); None: unsaid.
    stream_interval: int | None = None
    #: SGLang's ``--tool-call-parser`` (a ServerArgs field too); None: none, or unsaid (vLLM).
    tool_call_parser: str | None = None
    #: SGLang's ``--weight-version`` (a ServerArgs field); None: unsaid, or "default" (not set).
    weight_version: str | None = None


def parse_server_facts(models: object, server_info: object | None, dialect: Dialect) -> ServerFacts:
    """Read ``/v1/models`` and the server's description; FleetError naming what is missing."""
    try:
        entry = models["data"][0]  # type: ignore[index]
        model = str(entry["id"])
        context_length = int(entry["max_model_len"])
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise FleetError(f"/v1/models: no served model with max_model_len in {quote(models, 300)}") from exc
    info: Mapping[str, Any] = server_info if isinstance(server_info, Mapping) else {}
    declared = info.get("context_length")
    if declared is not None and int(declared) != context_length:
        raise FleetMismatchError(
            f"/v1/models says max_model_len {context_length} but {dialect.server_info_path} says "
            f"context_length {declared}"
        )
    return ServerFacts(
        model=model,
        model_path=str(info.get("model_path") or entry.get("root") or model),
        context_length=context_length,
        slots=_slots(info),
        max_req_input_len=_positive_int(info.get("max_req_input_len")),
        version=info.get("version"),
        simulator=bool(info.get("simulator", entry.get("simulator", False))),
        dialect=dialect,
        stream_interval=_positive_int(info.get("stream_interval")),
        tool_call_parser=info.get("tool_call_parser") or None,
        weight_version=_weight_version(info.get("weight_version")),
    )


#: What SGLang reports for weights whose version nobody set (``ServerArgs.weight_version``).
_UNSET_WEIGHT_VERSION = "default"


def _weight_version(value: object) -> str | None:
    return str(value) if value not in (None, "", _UNSET_WEIGHT_VERSION) else None


def _slots(info: Mapping[str, Any]) -> int | None:
    """The scheduler's effective slots summed over DP ranks (0.5.8+), else the launch flag."""
    states = info.get("internal_states") or []
    effective = [s.get("effective_max_running_requests_per_dp") for s in states if isinstance(s, dict)]
    if effective and all(_positive_int(n) for n in effective):
        return sum(effective)
    return _positive_int(info.get("max_running_requests"))


def _positive_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class _NotFound(FleetError):
    """A path the server does not serve (an older version)."""


def _get_json(client: httpx.Client, url: str, path: str) -> Any:
    try:
        response = client.get(url + path)
    except httpx.HTTPError as exc:
        raise ServerUnreachableError(f"{url}{path}: cannot reach the server ({type(exc).__name__}: {exc})") from exc
    if response.status_code == 401:
        raise FleetError(f"{url}{path}: 401 Unauthorized: set the API key environment variable the fleet names")
    if response.status_code == 404:
        raise _NotFound(f"{url}{path}: HTTP 404: {response.text[:300]}")
    if response.status_code != 200:
        raise FleetError(f"{url}{path}: HTTP {response.status_code}: {response.text[:300]}")
    try:
        return response.json()
    except ValueError as exc:
        raise FleetError(f"{url}{path}: not JSON: {response.text[:200]}") from exc


def read_server_facts(client: httpx.Client, url: str, backend: str) -> ServerFacts:
    """Ask one server what it is; the version picks the dialect (SGLang's paths moved over time)."""
    newest = dialect_for(backend)
    models = _get_json(client, url, "/v1/models")
    info: Any = None
    version: str | None = None
    if newest.server_info_path is not None:
        # Every row's path, newest first: an older server answers 404 to the newer path.
        paths = list(dict.fromkeys(d.server_info_path for d in DIALECTS if d.backend == backend))
        for path in paths:
            try:
                info = _get_json(client, url, path)  # type: ignore[arg-type]
                break
            except _NotFound:
                if path == paths[-1]:
                    raise FleetError(
                        f"{url}: none of {', '.join(paths)} is served: not an SGLang server "
                        f"{SGLANG_MIN_VERSION} or newer"
                    ) from None
        version = info.get("version") if isinstance(info, Mapping) else None
    elif newest.version_path is not None:
        try:
            version = _get_json(client, url, newest.version_path).get("version")
        except (FleetError, AttributeError):
            version = None  # optional across releases
    try:
        dialect = dialect_for(backend, version)
        facts = parse_server_facts(models, info, dialect)
    except FleetMismatchError as exc:
        raise FleetMismatchError(f"{url}: {exc}") from None
    except FleetError as exc:
        raise FleetError(f"{url}: {exc}") from None
    return facts if facts.version is not None else replace(facts, version=version)


#: A route every dialect protects with the API key.
PROTECTED_PATH = "/v1/models"


def serves_without_key(url: str, *, timeout_s: float) -> bool:
    """Whether the server answers a protected route to a request with no key (it has none set)."""
    try:
        return httpx.get(url + PROTECTED_PATH, timeout=timeout_s, verify=tls_context()).status_code == 200
    except httpx.HTTPError as exc:
        raise ServerUnreachableError(f"{url}{PROTECTED_PATH}: cannot reach the server ({exc})") from exc


# --- generation ----------------------------------------------------------------------------------


def chat_request(
    model: str,
    messages: Sequence[Mapping[str, Any]],
    max_tokens: int,
    sampling: SamplingSettings,
    *,
    stream: bool = False,
    stream_interval: int | None = None,
    continuous_usage: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str = "auto",
    token_ids: str | None = None,
) -> dict[str, Any]:
    """The body of ``POST /v1/chat/completions`` (the fields SGLang and vLLM both read).

    ``stream``: server-sent events, with the usage in a last chunk (``include_usage``: both SGLang's
    and vLLM's ``should_include_usage`` read it from ``stream_options``). ``stream_interval``: tokens
    per event, for a dialect that takes it per request (``Dialect.stream_interval_per_request``);
    ``continuous_usage``: the tokens so far in every chunk (``Dialect.continuous_usage``).
    ``tools``: tool definitions the chat template renders into the prompt (:func:`request_tools`),
    with ``tool_choice`` as :func:`tool_choice_for` picks it for the server; none, or an empty
    list, sends neither field (vLLM refuses ``tools: []``, ``check_tool_usage``).
    ``token_ids``: ask for the prompt's and the sampled token ids as the dialect returns them
    (``Dialect.token_ids``): SGLang's ``return_input_ids_in_sglext`` and
    ``return_output_ids_in_sglext`` (its ``return_token_ids`` is refused on a streamed chat),
    vLLM's ``return_token_ids``.
    """
    request: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "repetition_penalty": sampling.repetition_penalty,
    }
    if sampling.seed is not None:
        request["seed"] = sampling.seed
    if sampling.stop:
        request["stop"] = list(sampling.stop)
    template_kwargs = sampling.chat_template_kwargs
    if template_kwargs:
        request["chat_template_kwargs"] = template_kwargs
    if stream:
        request["stream"] = True
        request["stream_options"] = {"include_usage": True}
        if continuous_usage:
            request["stream_options"]["continuous_usage_stats"] = True
        if stream_interval is not None and stream_interval > 1:
            request["stream_interval"] = stream_interval
    if tools:
        request["tools"] = request_tools(tools)
        request["tool_choice"] = tool_choice
    if token_ids == "sglext":
        request["return_input_ids_in_sglext"] = True
        request["return_output_ids_in_sglext"] = True
    elif token_ids == "vllm":
        request["return_token_ids"] = True
    return request


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How often one prompt is tried on one server."""

    attempts: int = 5
    wait_initial_s: float = 1.0
    wait_max_s: float = 30.0
    wait_jitter_s: float = 1.0
    #: Retry a context-length 400 once, with max_tokens from the server's own prompt count.
    context_retry: bool = True
    #: Tokens kept free when max_tokens is recomputed.
    context_margin: int = 16
    min_output_tokens: int = 16
    #: How long a prompt may wait in all on a full queue (backpressure, which uses no attempt)
    #: before the last queue-full answer is its error; 0: at once (a borrowed server).
    backpressure_wait_s: float = 600.0


@dataclass(frozen=True)
class Exchange:
    """What became of one prompt on one server: an answer or the last error, never both."""

    answer: Answer | None
    error: RequestError | None
    attempts: int
    #: The max_tokens of the last attempt (lower than asked after a context retry).
    max_tokens: int


async def send_chat(
    client: HttpClient,
    url: str,
    request: Mapping[str, Any],
    dialect: Dialect,
    thresholds: LoopThresholds | None = None,
    *,
    stream_interval: int = 1,
    on_output: Callable[[], None] | None = None,
) -> Answer:
    """One attempt: the complete answer, or the RequestError that says why there is none.

    A streamed request (``request["stream"]``) is read chunk by chunk; with ``thresholds``, a
    loop ends it at once: closing the response with the body unread closes the connection, which
    is how both servers learn to stop decoding. SGLang 0.5.23's stream generator is cancelled on
    disconnect, and ``TokenizerManager.generate_request`` (``except BaseException``:
    ``_release_req_states_on_failure``) aborts the request at the scheduler at once; the
    response's background ``create_abort_task`` (an abort by ``rid`` 2 s after the stream ends)
    is only its fallback. Its slot is free within a second of the close, no ``/abort_request``
    needed (proved against the real server, ``real_engine/test_sglang_streaming.py``). vLLM's
    generator is cancelled on disconnect and ``AsyncLLM.generate`` aborts the request at once
    (proved against the real engine, ``real_engine/test_vllm_streaming.py``).

    ``on_output`` is called once the stream carries generated text, not at the 200: an error can
    still come as an event in the stream (``ChatStream`` raises it) before any text.
    """
    if not request.get("stream"):
        return await _send_plain(client, url, request, dialect)
    try:
        response = await client.post(f"{url}/v1/chat/completions", request)
        try:
            if response.status_code != 200:
                raise error_from_status(response.status_code, as_text(await read_body(response)))
            stream = ChatStream(dialect, thresholds, stream_interval=stream_interval)
            async for data in response.stream:
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


async def _send_plain(client: HttpClient, url: str, request: Mapping[str, Any], dialect: Dialect) -> Answer:
    try:
        response = await client.post(f"{url}/v1/chat/completions", request)
        try:
            data = await read_body(response)
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
    answer = parse_chat_completion(body, dialect)
    error = finish_error(answer)
    if error is not None:
        raise error
    return answer


async def generate(
    client: HttpClient,
    url: str,
    request: Mapping[str, Any],
    dialect: Dialect,
    policy: RetryPolicy,
    *,
    on_retry: Callable[[str], None] | None = None,
    thresholds: LoopThresholds | None = None,
    stream_interval: int = 1,
    on_output: Callable[[], None] | None = None,
) -> Exchange:
    """Send ``request`` until it has a complete answer or the policy gives up.

    Transient errors and unfinished answers are retried with exponential backoff and jitter, up to
    ``policy.attempts``; a full queue (backpressure) is waited out without using an attempt, for up
    to ``policy.backpressure_wait_s``. ``on_retry`` hears the kind of each error that caused a retry (``context_length`` for the
    one retry with a smaller ``max_tokens``). ``thresholds``: stop a streamed answer that loops
    (:class:`DegenerateError`, not retried); ``stream_interval``: the tokens per streamed event,
    to count a stopped answer's tokens; ``on_output``: ``send_chat``'s, called at most once an attempt.
    """
    attempts = 0
    spent = 0  # attempts that count against the policy: backpressure spends none
    max_tokens = int(request["max_tokens"])

    async def with_backoff(body: Mapping[str, Any]) -> Answer:
        nonlocal attempts, spent
        last: RequestError | None = None
        async for attempt in stamina.retry_context(
            on=_spends_an_attempt,
            attempts=max(1, policy.attempts - spent),
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
                        client, url, body, dialect, thresholds, stream_interval=stream_interval, on_output=on_output
                    )
                except QueueFullError:
                    raise
                except TransientError as exc:
                    spent += 1
                    last = exc
                    raise
        raise AssertionError("unreachable: stamina re-raises the last error")

    async def patiently(body: Mapping[str, Any]) -> Answer:
        """``with_backoff``, sent again after a full queue's answer, slower each time, for up to
        ``policy.backpressure_wait_s`` in all."""
        waited = 0.0
        delay = policy.wait_initial_s
        while True:
            try:
                return await with_backoff(body)
            except QueueFullError as exc:
                if waited + delay > policy.backpressure_wait_s:
                    raise
                if on_retry is not None:
                    on_retry(exc.kind)
                await asyncio.sleep(delay + random.uniform(0, policy.wait_jitter_s))
                waited += delay
                delay = min(2 * delay, policy.wait_max_s)

    try:
        try:
            answer = await patiently(request)
        except ContextLengthError as exc:
            if exc.overflow is None or not policy.context_retry:
                raise
            # The server counted the prompt differently: trust its count, once.
            budget = exc.overflow.context_length - exc.overflow.prompt_tokens - policy.context_margin
            if budget < policy.min_output_tokens:
                raise
            if on_retry is not None:
                on_retry(exc.kind)
            max_tokens = min(max_tokens, budget)
            answer = await patiently({**request, "max_tokens": max_tokens})
    except RequestError as error:
        return Exchange(None, error, attempts, max_tokens)
    return Exchange(answer, None, attempts, max_tokens)


def _spends_an_attempt(exc: Exception) -> bool:
    return isinstance(exc, TransientError) and not isinstance(exc, QueueFullError)
