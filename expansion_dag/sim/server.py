"""One simulated server: its lifecycle (loading, warming, ready, stopped) and the units it wires
together on one port: the router, the chat request intake, the scheduler and the endpoints.

Everything runs on one asyncio event loop with callbacks, no task per request (see
:mod:`expansion_dag.sim.scheduler`). Several servers can share one loop (one port each,
independent state).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time
from typing import Any

from expansion_dag.core import load_tokenizer
from expansion_dag.sim.config import SimServerConfig
from expansion_dag.sim.dialects import DIALECTS, dumps
from expansion_dag.sim.endpoints import Endpoints
from expansion_dag.sim.http import HttpConnection, HttpRequest
from expansion_dag.sim.intake import ChatIntake
from expansion_dag.sim.routes import Router
from expansion_dag.sim.scheduler import Scheduler

logger = logging.getLogger(__name__)

READY_LINE = "The server is fired up and ready to roll!"

_BACKLOG = 4096
_LOADING, _WARMING, _READY, _STOPPED = "loading", "warming", "ready", "stopped"


class SimServer:
    """One simulated SGLang (or vLLM) server on one port. Create and drive it inside an event loop.

    :meth:`start` binds the port at once but refuses connections until ``startup_delay_s`` has
    passed (like a server loading its model), then answers ``/health`` with 503 for ``warmup_s``,
    then prints the ready line. :meth:`stop` makes it vanish like a crashed process.
    """

    def __init__(self, config: SimServerConfig) -> None:
        self.config = config
        self.port = config.port
        dialect = DIALECTS[config.backend](config)
        tokenizer = load_tokenizer(config.tokenizer)
        self._scheduler = Scheduler(config, dialect, tokenizer.eos_token_id, on_limit=self.stop)
        self._intake = ChatIntake(config, dialect, tokenizer, self._scheduler)
        self._endpoints = Endpoints(config, dialect, self._scheduler, port=lambda: self.port)
        self._router = Router(
            config,
            dialect,
            health=self._health,
            sim_stats=self._sim_stats,
            intake=self._intake,
            endpoints=self._endpoints,
        )
        self._connections: set[HttpConnection] = set()
        #: Connections accepted: how a client's polling treats a server.
        self._connections_opened = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sock: socket.socket | None = None
        self._listener: asyncio.Server | None = None
        self._startup: asyncio.Task | None = None
        self._warmup: asyncio.TimerHandle | None = None
        self._ready: asyncio.Future | None = None
        self._stopped: asyncio.Future | None = None
        self._state = _LOADING

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
        self._loop = self._scheduler.loop = asyncio.get_running_loop()
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
        return HttpConnection(self._router.dispatch, self._connections)

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
        self._scheduler.start_clock()
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
        self._scheduler.drop_all()
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

    # the lifecycle's own endpoints

    def _health(self, request: HttpRequest, conn: HttpConnection) -> None:
        conn.respond(200 if self._state == _READY else 503)

    def stats(self) -> dict[str, Any]:
        """Cumulative counters since start; the busy integral and elapsed time since ready."""
        now = time.monotonic()
        c, scheduler, intake = self.config, self._scheduler, self._intake
        return {
            "simulator": True,
            "pid": os.getpid(),  # a launcher tells the simulator it started from a server already on the port
            "last_chat_request": intake.last_chat_request,
            "backend": c.backend,
            "url": self.url,
            "state": self._state,
            "slots": scheduler.slots,
            "monotonic_s": now,  # CLOCK_MONOTONIC: comparable with other processes' on this machine
            **scheduler.busy(now),
            "num_running": len(scheduler.running),
            "num_waiting": scheduler.num_waiting,
            "chat_requests_by_status": {str(k): v for k, v in sorted(scheduler.by_status.items())},
            "completed": scheduler.completed,
            "greedy_requests": intake.greedy_requests,
            "aborted": scheduler.aborted,
            "abort_finishes": scheduler.abort_finishes,
            "loops": sum(intake.loops.values()),
            "greedy_loops": intake.loops[True],
            "hung": scheduler.hung,
            "connections_opened": self._connections_opened,
            "load_reads": self._endpoints.load_reads,
            "prompt_tokens_total": scheduler.prompt_tokens_total,
            "completion_tokens_total": scheduler.completion_tokens_total,
            "max_requested_total_tokens": intake.max_requested_tokens,
            "context_exceeded": intake.context_exceeded,
            "time_model": {"ttft_s": c.ttft_s, "token_latency_s": c.token_latency_s},
            **({"timeline": scheduler.timeline.to_dict()} if scheduler.timeline is not None else {}),
        }

    def _sim_stats(self, request: HttpRequest, conn: HttpConnection) -> None:
        conn.respond(200, dumps(self.stats()))

