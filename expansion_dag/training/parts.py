"""A training set built in parts, each part once: a rebuild tokenizes only what is new.

Rendering and tokenizing each record is the expensive step, and a night adds one night's records to
a store of many. So the set is made of parts, each from a fixed set of records (one segment of the
store, ``SegmentPart``), kept in ``parts_dir``: its Parquet rows, its trainers' JSONL lines and its
counts (``part.json``, written last). A build takes as they are the parts whose records (segment
name and size, the keys an earlier segment answered, its lines set aside) and build (configuration,
tokenizer, identities, this folder's code: ``fingerprint``) are unchanged, builds the others (in
``workers`` processes where asked), and assembles the set; the manifest's ``parts`` says which
happened. The store's failure records are one more part, last, built again when they change:
counts only, but for a stopped loop's text before it (``loop_prefix: keep``). The rows are those a
single pass over the same records gives (``build_training_set``), in the same order.

``build_parts`` builds some parts alone (one shard's, in a run or pod of its own) into the same
folder, for the assembling build to take. Builders never clash: a part is built in a staging folder
named by its builder's claim (``Owner``, ``expansion_dag.store.BuildClaim``) and renamed into place
whole; one another builder placed first is kept. The assembling build removes only what no build
needs (parts of another fingerprint, of a segment it holds under another name, staging folders of
gone builders), never a part of a segment it does not know nor what a live builder is writing.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import secrets
import shutil
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from expansion_dag.core import Identity, ModeIdentities
from expansion_dag.training.build import (
    _fsync,
    _fsync_folder,
    _identity,
    _publish,
    _ShardWriter,
    _Stats,
    _write_manifest,
    _write_rows,
    tokenizer_facts,
    writing,
)
from expansion_dag.training.config import FORMATS, BuildTrace, TrainingSetConfig
from expansion_dag.training.manifest import Manifest
from expansion_dag.training.samples import _Tally

PART_DONE = "part.json"
STATE_NAME = "build.json"  # in parts_dir: what the parts there were built with
#: The core's modules a row's ids and mask depend on, besides this folder's.
RENDERING_CORE = ("modes", "records", "sampling", "token_ids", "tokenizer")


class Part(Protocol):
    """A fixed set of records (``expansion_dag.store.completions.SegmentPart``)."""

    name: str
    size: int
    taken: frozenset[str]
    set_aside: tuple[int, ...]

    def records(self) -> Iterator[dict[str, Any]]: ...


class Owner(Protocol):
    """A builder, as the folders it writes name it (``expansion_dag.store.BuildClaim``)."""

    id: str

    def alive(self, owner: str) -> bool: ...


class Unshared:
    """A builder whose folder no other builder shares (a test's, a benchmark's): it never judges
    another builder gone, so it leaves every other builder's staging folder alone."""

    def __init__(self) -> None:
        self.id = secrets.token_hex(8)

    def alive(self, owner: str) -> bool:
        return True


def build_training_set_in_parts(
    parts: Sequence[Part],
    failures: Iterable[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    config: TrainingSetConfig,
    out_dir: str | os.PathLike[str],
    *,
    parts_dir: str | os.PathLike[str],
    identities: ModeIdentities,
    known: Mapping[str, Identity] | None = None,
    trace: BuildTrace | None = None,
    workers: int = 1,
    owner: Owner | None = None,
) -> Manifest:
    """``build_training_set`` of ``parts``' records then ``failures`` (the store's ``parts()``),
    building only the parts ``parts_dir`` does not hold yet, as ``owner``."""
    parts_dir = Path(parts_dir)
    owner = owner or Unshared()
    summary = build_parts(
        parts, tokenizer, config, parts_dir=parts_dir, identities=identities, known=known, workers=workers,
        owner=owner,
    )
    # The failure records are one more part, last, not counted in ``summary`` (a part per segment):
    # most give only counts, a stopped loop's text before it a row where ``loop_prefix: keep`` says so.
    parts = [*parts, _Failures(failures)]
    build_parts(parts[-1:], tokenizer, config, parts_dir=parts_dir, identities=identities, known=known, owner=owner)
    fingerprint = _build_state(tokenizer, config, identities, known or {})["fingerprint"]
    keys = [_part_key(part, fingerprint) for part in parts]
    tally = _Tally(identities, known or {}, trace)

    def write(directory: Path) -> Manifest:
        files, stats = _assemble(keys, parts_dir, directory, config, tally)
        return _write_manifest(directory, files, stats, tally, tokenizer, config, parts=summary)

    manifest = _publish(Path(out_dir), write)
    _prune(parts_dir, keys, {part.name for part in parts}, fingerprint, owner)
    return manifest


class _Failures:
    """The store's failure records as a part, named the same in every build (so that the last
    build's is pruned) and told apart by their digest (``taken``: a changed record, a new part)."""

    name = "failures"
    set_aside: tuple[int, ...] = ()

    def __init__(self, records: Iterable[Mapping[str, Any]]):
        self._records = list(records)
        digest, self.size = hashlib.sha256(), 0
        for record in self._records:  # one at a time: a store's stopped loops hold MBs of text
            line = json.dumps(record, sort_keys=True).encode()
            digest.update(line)
            self.size += len(line)
        self.taken = frozenset({digest.hexdigest()})

    def records(self) -> Iterator[dict[str, Any]]:
        return iter(self._records)


def part_names(
    parts: Sequence[Part], tokenizer: PreTrainedTokenizerBase, config: TrainingSetConfig, identities: ModeIdentities,
    known: Mapping[str, Identity] | None = None,
) -> list[str]:
    """The folder name of each part's build in ``parts_dir``: new records or a changed build, a new name."""
    fingerprint = _build_state(tokenizer, config, identities, known or {})["fingerprint"]
    return [_part_key(part, fingerprint) for part in parts]


def build_parts(
    parts: Sequence[Part],
    tokenizer: PreTrainedTokenizerBase,
    config: TrainingSetConfig,
    *,
    parts_dir: str | os.PathLike[str],
    identities: ModeIdentities,
    known: Mapping[str, Identity] | None = None,
    workers: int = 1,
    owner: Owner | None = None,
) -> dict[str, Any]:
    """Build into ``parts_dir`` each of ``parts`` it does not hold yet, as ``owner``, and say how many
    were built, how many taken as they were, and why all were built (a changed build) if they were."""
    parts_dir = Path(parts_dir)
    parts_dir.mkdir(parents=True, exist_ok=True)
    builder = (owner or Unshared()).id
    state = _build_state(tokenizer, config, identities, known or {})
    why_all = _why_all(parts_dir, state)
    keys = [_part_key(part, state["fingerprint"]) for part in parts]
    todo = [(part, key) for part, key in zip(parts, keys) if _done(parts_dir / key) is None]
    with writing(parts_dir, "a part of the training set", "the parts built are kept and only the others are built"):
        _build_parts(todo, tokenizer, config, identities, known or {}, parts_dir, workers, builder,
                     state["fingerprint"])
    # Other builders may write it at the same time, each the same state: replaced whole, never torn.
    staged = parts_dir / f".{STATE_NAME}.tmp-{builder}"
    staged.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    os.replace(staged, parts_dir / STATE_NAME)
    return {"parts": len(keys), "built": len(todo), "reused": len(keys) - len(todo), "rebuilt_all_because": why_all}


def _prune(parts_dir: Path, keys: Sequence[str], segments: set[str], fingerprint: str, owner: Owner) -> None:
    """Remove from ``parts_dir`` what no build needs (the module's docstring says what that is)."""
    for name in sorted(set(os.listdir(parts_dir)) - {*keys, STATE_NAME}):
        path = parts_dir / name
        if name.startswith(".") and ".tmp-" in name:
            if owner.alive(name.rsplit(".tmp-", 1)[1]):
                continue  # a part, or the build's state, a live builder is writing
        elif (done := _done(path)) is not None and done.get("fingerprint") == fingerprint:
            if done.get("name") not in segments:
                continue  # a segment this build did not see: another builder's, newer
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _done(part_dir: Path) -> dict[str, Any] | None:
    """A built part's record (``part.json``, written last), or None for a part never finished or
    damaged since (a torn download, a disk that filled, a crash that kept its record and lost its
    files' data): such a part is built again, never read. Its files' sizes are checked, not their
    digests: a reuse reads no file."""
    try:
        done = json.loads((part_dir / PART_DONE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(done, dict) or not isinstance(done.get("files"), list) or not isinstance(done.get("bytes"), dict):
        return None
    return done if all(_size(part_dir / name) == size for name, size in done["bytes"].items()) else None


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _build_state(
    tokenizer: PreTrainedTokenizerBase, config: TrainingSetConfig, identities: ModeIdentities,
    known: Mapping[str, Identity],
) -> dict[str, Any]:
    """What a part's rows depend on besides its records, and its digest (``fingerprint``)."""
    code = hashlib.sha256()
    # A changed rule rebuilds every part, never mixes: this folder's code and the core's it renders with.
    core = Path(__file__).parents[1] / "core"
    for path in [*sorted(Path(__file__).parent.glob("*.py")), *(core / f"{m}.py" for m in RENDERING_CORE)]:
        code.update(path.read_bytes())
    state = {
        "config": config.to_dict(),
        "tokenizer": tokenizer_facts(tokenizer),
        "identity": _identity(identities),
        "modes": [[mode["name"], mode["share"]] for mode in identities.mix.describe()],
        "known": sorted(identity.label for identity in known.values()),
        "code": code.hexdigest()[:16],
    }
    state["fingerprint"] = hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()[:16]
    return state


def _why_all(parts_dir: Path, state: Mapping[str, Any]) -> str | None:
    """Why every part is built again (None when the parts of the last build are taken as they are)."""
    try:
        last = json.loads((parts_dir / STATE_NAME).read_text())
    except (OSError, ValueError):
        return "no earlier build in parts"
    if last.get("fingerprint") == state["fingerprint"]:
        return None
    changed = sorted(name for name in state if name != "fingerprint" and last.get(name) != state[name])
    if changed == ["config"]:
        changed = [f"config.{name}" for name in state["config"] if last["config"].get(name) != state["config"][name]]
    return "changed since the last build: " + ", ".join(changed)


def _part_key(part: Part, fingerprint: str) -> str:
    described = json.dumps([fingerprint, part.name, part.size, sorted(part.taken), part.set_aside])
    return hashlib.sha256(described.encode()).hexdigest()[:24]


def _build_parts(
    todo: Sequence[tuple[Part, str]], tokenizer: PreTrainedTokenizerBase, config: TrainingSetConfig,
    identities: ModeIdentities, known: Mapping[str, Identity], parts_dir: Path, workers: int, builder: str,
    fingerprint: str,
) -> None:
    if workers <= 1 or len(todo) <= 1:
        for part, key in todo:
            _build_part(part, key, tokenizer, config, identities, known, parts_dir, builder, fingerprint)
        return
    # Spawned, not forked: a fork would copy the tokenizer's threads' locks mid-use.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=context) as pool:
        futures = [
            pool.submit(_build_part, part, key, tokenizer, config, identities, known, parts_dir, builder, fingerprint)
            for part, key in todo
        ]
        for future in futures:
            future.result()


def _build_part(
    part: Part, key: str, tokenizer: PreTrainedTokenizerBase, config: TrainingSetConfig,
    identities: ModeIdentities, known: Mapping[str, Identity], parts_dir: Path, builder: str,
    fingerprint: str,
) -> None:
    """One part's rows and counts into ``parts_dir/key``, built in a staging folder of ``builder``'s
    and renamed into place whole."""
    staging = parts_dir / f".{key}.tmp-{builder}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    tally = _Tally(identities, known, BuildTrace())
    files, stats = _write_rows(part.records(), tokenizer, config, staging, tally)
    done = {"name": part.name, "size": part.size, "files": files, "stats": stats.to_dict(), "tally": tally.to_dict(),
            "fingerprint": fingerprint, "bytes": {f["name"]: (staging / f["name"]).stat().st_size for f in files}}
    (staging / PART_DONE).write_text(json.dumps(done, sort_keys=True))
    # On disk before the rename: after a machine crash, a part in place has its files, not empty ones.
    _fsync_folder(staging)
    target = parts_dir / key
    if _done(target) is None:
        shutil.rmtree(target, ignore_errors=True)  # a part cut short by a crash
        try:
            os.rename(staging, target)
            _fsync(parts_dir)
            return
        except OSError:
            if _done(target) is None:
                raise
    shutil.rmtree(staging, ignore_errors=True)  # another builder placed the same part first


def _assemble(
    keys: Sequence[str], parts_dir: Path, directory: Path, config: TrainingSetConfig, tally: _Tally
) -> tuple[list[dict[str, Any]], _Stats]:
    """The parts' files as one set in ``directory``, and their counts added up into ``tally``."""
    stats = _Stats(config.max_length)
    shards: list[dict[str, Any]] = []
    trainer_names = sorted({FORMATS[f].file for f in config.formats if f != "parquet"})
    trainers = {name: (open(directory / name, "wb"), hashlib.sha256()) for name in trainer_names}
    try:
        for key in keys:
            done = _done(parts_dir / key)
            for file in done["files"]:
                source = parts_dir / key / file["name"]
                if file["name"] in trainers:
                    fh, digest = trainers[file["name"]]
                    with open(source, "rb") as part_file:
                        for block in iter(lambda: part_file.read(1 << 20), b""):
                            fh.write(block)
                            digest.update(block)
                elif file.get("rows"):  # a part without rows has an empty shard: not carried
                    name = f"part-{len(shards):05d}.parquet"
                    _link(source, directory / name)
                    shards.append({**file, "name": name})
            stats.add_part(done["stats"])
            tally.add_part(done["tally"])
    finally:
        for fh, _ in trainers.values():
            fh.close()
    if not shards:
        shards = _ShardWriter(directory, config.rows_per_file).close()  # an empty set still has one shard
    return shards + [{"name": name, "sha256": digest.hexdigest()} for name, (_, digest) in trainers.items()], stats


def _link(source: Path, target: Path) -> None:
    """The part's file in the set without copying it where the filesystem allows."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
