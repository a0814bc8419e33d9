"""Whether a process of this machine still runs: the launcher asks it of the servers it started,
the shard lease of a holder on this host."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["pid_alive"]


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie does not (one of our own children is reaped to tell)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"
