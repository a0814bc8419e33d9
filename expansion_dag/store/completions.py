"""The completion store: every completion durable as soon as it returns, each prompt kept once.

``<root>/<shard>/seg-*.jsonl`` (a local folder or an fsspec URL), one writer a segment, so a write cut
short can only be a segment's last line. Each line is checked whole by one rule
(``expansion_dag.store.lines``): the scan, the digests and the build agree that a key's answer is its
first whole ``ok`` line, and a line that is not whole is quarantined, its prompt asked again. On a
remote root a run writes to a local spool and uploads each segment whole once sealed
(``expansion_dag.store.segments``). A digest beside each segment holds its records without texts, so
a growing store is not parsed again each night. A key is the completion identity
(``completion_key``): an ``ok`` record is final, a ``failed`` one only says the last attempt failed.
The layout, what is durable when, and what a torn line does: ``docs/storage.md``.
"""

from __future__ import annotations

import collections
import fcntl
import fnmatch
import hashlib
import json
import os
import secrets
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import pydantic_core

from expansion_dag.core import (
    FAILED,
    OK,
    Identity,
    as_upath,
    default_local_dir,
    entry_name,
    is_local,
    listing,
    local_path,
    upload,
    write_atomically,
)
from expansion_dag.store.identities import IDENTITIES, IdentityRegistry
from expansion_dag.store.lines import decode_line, encode_line
from expansion_dag.store.segments import DEFAULT_SEGMENT_INTERVAL_S, DEFAULT_SEGMENT_RECORDS, SegmentWriter

_OK_BYTES, _FAILED_BYTES = OK.encode(), FAILED.encode()
SEGMENT_GLOB = "seg-*.jsonl"
@dataclass
class ScanResult:
    """What segments hold (one shard's, or the whole store's): the latest status of every key, and damage found."""

    done: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    duplicates: int = 0
    #: The duplicates by the shard folder that holds the second answer of a key.
    duplicates_by_shard: collections.Counter[str] = field(default_factory=collections.Counter)
    #: Lines that are not whole, quarantined (``lines.BAD_LINE_REASONS``), by reason; ``torn_lines`` all of them.
    bad_lines: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def torn_lines(self) -> int:
        return sum(self.bad_lines.values())


@dataclass(frozen=True)
class SegmentPart:
    """One segment's completions as a build takes them: fixed once the segment is sealed (it is only
    ever appended to, so its name and size say which records it holds)."""

    name: str  # "<shard>/<segment file>"
    path: Path  # its local file (a cached copy of a remote one)
    size: int
    #: Keys whose completion an earlier segment holds: a second answer, never taken twice.
    taken: frozenset[str]
    digest: bool = False  # records cut to ``DIGEST_FIELDS``
    #: Offsets of its lines that are not whole: a segment garbled in place keeps its name and size,
    #: and a part built before is not of the records it holds now.
    set_aside: tuple[int, ...] = ()

    def records(self) -> Iterator[dict[str, Any]]:
        """The segment's completions in file order, each key's first once, less ``taken``."""
        lines = _digest(self.path) if self.digest else _whole_lines(self.path)
        yield from _firsts(lines, _OK_BYTES, set(self.taken))


class CompletionStore:
    """Completions of every shard under one root: a local folder or an fsspec URL."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        local_dir: str | os.PathLike[str] | None = None,
        segment_records: int = DEFAULT_SEGMENT_RECORDS,
        segment_interval_s: float = DEFAULT_SEGMENT_INTERVAL_S,
    ):
        if segment_records < 1 or segment_interval_s <= 0:
            raise ValueError("segment_records must be at least 1 and segment_interval_s positive")
        self.root = as_upath(root)
        self.local = is_local(self.root)
        digest = hashlib.sha256(str(self.root).encode()).hexdigest()[:16]
        work = Path(local_dir or default_local_dir()) / digest
        self.spool = work / "spool"
        self._cache = work / "segments"
        self._segment_records = segment_records
        self._segment_interval_s = segment_interval_s
        self._recovered = self.local
        self.registry = IdentityRegistry(self.root)

    def shards(self) -> list[str]:
        if self.local:
            folder = local_path(self.root)
            names = [p.name for p in folder.iterdir() if p.is_dir()] if folder.exists() else []
        else:
            self._recover()
            names = [entry_name(e) for e in listing(self.root) if e["type"] == "directory"]
        return sorted(n for n in names if n != IDENTITIES)

    def _segments(self, shard: str) -> list[Path]:
        """Local files of a shard's segments: the segments themselves, or cached copies of objects."""
        if self.local:
            folder = local_path(self.root / shard)
            return sorted(folder.glob(SEGMENT_GLOB)) if folder.exists() else []
        self._recover()
        cache = self._cache / shard
        objects = {
            e["name"]: (cache / entry_name(e), e["size"])
            for e in listing(self.root / shard)
            if e["type"] == "file" and fnmatch.fnmatch(entry_name(e), SEGMENT_GLOB)
        }
        # Same name and size is the same object: segments are never rewritten.
        stale = [
            name for name, (copy, size) in objects.items() if not (copy.exists() and copy.stat().st_size == size)
        ]
        if stale:
            cache.mkdir(parents=True, exist_ok=True)
            parts = [cache / f".{objects[name][0].name}.{os.getpid()}-{secrets.token_hex(3)}" for name in stale]
            self.root.fs.get(stale, [str(p) for p in parts])
            for name, part in zip(stale, parts):
                os.replace(part, objects[name][0])
        return sorted(copy for copy, _ in objects.values())

    def scan(self, shard: str | None = None) -> ScanResult:
        """Which keys are done and which only failed, in one shard or (``None``) the whole store.

        One pass over the lines and no JSON parsing (but for lines written before checksums), so
        resuming costs one cheap read of the store whatever the number of prompts. A key done in two
        shards counts as a duplicate. Lines that are not whole are counted and quarantined.
        """
        result = ScanResult()
        for one in self.shards() if shard is None else [shard]:
            for path in self._segments(one):
                bad: list[_BadLine] = []
                for key, status, _ in _whole_lines(path, bad):
                    if status == _OK_BYTES:
                        if key in result.done:
                            result.duplicates += 1
                            result.duplicates_by_shard[one] += 1
                        result.done.add(key)
                    elif status == _FAILED_BYTES:
                        result.failed.add(key)
                result.bad_lines.update(_quarantine(one, path, bad))
        # A failure only counts while no success exists for the key (a later run may have fixed it).
        result.failed -= result.done
        return result

    def done_keys(self) -> set[str]:
        """Keys with a completion anywhere in the store."""
        return self.scan().done

    def records(self, shard: str, *, status: str = OK) -> Iterator[dict[str, Any]]:
        """The shard's records of one status, one per key (the first whole line wins)."""
        seen: set[str] = set()
        for path in self._segments(shard):
            yield from _firsts(_whole_lines(path), status.encode(), seen)

    def latest_failures(self, shard: str) -> list[dict[str, Any]]:
        """The last failure record of each key that has no completion."""
        done: set[str] = set()
        latest: dict[str, bytes] = {}
        for path in self._segments(shard):
            for key, status, payload in _whole_lines(path):
                if status == _OK_BYTES:
                    done.add(key)
                elif status == _FAILED_BYTES:
                    latest[key] = payload
        return [r for key, payload in latest.items() if key not in done and (r := _parsed(payload)) is not None]

    def latest_records(self, shards: list[str] | None = None, *, digest: bool = False) -> Iterator[dict[str, Any]]:
        """Each key's record once, in file order: its first completion, or, for a key that never
        succeeded, its last failure (after every completion). Completions are parsed one at a time
        and let go.

        ``digest``: each record holds only ``DIGEST_FIELDS``, read from the segments' digests
        (``_digest``), so a shard run's checks and its length learning do not parse every
        completion's text again each night.
        """
        parts, failures = self.parts(shards, digest=digest)
        for part in parts:
            yield from part.records()
        yield from failures

    def parts(
        self, shards: list[str] | None = None, *, digest: bool = False
    ) -> tuple[list[SegmentPart], list[dict[str, Any]]]:
        """The store as fixed sets of records, for a build that keeps what it built from each: every
        segment in file order (its completions less those of keys an earlier segment holds), and the
        last failure of each key that never succeeded."""
        segments = ((shard, path) for shard in (self.shards() if shards is None else shards)
                    for path in self._segments(shard))
        return _parts(segments, digest)

    def writer(
        self, shard: str, *, identities: Sequence[Identity] = (), fsync_interval_s: float = 2.0,
        check: Callable[[], None] | None = None,
    ) -> SegmentWriter:
        """The one writer of a run of ``shard``; its ``identities`` (the pipeline always gives them: one
        per generation mode) are registered first. ``check`` runs after each line is written: what it
        raises (a lost shard lease) stops the sender, the line kept."""
        if shard == IDENTITIES:
            raise ValueError(f"{IDENTITIES!r} is the identity registry, not a shard")
        for identity in identities:
            self.registry.register(identity)
        if self.local:
            return SegmentWriter(local_path(self.root / shard), fsync_interval_s=fsync_interval_s, check=check)
        self._recover()
        return SegmentWriter(
            self.spool / shard,
            fsync_interval_s=fsync_interval_s,
            check=check,
            publish=lambda path: self._publish(shard, path),
            segment_records=self._segment_records,
            segment_interval_s=self._segment_interval_s,
        )

    def _publish(self, shard: str, path: Path) -> None:
        """Upload a sealed spool segment, then keep it as the read cache's copy of the object."""
        upload(path, self.root / shard / path.name)
        cached = self._cache / shard / path.name
        cached.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, cached)

    def _recover(self) -> None:
        """Upload the spool segments that dead writers left on this machine (once per store)."""
        if self._recovered:
            return
        for path in sorted(self.spool.glob(f"*/{SEGMENT_GLOB}")):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue  # published meanwhile
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its writer is alive
                # A live writer unlocks only after moving the segment out of the spool.
                if path.exists():
                    self._publish(path.parent.name, path)
            finally:
                os.close(fd)
        self._recovered = True


def _parts(segments: Iterable[tuple[str, Path]], digest: bool) -> tuple[list[SegmentPart], list[dict[str, Any]]]:
    """``CompletionStore.parts`` of these (shard, segment) in file order: one read of every segment's
    lines, keys and statuses only (a digest's with ``digest``); failure records are few, so held."""
    done: set[str] = set()
    failures: dict[str, bytes] = {}
    parts = []
    for shard, path in segments:
        first: set[str] = set()  # keys this segment answers first
        taken: set[str] = set()
        size = path.stat().st_size
        bad: list[_BadLine] = []
        for key, status, payload in _digest(path) if digest else _whole_lines(path, bad):
            if status == _OK_BYTES and key not in done:
                done.add(key)
                first.add(key)
                failures.pop(key, None)
            elif status == _OK_BYTES and key not in first:
                taken.add(key)
            elif status == _FAILED_BYTES and key not in done:
                failures[key] = payload
        set_aside = tuple(offset for offset, _, _ in bad)
        parts.append(SegmentPart(f"{shard}/{path.name}", path, size, frozenset(taken), digest, set_aside))
    return parts, [r for r in map(_parsed, failures.values()) if r is not None]


#: A line that is not whole: its offset in its segment, its bytes, and why (``lines.BAD_LINE_REASONS``).
_BadLine = tuple[int, bytes, str]
_QUARANTINE_SUFFIX = ".quarantine"


def _whole_lines(path: Path, bad: list[_BadLine] | None = None) -> Iterator[tuple[str, bytes, bytes]]:
    """(key, status, JSON) of each whole line of a segment, in file order; the others go to ``bad``."""
    offset = 0
    with open(path, "rb") as fh:
        for raw in fh:
            line = decode_line(raw)
            if not isinstance(line, str):
                yield line
            elif bad is not None:
                bad.append((offset, raw, line))
            offset += len(raw)


def _firsts(lines: Iterable[tuple[str, bytes, bytes]], status: bytes, seen: set[str]) -> Iterator[dict[str, Any]]:
    """The record of each key's first line of ``status`` in ``lines``, less the keys in ``seen`` (kept
    up to date)."""
    for key, line_status, payload in lines:
        if line_status == status and key not in seen and (record := _parsed(payload)) is not None:
            seen.add(key)
            yield record


def _quarantine(shard: str, path: Path, bad: list[_BadLine]) -> list[str]:
    """Keep the bad lines of a segment, each with its offset and reason, in ``<segment>.quarantine``
    (rewritten whole when they change); the reasons of those counted. A last line still being
    written (its writer holds the segment) is not bad yet."""
    if bad and bad[-1][2] == "unfinished" and _being_written(path):
        bad = bad[:-1]
    if not bad:
        return []
    body = b"".join(pydantic_core.to_json(_bad_line_record(shard, path, *line)) + b"\n" for line in bad)
    target = path.with_name(path.name + _QUARANTINE_SUFFIX)
    try:
        if not target.is_file() or target.read_bytes() != body:
            with write_atomically(as_upath(target)) as staged:
                staged.write_bytes(body)
    except OSError:
        pass  # a store this process may read but not write: counted, the bytes kept in the segment
    return [reason for _, _, reason in bad]


def _bad_line_record(shard: str, path: Path, offset: int, raw: bytes, reason: str) -> dict[str, Any]:
    fields = raw.split(b"\t", 2)
    return {
        "segment": f"{shard}/{path.name}", "offset": offset, "length": len(raw), "reason": reason,
        # What the line says it is, as far as it can be read: the key it would have answered.
        "key": fields[0].decode(errors="replace") if len(fields) > 1 else None,
        "status": fields[1].decode(errors="replace") if len(fields) > 2 else None,
        "line": raw.decode(errors="backslashreplace"),
    }


def _being_written(path: Path) -> bool:
    """Whether a live writer holds the segment (``segments._Segment`` locks it until it is closed)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # and with it this shared lock
    return False


#: What a digest keeps of a record: what the shard checks (``shard_figures``), the answer-length
#: learning (``answer_lengths.learn``) and a re-run's choice of what to send (``outcomes.is_final``)
#: read, and the two fields that say whose record it is.
DIGEST_FIELDS = (
    "key", "status", "prompt_id", "source", "finish_reason", "error", "outcome",
    "prompt_tokens", "local_prompt_tokens", "completion_tokens", "length_features",
)  # fmt: skip
_DIGEST_SUFFIX = ".digest"
#: Written in a digest's first line: a digest cut to other fields, or of lines read by another rule, is
#: rebuilt, not read.
_DIGEST_RULES = ("crc32-lines", "object-bounds", "crc32-covered")
_DIGEST_VERSION = hashlib.sha256(",".join((*_DIGEST_RULES, *DIGEST_FIELDS)).encode()).hexdigest()[:8].encode()


def _digest(path: Path) -> list[tuple[str, bytes, bytes]]:
    """The segment's lines with each record cut to ``DIGEST_FIELDS``, kept beside the segment's local file.

    A segment is only ever appended to, so its digest stays true of the bytes it covers (its first
    line: how many, and their CRC) and is extended by the lines written since: each line's JSON is
    parsed once, not on every read. The covered bytes are checked against their CRC (one pass of
    zlib's CRC, no JSON; once per process while the file's inode, size and time stay the same): a
    line garbled since it was digested (a bad sector, a stray write of the same length) rebuilds the
    digest, so no reader takes as done a line the scan quarantines. A line not yet whole is left for
    the next read. Where the digest cannot be written (a read-only store), it is recomputed in memory.
    """
    cache = path.with_name(path.name + _DIGEST_SUFFIX)
    covered, crc, lines = _read_digest(cache)
    with open(path, "rb") as fh:
        found = os.fstat(fh.fileno())
        stat = (found.st_ino, found.st_size, found.st_mtime_ns)
        checked = _CHECKED.get(path) == (*stat, covered, crc)
        if covered and not checked and _crc_of(fh, covered) != crc:
            covered, crc, lines = 0, 0, []  # not the bytes digested (garbled, or another file)
        fh.seek(covered)
        start, fresh = covered, []
        for raw in fh:
            line = decode_line(raw)
            if line == "unfinished":
                break  # the last line, still being written or torn: left for the next read
            covered += len(raw)
            crc = zlib.crc32(raw, crc)
            if isinstance(line, str):
                continue  # not whole: covered, never kept
            try:
                record = json.loads(line[2])
            except ValueError:
                continue  # whole, yet not JSON: never written so, never kept
            if isinstance(record, dict):
                small = {f: record[f] for f in DIGEST_FIELDS if f in record}
                fresh.append((line[0], line[1], pydantic_core.to_json(small)))
    lines += fresh
    if time.time_ns() - found.st_mtime_ns > _SETTLED_NS:  # a later write shows in its time (racy-git's rule)
        _CHECKED[path] = (*stat, covered, crc)
    if covered != start:
        try:
            with write_atomically(as_upath(cache)) as staged:
                body = b"".join(encode_line(k, st.decode(), pl) for k, st, pl in lines)
                staged.write_bytes(b"%d %08x %s\n" % (covered, crc, _DIGEST_VERSION) + body)
        except OSError:
            pass  # a store this process may read but not write: the digest is not kept
    return lines


#: Per segment, the file (inode, size, modification time) and the digest's covered bytes and CRC this
#: process last checked: a shard run reads the digests three times, and checks each segment's bytes once.
_CHECKED: dict[Path, tuple[int, ...]] = {}
#: How old a file's modification time must be for a check to stand while it stays the same: a write in
#: the same tick of the file system's clock would leave it unchanged (far above a tick, or clocks' skew).
_SETTLED_NS = 5_000_000_000


def _crc_of(fh: BinaryIO, size: int) -> int | None:
    """The CRC of the file's first ``size`` bytes; None when it is shorter."""
    fh.seek(0)
    crc = 0
    while size:
        chunk = fh.read(min(size, 1 << 20))
        if not chunk:
            return None
        crc = zlib.crc32(chunk, crc)
        size -= len(chunk)
    return crc


def _read_digest(cache: Path) -> tuple[int, int, list[tuple[str, bytes, bytes]]]:
    """(bytes of the segment covered, their CRC, lines) of a digest file; (0, 0, []) when absent,
    unreadable or of other fields (a digest is written whole, so a line not whole means it was
    damaged: it is rebuilt)."""
    try:
        with open(cache, "rb") as fh:
            covered_text, crc_text, version = fh.readline().split()
            if version != _DIGEST_VERSION:
                return 0, 0, []
            covered, crc = int(covered_text), int(crc_text, 16)
            lines = [decode_line(raw) for raw in fh]
    except (OSError, ValueError):
        return 0, 0, []
    whole = [line for line in lines if not isinstance(line, str)]
    return (covered, crc, whole) if len(whole) == len(lines) else (0, 0, [])


def _parsed(payload: bytes) -> dict[str, Any] | None:
    try:
        return json.loads(payload)
    except ValueError:
        return None  # whole, yet not JSON: no writer of this store wrote it; skipped
