"""The training set published whole: each build writes a new version beside the others, and a small
pointer, switched last, names the current one. A reader that follows the pointer once reads one
complete version, whatever builds run meanwhile.

Under the storage root:

* ``training_set_versions/<version>/``: one complete set each (``part-*.parquet``, ``manifest.json``,
  ``README.md``, the trainers' files). A version is named by its build's start (UTC, to the
  microsecond) and its builder's claim (``expansion_dag.store.BuildClaim``):
  ``20270115T020311123456Z-3fa9c1d2e4b5a6f7``.
* ``training_set``: on a local root, a symlink to the current version, replaced by a rename, so
  ``training_set/part-*.parquet`` is always one whole version.
* ``training_set.json``: on an object store, which has no links, ``{"version", "path"}``, written in
  one request (a conditional one on S3).

The pointer only moves forward: a build that finishes after a newer one published keeps its
version as an older one. After a switch, versions beyond ``keep`` (the current one included) are
removed, oldest first, and so are versions that were never published, but never one that a live
builder owns.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from upath import UPath

from expansion_dag.core import as_upath, entry_name, is_local, listing, local_path, upload
from expansion_dag.store import conditional_file
from expansion_dag.training.manifest import MANIFEST_NAME, current_version

VERSIONS = "training_set_versions"
CURRENT = "training_set"
POINTER = f"{CURRENT}.json"  # on an object store
#: A version's name, or a staging folder's made from it: its start, then its builder's claim.
_NAME = re.compile(r"\.?(\d{8}T\d{12}Z)-([0-9a-f]{16})")


class Claim(Protocol):
    """A builder's claim (``expansion_dag.store.BuildClaim``)."""

    id: str

    def check(self) -> None: ...
    def alive(self, owner: str) -> bool: ...


class Log(Protocol):
    def info(self, msg: str) -> None: ...
    def warning(self, msg: str) -> None: ...


@dataclass
class Version:
    """A version being built: its name, the local folder to write it in, where readers find it."""

    name: str
    directory: Path
    url: UPath
    current: bool = False  # once published: whether the pointer names it (no newer build did first)


@contextlib.contextmanager
def publishing(root: str | os.PathLike[str], *, claim: Claim, keep: int, scratch: str | os.PathLike[str],
               log: Log) -> Iterator[Version]:
    """A new version to write a whole set into (``version.directory``, which must not exist yet);
    when the block succeeds it is published: uploaded (an object store's, ``manifest.json`` last),
    the pointer switched, old versions removed. ``scratch``: a local folder for an object store's."""
    root = as_upath(root)
    name = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now := time.time()))}{int(now % 1 * 1e6):06d}Z-{claim.id}"
    url = root / VERSIONS / name
    if is_local(root):
        version = Version(name, local_path(url), url)
        yield version
    else:
        Path(scratch).mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="expansion-", dir=scratch))
        try:
            version = Version(name, folder / name, url)
            yield version
            upload(version.directory, url, last=MANIFEST_NAME)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    # The claim still holds: no other builder can have judged this version abandoned.
    claim.check()
    version.current = _switch_link(local_path(root), name) if is_local(root) else _switch_pointer(root, name)
    if not version.current:
        log.warning(f"a newer version of the training set was published while {name} was built: it stays "
                    f"the current one, and {url} is kept as an older version")
    _prune(root, keep, claim, log)


def _switch_link(root: Path, name: str) -> bool:
    """Point ``root/training_set`` at the version ``name`` unless a newer one is named already."""
    link = root / CURRENT
    with _locked(root / f".{CURRENT}.lock"):
        if link.is_symlink() and Path(os.readlink(link)).name > name:
            return False
        staged = root / f".{CURRENT}.link-{name}"
        staged.unlink(missing_ok=True)
        os.symlink(f"{VERSIONS}/{name}", staged)
        os.replace(staged, link)  # atomic: a reader follows the old link or the new one
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return True


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _switch_pointer(root: UPath, name: str) -> bool:
    """Write ``root/training_set.json`` naming the version ``name`` unless a newer one is named already."""
    pointer = conditional_file(root / POINTER)
    body = (json.dumps({"version": name, "path": f"{VERSIONS}/{name}"}, indent=2) + "\n").encode()
    while True:
        found = pointer.read()
        if found is None:
            if pointer.create(body) is not None:
                break
            continue  # another builder's pointer came first: compared next time round
        if _pointed(found.data) > name:
            return False
        if pointer.swap(body, found.version) is not None:
            break
    return True


def _pointed(data: bytes) -> str:
    """The version a pointer names ("" for one that cannot be read: any version is newer)."""
    try:
        named = json.loads(data)
    except ValueError:
        return ""
    return str(named.get("version", "")) if isinstance(named, dict) else ""


def _prune(root: UPath, keep: int, claim: Claim, log: Log) -> None:
    """Remove the versions no reader is meant to read any more (the module's docstring)."""
    versions = root / VERSIONS
    now = current_version(root / CURRENT)
    current = now.name if now.parent.name == VERSIONS else ""
    names = sorted(os.listdir(local_path(versions)) if is_local(root) else map(entry_name, listing(versions)))
    older = []
    for name in reversed(names):
        match = _NAME.fullmatch(name.split(".tmp-")[0])
        if match is None or name == current or (match.group(2) != claim.id and claim.alive(match.group(2))):
            continue  # not a version, the current one, or what another live builder is writing
        if not name.startswith(".") and name < current and _complete(versions / name):
            older.append(name)
        else:
            _remove(versions / name)  # never published, and its builder is gone
    for name in older[keep - 1:]:
        _remove(versions / name)
        log.info(f"removed the training set version {versions / name} (storage.training_set_versions: {keep})")


def _complete(version: UPath) -> bool:
    return (version / MANIFEST_NAME).exists()


def _remove(version: UPath) -> None:
    """Its manifest first: a reader that still holds it finds no set rather than part of one."""
    if is_local(version):
        local_path(version / MANIFEST_NAME).unlink(missing_ok=True)
        shutil.rmtree(local_path(version), ignore_errors=True)
        return
    if _complete(version):
        version.fs.rm_file((version / MANIFEST_NAME).path)
    version.fs.rm(version.path, recursive=True)
