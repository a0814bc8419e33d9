"""A shard's lease: one sender of a shard's prompts at a time, whoever starts it and wherever.

The CLI, a run launched from the UI, a backfill, the nightly schedule and a pod on another host all
take the shard's lease before choosing what to send, and hold it until the shard's writer is
closed. It is a small JSON file in the storage root, ``leases/<shard>.json``, that names its
holder (run id, host, pid, when it started, its last heartbeat, its timeout), taken and renewed
by compare-and-swap (``expansion_dag.store.conditional``: an exclusive create on a local root, S3's
conditional writes on an object store).

A second sender is told who holds it, once, and waits for it (then sends only what is still
missing), or fails at once naming the holder. A holder is taken over, with a warning naming it,
when its heartbeat is older than its timeout, or at once when it ran on this machine and its
process is gone. A lease that cannot be read is reported with the fields that could be, and taken
over only under the same rules (its file's date standing for the heartbeat).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from upath import UPath

from expansion_dag.core import pid_alive
from expansion_dag.store.conditional import Versioned, conditional_file

LEASES = "leases"  # the leases' folder under the storage root
LEASE_VERSION = 1
DEFAULT_LEASE_TIMEOUT_S = 120.0
#: Renewals per timeout: a holder misses three before it can be taken over.
HEARTBEATS_PER_TIMEOUT = 4
#: How often a waiting sender looks at the lease again, at most.
MAX_POLL_S = 2.0


class Log(Protocol):
    def info(self, msg: str) -> None: ...
    def warning(self, msg: str) -> None: ...
    def error(self, msg: str) -> None: ...


class ShardBusy(RuntimeError):
    """The shard's lease is held by a live sender, and this one was told not to wait."""


class LeaseLost(RuntimeError):
    """The lease was taken over while this sender held it: it stops sending."""


def this_machine() -> tuple[str, str]:
    """(host name, pid namespace): the pids of a lease are comparable only where both are equal."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return socket.gethostname(), namespace


@dataclass(frozen=True)
class Holder:
    """Who holds a lease, as its file says."""

    shard: str
    run_id: str
    host: str
    pid: int
    pid_namespace: str
    started: float
    heartbeat: float
    timeout_s: float
    token: str  # this taking of the lease: a renewal changes only the heartbeat
    version: int = LEASE_VERSION

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        return f"run {self.run_id} on host {self.host}, pid {self.pid}, since {since}"

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self), indent=2) + "\n").encode()


@dataclass(frozen=True)
class Seen:
    """A lease file as read: its holder, or what could be read of a bad one and why it is bad."""

    found: Versioned
    holder: Holder | None
    fields: dict[str, Any]
    problem: str | None

    @classmethod
    def parse(cls, found: Versioned) -> Seen:
        text = found.data.decode("utf-8", "replace")
        try:
            data = json.loads(text)
        except ValueError as exc:
            # Torn or not JSON: the fields that can still be read, for the report.
            return cls(found, None, _readable_fields(text), f"not JSON ({exc})")
        if not isinstance(data, dict):
            return cls(found, None, {}, f"not a JSON object: {text[:80]!r}")
        if data.get("version") != LEASE_VERSION:
            version = data.get("version")
            return cls(found, None, data, f"written by another version of expansion_dag (lease version {version!r})")
        try:
            return cls(found, Holder(**data), data, None)
        except TypeError as exc:
            return cls(found, None, data, f"unexpected fields ({exc})")

    def who(self) -> str:
        """The holder, as a key: the same across its renewals."""
        if self.holder is not None:
            return self.holder.token
        return repr([self.fields.get(k) for k in ("run_id", "host", "pid", "started")])

    def describe(self) -> str:
        if self.holder is not None:
            return self.holder.describe()
        named = ", ".join(f"{k} {self.fields[k]}" for k in ("run_id", "host", "pid", "started") if k in self.fields)
        return f"an unreadable lease ({named or 'no holder fields readable'})"

    def stale(self, default_timeout_s: float, now: float) -> str | None:
        """Why the holder may be taken over, or None while it may be alive."""
        fields = self.fields
        host, namespace = this_machine()
        pid = fields.get("pid")
        same_machine = fields.get("host") == host and fields.get("pid_namespace", "") == namespace
        if same_machine and isinstance(pid, int) and not pid_alive(pid):
            return f"its process {pid} on this machine is gone"
        heartbeat = fields.get("heartbeat")
        heartbeat = heartbeat if isinstance(heartbeat, (int, float)) else self.found.modified
        timeout = fields.get("timeout_s")
        timeout = timeout if isinstance(timeout, (int, float)) and timeout > 0 else default_timeout_s
        if now - heartbeat > timeout:
            return f"its last heartbeat was {now - heartbeat:.0f} s ago, over its {timeout:g} s timeout"
        return None


def _readable_fields(text: str) -> dict[str, Any]:
    """The ``"name": value`` pairs (strings and numbers) that can be read in a damaged JSON text."""
    fields = {}
    for name, value in re.findall(r'"(\w+)":\s*("[^"]*"|-?[\d.]+)', text):
        try:
            fields[name] = json.loads(value)
        except ValueError:
            continue
    return fields


class ShardLease:
    """The lease of one shard under a storage root: ``with`` it, or ``acquire`` then ``release``.

    ``wait``: wait for a live holder (then look again at what is missing), or raise ``ShardBusy``.
    While held, a background thread renews it every ``timeout_s / 4``; if it finds the lease taken
    over, ``check`` raises ``LeaseLost`` (the store's writer calls it after each line).
    """

    def __init__(self, root: UPath, shard: str, *, run_id: str, log: Log, timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
                 wait: bool = True):
        if timeout_s <= 0:
            raise ValueError(f"a lease timeout must be positive, got {timeout_s!r}")
        self.path = root / LEASES / f"{shard}.json"
        self._file = conditional_file(self.path)
        self._shard = shard
        self._run_id = run_id
        self._log = log
        self._timeout_s = float(timeout_s)
        self._wait = wait
        self._holder: Holder | None = None
        self._version: str | None = None
        self._lost: str | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def _mine(self, now: float) -> Holder:
        host, namespace = this_machine()
        started = self._holder.started if self._holder else now
        token = self._holder.token if self._holder else secrets.token_hex(8)
        return Holder(shard=self._shard, run_id=self._run_id, host=host, pid=os.getpid(), pid_namespace=namespace,
                      started=started, heartbeat=now, timeout_s=self._timeout_s, token=token)

    def acquire(self) -> None:
        said: set[str] = set()  # what was already said: of each holder, once
        while True:
            mine = self._mine(time.time())
            found = self._file.read()
            if found is None:
                self._version = self._file.create(mine.to_bytes())
                if self._version is None:
                    continue  # another sender created it first: look again
                break
            seen = Seen.parse(found)
            if seen.problem and "bad " + seen.who() not in said:
                said.add("bad " + seen.who())
                self._log.warning(f"{self._shard}: the lease {self.path} cannot be read: {seen.problem}; readable "
                                  f"fields: {seen.fields or 'none'}. It is taken over only as a dead holder's is.")
            why = seen.stale(self._timeout_s, time.time())
            if why is not None:
                self._version = self._file.swap(mine.to_bytes(), found.version)
                if self._version is None:
                    continue  # changed meanwhile: look again
                self._log.warning(f"{self._shard}: took over the lease {self.path} from {seen.describe()}: {why}")
                break
            if not self._wait:
                raise ShardBusy(
                    f"{self._shard} is being generated by {seen.describe()} (lease {self.path}); not waiting "
                    "(storage.when_shard_busy: fail). Run it again once that run has ended."
                )
            if "busy " + seen.who() not in said:
                said.add("busy " + seen.who())
                self._log.warning(f"{self._shard} is being generated by {seen.describe()}; waiting "
                                  "(then only what is still missing is sent)")
            time.sleep(min(MAX_POLL_S, self._timeout_s / HEARTBEATS_PER_TIMEOUT))
        self._holder = mine
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeats, name=f"lease {self._shard}", daemon=True)
        self._beat.start()

    def _heartbeats(self) -> None:
        failing = False
        while not self._stop.wait(self._timeout_s / HEARTBEATS_PER_TIMEOUT):
            try:
                renewed = self._file.swap(self._mine(time.time()).to_bytes(), self._version or "")
            except Exception as exc:  # a store briefly unreachable: tried again at the next beat
                if not failing:
                    self._log.warning(f"{self._shard}: the lease {self.path} could not be renewed ({exc}); retrying")
                failing = True
                continue
            failing = False
            if renewed is None:
                found = self._file.read()
                self._lost = Seen.parse(found).describe() if found is not None else "nobody (it was removed)"
                self._log.error(f"{self._shard}: the lease {self.path} was taken over by {self._lost}; this run "
                                "stops sending so that no prompt is sent twice")
                return
            self._version = renewed

    def check(self) -> None:
        """Raise ``LeaseLost`` once the lease was found taken over."""
        if self._lost is not None:
            raise LeaseLost(
                f"{self._shard}: the lease {self.path} was taken over by {self._lost}, so this run stopped "
                "sending; what it wrote is kept"
            )

    def release(self) -> None:
        """Stop renewing and remove the lease while it is still this run's (never someone else's)."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
        if self._version is None or self._lost is not None:
            return
        try:
            if not self._file.delete(self._version):
                self._log.warning(f"{self._shard}: the lease {self.path} was no longer this run's; left as it is")
        except Exception as exc:  # the work is done and kept: a lease left behind only times out
            self._log.warning(f"{self._shard}: the lease {self.path} could not be removed ({exc}); the next "
                              f"run takes it over {self._timeout_s:g} s after this run's last heartbeat")
        self._version = self._holder = None

    def __enter__(self) -> ShardLease:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
