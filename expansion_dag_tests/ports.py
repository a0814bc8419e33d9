"""Ports for servers the tests start.

A port the kernel hands out for ``bind(0)`` lies in its ephemeral range, which it also hands out as the source
port of outgoing connections: between picking such a port and a server binding it, another process's client
can take it (CI saw "Address already in use" that way). So ports come from below that range, each pytest-xdist
worker from its own slice, and each is checked free before it is handed out.
"""

from __future__ import annotations

import itertools
import os

from expansion_dag.core import free_port_block

_FIRST, _LAST = 20000, 32000  # below Linux's default ephemeral range (32768-60999)
_SLICE = 1500


def _worker_index() -> int:
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name[2:]) if name[2:].isdigit() else 0


def _candidates():
    start = _FIRST + (_worker_index() * _SLICE) % (_LAST - _FIRST)
    # The pid varies the starting point so that two sessions on one machine rarely meet.
    offset = os.getpid() % _SLICE
    return (start + (offset + i) % _SLICE for i in itertools.count())


_next = _candidates()


def free_ports(count: int = 1) -> list[int]:
    """``count`` consecutive ports on 127.0.0.1 that nothing holds now and this session has not handed out."""
    try:
        block = free_port_block(count, itertools.islice(_next, _SLICE), "127.0.0.1")
    except RuntimeError:
        raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1 between {_FIRST} and {_LAST}") from None
    # Consume the rest of the block so that the next call does not hand it out again.
    for _ in range(count - 1):
        next(_next)
    return block


def free_port(count: int = 1) -> int:
    """The first of ``count`` consecutive free ports (a simulated fleet takes a run of them)."""
    return free_ports(count)[0]
