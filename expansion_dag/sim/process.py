"""A simulated fleet in a process of its own, for benchmarks: the CPU of the process that drives it
is then its client's alone, and the two do not share a GIL.

The servers are :class:`~expansion_dag.sim.fleet.SimulatedFleet`'s, configured by the same
:class:`~expansion_dag.sim.config.SimServerConfig` values (the ``keep_timeline`` record included),
in a spawned process that answers over a pipe. It ends with the process that started it, even one
killed outright: its pipe closes, and it stops its servers.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from expansion_dag.sim.config import SimServerConfig
from expansion_dag.sim.fleet import DEFAULT_FLEET_TIMEOUT_S, SimulatedFleet

_STATS, _STOP = "stats", "stop"
#: How often :meth:`FleetProcess.wait_idle` asks the servers again.
_IDLE_POLL_S = 0.1


def _serve(configs: list[SimServerConfig], conn: Connection) -> None:
    """The fleet's process: its URLs once every server is ready (or why they are not), then each
    server's stats whenever asked, until told to stop or the parent is gone."""
    with contextlib.ExitStack() as stack:
        try:
            fleet = stack.enter_context(SimulatedFleet(configs))
        except Exception as exc:  # noqa: BLE001 - whatever it is, the parent says it
            conn.send(f"the simulated fleet did not start: {type(exc).__name__}: {exc}")
            return
        conn.send(fleet.urls)
        with contextlib.suppress(EOFError, ConnectionError):  # the parent went away: stop with it
            while conn.recv() == _STATS:
                conn.send([fleet.stats(i) for i in range(len(configs))])


class FleetProcess:
    """One simulated server per config, in a spawned process; stopped on exit.

    >>> with FleetProcess([SimServerConfig(port=0)] * 8) as fleet:  # doctest: +SKIP
    ...     fleet.urls, fleet.pid, fleet.stats()[0]["completed"]
    """

    def __init__(self, configs: Sequence[SimServerConfig], *, timeout_s: float = DEFAULT_FLEET_TIMEOUT_S) -> None:
        if not configs:
            raise ValueError("a simulated fleet needs at least one server config")
        self.configs = list(configs)
        self._timeout_s = timeout_s
        context = multiprocessing.get_context("spawn")  # no copy of the caller's threads or state
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(self.configs, child), name="simulated-fleet", daemon=True)
        self._child_end = child
        self.urls: list[str] = []

    def __enter__(self) -> FleetProcess:
        self._process.start()
        self._child_end.close()  # the child's end lives in the child alone: its death reads as EOF here
        try:
            if not self._conn.poll(self._timeout_s):
                raise RuntimeError(f"the simulated fleet was not ready after {self._timeout_s:.0f} s")
            answer = self._conn.recv()
        except EOFError:
            answer = f"the simulated fleet's process exited with {self._process.exitcode} before it was ready"
        except BaseException:
            self.__exit__(None, None, None)
            raise
        if isinstance(answer, str):
            self.__exit__(None, None, None)
            raise RuntimeError(answer)
        self.urls = answer
        return self

    def __exit__(self, *exc_info: object) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(_STOP)
        self._process.join(self._timeout_s)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(self._timeout_s)
        self._conn.close()

    @property
    def pid(self) -> int:
        """The fleet's process (its CPU is the servers' alone)."""
        assert self._process.pid is not None, "the fleet has not started"
        return self._process.pid

    def stats(self) -> list[dict[str, Any]]:
        """Each server's stats, as ``GET /sim/stats`` answers them (the timeline with them, if kept)."""
        self._conn.send(_STATS)
        return self._conn.recv()

    def wait_idle(self, timeout_s: float = DEFAULT_FLEET_TIMEOUT_S) -> list[dict[str, Any]]:
        """Each server's stats once none runs or queues a request: a client that went away is
        recorded when the server sees it go, a moment after the client's own end."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if not any(s["num_running"] or s["num_waiting"] for s in stats):
                return stats
            if time.monotonic() > deadline:
                raise RuntimeError(f"the simulated fleet was still busy after {timeout_s:.0f} s")
            time.sleep(_IDLE_POLL_S)
