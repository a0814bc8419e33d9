"""Parts kept across runs and machines under the storage root: the training set's parts, built once
and reused, whether the root is a local folder or an object store."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

from upath import UPath

from expansion_dag.core import entry_name, is_local, listing, local_path, upload
from expansion_dag.store.lease import BuildClaim


@contextmanager
def kept_parts(
    root: UPath, name: str, *, last: str, claim: BuildClaim, local_dir: str, only: Collection[str] | None = None
) -> Iterator[Path]:
    """A local folder of parts (a subfolder each, complete once it holds ``last``) that outlives
    runs and machines: under a local root, the folder itself; for a remote one, a copy under
    ``local_dir`` (this machine's folder) brought up to date from ``<root>/<name>`` first (a run pod
    starts with an empty disk), and the object store made to hold what the block left in it afterwards.

    ``only``: the subfolders the block needs (one shard's parts); the others are neither
    downloaded nor removed from the object store, whatever other runs do with them meanwhile."""
    if is_local(root):
        yield local_path(root / name)
        return
    remote = root / name
    local = Path(local_dir, "cache", hashlib.sha256(str(root).encode()).hexdigest()[:16], name)
    local.mkdir(parents=True, exist_ok=True)
    there = {
        entry_name(e): e["type"] for e in listing(remote)
        if only is None or e["type"] == "file" or entry_name(e) in only
    }
    # The parts the object store holds whole; the others may be another builder's uploads under way.
    whole = {path.rsplit("/", 2)[-2] for path in remote.fs.find(remote.path) if path.endswith(f"/{last}")}
    for entry, kind in there.items():
        if kind == "directory" and not (local / entry / last).exists():
            staged = local / f".{entry}.tmp-{claim.id}"  # never a half copy under its name
            shutil.rmtree(staged, ignore_errors=True)
            staged.mkdir()
            for file in listing(remote / entry):
                remote.fs.get_file(file["name"], str(staged / entry_name(file)))
            shutil.rmtree(local / entry, ignore_errors=True)
            os.rename(staged, local / entry)
        elif kind == "file":
            remote.fs.get_file((remote / entry).path, str(local / entry))
    yield local
    here = set(os.listdir(local))
    for entry in sorted(here):
        if entry.startswith("."):
            continue  # a builder's staging, never finished
        if (local / entry).is_file():
            upload(local / entry, remote / entry)
        elif entry not in whole and (only is None or entry in only) and (local / entry / last).exists():
            upload(local / entry, remote / entry, last=last)
    # Only what the build removed as no build's (training.parts): never a part being uploaded.
    for entry in sorted((whole & set(there)) - here):
        remote.fs.rm((remote / entry).path, recursive=True)
