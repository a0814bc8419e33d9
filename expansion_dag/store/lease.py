"""A shard's lease: one sender of a shard's prompts at a time, whoever starts it and wherever.

The CLI, a UI run, a backfill, the nightly schedule and a pod on another host all take the shard's
lease before choosing what to send, and hold it until the shard's writer is closed. It is a small
JSON file, ``leases/<shard>.json``, naming its holder (run id, a random id of its process; host,
pid, start, last heartbeat and timeout as hints), taken and renewed by compare-and-swap
(``expansion_dag.store.conditional``: an exclusive create locally, S3's conditional writes, proven
enforced before the first lease there).

A second sender is told who holds it, once, and waits (then sends only what is still missing) up
to a deadline, or fails at once naming the holder. A holder is taken over, with a warning naming
it, when its heartbeat is older than its timeout, or at once when its process is known gone: it
holds a lock on ``<local_dir>/leases/<token>.alive`` while it holds the lease, which a sender
sharing that folder can test. A host name, a pid and a pid namespace prove nothing: cloned machines
and containers share them. An unreadable lease is reported with the fields that could be read, and
taken over under the same rules (its file's date standing for the heartbeat).

The holder stops sending (``check`` raises ``LeaseLost``) as soon as it cannot be sure the lease is
its own: taken over, a renewal failed, or none succeeded for three quarters of the timeout.
Renewals carry a timeout of half the lease's. On a local root ``check`` also sees the root removed
(``rm -rf``) at the next line written, and says what went with it. ``BuildClaim`` is the same lease
for a builder of the training set: the folder it writes is its own while its claim is alive.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from upath import UPath

from expansion_dag.core import default_local_dir, is_local, local_path
from expansion_dag.store.conditional import Versioned, conditional_file

LEASES = "leases"  # the leases' folder under the storage root, and the live holders' under a local dir
BUILDERS = "builders"  # the builders' claims, under the leases' folder
LEASE_VERSION = 2
#: Renewals per timeout: a holder misses three before it can be taken over.
HEARTBEATS_PER_TIMEOUT = 4
#: A holder stops sending once its last renewal is this old (a share of the timeout): before any
#: other run may take the lease over, with a heartbeat to spare for clocks that differ.
SURE_FOR = 0.75
#: A renewal's timeout, a share of the lease's: a store that does not answer cannot hold it longer.
RENEWAL_TIMEOUT = 0.5
#: How often a waiting sender looks at the lease again, at most.
MAX_POLL_S = 2.0
_TOKEN = re.compile(r"[0-9a-f]{16}")


class Log(Protocol):
    def info(self, msg: str) -> None: ...
    def warning(self, msg: str) -> None: ...
    def error(self, msg: str) -> None: ...


class ShardBusy(RuntimeError):
    """The shard's lease is held by a live sender, and this one was told not to wait."""


class LeaseLost(RuntimeError):
    """The lease was taken over, or could not be kept, while this sender held it: it stops sending."""


def _new_process_id() -> None:
    global _PROCESS_ID
    _PROCESS_ID = secrets.token_hex(8)


_PROCESS_ID = ""
_new_process_id()
os.register_at_fork(after_in_child=_new_process_id)  # a forked child is another holder


def process_id() -> str:
    """This process's random id: what names a holder (a host name and a pid can be anyone's)."""
    return _PROCESS_ID


@dataclass(frozen=True)
class Holder:
    """Who holds a lease, as its file says."""

    shard: str
    run_id: str
    holder: str  # the holder's process: process_id()
    host: str  # a hint for the reader: another machine may have the same name
    pid: int  # a hint too: a pid of another machine
    started: float
    heartbeat: float
    timeout_s: float
    token: str  # this taking of the lease: a renewal changes only the heartbeat
    version: int = LEASE_VERSION

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        return f"run {self.run_id} on host {self.host}, pid {self.pid} (holder {self.holder}), since {since}"

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self), indent=2) + "\n").encode()


def _alive_file(local_dir: str | os.PathLike[str], token: str) -> Path:
    return Path(local_dir, LEASES, f"{token}.alive")


class _Alive:
    """A lock held on ``<local_dir>/leases/<token>.alive`` while a lease is: released by the kernel
    when the process ends, however it ends."""

    def __init__(self, local_dir: str | os.PathLike[str], token: str):
        self.path = _alive_file(local_dir, token)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        os.close(self._fd)


def _gone_here(local_dir: str | os.PathLike[str], token: Any) -> bool:
    """Whether the holder of ``token`` held its lock in ``local_dir`` and its process has ended."""
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        return False
    path = _alive_file(local_dir, token)
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False  # not a holder of this machine (or not one whose lock can be tried): only its heartbeat tells
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    path.unlink(missing_ok=True)
    return True


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
            holder = Holder(**data)
        except TypeError as exc:
            return cls(found, None, data, f"unexpected fields ({exc})")
        # A field of another type ("started": "yesterday", written by hand) would fail whoever reads it.
        wrong = [f"{f.name} {data[f.name]!r}" for f in dataclasses.fields(Holder) if not _of_type(data[f.name], f.type)]
        if wrong:
            return cls(found, None, data, f"fields of the wrong type: {', '.join(wrong)}")
        return cls(found, holder, data, None)

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

    def stale(self, default_timeout_s: float, now: float, local_dir: str | os.PathLike[str]) -> str | None:
        """Why the holder may be taken over, or None while it may be alive."""
        fields = self.fields
        if self.holder is not None and _gone_here(local_dir, self.holder.token):
            return f"its process (pid {self.holder.pid}) on this machine is gone"
        heartbeat = fields.get("heartbeat")
        heartbeat = heartbeat if isinstance(heartbeat, (int, float)) else self.found.modified
        timeout = fields.get("timeout_s")
        timeout = timeout if isinstance(timeout, (int, float)) and timeout > 0 else default_timeout_s
        if now - heartbeat > timeout:
            return f"its last heartbeat was {now - heartbeat:.0f} s ago, over its {timeout:g} s timeout"
        return None


def _of_type(value: Any, annotation: str) -> bool:
    """Whether a lease field's JSON value is of its ``Holder`` annotation's type (an int is a float)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, {"str": str, "int": int, "float": (int, float)}[annotation])


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
    While held, a background thread renews it every ``timeout_s / 4``; ``check`` raises ``LeaseLost``
    once the lease is not surely this run's (the store's writer calls it after each line).
    ``local_dir``: this machine's folder (``storage.local_dir``), where a live holder keeps its lock.
    ``wait_s``: how long to wait at most (then ``ShardBusy``); ``on_wait(holder, gives_up_at)``, with
    the time (``time.time()``) it gives up, when it starts waiting for a holder.
    """

    def __init__(self, root: UPath, shard: str, *, run_id: str, log: Log, timeout_s: float,
                 wait: bool, local_dir: str | os.PathLike[str] | None = None, wait_s: float = 3600.0,
                 on_wait: Callable[[str, float], None] | None = None):
        if timeout_s <= 0:
            raise ValueError(f"a lease timeout must be positive, got {timeout_s!r}")
        self.path = root / LEASES / f"{shard}.json"
        # A local root, watched while the lease is held: its removal is seen at the next check.
        self._root = local_path(root) if is_local(root) else None
        self._root_id: tuple[int, int] | None = None
        self._wait_s = wait_s
        self._on_wait = on_wait
        self._timeout_s = float(timeout_s)
        self._file = conditional_file(self.path, timeout_s=self._timeout_s * RENEWAL_TIMEOUT)
        self._shard = shard
        self._run_id = run_id
        self._log = log
        self._wait = wait
        self._local_dir = local_dir or default_local_dir()
        self._holder: Holder | None = None
        self._token = ""
        self._alive: _Alive | None = None
        self._version: str | None = None
        self._renewed = 0.0  # time.monotonic() of the heartbeat last written
        self._lost: str | None = None
        self._failed: str | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def _mine(self, now: float) -> Holder:
        started = self._holder.started if self._holder else now
        return Holder(shard=self._shard, run_id=self._run_id, holder=process_id(), host=socket.gethostname(),
                      pid=os.getpid(), started=started, heartbeat=now, timeout_s=self._timeout_s, token=self._token)

    def acquire(self) -> None:
        self._file.prove_conditional_writes()
        self._token = secrets.token_hex(8)
        self._alive = _Alive(self._local_dir, self._token)  # held before any lease names it
        try:
            self._holder, self._renewed = self._take()
            self._root_id = _identity(self._root)  # the root that holds the lease now
        except BaseException:
            self._alive.close()
            self._alive = None
            raise
        self._lost = self._failed = None
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeats, name=f"lease {self._shard}", daemon=True)
        self._beat.start()

    def _take(self) -> tuple[Holder, float]:
        """Wait for the lease (or raise ``ShardBusy``), then take it: this holder, and when (monotonic)."""
        said: set[str] = set()  # what was already said: of each holder, once
        gives_up_at: float | None = None  # time.time() when the wait ends, once waiting
        while True:
            at = time.monotonic()
            mine = self._mine(time.time())
            found = self._file.read()
            if found is None:
                self._version = self._file.create(mine.to_bytes())
                if self._version is None:
                    continue  # another sender created it first: look again
                return mine, at
            seen = Seen.parse(found)
            if seen.problem and "bad " + seen.who() not in said:
                said.add("bad " + seen.who())
                self._log.warning(f"{self._shard}: the lease {self.path} cannot be read: {seen.problem}; readable "
                                  f"fields: {seen.fields or 'none'}. It is taken over only as a dead holder's is.")
            why = seen.stale(self._timeout_s, time.time(), self._local_dir)
            if why is not None:
                self._version = self._file.swap(mine.to_bytes(), found.version)
                if self._version is None:
                    continue  # changed meanwhile: look again
                self._log.warning(f"{self._shard}: took over the lease {self.path} from {seen.describe()}: {why}")
                return mine, at
            if not self._wait:
                raise self._busy(seen)
            gives_up_at = gives_up_at or time.time() + self._wait_s
            if time.time() >= gives_up_at:
                raise ShardBusy(
                    f"{self._shard} is being generated by {seen.describe()} (lease {self.path}); gave up waiting "
                    f"after {self._wait_s:g} s (storage.shard_busy_wait_s). Run it again once that run has ended."
                )
            if "busy " + seen.who() not in said:
                said.add("busy " + seen.who())
                self._log.warning(f"{self._shard} is being generated by {seen.describe()}; waiting until "
                                  f"{_clock(gives_up_at)} at most (then only what is still missing is sent)")
                if self._on_wait is not None:
                    self._on_wait(seen.describe(), gives_up_at)
            time.sleep(min(MAX_POLL_S, self._timeout_s / HEARTBEATS_PER_TIMEOUT))

    def busy(self) -> ShardBusy | None:
        """What taking the lease without waiting would fail on now (its holder may be alive), read
        without taking it; None when it would be taken (free, or its holder gone)."""
        found = self._file.read()
        if found is None:
            return None
        seen = Seen.parse(found)
        return self._busy(seen) if seen.stale(self._timeout_s, time.time(), self._local_dir) is None else None

    def _busy(self, seen: Seen) -> ShardBusy:
        return ShardBusy(
            f"{self._shard} is being generated by {seen.describe()} (lease {self.path}); not waiting "
            "(storage.when_shard_busy: fail). Run it again once that run has ended."
        )

    def _heartbeats(self) -> None:
        try:
            while not self._stop.wait(self._timeout_s / HEARTBEATS_PER_TIMEOUT):
                at = time.monotonic()
                renewed = self._file.swap(self._mine(time.time()).to_bytes(), self._version or "")
                if renewed is None and self._root is not None and _identity(self._root) != self._root_id:
                    self._log.error(f"{self._shard}: the storage root {self._root} was removed; this run stops sending")
                    return  # check() says so at the next line written
                if renewed is None:
                    found = self._file.read()
                    self._lost = Seen.parse(found).describe() if found is not None else "nobody (it was removed)"
                    self._log.error(f"{self._shard}: the lease {self.path} was taken over by {self._lost}; this run "
                                    "stops sending so that no prompt is sent twice")
                    return
                self._version, self._renewed = renewed, at
        except BaseException as exc:  # whatever it is, the lease can no longer be kept for sure
            self._failed = f"{type(exc).__name__}: {exc}"
            self._log.error(f"{self._shard}: the lease {self.path} could not be renewed ({self._failed}); this run "
                            "stops sending so that no prompt is sent twice")

    def check(self) -> None:
        """Raise ``LeaseLost`` once the lease is not surely this run's any more, or its root is gone."""
        if self._root is not None and _identity(self._root) != self._root_id:
            raise LeaseLost(
                f"{self._shard}: the storage root {self._root} was removed while this run wrote into it, so this "
                "run stopped sending: what it wrote went with it. Run again to start over in a new root."
            )
        kept = "What it wrote is kept; run the shard again and only what is still missing is sent."
        if self._lost is not None:
            raise LeaseLost(
                f"{self._shard}: the lease {self.path} was taken over by {self._lost}, so this run stopped "
                f"sending. {kept}"
            )
        fix = ("Fix: make the storage root answer this host again (the network, its credentials, a full disk or "
               f"a stuck lock file: the error says which); until then another run may take the shard over. {kept}")
        if self._failed is not None:
            raise LeaseLost(f"{self._shard}: the lease {self.path} could not be renewed ({self._failed}), so this "
                            f"run stopped sending. {fix}")
        quiet = time.monotonic() - self._renewed
        if self._holder is not None and quiet > SURE_FOR * self._timeout_s:
            raise LeaseLost(
                f"{self._shard}: the lease {self.path} has not been renewed for {quiet:.0f} s (a renewal is still "
                f"waiting for the store), so this run stopped sending before its {self._timeout_s:g} s timeout "
                f"could let another run take the shard over. {fix}"
            )

    def release(self) -> None:
        """Stop renewing and remove the lease while it is still this run's (never someone else's)."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
        try:
            if self._version is not None and self._lost is None:
                if not self._file.delete(self._version):
                    self._log.warning(f"{self._shard}: the lease {self.path} was no longer this run's; left as it is")
        except Exception as exc:  # the work is done and kept: a lease left behind only times out
            self._log.warning(f"{self._shard}: the lease {self.path} could not be removed ({exc}); the next "
                              f"run takes it over {self._timeout_s:g} s after this run's last heartbeat")
        finally:
            if self._alive is not None:
                self._alive.close()
            self._version = self._holder = self._alive = None

    def __enter__(self) -> ShardLease:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _identity(folder: Path | None) -> tuple[int, int] | None:
    """Which folder is at ``folder`` now (device and inode); None: none, or not watched."""
    try:
        found = os.stat(folder) if folder is not None else None
    except FileNotFoundError:
        return None
    return (found.st_dev, found.st_ino) if found is not None else None


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(at))


class BuildClaim:
    """A builder's claim on the folders it writes under the storage root (a version of the training
    set, a part it is building): a lease of its own, ``leases/builders/<id>.json``, renewed while it
    works. Another builder removes such a folder only once its claim is gone or stale (``alive``)."""

    def __init__(self, root: UPath, *, run_id: str, log: Log, timeout_s: float,
                 local_dir: str | os.PathLike[str] | None = None):
        self.id = secrets.token_hex(8)
        self._root = root
        self._timeout_s = timeout_s
        self._local_dir = local_dir or default_local_dir()
        self._lease = ShardLease(root, f"{BUILDERS}/{self.id}", run_id=run_id, log=log, timeout_s=timeout_s,
                                 wait=False, local_dir=self._local_dir)

    def check(self) -> None:
        """Raise ``LeaseLost`` once the claim is not surely held: what it wrote may be removed."""
        self._lease.check()

    def alive(self, owner: str) -> bool:
        """Whether the builder ``owner`` (a ``BuildClaim.id``) may still be writing; a stale claim is removed."""
        if owner == self.id:
            return True
        if not _TOKEN.fullmatch(owner):
            return False
        claim = conditional_file(self._root / LEASES / BUILDERS / f"{owner}.json")
        found = claim.read()
        if found is None:
            return False
        if Seen.parse(found).stale(self._timeout_s, time.time(), self._local_dir) is None:
            return True
        claim.delete(found.version)
        return False

    def __enter__(self) -> BuildClaim:
        self._lease.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lease.release()
