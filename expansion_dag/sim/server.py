"""One simulated server: its state (slots, FIFO queue, stats, faults) and its HTTP surface.

Everything runs on one asyncio event loop with callbacks, no task per request: a request that gets
a slot arms one timer for ``ttft_s + completion_tokens * token_latency_s`` and is answered when it
fires. Several servers can share one loop (one port each, independent state).
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import json
import logging
import math
import socket
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from expansion_dag.sim.config import SimServerConfig
from expansion_dag.sim.generation import Completion, OutputModel, supports_thinking
from expansion_dag.sim.http import HttpConnection, HttpRequest
from expansion_dag.tokenizer import count_tokens, load_tokenizer, render_prompts

logger = logging.getLogger(__name__)

#: The SGLang version whose surface is simulated (see /work/shared/reference/sglang-api.md).
SGLANG_VERSION = "0.5.23"
READY_LINE = "The server is fired up and ready to roll!"

_BACKLOG = 4096
_AUTH_EXEMPT = ("/health", "/ready", "/metrics")
_NOT_FOUND = b'{"detail":"Not Found"}'
_METHOD_NOT_ALLOWED = b'{"detail":"Method Not Allowed"}'
_UNAUTHORIZED = b'{"error":"Unauthorized"}'
# What the simulated GPU reports; only the shape matters to clients.
_WEIGHT_GB = 16.4
_KV_CACHE_GB = 60.0

_LOADING, _WARMING, _READY, _STOPPED = "loading", "warming", "ready", "stopped"
_WAITING, _RUNNING, _DONE = 0, 1, 2


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
    """What differs between the SGLang and the vLLM server: error bodies, context rules, answers."""

    owned_by = "sglang"

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

    def completion_cap(self, prompt_tokens: int, max_tokens: int | None, context: int) -> int:
        """How many tokens the request may generate, or the context error SGLang answers."""
        if max_tokens is not None and max_tokens > context:
            raise self.error(
                f"max_completion_tokens is too large: {max_tokens}."
                f"This model supports at most {context} completion tokens."
            )
        if prompt_tokens >= context:
            raise self.error(
                f"The input ({prompt_tokens} tokens) is longer than the "
                f"model's context length ({context} tokens)."
            )
        if max_tokens is None:
            return context - prompt_tokens
        if prompt_tokens + max_tokens > context:
            raise self.error(
                "Requested token count exceeds the model's maximum context length "
                f"of {context} tokens. You requested a total of {prompt_tokens + max_tokens} "
                f"tokens: {prompt_tokens} tokens from the input messages and "
                f"{max_tokens} tokens for the completion. Please reduce the number "
                "of tokens in the input messages or the completion to fit within the limit."
            )
        return max_tokens

    def completion_body(self, job: _Job, eos_token_id: int | None) -> dict[str, Any]:
        c = job.completion
        stopped = c.finish_reason == "stop"
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
                    "matched_stop": eos_token_id if stopped else None,
                }
            ],
            "usage": {
                "prompt_tokens": job.prompt_tokens,
                "completion_tokens": c.completion_tokens,
                "total_tokens": job.prompt_tokens + c.completion_tokens,
                "reasoning_tokens": c.reasoning_tokens,
            },
        }


class _VllmDialect(_Dialect):
    owned_by = "vllm"

    def error(
        self, message: str, *, status: int = 400, err_type: str = "BadRequestError", param: str | None = None
    ) -> _RequestError:
        body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
        return _RequestError(status, _dumps(body))

    def validation_error(self, loc: tuple[str | int, ...], message: str) -> _RequestError:
        return self.error(f"{loc[-1]}: {message}", param=str(loc[-1]))

    def completion_cap(self, prompt_tokens: int, max_tokens: int | None, context: int) -> int:
        if max_tokens is not None and max_tokens > context:
            raise self.error(
                f"max_tokens={max_tokens} cannot be greater than max_model_len={context}. "
                "Please request fewer output tokens.",
                param="max_tokens",
            )
        if prompt_tokens >= context:
            raise self.error(
                f"This model's maximum context length is {context} tokens. However, your prompt "
                f"contains at least {prompt_tokens} input tokens. "
                "Please reduce the length of the input prompt.",
                param="input_tokens",
            )
        # vLLM lets prompt + max_tokens run past the context and stops the output at the edge.
        room = context - prompt_tokens
        return room if max_tokens is None else min(max_tokens, room)

    def completion_body(self, job: _Job, eos_token_id: int | None) -> dict[str, Any]:
        c = job.completion
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
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
                        "tool_calls": [],
                    },
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": None,
                }
            ],
            "usage": {
                "prompt_tokens": job.prompt_tokens,
                "total_tokens": job.prompt_tokens + c.completion_tokens,
                "completion_tokens": c.completion_tokens,
                "prompt_tokens_details": None,
            },
        }


_DIALECTS = {"sglang": _Dialect(), "vllm": _VllmDialect()}


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


class SimServer:
    """One simulated SGLang (or vLLM) server on one port. Create and drive it inside an event loop.

    :meth:`start` binds the port at once but refuses connections until ``startup_delay_s`` has
    passed (like a server loading its model), then answers ``/health`` with 503 for ``warmup_s``,
    then prints the ready line. :meth:`stop` makes it vanish like a crashed process.
    """

    def __init__(self, config: SimServerConfig) -> None:
        self.config = config
        self._dialect = _DIALECTS[config.backend]
        self._tokenizer = load_tokenizer(config.tokenizer)
        self._thinking_model = supports_thinking(self._tokenizer)
        self._eos_token_id = self._tokenizer.eos_token_id
        self._output = OutputModel(
            tokenizer_spec=config.tokenizer,
            max_length=config.context_length,
            median_tokens=config.output_median_tokens,
            sigma=config.output_sigma,
            reasoning_share=config.reasoning_share,
            seed=config.seed,
        )
        self._bearer = None if config.api_key is None else f"Bearer {config.api_key}".encode()
        self._slots = config.max_running_requests
        self._max_total_tokens = config.max_running_requests * config.context_length
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
        self._by_status: collections.Counter[int] = collections.Counter()
        self._completed = 0
        self._aborted = 0
        self._hung = 0
        self._prompt_tokens_total = 0
        self._completion_tokens_total = 0
        self._max_requested_tokens = 0
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

    async def _serve_after_startup_delay(self) -> None:
        await asyncio.sleep(self.config.startup_delay_s)
        self._listener = await self._loop.create_server(
            lambda: HttpConnection(self._dispatch, self._connections), sock=self._sock, backlog=_BACKLOG
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
        if self.config.backend == "sglang":
            routes |= {
                "/ready": {"GET": self._health},
                "/server_info": {"GET": self._server_info},
                "/get_server_info": {"GET": self._server_info},
                "/model_info": {"GET": self._model_info},
                "/get_model_info": {"GET": self._model_info},
                "/v1/loads": {"GET": self._loads},
            }
        else:
            routes["/tokenize"] = {"POST": self._tokenize}
        return routes

    def _dispatch(self, request: HttpRequest, conn: HttpConnection) -> None:
        path = request.path
        if (
            self._bearer is not None
            and not path.startswith(_AUTH_EXEMPT)
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
        name = self.config.model_name
        card = {
            "id": name,
            "object": "model",
            "created": self._created,
            "owned_by": self._dialect.owned_by,
            "root": name,
            "parent": None,
            "max_model_len": self.config.context_length,
        }
        conn.respond(200, _dumps({"object": "list", "data": [card]}))

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
        c = self.config
        used = self._used_tokens(time.monotonic())
        info = {
            "model_path": c.model_path,
            "tokenizer_path": c.tokenizer,
            "served_model_name": c.model_name,
            "host": c.host,
            "port": self.port,
            "context_length": c.context_length,
            "max_running_requests": c.max_running_requests,
            "max_queued_requests": c.max_queued_requests,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "reasoning_parser": c.reasoning_parser,
            "random_seed": c.seed,
            "schedule_policy": "fcfs",
            "status": "Up" if self._state == _READY else "Starting",
            "max_total_num_tokens": self._max_total_tokens,
            "max_req_input_len": min(c.context_length - 1, self._max_total_tokens - 1) - 5,
            "internal_states": [
                {
                    "effective_max_running_requests_per_dp": self._slots,
                    "last_gen_throughput": self._gen_throughput(),
                    "memory_usage": {
                        "weight": _WEIGHT_GB,
                        "kvcache": round(_KV_CACHE_GB * used / self._max_total_tokens, 2),
                        "token_capacity": self._max_total_tokens,
                        "graph": 0,
                    },
                }
            ],
            "version": SGLANG_VERSION,
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
        used = self._used_tokens(time.monotonic())
        running = len(self._running)
        load = {
            "dp_rank": 0,
            "timestamp": time.time(),
            "num_running_reqs": running,
            "num_waiting_reqs": self._num_waiting,
            "num_used_tokens": used,
            "num_total_tokens": used + self._waiting_prompt_tokens,
            "max_total_num_tokens": self._max_total_tokens,
            "token_usage": used / self._max_total_tokens,
            "gen_throughput": self._gen_throughput(),
            "cache_hit_rate": 0.0,
            "utilization": running / self._slots,
            "max_running_requests": self._slots,
            "memory": {
                "weight_gb": _WEIGHT_GB,
                "kv_cache_gb": _KV_CACHE_GB,
                "graph_gb": 0.0,
                "token_capacity": self._max_total_tokens,
            },
            "queues": {"waiting": self._num_waiting, "grammar": 0, "paused": 0, "retracted": 0},
        }
        body = {
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "version": SGLANG_VERSION,
            "accelerator": "simulated",
            "num_accelerators": 1,
            "loads": [load],
        }
        conn.respond(200, _dumps(body))

    def stats(self) -> dict[str, Any]:
        """Cumulative counters since start; the busy integral and elapsed time since ready."""
        now = time.monotonic()
        busy = self._busy_slot_s + len(self._running) * (now - self._busy_since)
        elapsed = None if self._ready_at is None else now - self._ready_at
        c = self.config
        return {
            "simulator": True,
            "backend": c.backend,
            "url": self.url,
            "state": self._state,
            "slots": self._slots,
            "monotonic_s": now,
            "elapsed_since_ready_s": elapsed,
            "busy_slot_seconds": busy,
            "utilization_since_ready": busy / (self._slots * elapsed) if elapsed else None,
            "num_running": len(self._running),
            "num_waiting": self._num_waiting,
            "chat_requests_by_status": {str(k): v for k, v in sorted(self._by_status.items())},
            "completed": self._completed,
            "aborted": self._aborted,
            "hung": self._hung,
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
        if body.get("stream"):
            raise d.error("The simulator answers only non-streaming requests (stream=false).")
        if body.get("n") not in (None, 1):
            raise d.error("The simulator supports only n=1.")
        max_tokens = body.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 0):
            raise d.validation_error(("body", "max_tokens"), "Input should be a non-negative integer")
        request_seed = body.get("seed")
        rendered, kwargs = self._render(body)
        prompt_tokens = self._reported(count_tokens(self._tokenizer, [rendered])[0])

        requested = prompt_tokens + (max_tokens or 0)
        self._max_requested_tokens = max(self._max_requested_tokens, requested)
        if prompt_tokens >= c.context_length or requested > c.context_length:
            self._context_exceeded += 1
        cap = d.completion_cap(prompt_tokens, max_tokens, c.context_length)

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
        hang = _evenly_spaced_hit(self._survivors, c.hang_rate)
        self._survivors += 1

        completion = self._output.generate(
            rendered,
            request_seed=request_seed if type(request_seed) is int else None,
            cap=cap,
            thinking=self._thinking_model and kwargs.get("enable_thinking", True) is not False,
            split_reasoning=c.reasoning_parser is not None
            and body.get("separate_reasoning", True) is not False,
        )
        rid = body.get("rid")
        return _Job(
            conn,
            request_id=rid if isinstance(rid, str) else None,
            model=body.get("model") if isinstance(body.get("model"), str) else "default",
            prompt_tokens=prompt_tokens,
            completion=completion,
            duration_s=None if hang else c.ttft_s + completion.completion_tokens * c.token_latency_s,
        )

    def _account_busy(self, now: float) -> None:
        self._busy_slot_s += len(self._running) * (now - self._busy_since)
        self._busy_since = now

    def _run(self, job: _Job) -> None:
        now = time.monotonic()
        self._account_busy(now)
        self._running.add(job)
        job.state = _RUNNING
        job.started_at = now
        if job.duration_s is None:
            self._hung += 1
        else:
            job.timer = self._loop.call_later(job.duration_s, self._finish, job)

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
        self._release(job)
        self._completed += 1
        self._by_status[200] += 1
        self._prompt_tokens_total += job.prompt_tokens
        self._completion_tokens_total += job.completion.completion_tokens
        job.conn.respond(200, _dumps(self._dialect.completion_body(job, self._eos_token_id)))
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
