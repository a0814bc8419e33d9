"""Small files under the storage root that change only by compare-and-swap: created only where
absent, replaced or deleted only while they are still the version read.

What makes each step atomic depends on where the root is:

* Local folder: every change is made under an ``flock`` of ``<name>.lock`` beside the file, and
  lands whole (written aside, then linked or renamed into place). A version is the content's hash.
* S3 (and S3-compatible servers): conditional writes, ``If-None-Match: *`` to create and
  ``If-Match: <ETag>`` to replace or delete. A version is the ETag.
* Any other fsspec store: checked, written, then read back; not atomic against a writer on
  another machine at the same instant (a best effort, as the storage docs say).

Used by the shard lease (``expansion_dag.store.lease``) and the identity registry (``store.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from upath import UPath

from expansion_dag.core import is_local, local_path


@dataclass(frozen=True)
class Versioned:
    """A file's content as read, the version a change must name, and when it was last written (epoch s)."""

    data: bytes
    version: str
    modified: float


class LocalFile:
    """A file in a local folder, changed under an ``flock`` of its lock file."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = path.with_name(f".{path.name}.lock")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

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

    def __init__(self, path: UPath):
        import botocore.session

        self.path = path
        self.bucket, _, self.key = path.path.partition("/")
        options = path.storage_options
        client_kwargs: dict[str, Any] = dict(options.get("client_kwargs") or {})
        for ours, theirs in (("endpoint_url", "endpoint_url"), ("key", "aws_access_key_id"),
                             ("secret", "aws_secret_access_key"), ("token", "aws_session_token")):
            if options.get(ours):
                client_kwargs[theirs] = options[ours]
        # Credentials, region and AWS_ENDPOINT_URL from the environment, as s3fs reads them.
        self._client = botocore.session.get_session().create_client("s3", **client_kwargs)

    def read(self) -> Versioned | None:
        try:
            answer = self._client.get_object(Bucket=self.bucket, Key=self.key)
        except self._client.exceptions.NoSuchKey:
            return None
        return Versioned(answer["Body"].read(), answer["ETag"], answer["LastModified"].timestamp())

    def _conditional(self, call: str, **kwargs: Any) -> dict[str, Any] | None:
        """The answer of ``call``; None when its condition failed (412, 409 for a concurrent one, or the
        object is gone). Anything else, a missing bucket included, is raised as botocore words it."""
        from botocore.exceptions import ClientError

        try:
            return getattr(self._client, call)(Bucket=self.bucket, Key=self.key, **kwargs)
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status in (409, 412) or exc.response.get("Error", {}).get("Code") == "NoSuchKey":
                return None
            raise

    def create(self, data: bytes) -> str | None:
        answer = self._conditional("put_object", Body=data, IfNoneMatch="*")
        return answer["ETag"] if answer else None

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


def conditional_file(path: UPath) -> LocalFile | S3Object | FsspecFile:
    """The compare-and-swap handle of ``path`` for its kind of storage."""
    if is_local(path):
        return LocalFile(local_path(path))
    if path.protocol in ("s3", "s3a"):
        return S3Object(path)
    return FsspecFile(path)


def _hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
