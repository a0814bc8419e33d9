"""The segment writer: one run's completions appended to a shard's segments, each with one writer.

A line (``expansion_dag.store.lines``: checked whole on read) is written on an ``O_APPEND`` descriptor
of a local file, its bytes all written before the next line's (a write the kernel takes only in
part is continued), so once ``append`` returns the line survives the death of the process (SIGKILL
included); ``fsync`` runs every ``fsync_interval_s`` and when a segment is closed, for machine
crashes, and the segment's folder is synced once the segment is named. A write that fails leaves
its segment behind (its last line cut short, read as such): the next line opens a new segment, so
no line is ever appended after a torn one. The layout, and what is durable when, are the store's
(``expansion_dag.store.completions``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pydantic_core

from expansion_dag.core import unwritable
from expansion_dag.store.lines import encode_line

DEFAULT_SEGMENT_RECORDS = 1000
DEFAULT_SEGMENT_INTERVAL_S = 60.0
_SEAL_CHECK_S = 1.0  # how often a quiet writer checks whether its segment is due for upload


class _Segment:
    """One fresh segment file and its one writer."""

    def __init__(self, path: Path):
        self.path = path
        if not path.parent.is_dir():  # a shard's first segment
            path.parent.mkdir(parents=True, exist_ok=True)
            fsync_folder(path.parent.parent)
        # Created under a name that no reader and no spool recovery looks at, locked, then named:
        # a segment is never seen unlocked while its writer lives.
        opening = path.with_name(f".{path.name}.opening")
        self._fd = os.open(opening, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_EXCL, 0o644)
        # Held until the segment is closed: spool recovery takes only segments whose writer died.
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        os.rename(opening, path)
        # The name survives a machine crash with the lines synced after it.
        fsync_folder(path.parent)
        self.opened = time.monotonic()
        self.lines = 0
        self._last_fsync = self.opened

    def write(self, line: bytes, fsync_interval_s: float) -> None:
        # A crash leaves whole lines plus at most one torn tail: the writer opens a new segment
        # after a failed write.
        written = memoryview(line)
        while written:
            taken = os.write(self._fd, written)
            if not taken:
                raise OSError(errno.EIO, f"the disk took no byte of a line of {self.path}")
            written = written[taken:]
        self.lines += 1
        now = time.monotonic()
        if now - self._last_fsync >= fsync_interval_s:
            os.fsync(self._fd)
            self._last_fsync = now

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


class SegmentWriter:
    """The one writer of a run of a shard.

    Without ``publish`` (a local root) it appends to one segment in ``folder``. With ``publish`` (a
    remote root) ``folder`` is the spool: each segment is sealed when due and handed to ``publish``
    in a background thread, which uploads it and moves it out of the spool.
    """

    def __init__(
        self,
        folder: Path,
        *,
        fsync_interval_s: float,
        publish: Callable[[Path], None] | None = None,
        segment_records: int = DEFAULT_SEGMENT_RECORDS,
        segment_interval_s: float = DEFAULT_SEGMENT_INTERVAL_S,
        check: Callable[[], None] | None = None,
    ):
        self._folder = folder
        self._check = check
        self._fsync_interval_s = fsync_interval_s
        self._publish = publish
        self._segment_records = segment_records
        self._segment_interval_s = segment_interval_s
        self._segment: _Segment | None = None  # opened by the first line, so no empty segments
        self._writer_id = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._segments_opened = 0
        self._lock = threading.Lock()  # the appending thread and the publisher both seal
        self._error: BaseException | None = None
        self._closed = False
        self.written = 0
        if publish is not None:
            self._sealed: queue.SimpleQueue[_Segment | None] = queue.SimpleQueue()
            self._publisher = threading.Thread(target=self._publish_sealed, name=f"publish {folder.name}", daemon=True)
            self._publisher.start()

    @property
    def path(self) -> Path | None:
        """The segment being appended to."""
        return self._segment.path if self._segment else None

    def append(self, record: Mapping[str, Any]) -> None:
        # Compact UTF-8 JSON, as ``json.dumps(ensure_ascii=False)`` writes it, in a sixth of its
        # CPU on answers with non-ASCII text (pydantic's Rust encoder): one record per request.
        line = encode_line(record["key"], record["status"], pydantic_core.to_json(record))
        with self._lock:
            if self._closed:
                raise ValueError(f"the writer of {self._folder} is closed")
            try:
                if self._segment is None:
                    self._segment = _Segment(self._next_path())
                self._segment.write(line, self._fsync_interval_s)
            except OSError as exc:
                self._drop_segment()
                raise unwritable(
                    exc, self._folder, "a completion", "the completions written are kept and only the others are sent"
                ) from exc
            self.written += 1
            if self._publish is not None and self._segment.lines >= self._segment_records:
                self._seal()
        self._raise_publish_error()
        if self._check is not None:
            self._check()

    def _next_path(self) -> Path:
        # Names sort in the order a writer wrote its segments, and the runs of a shard theirs (to
        # the microsecond: two runs in one second): readers keep the first ok line of a key and
        # the last failure. (Names of whole seconds, older, sort before those of their second.)
        now = time.time()
        stamp = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now))}{int(now % 1 * 1e6):06d}"
        self._segments_opened += 1
        return self._folder / f"seg-{stamp}-{self._writer_id}-{self._segments_opened:06d}.jsonl"

    def _drop_segment(self) -> None:
        """Leave the current segment, if any, as a failed write left it (the lock held): never
        appended to again. In a spool it is a dead writer's segment now, which the next run here
        uploads."""
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    def _seal(self) -> None:
        """Hand the current segment, synced, to the publisher (the lock is held)."""
        assert self._segment is not None
        self._segment.sync()
        self._sealed.put(self._segment)
        self._segment = None

    def _publish_sealed(self) -> None:
        assert self._publish is not None
        while True:
            try:
                segment = self._sealed.get(timeout=min(_SEAL_CHECK_S, self._segment_interval_s))
            except queue.Empty:
                with self._lock:
                    current = self._segment
                    if current is not None and time.monotonic() - current.opened >= self._segment_interval_s:
                        self._seal()
                continue
            if segment is None:
                return
            try:
                self._publish(segment.path)
            except Exception as exc:  # the segment stays in the spool, unlocked, for recovery
                self._error = self._error or exc
            finally:
                segment.close()

    def _raise_publish_error(self) -> None:
        if self._error is not None:
            raise OSError(
                f"a completion segment could not be uploaded: {self._error}. Its completions are kept in "
                f"{self._folder}; the next run on this machine uploads them."
            ) from self._error

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            if self._segment is not None and self._publish is not None:
                self._seal()
            elif self._segment is not None:
                self._segment.sync()
                self._segment.close()
                self._segment = None
        if self._publish is not None:
            self._sealed.put(None)
            self._publisher.join()
        self._raise_publish_error()

    def __enter__(self) -> SegmentWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fsync_folder(folder: Path) -> None:
    """Sync a folder's entries: a file created or renamed in it keeps its name through a machine crash."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
