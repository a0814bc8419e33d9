"""A simulated server's own record of what it was sent and what it said of its load.

Kept only when ``SimServerConfig.keep_timeline`` is set (it grows with every request): tests and
benchmarks judge a client's conduct from the server's side with it, e.g. that the shards borrowing
a server never hold more of it than it has slots, whatever the machine's speed.
"""

from __future__ import annotations

import time
from typing import Any


class Timeline:
    """Each load answer (when, idle slots reported) and each chat request (arrived, ended, status)."""

    def __init__(self) -> None:
        self.loads: list[tuple[float, int]] = []
        self.requests: list[list[Any]] = []

    def load(self, idle: int) -> None:
        self.loads.append((time.monotonic(), idle))

    def arrived(self, instruction: str) -> list[Any]:
        """An accepted request; its entry is ended by :meth:`ended` when it leaves the server."""
        entry = [time.monotonic(), None, None, instruction]
        self.requests.append(entry)
        return entry

    @staticmethod
    def ended(entry: list[Any], status: int | str) -> None:
        if entry[1] is None:
            entry[1], entry[2] = time.monotonic(), status

    def refused(self, status: int) -> None:
        """A request answered with an error before it was queued."""
        now = time.monotonic()
        self.requests.append([now, now, status, None])

    def to_dict(self) -> dict[str, Any]:
        """CLOCK_MONOTONIC times, comparable with other processes' on this machine."""
        return {
            "loads": [list(load) for load in self.loads],
            "requests": [
                {"arrived": a, "ended": e, "status": s, "instruction": text} for a, e, s, text in self.requests
            ],
        }
