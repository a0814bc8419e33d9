"""Whether a process of this machine still runs: the launcher asks it of the servers it started,
the shard lease of a holder on this host. And ports on this machine that nothing holds, for the
servers a test or a benchmark starts."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from collections.abc import Iterable
from pathlib import Path

__all__ = ["free_port_block", "pid_alive", "process_start"]


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


def process_start(pid: int) -> str | None:
    """When ``pid`` started, as the kernel says it: with the pid, it names one process of this
    machine for good, where a pid alone is reused (after a reboot, or once the pids wrap). None: no
    such process.

    Linux: this boot's id and the start time in clock ticks (``/proc/<pid>/stat``, field 22);
    elsewhere ``ps``'s start time, to the second.
    """
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        started = subprocess.run(["ps", "-o", "lstart=", "-p", str(pid)], capture_output=True, text=True).stdout
        return started.strip() or None
    try:
        # The name (field 2) may hold spaces and parentheses: fields are counted after its last ")".
        return f"{boot}/{Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[19]}"
    except (OSError, IndexError):
        return None


def free_port_block(count: int, starts: Iterable[int], host: str) -> list[int]:
    """The first run of ``count`` consecutive ports, beginning at one of ``starts`` in turn, that
    nothing on ``host`` holds now (a simulated fleet takes a run of them)."""
    for first in starts:
        block = list(range(first, first + count))
        if block[-1] <= 65535 and all(_is_free(host, port) for port in block):
            return block
    raise RuntimeError(f"no {count} consecutive free ports on {host} among those tried")


def _is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
