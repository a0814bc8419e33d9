"""A simulated fleet for tests and benchmarks: servers on a background thread's event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from expansion_dag.sim.config import SimServerConfig
from expansion_dag.sim.server import SimServer

DEFAULT_FLEET_TIMEOUT_S = 60.0

T = TypeVar("T")


class SimulatedFleet:
    """Start one simulated server per config in this process; stop them all on exit.

    >>> with SimulatedFleet([SimServerConfig(port=0)] * 2) as fleet:  # doctest: +SKIP
    ...     fleet.urls  # ['http://127.0.0.1:41231', 'http://127.0.0.1:41232']

    ``wait_ready`` makes ``__enter__`` (and :meth:`restart`) return only once every server is
    ready; without it they return as soon as the ports are bound, so a test can watch startup.
    Servers live on their own thread: use the methods here, not the server objects, to act on them.
    """

    def __init__(
        self,
        configs: Sequence[SimServerConfig],
        *,
        wait_ready: bool = True,
        timeout_s: float = DEFAULT_FLEET_TIMEOUT_S,
    ) -> None:
        if not configs:
            raise ValueError("a simulated fleet needs at least one server config")
        self._configs = list(configs)
        self._wait = wait_ready
        self._timeout_s = timeout_s
        self._servers: list[SimServer] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> SimulatedFleet:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="simulated-fleet", daemon=True)
        self._thread.start()
        try:
            # Built here: loading the tokenizer needs no loop, and errors surface in the caller.
            servers = [SimServer(config) for config in self._configs]
            for server in servers:
                self._call(server.start)
                self._servers.append(server)
            if self._wait:
                self.wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._loop is None:
            return

        async def shutdown() -> None:
            for server in self._servers:
                server.stop("stopped with the fleet")
            await asyncio.sleep(0)  # let the cancelled startup tasks finish

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(self._timeout_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(self._timeout_s)
        self._loop.close()
        self._loop = None

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self._servers]

    def state(self, index: int) -> str:
        return self._servers[index].state

    def stats(self, index: int) -> dict[str, Any]:
        """The same counters as ``GET /sim/stats``, read without HTTP."""
        return self._call(self._servers[index].stats)

    def wait_ready(self, index: int | None = None) -> None:
        """Block until one server (or all) is ready; raise if one stopped first."""
        chosen = self._servers if index is None else [self._servers[index]]

        async def wait() -> None:
            await asyncio.gather(*(s.wait_ready() for s in chosen))

        asyncio.run_coroutine_threadsafe(wait(), self._loop).result(self._timeout_s)

    def kill(self, index: int) -> None:
        """Make one server vanish like a crashed process: port closed, connections dropped."""
        self._call(lambda: self._servers[index].stop("killed through the fleet API"))

    def restart(self, index: int, *, config: SimServerConfig | None = None) -> None:
        """Kill one server (if still up) and start a fresh one on the same port.

        The new server goes through startup delay and warmup again and starts with empty
        state, as a relaunched process would. ``config`` replaces its config (port kept).
        """
        old = self._servers[index]
        self._call(lambda: old.stop("restarted through the fleet API"))
        new = SimServer(dataclasses.replace(config or old.config, port=old.port))
        self._call(new.start)
        self._servers[index] = new
        if self._wait:
            self.wait_ready(index)

    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the fleet's loop thread and return its result."""

        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(self._timeout_s)
