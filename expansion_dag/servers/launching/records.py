"""Who launched each server, and who uses the fleet: the launcher's bookkeeping on this machine.

- ``ServerRecord`` (``server-<port>.json``): the launched process (pid, with its start time, which
  no other process shares: ``expansion_dag.core.process_start``), its host, the command it was
  launched with, and its owner: the command (``expansion-dag run``, ``plan``) or run that launched
  it. A record that does not name a live process of this host started then is not ours: nothing it
  names is ever signalled.
- Users: each process that uses the fleet holds a lock on ``users/<owner>.<pid>.lock`` while it
  does (released by the kernel however it ends), so that an owner ending leaves running what
  another still uses, and a server no longer matching the configuration is restarted only when
  nobody else uses it.
- The owner: ``$EXPANSION_FLEET_OWNER`` (a CLI command sets it, for itself and its shards'
  processes), else this process's random id.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shlex
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from expansion_dag.core import pid_alive, process_start

#: Names the owner of what a command launches, for it and the processes it starts.
OWNER_ENV = "EXPANSION_FLEET_OWNER"
USERS = "users"
_PROCESS_OWNER = secrets.token_hex(8)


def fleet_owner() -> str:
    """Whose launched servers this process's are: its command's, else its own."""
    return os.environ.get(OWNER_ENV) or _PROCESS_OWNER


@dataclass(frozen=True)
class ServerRecord:
    """A launched server, as its record says."""

    port: int
    gpu: int
    pid: int
    started: str  # process_start(pid) when launched
    host: str
    argv: list[str]
    owner: str
    launched_at: float

    @classmethod
    def of(cls, *, port: int, gpu: int, pid: int, argv: Sequence[str], owner: str) -> ServerRecord:
        return cls(port=port, gpu=gpu, pid=pid, started=process_start(pid) or "", host=socket.gethostname(),
                   argv=list(argv), owner=owner, launched_at=time.time())

    @classmethod
    def read(cls, path: Path) -> ServerRecord | None:
        """The record at ``path``; None when there is none, or one this version cannot read."""
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def write(self, path: Path) -> None:
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(asdict(self), indent=2) + "\n")
        temporary.replace(path)  # whole or absent: a reader never sees half a record

    def not_ours(self) -> str | None:
        """Why the process this record names is not the server launched then (None: it is, and runs)."""
        if self.host != socket.gethostname():
            return f"it was launched on host {self.host}, not this one ({socket.gethostname()})"
        now = process_start(self.pid)
        if now is None:
            return f"its process {self.pid} has ended"
        if not self.started or now != self.started:
            return f"pid {self.pid} is another process now (started {now}; the server started {self.started or '?'})"
        return None

    def difference(self, argv: Sequence[str], gpu: int) -> str | None:
        """How the running server's launch differs from ``argv`` on ``gpu``; None: it does not."""
        changes = [] if gpu == self.gpu else [f"GPU {self.gpu} (running) / {gpu} (configured)"]
        if list(argv) != self.argv:
            running, configured = _flags(self.argv), _flags(argv)
            flags = [f"{name} {running.get(name, '(none)')} (running) / {configured.get(name, '(none)')} (configured)"
                     for name in sorted(running.keys() | configured.keys())
                     if running.get(name) != configured.get(name)]
            changes += flags or [f"command `{shlex.join(self.argv)}` (running) / `{shlex.join(argv)}` (configured)"]
        return "; ".join(changes) or None


def running(path: Path, url: str, notes: list[str]) -> ServerRecord | None:
    """The record at ``path`` while it names the launched process, alive. One that does not is
    removed (the caller holds the launch lock) and what it named left alone, said in ``notes``."""
    record = ServerRecord.read(path)
    if record is None:
        return None
    why = record.not_ours()
    if why is None:
        return record
    if record.host == socket.gethostname() and pid_alive(record.pid):
        notes.append(f"{url}: the record {path} names pid {record.pid}, which is not the server launched then "
                     f"({why}): that process is left alone")
    path.unlink(missing_ok=True)
    return None


def _flags(argv: Sequence[str]) -> dict[str, str]:
    """``--name value`` and ``--name=value`` pairs, a flag with no value as ""."""
    found = {}
    for i, word in enumerate(argv):
        if word.startswith("--"):
            name, equals, value = word.partition("=")
            following = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else ""
            found[name] = value if equals else following
    return found


class _Use:
    """A lock held on ``users/<owner>.<pid>.lock`` while this process uses the fleet."""

    def __init__(self, users: Path, owner: str):
        users.mkdir(parents=True, exist_ok=True)
        self.path = users / f"{owner}.{os.getpid()}.lock"
        # Locked before it takes its name: a reader never finds it unlocked and removes it.
        new = self.path.with_suffix(".new")
        self._fd = os.open(new, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        os.write(self._fd, f"pid {os.getpid()}: {shlex.join(sys.argv)}".encode())
        new.replace(self.path)
        self.count = 0

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        os.close(self._fd)


#: This process's uses, by users' folder and owner: counted, as the CLI and a run in its process both use it.
_USES: dict[tuple[Path, str], _Use] = {}


def use(state_dir: Path, owner: str) -> None:
    """Count this process among the fleet's users for ``owner``, until as many :func:`unuse`, or its end."""
    key = (state_dir / USERS, owner)
    if key not in _USES:
        _USES[key] = _Use(*key)
    _USES[key].count += 1


def unuse(state_dir: Path, owner: str) -> None:
    key = (state_dir / USERS, owner)
    held = _USES.get(key)
    if held is not None:
        held.count -= 1
        if held.count <= 0:
            del _USES[key]
            held.close()


def users(state_dir: Path) -> dict[str, list[str]]:
    """The fleet's live users, by owner: what each of their processes is. A user gone is forgotten."""
    found: dict[str, list[str]] = {}
    for path in sorted((state_dir / USERS).glob("*.lock")):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # held: its process uses the fleet
                found.setdefault(path.name.split(".")[0], []).append(os.pread(fd, 4096, 0).decode(errors="replace"))
                continue
            with contextlib.suppress(OSError):
                path.unlink()  # its process ended
        finally:
            os.close(fd)
    return found
