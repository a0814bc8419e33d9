"""Small files under the storage root that change only by compare-and-swap: created only where
absent, replaced or deleted only while they are still the version read.

What makes each step atomic depends on where the root is:

* Local folder: every change is made under an ``flock`` of ``<name>.lock`` beside the file, and
  lands whole (written aside, then linked or renamed into place). A version is the content's hash.
* S3 (and S3-compatible servers): conditional writes, ``If-None-Match: *`` to create and
  ``If-Match: <ETag>`` to replace or delete. A version is the ETag. A server that takes the
  headers but does not enforce them would let two writers both win: ``prove_conditional_writes``
  shows that it enforces them (once per store and process) before the lease relies on them.
* Any other fsspec store: checked, written, then read back; not atomic against a writer on
  another machine at the same instant (a best effort, as the storage docs say).

``timeout_s`` bounds each change (a lock wait, an HTTP request): a store that stops answering
fails the call instead of holding it past a lease's timeout.

Used by the shard lease (``expansion_dag.store.lease``) and the identity registry (``store.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from upath import UPath

from expansion_dag.core import is_local, local_path


#: Attempts of one S3 request under a timeout (botocore's standard retry mode): a dropped
#: connection is tried once more, and both fit in the time given.
S3_ATTEMPTS = 2
#: Polls of a held lock file a second, while a change waits for it under a timeout.
LOCK_POLLS_PER_S = 50


class ConditionalWritesIgnored(RuntimeError):
    """The object store takes conditional writes but does not enforce them: no lease may rely on it."""


@dataclass(frozen=True)
class Versioned:
    """A file's content as read, the version a change must name, and when it was last written (epoch s)."""

    data: bytes
    version: str
    modified: float


class LocalFile:
    """A file in a local folder, changed under an ``flock`` of its lock file."""

    def __init__(self, path: Path, *, timeout_s: float | None = None):
        self.path = path
        self._lock = path.with_name(f".{path.name}.lock")
        self._timeout_s = timeout_s

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if self._timeout_s is None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            else:
                self._lock_within(fd, self._timeout_s)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _lock_within(self, fd: int, timeout_s: float) -> None:
        """The lock, or TimeoutError once another process has held it for ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{self._lock} was held by another process for over {timeout_s:g} s"
                    ) from None
                time.sleep(1 / LOCK_POLLS_PER_S)

    def prove_conditional_writes(self) -> None:
        """Nothing to prove: every change is made under the lock."""

    def read(self) -> Versioned | None:
        try:
            with open(self.path, "rb") as fh:
                data = fh.read()
                modified = os.fstat(fh.fileno()).st_mtime
        except FileNotFoundError:
            return None
        return Versioned(data, _hash(data), modified)

    def _staged(self, data: bytes) -> Path:
        staged = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}-{secrets.token_hex(3)}")
        with open(staged, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        return staged

    def create(self, data: bytes) -> str | None:
        with self._locked():
            staged = self._staged(data)
            try:
                os.link(staged, self.path)  # fails where the file exists: an exclusive create, whole
            except FileExistsError:
                return None
            finally:
                staged.unlink()
        return _hash(data)

    def swap(self, data: bytes, expected: str) -> str | None:
        with self._locked():
            current = self.read()
            if current is None or current.version != expected:
                return None
            os.replace(self._staged(data), self.path)
        return _hash(data)

    def delete(self, expected: str) -> bool:
        with self._locked():
            current = self.read()
            if current is None or current.version != expected:
                return False
            self.path.unlink()
        return True


class S3Object:
    """An S3 object, changed by conditional writes (botocore's ``IfNoneMatch`` and ``IfMatch``)."""

    def __init__(self, path: UPath, *, timeout_s: float | None = None):
        import botocore.session
        from botocore.config import Config

        self.path = path
        self.bucket, _, self.key = path.path.partition("/")
        options = path.storage_options
        client_kwargs: dict[str, Any] = dict(options.get("client_kwargs") or {})
        for ours, theirs in (("endpoint_url", "endpoint_url"), ("key", "aws_access_key_id"),
                             ("secret", "aws_secret_access_key"), ("token", "aws_session_token")):
            if options.get(ours):
                client_kwargs[theirs] = options[ours]
        if timeout_s is not None:
            # botocore's defaults (60 s a read, retried) could outlast a lease: every attempt of a
            # call, and the call as a whole, ends well within ``timeout_s``.
            attempt_s = timeout_s / (S3_ATTEMPTS + 1)
            bounded = Config(connect_timeout=attempt_s, read_timeout=attempt_s,
                             retries={"total_max_attempts": S3_ATTEMPTS, "mode": "standard"})
            given = client_kwargs.get("config")
            client_kwargs["config"] = given.merge(bounded) if given is not None else bounded
        # Credentials, region and AWS_ENDPOINT_URL from the environment, as s3fs reads them.
        self._client = botocore.session.get_session().create_client("s3", **client_kwargs)

    def read(self) -> Versioned | None:
        try:
            answer = self._client.get_object(Bucket=self.bucket, Key=self.key)
        except self._client.exceptions.NoSuchKey:
            return None
        return Versioned(answer["Body"].read(), answer["ETag"], answer["LastModified"].timestamp())

    def _conditional(self, call: str, key: str | None = None, **kwargs: Any) -> dict[str, Any] | None:
        """The answer of ``call``; None when its condition failed (412, 409 for a concurrent one, or the
        object is gone). Anything else, a missing bucket included, is raised as botocore words it."""
        from botocore.exceptions import ClientError

        try:
            return getattr(self._client, call)(Bucket=self.bucket, Key=key or self.key, **kwargs)
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status in (409, 412) or exc.response.get("Error", {}).get("Code") == "NoSuchKey":
                return None
            raise

    def create(self, data: bytes) -> str | None:
        answer = self._conditional("put_object", Body=data, IfNoneMatch="*")
        return answer["ETag"] if answer else None

    def prove_conditional_writes(self) -> None:
        """Raise ``ConditionalWritesIgnored`` unless the store refuses a second conditional create of
        one object and a replace naming an ETag it no longer has; proven once per store and process."""
        store = (self._client.meta.endpoint_url, self.bucket)
        with _PROVING:
            if store in _PROVEN:
                return
            folder = self.key.rpartition("/")[0]
            probe = f"{folder}/.conditional-writes-probe-{secrets.token_hex(8)}".lstrip("/")
            try:
                broken = self._ignored_condition(probe)
            finally:
                self._client.delete_object(Bucket=self.bucket, Key=probe)
            if broken is not None:
                raise ConditionalWritesIgnored(
                    f"the object store {store[0]} (bucket {self.bucket}) does not enforce conditional writes: "
                    f"{broken} (probe s3://{self.bucket}/{probe}). The shard lease relies on them (If-None-Match "
                    "to take it, If-Match to renew it); without them two runs could both hold a shard and send "
                    "its prompts twice, so no lease is taken there. Fix: set storage.root to an S3 store that "
                    "enforces If-None-Match and If-Match on PutObject, or to a folder every run can reach "
                    "(the lease then uses file locks)"
                )
            _PROVEN.add(store)

    def _ignored_condition(self, probe: str) -> str | None:
        """What the store did that a store enforcing conditional writes refuses, or None."""
        from botocore.exceptions import ClientError

        try:
            first = self._conditional("put_object", probe, Body=b"1", IfNoneMatch="*")
            if first is None:
                return "a conditional create (If-None-Match: *) of a new object was refused"
            if self._conditional("put_object", probe, Body=b"2", IfNoneMatch="*") is not None:
                return "a second conditional create (If-None-Match: *) of the same object succeeded"
            second = self._conditional("put_object", probe, Body=b"3", IfMatch=first["ETag"])
            if second is None:
                return "a replace naming the object's own ETag (If-Match) was refused"
            if self._conditional("put_object", probe, Body=b"4", IfMatch=first["ETag"]) is not None:
                return "a replace naming an ETag the object no longer has (If-Match) succeeded"
        except ClientError as exc:
            if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") != 501:
                raise
            return f"it answered a conditional write with 501 ({exc})"
        return None

    def swap(self, data: bytes, expected: str) -> str | None:
        answer = self._conditional("put_object", Body=data, IfMatch=expected)
        return answer["ETag"] if answer else None

    def delete(self, expected: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            return self._conditional("delete_object", IfMatch=expected) is not None
        except ClientError as exc:
            if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") != 501:
                raise
        # A server with conditional writes but not conditional deletes: checked, then deleted.
        current = self.read()
        if current is None or current.version != expected:
            return False
        self._client.delete_object(Bucket=self.bucket, Key=self.key)
        return True


class FsspecFile:
    """A file on another fsspec store: checked, written and read back (not atomic across machines)."""

    def __init__(self, path: UPath):
        self.path = path
        self._fs = path.fs

    def prove_conditional_writes(self) -> None:
        """Nothing to prove: such a store has no conditional writes (a best effort, as the docs say)."""

    def read(self) -> Versioned | None:
        try:
            data = self._fs.cat_file(self.path.path)
        except FileNotFoundError:
            return None
        try:
            modified = self._fs.modified(self.path.path).timestamp()
        except NotImplementedError:
            modified = time.time()  # unknown: as if written now, so never judged old for lack of a date
        return Versioned(data, _hash(data), modified)

    def _written(self, data: bytes) -> str | None:
        self._fs.pipe_file(self.path.path, data)
        after = self.read()  # another writer at the same instant: the last one wins, and knows it
        return after.version if after is not None and after.data == data else None

    def create(self, data: bytes) -> str | None:
        return None if self._fs.exists(self.path.path) else self._written(data)

    def swap(self, data: bytes, expected: str) -> str | None:
        current = self.read()
        return self._written(data) if current is not None and current.version == expected else None

    def delete(self, expected: str) -> bool:
        current = self.read()
        if current is None or current.version != expected:
            return False
        self._fs.rm_file(self.path.path)
        return True


def conditional_file(path: UPath, *, timeout_s: float | None = None) -> LocalFile | S3Object | FsspecFile:
    """The compare-and-swap handle of ``path`` for its kind of storage; ``timeout_s`` bounds each change."""
    if is_local(path):
        return LocalFile(local_path(path), timeout_s=timeout_s)
    if path.protocol in ("s3", "s3a"):
        return S3Object(path, timeout_s=timeout_s)
    return FsspecFile(path)


#: The stores (endpoint, bucket) proven to enforce conditional writes in this process.
_PROVEN: set[tuple[str, str]] = set()
_PROVING = threading.Lock()


def _hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
