"""One simulated server: its state (slots, FIFO queue, stats, faults) and its HTTP surface.

Everything runs on one asyncio event loop with callbacks, no task per request: a request that gets
a slot arms one timer for ``ttft_s + completion_tokens * token_latency_s`` and is answered when it
fires. Several servers can share one loop (one port each, independent state).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime
import json
import logging
import math
import os
import re
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from expansion_dag.sim.config import SimServerConfig, version_tuple
from expansion_dag.sim.generation import Completion, OutputModel, supports_thinking, word_stream
from expansion_dag.sim.http import HttpConnection, HttpRequest
from expansion_dag.tokenizer import count_tokens, load_tokenizer, render_prompts

logger = logging.getLogger(__name__)

READY_LINE = "The server is fired up and ready to roll!"

_BACKLOG = 4096
_NOT_FOUND = b'{"detail":"Not Found"}'
_METHOD_NOT_ALLOWED = b'{"detail":"Method Not Allowed"}'
_UNAUTHORIZED = b'{"error":"Unauthorized"}'
# What the simulated GPU reports; only the shape matters to clients.
_WEIGHT_GB = 16.4
_KV_CACHE_GB = 60.0
_STARTUP_AVAILABLE_GB = 139.8
#: SGLang 0.5.23 reports graph-capture memory per phase (model_executor/graph_memory_usage.py).
_GRAPH_PHASES = ("prefill", "decode", "target_verify", "draft_prefill", "draft_decode", "draft_extend")

#: SGLang paths that appeared or went away between versions, read from the 0.5.4 to 0.5.23 wheels'
#: entrypoints/http_server.py: (path, first version serving it, first version without it).
_SGLANG_ROUTE_VERSIONS = (
    ("/server_info", "0.5.6", None),
    ("/model_info", "0.5.6", None),
    ("/v1/loads", "0.5.8", None),
    ("/get_load", None, "0.5.21"),
    ("/ready", "0.5.21", None),  # absent in 0.5.8, present in 0.5.21; versions between were not read
)
#: From this version the scheduler reports its effective slots per DP rank, and (as in 0.5.23) the
#: memory usage with graph memory per phase; before it, as 0.5.4 and 0.5.7 do.
_EFFECTIVE_SLOTS_SINCE = (0, 5, 8)
#: /get_load answers carry a timestamp from this version.
_GET_LOAD_TIC_SINCE = (0, 5, 7)

#: Tokens a streamed answer sends per timer tick: the events the stream interval makes, written in
#: batches so that a simulated fleet costs few timers.
_STREAM_TICK_TOKENS = 16
#: A looping answer (``loop_rate``): this many words, then a span of ``_LOOP_SPAN_WORDS`` repeated.
_LOOP_PREFIX_WORDS = 40
_LOOP_SPAN_WORDS = 12
_TOKEN_PIECES = re.compile(r"\s*\S+|\s+")

_LOADING, _WARMING, _READY, _STOPPED = "loading", "warming", "ready", "stopped"
_WAITING, _RUNNING, _DONE = 0, 1, 2


def _stream_deltas(fields: Iterable[tuple[str, str | None]], interval: int) -> Iterator[tuple[str, str, int]]:
    """A streamed answer's events as (field, text, tokens): the first token alone, then ``interval``
    tokens an event, as SGLang's ``OutputStreamer`` and vLLM's ``RequestState`` send them."""
    first = True
    for name, text in fields:
        if not text:
            continue
        pieces = _TOKEN_PIECES.findall(text)
        start = 0
        if first:
            yield name, pieces[0], 1
            start, first = 1, False
        for i in range(start, len(pieces), interval):
            chunk = pieces[i : i + interval]
            yield name, "".join(chunk), len(chunk)


def _usage_so_far(job: _Job) -> dict[str, int] | None:
    """A choice chunk's usage when the request asked for it in every chunk, else None."""
    if not job.continuous_usage:
        return None
    return {
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": job.sent_tokens,
        "total_tokens": job.prompt_tokens + job.sent_tokens,
    }


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _evenly_spaced_hit(n: int, rate: float) -> bool:
    """Whether item ``n`` (0-based) is hit when a ``rate`` share is hit, spread evenly by count."""
    return math.floor((n + 1) * rate + 1e-9) > math.floor(n * rate + 1e-9)


class _RequestError(Exception):
    """A request rejected before it reaches a slot: the HTTP status and the JSON body."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.body = body


class _Dialect:
    """What differs between the SGLang and the vLLM server: errors, context rules, answers, auth.

    The texts and shapes are SGLang 0.5.23's (``entrypoints/openai/protocol.py``,
    ``serving_chat.py``, ``managers/tokenizer_manager.py``, ``managers/scheduler.py``); the
    contract suite compares them with the fixtures recorded from that source.
    """

    owned_by = "sglang"
    #: Where a streamed chunk carries the thinking.
    reasoning_delta = "reasoning_content"
    #: Honours ``stream_options.continuous_usage_stats``. SGLang from 0.5.5 does too, but not the
    #: 0.5.4 surface emulated here as well, and the client asks only vLLM for it.
    continuous_usage = False

    def __init__(self, config: SimServerConfig) -> None:
        self.config = config

    def stream_interval(self, body: dict[str, Any]) -> int:
        """SGLang streams at its launch setting: its chat API has no per-request interval."""
        return self.config.stream_interval

    def stream_event(
        self, job: _Job, delta: dict[str, Any] | None, finish_reason: str | None = None, usage: dict | None = None
    ) -> bytes:
        """One ``data:`` event of a streamed answer: a delta, the finish, or (no choices) the usage."""
        choices = []
        if delta is not None:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            if self.owned_by == "sglang":
                choice["matched_stop"] = None
            choices.append(choice)
        chunk: dict[str, Any] = {
            "id": job.chunk_id,
            "object": "chat.completion.chunk",
            "created": job.created,
            "model": job.model if self.owned_by == "sglang" else self.config.model_name,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        return b"data: " + _dumps(chunk) + b"\n\n"

    def error(
        self, message: str, *, status: int = 400, err_type: str = "BadRequestError", param: str | None = None
    ) -> _RequestError:
        body = {"object": "error", "message": message, "type": err_type, "param": param, "code": status}
        return _RequestError(status, _dumps(body))

    def validation_error(self, loc: tuple[str | int, ...], message: str) -> _RequestError:
        """A malformed request, as SGLang's handler turns FastAPI's RequestValidationError into a 400."""
        errors = [{"loc": list(loc), "msg": message, "type": "value_error"}]
        return self.error(f"1 validation error:\n  {errors[0]} {errors}", err_type="Bad Request")

    def content_type_error(self) -> _RequestError:
        return self.validation_error(
            ("header", "content-type"), "Unsupported Media Type: Only 'application/json' is allowed"
        )

    def requires_key(self, path: str) -> bool:
        """SGLang guards every path but health, readiness and metrics (``utils/auth.py``)."""
        return not path.startswith(("/health", "/ready", "/metrics"))

    def check_model(self, model: object) -> None:
        """SGLang does not check the requested model against the served one."""

    def max_tokens(self, max_tokens: int | None, max_completion_tokens: int | None) -> tuple[str, int | None]:
        # SGLang takes `max_completion_tokens or max_tokens`: a 0 falls back to the other field.
        return "max_completion_tokens", max_completion_tokens or max_tokens

    def completion_cap(self, prompt_tokens: int, field: str, max_tokens: int | None) -> int:
        """How many tokens the request may generate, or the error SGLang answers, in its order."""
        c = self.config
        context = c.context_length
        if max_tokens and max_tokens > context:  # serving_chat._validate_request
            raise self.error(
                f"max_completion_tokens is too large: {max_tokens}."
                f"This model supports at most {context} completion tokens."
            )
        if prompt_tokens >= context:  # tokenizer_manager._validate_one_request
            raise self.error(
                f"The input ({prompt_tokens} tokens) is longer than the "
                f"model's context length ({context} tokens)."
            )
        if max_tokens is not None and prompt_tokens + max_tokens > context:
            raise self.error(
                "Requested token count exceeds the model's maximum context length "
                f"of {context} tokens. You requested a total of {prompt_tokens + max_tokens} "
                f"tokens: {prompt_tokens} tokens from the input messages and "
                f"{max_tokens} tokens for the completion. Please reduce the number "
                "of tokens in the input messages or the completion to fit within the limit."
            )
        if prompt_tokens >= c.max_req_input_len:  # the scheduler: managers/utils.validate_input_length
            raise self.error(
                f"Input length ({prompt_tokens} tokens) exceeds the maximum allowed length "
                f"({c.max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate."
            )
        # The scheduler silently lowers max_new_tokens to fit (scheduler.init_req_max_new_tokens).
        room = c.max_req_len - prompt_tokens - 1
        return max(0, room if max_tokens is None else min(max_tokens, room))

    def model_card(self, created: int) -> dict[str, Any]:
        name = self.config.model_name
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "sglang",
            "root": name,
            "parent": None,
            "max_model_len": self.config.context_length,
        }

    def completion_body(self, job: _Job, eos_token_id: int | None) -> dict[str, Any]:
        c = job.completion
        reasoning_tokens = c.reasoning_tokens
        return {
            "id": job.request_id or uuid.uuid4().hex,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": job.model,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": c.content,
                        "reasoning_content": c.reasoning_content,
                    },
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                    # The end-of-sequence token a stop matched; a length or an abort matched none.
                    "matched_stop": eos_token_id if c.finish_reason == "stop" else None,
                }
            ],
            "usage": {
                "prompt_tokens": job.prompt_tokens,
                "total_tokens": job.prompt_tokens + c.completion_tokens,
                "completion_tokens": c.completion_tokens,
                "prompt_tokens_details": None,
                "reasoning_tokens": reasoning_tokens,
                "completion_tokens_details": {"reasoning_tokens": reasoning_tokens} if reasoning_tokens else None,
            },
            "metadata": {"weight_version": "default"},
        }


class _VllmDialect(_Dialect):
    """vLLM 0.33.0: ``entrypoints/openai/chat_completion``, ``renderers/params.py``,
    ``entrypoints/serve/exception_handling``, ``entrypoints/serve/middleware/authenticate.py``."""

    owned_by = "vllm"
    reasoning_delta = "reasoning"
    continuous_usage = True
    #: Paths the API key guards; /health, /version, /tokenize are open.
    _GUARDED = ("/v1", "/v2", "/inference", "/cohere")

    def error(
        self, message: str, *, status: int = 400, err_type: str = "BadRequestError", param: str | None = None
    ) -> _RequestError:
        body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
        return _RequestError(status, _dumps(body))

    def validation_failed(self, message: str, param: str, value: int) -> _RequestError:
        """A VLLMValidationError: its text ends with the parameter and value it names."""
        return self.error(f"{message} (parameter={param}, value={value})", param=param)

    def validation_error(self, loc: tuple[str | int, ...], message: str) -> _RequestError:
        return self.error(f"{loc[-1]}: {message}", param=str(loc[-1]))

    def requires_key(self, path: str) -> bool:
        return path.startswith(self._GUARDED)

    def stream_interval(self, body: dict[str, Any]) -> int:
        """A request's ``stream_interval`` raises the server's, never lowers it (``RequestState``)."""
        asked = body.get("stream_interval")
        valid = isinstance(asked, int) and not isinstance(asked, bool) and asked >= 1
        return max(self.config.stream_interval, asked if valid else 1)

    def check_model(self, model: object) -> None:
        if model and model != self.config.model_name:
            raise self.error(
                f"The model `{model}` does not exist.", status=404, err_type="NotFoundError", param="model"
            )

    def max_tokens(self, max_tokens: int | None, max_completion_tokens: int | None) -> tuple[str, int | None]:
        if max_completion_tokens is not None:
            return "max_completion_tokens", max_completion_tokens
        return "max_tokens", max_tokens

    def completion_cap(self, prompt_tokens: int, field: str, max_tokens: int | None) -> int:
        context = self.config.context_length
        if max_tokens is not None and max_tokens > context:  # TokenizeParams.__post_init__
            raise self.validation_failed(
                f"{field}={max_tokens} cannot be greater than max_model_len={context}. "
                "Please request fewer output tokens.",
                field,
                max_tokens,
            )
        if prompt_tokens > context:  # TokenizeParams._token_len_check
            qualifier = "at least " if prompt_tokens == context + 1 else ""
            raise self.validation_failed(
                f"This model's maximum context length is {context} tokens. However, your prompt "
                f"contains {qualifier}{prompt_tokens} input tokens, which exceeds this limit even "
                "without any output tokens. Please reduce the length of the input prompt.",
                "input_tokens",
                prompt_tokens,
            )
        # get_max_tokens: prompt + max_tokens may run past the context; the output stops at the edge.
        room = context - prompt_tokens
        cap = room if max_tokens is None else min(max_tokens, room)
        if cap < 1:  # SamplingParams._verify_args
            raise self.validation_failed(f"max_tokens must be at least 1, got {cap}.", "max_tokens", cap)
        return cap

    def model_card(self, created: int) -> dict[str, Any]:
        permission = {
            "id": f"modelperm-{uuid.uuid4().hex}",
            "object": "model_permission",
            "created": created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        return {
            "id": self.config.model_name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": self.config.model_path,
            "parent": None,
            "max_model_len": self.config.context_length,
            "permission": [permission],
        }

    def completion_body(self, job: _Job, eos_token_id: int | None) -> dict[str, Any]:
        c = job.completion
        parsed = self.config.reasoning_parser is not None
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.config.model_name,  # vLLM names the served model, not the requested one
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        # vLLM's reasoning parser leaves no content (null) when the answer never started.
                        "content": c.content if c.content or c.reasoning_content is None else None,
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "reasoning": c.reasoning_content,
                    },
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": None,
                    "token_ids": None,
                    "routed_experts": None,
                    "weight_versions": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {
                "prompt_tokens": job.prompt_tokens,
                "total_tokens": job.prompt_tokens + c.completion_tokens,
                "completion_tokens": c.completion_tokens,
                "prompt_tokens_details": None,
                # Present, even at 0, whenever the server runs a reasoning parser.
                "completion_tokens_details": {"reasoning_tokens": c.reasoning_tokens} if parsed else None,
            },
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }


_DIALECTS: dict[str, type[_Dialect]] = {"sglang": _Dialect, "vllm": _VllmDialect}


class _Job:
    """One accepted generation request, waiting for or holding a slot."""

    __slots__ = (
        "conn",
        "request_id",
        "model",
        "prompt_tokens",
        "completion",
        "duration_s",
        "state",
        "started_at",
        "timer",
        "stream_usage",
        "pieces",
        "sent",
        "sent_tokens",
        "continuous_usage",
        "chunk_id",
        "created",
    )

    def __init__(
        self,
        conn: HttpConnection,
        *,
        request_id: str | None,
        model: str,
        prompt_tokens: int,
        completion: Completion,
        duration_s: float | None,
    ) -> None:
        self.conn = conn
        self.request_id = request_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.completion = completion
        self.duration_s = duration_s  # None: a hung request, answered never
        self.state = _WAITING
        self.started_at = 0.0
        self.timer: asyncio.TimerHandle | None = None
        #: None: answered in one body; else streamed, with a usage chunk when True.
        self.stream_usage: bool | None = None
        #: A streamed answer's events, (field, text, tokens), how many were sent, and their tokens.
        self.pieces: list[tuple[str, str, int]] = []
        self.sent = 0
        self.sent_tokens = 0
        #: Every choice chunk carries the usage so far (vLLM's ``continuous_usage_stats``).
        self.continuous_usage = False
        self.chunk_id = uuid.uuid4().hex
        self.created = int(time.time())


class SimServer:
    """One simulated SGLang (or vLLM) server on one port. Create and drive it inside an event loop.

    :meth:`start` binds the port at once but refuses connections until ``startup_delay_s`` has
    passed (like a server loading its model), then answers ``/health`` with 503 for ``warmup_s``,
    then prints the ready line. :meth:`stop` makes it vanish like a crashed process.
    """

    def __init__(self, config: SimServerConfig) -> None:
        self.config = config
        self._dialect = _DIALECTS[config.backend](config)
        self._version = version_tuple(config.server_version)
        self._tokenizer = load_tokenizer(config.tokenizer)
        self._thinking_model = supports_thinking(self._tokenizer)
        self._eos_token_id = self._tokenizer.eos_token_id
        self._output = OutputModel(
            tokenizer_spec=config.tokenizer,
            max_length=min(config.context_length, config.output_max_tokens or config.context_length),
            median_tokens=config.output_median_tokens,
            sigma=config.output_sigma,
            reasoning_share=config.reasoning_share,
            seed=config.seed,
            median_by_marker=config.output_median_by_marker,
            prompt_exponent=config.output_prompt_exponent,
        )
        self._bearer = None if config.api_key is None else f"Bearer {config.api_key}".encode()
        self._slots = config.max_running_requests
        self._max_total_tokens = config.kv_capacity
        self._routes = self._build_routes()
        self._connections: set[HttpConnection] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sock: socket.socket | None = None
        self._listener: asyncio.Server | None = None
        self._startup: asyncio.Task | None = None
        self._warmup: asyncio.TimerHandle | None = None
        self._ready: asyncio.Future | None = None
        self._stopped: asyncio.Future | None = None
        self._state = _LOADING
        self._created = int(time.time())
        self._started_at = time.time()
        self.port = config.port
        # slots and queue
        self._running: set[_Job] = set()
        self._waiting: collections.deque[_Job] = collections.deque()
        self._num_waiting = 0  # aborted jobs stay in the deque until popped
        self._waiting_prompt_tokens = 0
        # stats; the busy integral restarts when the server becomes ready
        self._ready_at: float | None = None
        self._busy_slot_s = 0.0
        self._busy_since = time.monotonic()
        #: The last moment every slot was busy, and the longest a completed request held its slot:
        #: a benchmark's tail is the time from the fleet's last full moment to its end.
        self._last_full_at: float | None = None
        self._longest_request_s = 0.0
        self._by_status: collections.Counter[int] = collections.Counter()
        self._completed = 0
        self._aborted = 0
        self._abort_finishes = 0
        self._hung = 0
        #: Connections accepted and load reads answered: how a client's polling treats a server.
        self._connections_opened = 0
        self._load_reads = 0
        self._prompt_tokens_total = 0
        self._completion_tokens_total = 0
        self._max_requested_tokens = 0
        self._last_chat_request: dict[str, Any] | None = None  # what a test checks the client sent
        self._context_exceeded = 0
        self._generation_requests = 0  # fault-injection counters
        self._survivors = 0

    # lifecycle

    @property
    def url(self) -> str:
        host = self.config.host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    @property
    def state(self) -> str:
        """``loading`` (port refuses), ``warming`` (health 503), ``ready`` or ``stopped``."""
        return self._state

    def start(self) -> None:
        """Bind the port now (so an ephemeral one is known) and serve after the startup delay."""
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._stopped = self._loop.create_future()
        # Bound but not listening: connections are refused, as while a real server loads its model.
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.config.host, self.config.port))
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._startup = self._loop.create_task(self._serve_after_startup_delay())

    async def wait_ready(self) -> None:
        """Return once the server is ready; raise if it stopped first."""
        await asyncio.shield(self._ready)

    async def wait_stopped(self) -> None:
        """Return once the server has stopped (killed, died or shut down)."""
        await asyncio.shield(self._stopped)

    def _new_connection(self) -> HttpConnection:
        self._connections_opened += 1
        return HttpConnection(self._dispatch, self._connections)

    async def _serve_after_startup_delay(self) -> None:
        await asyncio.sleep(self.config.startup_delay_s)
        self._listener = await self._loop.create_server(
            self._new_connection, sock=self._sock, backlog=_BACKLOG
        )
        self._state = _WARMING
        logger.info(
            "simulated %s server listening on %s (warming up %.1f s)",
            self.config.backend,
            self.url,
            self.config.warmup_s,
        )
        self._warmup = self._loop.call_later(self.config.warmup_s, self._become_ready)

    def _become_ready(self) -> None:
        self._state = _READY
        now = time.monotonic()
        self._ready_at = now
        self._busy_slot_s = 0.0
        self._busy_since = now
        print(f"[simulator {self.url}] {READY_LINE}", file=sys.stdout, flush=True)
        self._ready.set_result(None)

    def stop(self, reason: str = "stopped") -> None:
        """Vanish like a crashed server: stop listening, drop every connection, forget all work."""
        if self._state == _STOPPED:
            return
        self._state = _STOPPED
        if self._startup is not None:
            self._startup.cancel()
        if self._warmup is not None:
            self._warmup.cancel()
        if self._listener is not None:
            self._listener.close()
        elif self._sock is not None:
            self._sock.close()
        for job in self._running:
            if job.timer is not None:
                job.timer.cancel()
            job.state = _DONE
        for job in self._waiting:
            job.state = _DONE
        self._running.clear()
        self._waiting.clear()
        self._num_waiting = 0
        self._waiting_prompt_tokens = 0
        for conn in list(self._connections):
            conn.on_abort = None
            conn.drop()
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(
                RuntimeError(f"simulated server {self.url} stopped before ready: {reason}")
            )
            self._ready.exception()  # mark retrieved: nobody may be waiting
        if self._stopped is not None:
            self._stopped.set_result(reason)
        logger.info("simulated server %s %s", self.url, reason)

    # HTTP routing

    def _build_routes(self) -> dict[str, dict[str, Callable[[HttpRequest, HttpConnection], None]]]:
        routes = {
            "/health": {"GET": self._health},
            "/health_generate": {"GET": self._health},
            "/v1/models": {"GET": self._models},
            "/v1/chat/completions": {"POST": self._chat_completions},
            "/sim/stats": {"GET": self._sim_stats},
        }
        if self.config.backend == "vllm":
            routes["/tokenize"] = {"POST": self._tokenize}
            routes["/version"] = {"GET": self._vllm_version}
            return routes
        routes |= {
            "/ready": {"GET": self._health},
            "/server_info": {"GET": self._server_info},
            "/get_server_info": {"GET": self._server_info},
            "/model_info": {"GET": self._model_info},
            "/get_model_info": {"GET": self._model_info},
            "/v1/loads": {"GET": self._loads},
            "/get_load": {"GET": self._get_load},
        }
        for path, since, until in _SGLANG_ROUTE_VERSIONS:
            if (since and self._version < version_tuple(since)) or (until and self._version >= version_tuple(until)):
                del routes[path]
        return routes

    def _dispatch(self, request: HttpRequest, conn: HttpConnection) -> None:
        path = request.path
        if (
            self._bearer is not None
            and self._dialect.requires_key(path)
            and request.headers.get(b"authorization") != self._bearer
        ):
            conn.respond(401, _UNAUTHORIZED)
            return
        methods = self._routes.get(path)
        if methods is None:
            conn.respond(404, _NOT_FOUND)
            return
        handler = methods.get(request.method)
        if handler is None:
            conn.respond(405, _METHOD_NOT_ALLOWED)
            return
        handler(request, conn)

    # probing endpoints

    def _health(self, request: HttpRequest, conn: HttpConnection) -> None:
        conn.respond(200 if self._state == _READY else 503)

    def _models(self, request: HttpRequest, conn: HttpConnection) -> None:
        card = self._dialect.model_card(self._created)
        conn.respond(200, _dumps({"object": "list", "data": [card]}))

    def _vllm_version(self, request: HttpRequest, conn: HttpConnection) -> None:
        conn.respond(200, _dumps({"version": self.config.server_version}))

    def _gen_throughput(self) -> float:
        # Every running request emits one token per token_latency_s.
        latency = self.config.token_latency_s
        return len(self._running) / latency if latency > 0 else 0.0

    def _used_tokens(self, now: float) -> int:
        ttft, latency = self.config.ttft_s, self.config.token_latency_s
        used = 0
        for job in self._running:
            n = job.completion.completion_tokens
            produced = n if latency <= 0 else min(n, max(0, int((now - job.started_at - ttft) / latency)))
            used += job.prompt_tokens + produced
        return used

    def _server_info(self, request: HttpRequest, conn: HttpConnection) -> None:
        """The server arguments the client may read, the scheduler's figures and one internal state.

        A real body carries every ServerArgs field (hundreds); the simulator sends the ones recorded
        in the contract fixtures, as a server launched with ``--context-length`` and
        ``--max-running-requests`` reports them.
        """
        c = self.config
        share = self._used_tokens(time.monotonic()) / self._max_total_tokens
        state: dict[str, Any] = {"last_gen_throughput": self._gen_throughput()}
        if self._version >= _EFFECTIVE_SLOTS_SINCE:
            state["effective_max_running_requests_per_dp"] = self._slots
            state["memory_usage"] = {
                "weight": _WEIGHT_GB,
                "kvcache": round(_KV_CACHE_GB * share, 3),
                "startup_available": _STARTUP_AVAILABLE_GB,
                "token_capacity": self._max_total_tokens,
                "token_capacity_swa": None,
                "graph": dict.fromkeys(_GRAPH_PHASES, 0.0),
            }
        else:
            state["memory_usage"] = {
                "weight": _WEIGHT_GB,
                "kvcache": round(_KV_CACHE_GB * share, 2),
                "token_capacity": self._max_total_tokens,
                "graph": 0.0,
            }
        info = {
            "model_path": c.model_path,
            "tokenizer_path": c.tokenizer,
            "served_model_name": c.model_name,
            "host": c.host,
            "port": self.port,
            "context_length": c.context_length,
            "max_running_requests": c.max_running_requests,
            "max_queued_requests": c.max_queued_requests,
            "max_total_tokens": c.max_total_tokens,
            "stream_interval": c.stream_interval,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "reasoning_parser": c.reasoning_parser,
            "random_seed": c.seed,
            "schedule_policy": "fcfs",
            # The scheduler's handshake; the HTTP server only starts once it is in.
            "status": "ready",
            "max_total_num_tokens": self._max_total_tokens,
            "max_req_input_len": c.max_req_input_len,
            "internal_states": [state],
            "version": c.server_version,
            "simulator": True,
        }
        conn.respond(200, _dumps(info))

    def _model_info(self, request: HttpRequest, conn: HttpConnection) -> None:
        c = self.config
        info = {
            "model_path": c.model_path,
            "served_model_name": c.model_name,
            "tokenizer_path": c.tokenizer,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "reasoning_parser": c.reasoning_parser,
            "model_type": None,
            "architectures": None,
            "simulator": True,
        }
        conn.respond(200, _dumps(info))

    def _loads(self, request: HttpRequest, conn: HttpConnection) -> None:
        """``/v1/loads`` (0.5.8+): one LoadSnapshot per DP rank, as ``managers/load_snapshot.py``."""
        self._load_reads += 1
        used = self._used_tokens(time.monotonic())
        running = len(self._running)
        load = {
            "timestamp": time.time(),
            "dp_rank": 0,
            "num_running_reqs": running,
            "num_waiting_reqs": self._num_waiting,
            "num_waiting_uncached_tokens": self._waiting_prompt_tokens,
            "num_used_tokens": used,
            "num_total_tokens": used + self._waiting_prompt_tokens,
            "num_active_tokens": used + self._waiting_prompt_tokens,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": self._max_total_tokens,
            "max_running_requests": self._slots,
            "token_usage": round(used / self._max_total_tokens, 4),
            "gen_throughput": round(self._gen_throughput(), 2),
            "cache_hit_rate": 0.0,
            "utilization": round(running / self._slots, 4),
            "total_prefill_uncached_tokens": self._prompt_tokens_total,
            "total_prefill_busy_us": 0,
            "decode_moments": None,
            "memory": {
                "weight_gb": _WEIGHT_GB,
                "kv_cache_gb": _KV_CACHE_GB,
                "graph_gb": 0.0,
                "token_capacity": self._max_total_tokens,
            },
            "disaggregation": {
                "mode": "null",
                "prefill_bootstrap_queue_reqs": 0,
                "prefill_inflight_queue_reqs": 0,
                "decode_prealloc_queue_reqs": 0,
                "decode_transfer_queue_reqs": 0,
                "decode_retracted_queue_reqs": 0,
                "kv_transfer_speed_gb_s": 0.0,
                "kv_transfer_latency_ms": 0.0,
            },
            "queues": {"waiting": self._num_waiting, "grammar": 0, "paused": 0, "retracted": 0, "prealloc_ready": 0},
        }
        body = {
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "version": self.config.server_version,
            "accelerator": "simulated",
            "num_accelerators": 1,
            "loads": [load],
        }
        conn.respond(200, _dumps(body))

    def _get_load(self, request: HttpRequest, conn: HttpConnection) -> None:
        """``/get_load`` (before 0.5.21): per DP rank, requests running or waiting, and their tokens."""
        self._load_reads += 1
        used = self._used_tokens(time.monotonic())
        load: dict[str, Any] = {
            "rid": None,
            "http_worker_ipc": None,
            "dp_rank": 0,
            "num_reqs": len(self._running) + self._num_waiting,
            "num_waiting_reqs": self._num_waiting,
            "num_tokens": used + self._waiting_prompt_tokens,
        }
        if self._version >= _GET_LOAD_TIC_SINCE:
            load["ts_tic"] = time.perf_counter()
        conn.respond(200, _dumps([load]))

    def stats(self) -> dict[str, Any]:
        """Cumulative counters since start; the busy integral and elapsed time since ready."""
        now = time.monotonic()
        busy = self._busy_slot_s + len(self._running) * (now - self._busy_since)
        elapsed = None if self._ready_at is None else now - self._ready_at
        c = self.config
        return {
            "simulator": True,
            "pid": os.getpid(),  # a launcher tells the simulator it started from a server already on the port
            "last_chat_request": self._last_chat_request,
            "backend": c.backend,
            "url": self.url,
            "state": self._state,
            "slots": self._slots,
            "monotonic_s": now,  # CLOCK_MONOTONIC: comparable with other processes' on this machine
            "last_full_at_monotonic_s": now if len(self._running) >= self._slots else self._last_full_at,
            "longest_request_s": self._longest_request_s,
            "elapsed_since_ready_s": elapsed,
            "busy_slot_seconds": busy,
            "utilization_since_ready": busy / (self._slots * elapsed) if elapsed else None,
            "num_running": len(self._running),
            "num_waiting": self._num_waiting,
            "chat_requests_by_status": {str(k): v for k, v in sorted(self._by_status.items())},
            "completed": self._completed,
            "aborted": self._aborted,
            "abort_finishes": self._abort_finishes,
            "hung": self._hung,
            "connections_opened": self._connections_opened,
            "load_reads": self._load_reads,
            "prompt_tokens_total": self._prompt_tokens_total,
            "completion_tokens_total": self._completion_tokens_total,
            "max_requested_total_tokens": self._max_requested_tokens,
            "context_exceeded": self._context_exceeded,
            "time_model": {"ttft_s": c.ttft_s, "token_latency_s": c.token_latency_s},
        }

    def _sim_stats(self, request: HttpRequest, conn: HttpConnection) -> None:
        conn.respond(200, _dumps(self.stats()))

    # generation

    def _parse_json(self, request: HttpRequest) -> dict[str, Any]:
        content_type = request.headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
        if content_type != b"application/json":
            raise self._dialect.content_type_error()
        try:
            body = json.loads(request.body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise self._dialect.validation_error(("body", 0), f"JSON decode error: {exc}") from None
        if not isinstance(body, dict):
            raise self._dialect.validation_error(("body",), "Input should be a valid dictionary")
        return body

    def _render(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """The prompt rendered with the chat template as the server does, and the template kwargs."""
        d = self._dialect
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise d.validation_error(("body", "messages"), "Input should be a valid list of message objects")
        if not messages:
            raise d.error("Messages cannot be empty.")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise d.validation_error(("body", "chat_template_kwargs"), "Input should be a valid dictionary")
        try:
            return render_prompts(self._tokenizer, [messages], kwargs)[0], kwargs
        except Exception as exc:  # the chat template raises jinja and type errors on odd input
            raise d.error(f"cannot apply the chat template: {exc}") from None

    def _reported(self, local_tokens: int) -> int:
        """A prompt count as this server reports it: the local count plus the configured skew."""
        return max(0, local_tokens + self.config.prompt_token_skew)

    def _chat_completions(self, request: HttpRequest, conn: HttpConnection) -> None:
        try:
            job = self._accept(request, conn)
        except _RequestError as exc:
            self._by_status[exc.status] += 1
            conn.respond(exc.status, exc.body)
            return
        conn.on_abort = lambda: self._abort(job)
        if len(self._running) < self._slots:
            self._run(job)
        else:
            self._waiting.append(job)
            self._num_waiting += 1
            self._waiting_prompt_tokens += job.prompt_tokens

    def _accept(self, request: HttpRequest, conn: HttpConnection) -> _Job:
        """Validate a chat request as the server would and turn it into a job, or raise."""
        d, c = self._dialect, self.config
        body = self._parse_json(request)
        self._last_chat_request = body
        if body.get("n") not in (None, 1):
            raise d.error("The simulator supports only n=1.")
        for field in ("max_tokens", "max_completion_tokens"):
            value = body.get(field)
            if value is not None and (type(value) is not int or value < 0):
                raise d.validation_error(("body", field), "Input should be a non-negative integer")
        field, max_tokens = d.max_tokens(body.get("max_tokens"), body.get("max_completion_tokens"))
        d.check_model(body.get("model"))
        request_seed = body.get("seed")
        rendered, kwargs = self._render(body)
        prompt_tokens = self._reported(count_tokens(self._tokenizer, [rendered])[0])

        requested = prompt_tokens + (max_tokens or 0)
        self._max_requested_tokens = max(self._max_requested_tokens, requested)
        if prompt_tokens >= c.context_length or requested > c.context_length:
            self._context_exceeded += 1
        cap = d.completion_cap(prompt_tokens, field, max_tokens)

        n = self._generation_requests
        self._generation_requests += 1
        if _evenly_spaced_hit(n, c.fail_rate):
            raise d.error(
                f"Simulated failure injected by the simulator (fail_rate={c.fail_rate}).",
                status=c.fail_status,
                err_type=str(c.fail_status),
            )
        if (
            c.max_queued_requests is not None
            and len(self._running) >= self._slots
            and self._num_waiting >= c.max_queued_requests
        ):
            raise d.error("The request queue is full.", status=503, err_type="503")
        survivor = self._survivors
        self._survivors += 1
        hang = _evenly_spaced_hit(survivor, c.hang_rate)

        def generate(limit: int) -> Completion:
            return self._output.generate(
                rendered,
                request_seed=request_seed if type(request_seed) is int else None,
                cap=limit,
                thinking=self._thinking_model and kwargs.get("enable_thinking", True) is not False,
                split_reasoning=c.reasoning_parser is not None
                and body.get("separate_reasoning", True) is not False,
                prompt_tokens=prompt_tokens,
            )

        completion = generate(cap)
        if _evenly_spaced_hit(survivor, c.loop_rate):
            completion = self._looping(rendered, cap, split=c.reasoning_parser is not None)
        elif not hang and _evenly_spaced_hit(survivor, c.abort_rate):
            # Aborted halfway (/abort_request, abort_all): SGLang answers 200 with the partial text.
            completion = dataclasses.replace(generate(completion.completion_tokens // 2), finish_reason="abort")
        rid = body.get("rid")
        job = _Job(
            conn,
            request_id=rid if isinstance(rid, str) else None,
            model=body.get("model") if isinstance(body.get("model"), str) else "default",
            prompt_tokens=prompt_tokens,
            completion=completion,
            duration_s=None if hang else c.ttft_s + completion.completion_tokens * c.token_latency_s,
        )
        if body.get("stream"):
            # Both servers send the usage chunk only when asked (should_include_usage).
            options = body.get("stream_options")
            job.stream_usage = bool(isinstance(options, dict) and options.get("include_usage"))
            job.continuous_usage = job.stream_usage and d.continuous_usage and bool(options.get("continuous_usage_stats"))
            fields = ((d.reasoning_delta, completion.reasoning_content), ("content", completion.content))
            job.pieces = list(_stream_deltas(fields, d.stream_interval(body)))
        return job

    def _looping(self, rendered: str, cap: int, *, split: bool) -> Completion:
        """A degenerate answer: a few words, then one span repeated until the cap (one token a word)."""
        words = word_stream(self.config.tokenizer, 4096 + self.config.context_length)
        start = sum(rendered.encode()) % 4000
        prefix = words.words(start, _LOOP_PREFIX_WORDS).split()
        span = words.words(start + _LOOP_PREFIX_WORDS, _LOOP_SPAN_WORDS).split()
        body = (prefix + span * (cap // _LOOP_SPAN_WORDS + 1))[:cap]
        text = " ".join(body)
        return Completion(
            content="" if split else text,
            reasoning_content=text if split else None,
            completion_tokens=len(body),
            reasoning_tokens=len(body) if split else 0,
            finish_reason="length",
        )

    def _account_busy(self, now: float) -> None:
        self._busy_slot_s += len(self._running) * (now - self._busy_since)
        self._busy_since = now
        if len(self._running) >= self._slots:
            self._last_full_at = now

    def _run(self, job: _Job) -> None:
        now = time.monotonic()
        self._account_busy(now)
        self._running.add(job)
        job.state = _RUNNING
        job.started_at = now
        if job.duration_s is None:
            self._hung += 1
        elif job.stream_usage is not None:
            job.timer = self._loop.call_later(self.config.ttft_s, self._stream_tick, job)
        else:
            job.timer = self._loop.call_later(job.duration_s, self._finish, job)

    def _stream_tick(self, job: _Job) -> None:
        """Send the next tokens of a streamed answer; finish once all are sent."""
        d = self._dialect
        if job.sent == 0:
            job.conn.start_stream()
            job.conn.send_event(d.stream_event(job, {"role": "assistant", "content": ""}, usage=_usage_so_far(job)))
        events, tokens = [], 0
        while job.sent < len(job.pieces) and tokens < _STREAM_TICK_TOKENS:
            name, text, n = job.pieces[job.sent]
            job.sent += 1
            job.sent_tokens += n
            events.append(d.stream_event(job, {name: text}, usage=_usage_so_far(job)))
            tokens += n
        if events:
            job.conn.send_event(b"".join(events))
        delay = max(tokens, 1) * self.config.token_latency_s
        then = self._stream_tick if job.sent < len(job.pieces) else self._finish
        job.timer = self._loop.call_later(delay, then, job)

    def _release(self, job: _Job) -> None:
        """Free the job's slot and hand it to the next waiting request."""
        self._account_busy(time.monotonic())
        self._running.discard(job)
        job.state = _DONE
        while self._waiting and len(self._running) < self._slots:
            nxt = self._waiting.popleft()
            if nxt.state == _WAITING:
                self._num_waiting -= 1
                self._waiting_prompt_tokens -= nxt.prompt_tokens
                self._run(nxt)

    def _finish(self, job: _Job) -> None:
        self._longest_request_s = max(self._longest_request_s, time.monotonic() - job.started_at)
        self._release(job)
        self._completed += 1
        self._by_status[200] += 1
        if job.completion.finish_reason == "abort":
            self._abort_finishes += 1
        self._prompt_tokens_total += job.prompt_tokens
        self._completion_tokens_total += job.completion.completion_tokens
        body = self._dialect.completion_body(job, self._eos_token_id)
        if job.stream_usage is None:
            job.conn.respond(200, _dumps(body))
        else:
            d = self._dialect
            events = d.stream_event(job, {}, finish_reason=job.completion.finish_reason, usage=_usage_so_far(job))
            if job.stream_usage:
                events += d.stream_event(job, None, usage=body["usage"])
            job.conn.send_event(events + b"data: [DONE]\n\n")
            job.conn.end_stream()
        limit = self.config.die_after_requests
        if limit is not None and self._completed >= limit:
            self.stop(f"died after {limit} completed requests (die_after_requests)")

    def _abort(self, job: _Job) -> None:
        """The client went away before its answer: drop the request and free its slot."""
        if job.state == _DONE:
            return
        self._aborted += 1
        if job.state == _WAITING:
            job.state = _DONE
            self._num_waiting -= 1
            self._waiting_prompt_tokens -= job.prompt_tokens
            return
        if job.timer is not None:
            job.timer.cancel()
        self._release(job)

    # vLLM only

    def _tokenize(self, request: HttpRequest, conn: HttpConnection) -> None:
        try:
            body = self._parse_json(request)
            if "messages" in body:
                text, _ = self._render(body)
            elif isinstance(body.get("prompt"), str):
                text = body["prompt"]
            else:
                raise self._dialect.validation_error(("body", "prompt"), "Field required: prompt or messages")
        except _RequestError as exc:
            conn.respond(exc.status, exc.body)
            return
        # The same encoding as expansion_dag.tokenizer.count_tokens, kept for its ids.
        tokens = self._tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
        answer = {
            "count": self._reported(len(tokens)),
            "max_model_len": self.config.context_length,
            "tokens": tokens,
            "token_strs": None,
        }
        conn.respond(200, _dumps(answer))
