"""The tokenized drafter training set, built from completion records.

Each kept completion becomes one sample: the prompt and the target model's answer rendered with
the chat template, as token ids plus a loss mask that is 1 on exactly the tokens the assistant
wrote. A regenerated conversation becomes one sample too, from the record of its last turn (whose
messages hold the earlier regenerated turns), with every assistant turn masked 1.

One pass: ``build_training_set`` reads the records once, in the order given (the store's file
order), tokenizes each kept sample once, and writes from that pass every output the config's
``formats`` name (the Parquet set always; the trainers' JSONL files beside it, ``FORMATS``), the
manifest naming them, the dataset card (``README.md``, ``dataset_card``) and, in a
``BuildTrace``, what the checks and the nightly table need: a digest of each row's expected
render (the round trip decodes sampled rows against it) and each prompt's outcome.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from transformers import PreTrainedTokenizerBase

from expansion_dag.core import UNWRITABLE, Identity, ModeIdentities, unwritable
from expansion_dag.training.config import FORMATS, BuildTrace, TrainingSetConfig, mask_convention
from expansion_dag.training.dataset_card import dataset_card
from expansion_dag.training.exports import _JsonlOutputs
from expansion_dag.training.manifest import MANIFEST_NAME, Manifest, current_version
from expansion_dag.training.parquet import _digests, _ShardWriter, _table
from expansion_dag.training.rows import FROM_SERVER, MEASURED_PER_CHUNK, RETOKENIZED, _Chunk, _encoded_chunks
from expansion_dag.training.samples import _Tally

CARD_NAME = "README.md"
HISTOGRAM_BINS = 40


class _Stats:
    """Counts that stay bounded: lengths are binned exactly, one counter per possible length."""

    def __init__(self, max_length: int):
        self.length_counts = np.zeros(max_length + 1, dtype=np.int64)
        self.assistant_tokens = 0
        self.by_source: dict[str, dict[str, int]] = {}
        self.by_mode: Counter[tuple[str, str]] = Counter()  # (mode, "samples" | "assistant_tokens")
        self.conversations: set[str] = set()  # ids of the rows that are whole conversations
        self.loop_rows: Counter[str] = Counter()  # rows cut before a stopped loop, by the rule that stopped it
        self.output_tokens = 0  # the server's count for the answers that became rows
        self.from_server = 0  # rows from the server's ids
        self.text_differs = 0  # of those, rows whose sampled ids decode to other text than the server's
        self.retokenized: Counter[str] = Counter()  # why each re-tokenized row is
        self.measured: Counter[str] = Counter()  # rows from ids re-tokenized too: the sums
        self.most: Counter[str] = Counter()  # and the largest differences

    def add(self, table: pa.Table, chunk: _Chunk) -> None:
        lengths = table.column("length").to_numpy()
        self.length_counts += np.bincount(lengths, minlength=self.length_counts.size)
        self.assistant_tokens += sum(chunk.trained)
        for source, length in zip(table.column("source").to_pylist(), lengths.tolist()):
            entry = self.by_source.setdefault(source, {"samples": 0, "tokens": 0})
            entry["samples"] += 1
            entry["tokens"] += length
        for sample, trained in zip(chunk.samples, chunk.trained):
            self.by_mode[sample.mode, "samples"] += 1
            self.by_mode[sample.mode, "assistant_tokens"] += trained
            self.output_tokens += sample.output_tokens
            if sample.conversation:
                self.conversations.add(sample.id)
            if sample.truncated:
                self.loop_rows[sample.loop_rule] += 1
        for sample, match, difference in zip(chunk.samples, chunk.match_text, chunk.differences):
            if match is None:
                self.retokenized[sample.retokenized] += 1
                continue
            self.from_server += 1
            self.text_differs += not match
            if difference is not None:
                for name, tokens in (("", difference.row), ("prompt_", difference.prompt)):
                    self.measured[f"{name}rows_differing"] += tokens > 0
                    self.measured[f"{name}tokens_differing_sum"] += tokens
                    self.most[f"{name}tokens_differing_max"] = max(self.most[f"{name}tokens_differing_max"], tokens)
                self.measured["rows_measured"] += 1

    def to_dict(self) -> dict[str, Any]:
        """As JSON keeps it with a part (``training.parts``): lengths as {length: rows}."""
        return {
            "length_counts": {str(n): int(c) for n, c in enumerate(self.length_counts) if c},
            "assistant_tokens": self.assistant_tokens,
            "by_source": self.by_source,
            "by_mode": [[mode, kind, n] for (mode, kind), n in self.by_mode.items()],
            "conversations": sorted(self.conversations),
            "loop_rows": dict(self.loop_rows),
            "output_tokens": self.output_tokens,
            "from_server": self.from_server,
            "text_differs": self.text_differs,
            "retokenized": dict(self.retokenized),
            "measured": dict(self.measured),
            "most": dict(self.most),
        }

    def add_part(self, part: Mapping[str, Any]) -> None:
        """Another part's counts (``to_dict``) added to these, as one pass over both would count."""
        for length, count in part["length_counts"].items():
            self.length_counts[int(length)] += count
        self.assistant_tokens += part["assistant_tokens"]
        for source, figures in part["by_source"].items():
            entry = self.by_source.setdefault(source, {"samples": 0, "tokens": 0})
            entry["samples"] += figures["samples"]
            entry["tokens"] += figures["tokens"]
        for mode, kind, n in part["by_mode"]:
            self.by_mode[mode, kind] += n
        self.conversations.update(part["conversations"])
        self.loop_rows.update(part.get("loop_rows", {}))
        self.output_tokens += part["output_tokens"]
        self.from_server += part["from_server"]
        self.text_differs += part["text_differs"]
        self.retokenized.update(part["retokenized"])
        self.measured.update(part["measured"])
        for name, most in part["most"].items():
            self.most[name] = max(self.most[name], most)

    def retokenization(self, chunk_rows: int) -> dict[str, Any]:
        """The measured difference between rows from ids and their re-tokenization (``Manifest.retokenization``)."""
        names = ("rows_measured", "rows_differing", "tokens_differing_sum", "tokens_differing_max",
                 "prompt_rows_differing", "prompt_tokens_differing_sum", "prompt_tokens_differing_max")
        return {
            "sample": f"the first {MEASURED_PER_CHUNK} rows from ids of each chunk of {chunk_rows} records",
            **{name: self.measured[name] + self.most[name] for name in names},
        }

    def modes(self, identities: ModeIdentities) -> dict[str, dict[str, Any]]:
        """Each mode: its configured share and settings, and the rows and trained tokens it got."""
        samples = int(self.length_counts.sum())
        section = {}
        for mode in identities.mix.describe():
            rows = self.by_mode[mode["name"], "samples"]
            section[mode["name"]] = {
                "share": mode["share"],
                "fingerprint": identities.by_mode[mode["name"]].fingerprint,
                "settings": json.loads(json.dumps(mode["settings"])),  # as the manifest reads back
                "samples": rows,
                "sample_share": round(rows / samples, 4) if samples else 0.0,
                "assistant_tokens": self.by_mode[mode["name"], "assistant_tokens"],
            }
        return section

    def summary(self) -> tuple[int, int, dict[str, float], dict[str, Any]]:
        """samples, tokens, tokens per sample, histogram."""
        counts = self.length_counts
        samples = int(counts.sum())
        tokens = int((counts * np.arange(counts.size)).sum())
        if samples == 0:
            zero = {k: 0 for k in ("mean", "p50", "p90", "p99", "max")}
            return 0, 0, zero, {"start": 0, "bin_width": 1, "counts": []}
        cumulative = np.cumsum(counts)
        nonzero = np.flatnonzero(counts)
        low, high = int(nonzero[0]), int(nonzero[-1])

        def rank(q: float) -> int:  # nearest-rank percentile: exact, no interpolation
            return int(np.searchsorted(cumulative, math.ceil(q * samples)))

        per_sample = {
            "mean": round(tokens / samples, 2),
            "p50": rank(0.50),
            "p90": rank(0.90),
            "p99": rank(0.99),
            "max": high,
        }
        width = max(1, math.ceil((high - low + 1) / HISTOGRAM_BINS))
        bins = math.ceil((high - low + 1) / width)
        padded = np.zeros(bins * width, dtype=np.int64)
        padded[: high - low + 1] = counts[low : high + 1]
        histogram = {
            "start": low,
            "bin_width": width,
            "counts": padded.reshape(bins, width).sum(axis=1).tolist(),
        }
        return samples, tokens, per_sample, histogram


def build_training_set(
    records: Iterable[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    config: TrainingSetConfig,
    out_dir: str | os.PathLike[str],
    *,
    identities: ModeIdentities,
    known: Mapping[str, Identity] | None = None,
    trace: BuildTrace | None = None,
) -> Manifest:
    """Write the outputs ``config.formats`` names, ``manifest.json`` and the card under ``out_dir``, replacing what was there.

    Only records of ``identities`` are taken, each prompt's under the mode the mix draws it into,
    rendered with that mode's chat_template_kwargs; ``known`` (the store's registry, by
    fingerprint) names the other identities in the manifest. ``trace``, if given, is filled with
    what the pass saw.

    Everything is written into a sibling temporary folder that is renamed into place at the end,
    so ``out_dir`` only ever holds a complete set (between the two renames that replace an old set
    it is briefly absent). The same records in the same order give byte-identical files.
    """
    tally = _Tally(identities, known or {}, trace)

    def write(directory: Path) -> Manifest:
        files, stats = _write_rows(records, tokenizer, config, directory, tally)
        return _write_manifest(directory, files, stats, tally, tokenizer, config)

    return _publish(Path(out_dir), write)


def _publish(out_dir: Path, write: Callable[[Path], Manifest]) -> Manifest:
    """``write`` a whole set into a sibling temporary folder, then rename it into place as ``out_dir``."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)  # left by a crashed run of a recycled pid
    staging.mkdir()
    try:
        with writing(out_dir.parent, "the training set", "the set published before stays the current one"):
            manifest = write(staging)
            # On disk before the rename, so that a machine crash cannot leave a renamed set whose
            # files were still in the page cache.
            _fsync_folder(staging)
            _replace_dir(staging, out_dir)
            _fsync(out_dir.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def _write_rows(
    records: Iterable[Mapping[str, Any]], tokenizer: PreTrainedTokenizerBase, config: TrainingSetConfig,
    directory: Path, tally: _Tally,
) -> tuple[list[dict[str, Any]], _Stats]:
    """The rows of ``records`` into ``directory``'s Parquet shards and trainers' files: those files
    ({name, sha256}, and rows for a shard) and what was counted."""
    stats = _Stats(config.max_length)
    writer = _ShardWriter(directory, config.rows_per_file)
    jsonl = _JsonlOutputs(directory, config.formats)
    try:
        for chunk in _encoded_chunks(records, tokenizer, config, tally):
            if not chunk.samples:
                continue
            table = _table(chunk, config)
            writer.write(table)
            jsonl.write(chunk.samples, table)
            stats.add(table, chunk)
            if tally.trace is not None:
                for sample, digest in zip(chunk.samples, _digests(chunk, table)):
                    tally.trace.renders.setdefault(sample.id, []).append(digest)
    finally:
        files = writer.close() + jsonl.close()
    return files, stats


def _write_manifest(
    directory: Path,
    files: list[dict[str, Any]],
    stats: _Stats,
    tally: _Tally,
    tokenizer: PreTrainedTokenizerBase,
    config: TrainingSetConfig,
    parts: dict[str, Any] | None = None,
) -> Manifest:
    """The manifest and the card of a set whose files and counts are these, written last."""
    shards = [f["name"] for f in files if f["name"].endswith(".parquet")]
    samples, tokens, per_sample, histogram = stats.summary()
    # A conversation's row holds its earlier turns' answers too.
    in_set = stats.output_tokens + sum(tally.folded_tokens[c] for c in stats.conversations)
    identity = _identity(tally.identities)
    manifest = Manifest(
        samples=samples,
        tokens=tokens,
        assistant_tokens=stats.assistant_tokens,
        tokens_per_sample=per_sample,
        by_source=dict(sorted(stats.by_source.items())),
        left_out=tally.left_out(),
        other_identities=dict(sorted(tally.others.items())),
        identity=identity,
        simulated=identity["simulated"],
        histogram=histogram,
        config=config.to_dict(),
        tokenizer=tokenizer_facts(tokenizer),
        files=[f for f in files if f["name"] in shards],
        output_tokens=tally.output_tokens,
        output_tokens_in_set=in_set,
        useful_token_share=round(in_set / tally.output_tokens, 4) if tally.output_tokens else 0.0,
        outputs={f: shards if f == "parquet" else [FORMATS[f].file] for f in config.formats},
        trainer_files=[f for f in files if f["name"] not in shards],
        mask_convention=mask_convention(config),
        modes=stats.modes(tally.identities),
        conversations=len(stats.conversations),
        loop_rows=dict(sorted(stats.loop_rows.items())),
        conversation_turns_folded=tally.folded,
        ids_from={FROM_SERVER: stats.from_server, RETOKENIZED: sum(stats.retokenized.values())},
        retokenized_because=dict(sorted(stats.retokenized.items())),
        ids_text_differs=stats.text_differs,
        retokenization=stats.retokenization(config.chunk_rows),
        parts=parts or {},
    )
    (directory / CARD_NAME).write_text(dataset_card(manifest))
    (directory / MANIFEST_NAME).write_text(manifest.to_json())
    return manifest


def tokenizer_facts(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """What the manifest says of the tokenizer: its size and its chat template's digest."""
    template = json.dumps(tokenizer.chat_template, sort_keys=True).encode()
    return {"vocab_size": len(tokenizer), "chat_template_sha256": hashlib.sha256(template).hexdigest()}


def _identity(identities: ModeIdentities) -> dict[str, Any]:
    """What the set was taken from: a run without modes, its identity; a mix, the model and one
    fingerprint of every mode's settings, share and the draw's seed (each mode: ``Manifest.modes``)."""
    if len(identities.by_mode) == 1:
        return next(iter(identities.by_mode.values())).to_dict()
    first = identities.identities[0]
    mix = [[m["name"], m["share"], identities.by_mode[m["name"]].fingerprint] for m in identities.mix.describe()]
    canonical = json.dumps({"modes": mix, "seed": identities.mix.seed}, sort_keys=True).encode()
    return {"model": first.model, "simulated": first.simulated,
            "fingerprint": hashlib.sha256(canonical).hexdigest()[:16], "settings": {}}


def _replace_dir(new: Path, target: Path) -> None:
    if target.exists():
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
        os.rename(new, target)
        shutil.rmtree(old)
    else:
        os.rename(new, target)


@contextlib.contextmanager
def writing(folder: Path, what: str, after: str) -> Iterator[None]:
    """A disk that is full or read-only under ``folder`` said as the store's writer says it: the
    folder, why, and the fix (``core.unwritable``), never the OS's bare error."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in UNWRITABLE:
            raise
        raise unwritable(exc, folder, what, after) from exc


def _fsync_folder(folder: Path) -> None:
    """A flat folder's files, then the folder itself, on disk."""
    for path in [*folder.iterdir(), folder]:
        _fsync(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # directories too, on Linux
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def data_files(out_dir: str | os.PathLike[str]) -> list[str]:
    """The shard paths (URLs) of a built set, for ``datasets.load_dataset("parquet", data_files=...)``:
    of the one version ``out_dir`` names, however many are published meanwhile."""
    version = current_version(out_dir)
    return [str(version / f["name"]) for f in Manifest.read(version).files]
