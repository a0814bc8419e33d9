"""The completion store: every completion durable the moment it returns, each prompt kept once.

Layout: ``<root>/<shard>/seg-<time>-<pid>-<rand>.jsonl``. Each run of a shard appends to a segment
file of its own (one writer per file, so a torn write can only be the file's last line). A line is
``<key>\\t<status>\\t<json>\\n``: resuming reads keys and statuses without parsing JSON, which keeps
the resume scan cheap when completions are long.

Crash safety: a line is written with one ``os.write`` on an ``O_APPEND`` descriptor, so once
``append`` returns the line survives the death of the process (SIGKILL included); ``fsync`` runs
every ``fsync_interval_s`` and on close, for machine crashes. A last line without its newline, or
whose JSON does not parse, is a torn write: it is counted and ignored on read, never fatal.

A key is the completion identity (``completion_key``): the prompt plus everything that shapes the
answer. An ``ok`` record is final; a ``failed`` record only says the last attempt failed, so the
next run retries it.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OK = "ok"
FAILED = "failed"


def completion_key(prompt_id: str, settings_fingerprint: str) -> str:
    """Identity of a completion: which prompt, answered under which model and sampling settings."""
    return hashlib.sha256(f"{prompt_id}:{settings_fingerprint}".encode()).hexdigest()[:32]


@dataclass
class ScanResult:
    """What a shard's segments hold: the latest status of every key, and damage found."""

    done: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    duplicates: int = 0
    torn_lines: int = 0


@dataclass(frozen=True)
class _Location:
    path: Path
    offset: int
    length: int


class CompletionStore:
    """Completions of every shard under one root folder."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)

    def shard_dir(self, shard: str) -> Path:
        return self.root / shard

    def shards(self) -> list[str]:
        if not self.root.exists():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())

    def _segments(self, shard: str) -> list[Path]:
        folder = self.shard_dir(shard)
        return sorted(folder.glob("seg-*.jsonl")) if folder.exists() else []

    def _lines(self, shard: str) -> Iterator[tuple[str, str, _Location | None]]:
        """(key, status, location) of each intact line; location None marks a torn line."""
        for path in self._segments(shard):
            offset = 0
            with open(path, "rb") as fh:
                for raw in fh:
                    length = len(raw)
                    parts = raw.split(b"\t", 2)
                    if not raw.endswith(b"\n") or len(parts) != 3:
                        yield "", "", None
                    else:
                        yield parts[0].decode(), parts[1].decode(), _Location(path, offset, length)
                    offset += length

    def scan(self, shard: str) -> ScanResult:
        """Which keys of a shard are done and which only failed; cheap (no JSON parsing)."""
        result = ScanResult()
        for key, status, loc in self._lines(shard):
            if loc is None:
                result.torn_lines += 1
            elif status == OK:
                if key in result.done:
                    result.duplicates += 1
                result.done.add(key)
            elif status == FAILED:
                result.failed.add(key)
        # A failure only counts while no success exists for the key (a later run may have fixed it).
        result.failed -= result.done
        return result

    def done_keys(self, shards: list[str] | None = None) -> set[str]:
        """Keys with a completion in any of the given shards (all shards by default)."""
        keys: set[str] = set()
        for shard in self.shards() if shards is None else shards:
            keys |= self.scan(shard).done
        return keys

    def records(self, shard: str, *, status: str = OK) -> Iterator[dict[str, Any]]:
        """The shard's records of one status, one per key (the first intact line wins)."""
        seen: set[str] = set()
        for key, line_status, loc in self._lines(shard):
            if loc is None or line_status != status or key in seen:
                continue
            record = _read_record(loc)
            if record is None:
                continue
            seen.add(key)
            yield record

    def latest_failures(self, shard: str) -> list[dict[str, Any]]:
        """The last failure record of each key that has no completion."""
        scan = self.scan(shard)
        latest: dict[str, _Location] = {}
        for key, status, loc in self._lines(shard):
            if loc is not None and status == FAILED and key in scan.failed:
                latest[key] = loc
        return [r for r in (_read_record(loc) for loc in latest.values()) if r is not None]

    def iter_completions_sorted(self, shards: list[str] | None = None) -> Iterator[dict[str, Any]]:
        """Every completion across shards once, ordered by key: the same store gives the same order.

        Only locations are held in memory; records are read one at a time, so the caller can
        stream half a billion tokens through a bounded buffer.
        """
        index: dict[str, _Location] = {}
        for shard in self.shards() if shards is None else shards:
            for key, status, loc in self._lines(shard):
                if loc is not None and status == OK and key not in index:
                    index[key] = loc
        for key in sorted(index):
            record = _read_record(index[key])
            if record is not None:
                yield record

    def writer(self, shard: str, *, fsync_interval_s: float = 2.0) -> SegmentWriter:
        return SegmentWriter(self.shard_dir(shard), fsync_interval_s=fsync_interval_s)


def _read_record(loc: _Location) -> dict[str, Any] | None:
    with open(loc.path, "rb") as fh:
        fh.seek(loc.offset)
        raw = fh.read(loc.length)
    try:
        return json.loads(raw.split(b"\t", 2)[2])
    except (ValueError, IndexError):
        return None  # a line cut inside its JSON by a crash: torn, ignored


class SegmentWriter:
    """The one writer of a fresh segment file."""

    def __init__(self, folder: Path, *, fsync_interval_s: float):
        folder.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        self.path = folder / f"seg-{stamp}-{os.getpid()}-{secrets.token_hex(3)}.jsonl"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_EXCL, 0o644)
        self._fsync_interval_s = fsync_interval_s
        self._last_fsync = time.monotonic()
        self.written = 0

    def append(self, record: Mapping[str, Any]) -> None:
        key = record["key"]
        status = record["status"]
        payload = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
        # One write call per line: a crash leaves whole lines plus at most one torn tail.
        os.write(self._fd, f"{key}\t{status}\t{payload}\n".encode())
        self.written += 1
        now = time.monotonic()
        if now - self._last_fsync >= self._fsync_interval_s:
            os.fsync(self._fd)
            self._last_fsync = now

    def close(self) -> None:
        if self._fd < 0:
            return
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        if self.written == 0:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> SegmentWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
