"""Servers' loads, polled while a run goes: the slots free beyond the queue (:func:`read_idle_slots`,
from ``/v1/loads``, or ``/get_load`` before SGLang 0.5.8) and the tokens a second each generates
(:func:`read_throughputs`). A server that cannot say is simply not counted: never an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import httpx

from expansion_dag.servers.dialects import Dialect
from expansion_dag.servers.transport import client

if TYPE_CHECKING:
    from expansion_dag.servers.probing.fleet import ServerInfo


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
    http: httpx.AsyncClient, url: str, dialect: Dialect, *, slots: int | None, timeout_s: float
) -> int | None:
    """:func:`parse_idle_slots` of the server's load now; None when it cannot say (never an error)."""
    if dialect.loads_path is None:
        return None
    try:
        response = await http.get(url + dialect.loads_path, timeout=timeout_s)
        if response.status_code != 200:
            return None
        return parse_idle_slots(response.json(), dialect, slots)
    except (httpx.HTTPError, ValueError):
        return None  # a helper that cannot say is simply not used


def read_throughputs(
    servers: Sequence[ServerInfo], *, api_key: str | None = None, timeout_s: float = 10.0
) -> dict[str, float | None]:
    """Each server's output tokens a second now (``parse_gen_throughput``); None where it
    does not say or does not answer."""
    found: dict[str, float | None] = {}
    with client(timeout_s=timeout_s, api_key=api_key) as http:
        for server in servers:
            path = server.dialect.loads_path
            try:
                response = http.get(server.url + path) if path else None
                ok = response is not None and response.status_code == 200
                found[server.url] = parse_gen_throughput(response.json(), server.dialect) if ok else None
            except (httpx.HTTPError, ValueError):
                found[server.url] = None
    return found
