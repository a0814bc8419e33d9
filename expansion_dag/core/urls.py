"""Storage locations as URLs: a local folder, or any fsspec URL (``s3://bucket/prefix``, ``gs://``...).

Remote credentials and endpoints come from the filesystem's usual environment: for S3,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION`` and, for an S3-compatible
server, ``AWS_ENDPOINT_URL`` (read by botocore, so by s3fs).

A URL that carries credentials (``http://user:password@host``) is named without them wherever it
is kept or shown (``without_credentials``): records, logs, metadata. A server's are kept apart when
it is first named (``server_url``) and sent with every request to it (``auth_headers``).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import re
import secrets
import shutil
import socket
import tempfile
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from upath import UPath

LOCAL_PROTOCOLS = ("", "file", "local")


def as_upath(location: str | os.PathLike[str]) -> UPath:
    """A location as a UPath; a UPath given is kept with its storage options."""
    if isinstance(location, UPath):
        return location
    path = UPath(location)
    if is_local(path):
        return path
    # Other processes (one per shard) write under the same root: a cached listing would hide them.
    return UPath(location, use_listings_cache=False)


@functools.lru_cache(maxsize=256)
def without_credentials(url: str) -> str:
    """``url`` without its user and password, if it has any (cached: every record names its server)."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def url_credentials(url: str) -> tuple[str, str] | None:
    """The user and password a URL carries (decoded), or None."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return None
    return urllib.parse.unquote(parts.username or ""), urllib.parse.unquote(parts.password or "")


#: The credentials of the servers configured as ``user:password@host``, by the URL without them
#: that names each everywhere: kept in this process alone, never written down.
_SERVER_CREDENTIALS: dict[str, tuple[str, str]] = {}


def server_url(configured: str) -> str:
    """A configured server URL as the project names it: without its credentials, which every
    request to it sends from now on (``auth_headers``)."""
    url = configured.rstrip("/")
    named = without_credentials(url)
    credentials = url_credentials(url)
    if credentials is not None:
        _SERVER_CREDENTIALS[named] = credentials
    return named


def auth_headers(url: str, api_key: str | None = None) -> dict[str, str]:
    """The ``Authorization`` of a request to ``url`` (a server's URL, named without credentials,
    or one under it): HTTP basic with the credentials its configured URL carried, else the API key
    as a bearer token. One header holds one of them: a URL's credentials win (they are its proxy's)."""
    for server, (user, password) in _SERVER_CREDENTIALS.items():
        if url == server or url.startswith(server + "/"):
            return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def is_local(path: UPath) -> bool:
    return path.protocol in LOCAL_PROTOCOLS


def local_path(path: UPath) -> Path:
    return Path(path.path)


def default_local_dir() -> str:
    """This machine's folder for a remote root's spool, caches and staging.

    ``$EXPANSION_LOCAL_DIR``, else ``~/.cache/expansion_dag``. It must outlive a run: a killed
    run's spooled completions wait there for the next run on this machine to upload them.
    """
    return os.environ.get("EXPANSION_LOCAL_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "expansion_dag")


def fleet_state_dir(root: str, local_dir: str | None = None) -> str:
    """Where the servers launched for storage root ``root`` keep their records, locks and logs:
    under this machine's folder (``local_dir``, else :func:`default_local_dir`), never in the root,
    whose deletion must not orphan them; one folder per host (a home directory may be shared by
    several), and one per root, named by its last part and a hash of all of it."""
    name = re.sub(r"[^\w.-]", "_", root.rstrip("/").rsplit("/", 1)[-1])[:40] or "root"
    key = hashlib.sha256(root.encode()).hexdigest()[:12]
    return os.path.join(local_dir or default_local_dir(), "fleet", socket.gethostname(), f"{name}-{key}")


def listing(path: UPath) -> list[dict[str, Any]]:
    """The entries (fsspec ``ls`` details) directly under a remote folder; none when it is absent."""
    try:
        return path.fs.ls(path.path, detail=True)
    except FileNotFoundError:
        return []


def entry_name(entry: dict[str, Any]) -> str:
    """The last part of a ``listing`` entry's name."""
    return entry["name"].rstrip("/").rsplit("/", 1)[-1]


def upload(local: Path, target: UPath, *, last: str | None = None) -> None:
    """Copy a local file, or the files of a flat local folder, to ``target``.

    A folder replaces what ``target`` held: its file named ``last`` is removed first and uploaded
    after every other file, so that its presence marks a complete copy; files of an older copy that
    the new one lacks are removed at the end.
    """
    fs = target.fs
    if local.is_file():
        # One PUT: an object store shows the whole object or nothing.
        fs.put_file(str(local), target.path)
        return
    names = sorted(p.name for p in local.iterdir())
    old = {entry_name(entry) for entry in listing(target)}
    if last in old:
        fs.rm_file((target / last).path)
    for name in sorted(names, key=lambda n: n == last):
        fs.put_file(str(local / name), (target / name).path)
    for name in sorted(old - set(names)):
        fs.rm_file((target / name).path)


@contextmanager
def write_atomically(target: UPath) -> Iterator[Path]:
    """A local file to write; on success it replaces ``target`` whole (never a half file)."""
    if not is_local(target):
        with upload_after(target) as staged:
            yield staged
        return
    final = local_path(target)
    final.parent.mkdir(parents=True, exist_ok=True)
    staged = final.with_name(f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(3)}")
    try:
        yield staged
        os.replace(staged, final)
    finally:
        staged.unlink(missing_ok=True)


@contextmanager
def upload_after(
    target: UPath, *, scratch: str | os.PathLike[str] | None = None, last: str | None = None
) -> Iterator[Path]:
    """A local path (in ``scratch``, else the system's temp folder) to build ``target`` in: a
    file or a flat folder, uploaded (see ``upload``) when the block succeeds, then removed."""
    if scratch is not None:
        Path(scratch).mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="expansion-", dir=scratch))
    try:
        yield folder / target.name
        upload(folder / target.name, target, last=last)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
