"""The Parquet training set's files: its schema, a chunk's rows as a table, and the shards written."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from expansion_dag.training.config import TrainingSetConfig
from expansion_dag.training.rows import FROM_SERVER, RETOKENIZED, _Chunk, ids_digest

SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("length", pa.int32()),
        ("ids_from", pa.string()),  # FROM_SERVER or RETOKENIZED
        # A row from ids: whether they decode to the text the server returned (the ids win either way).
        ("ids_match_text", pa.bool_()),
        # A row cut before a stopped loop: "loop" and the rule that stopped it; null for a whole answer.
        ("truncated", pa.string()),
        ("loop_rule", pa.string()),
    ]
)
# Spelled out so that a pyarrow upgrade changing its defaults cannot silently change the bytes.
_PARQUET_OPTIONS: dict[str, Any] = {
    "version": "2.6",
    "compression": "zstd",
    "compression_level": 3,
    "use_dictionary": ["source", "ids_from"],
    "write_statistics": False,
    "data_page_size": 1 << 20,
}


def _table(chunk: _Chunk, config: TrainingSetConfig) -> pa.Table:
    ids = chunk.ids
    segment_lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    values = np.concatenate([np.asarray(s, dtype=np.int32) for s in ids]) if ids else np.empty(0, np.int32)
    # Segments alternate before the turn, the turn, its trailer: the mask is 0, 1 and the
    # convention's over their lengths; a sample is its turns' segments.
    trailer = int(config.train_newline_after_end_of_turn)
    pattern = np.tile(np.array([0, 1, trailer], dtype=np.uint8), len(ids) // 3)
    mask = np.repeat(pattern, segment_lengths)
    turn_lengths = segment_lengths.reshape(-1, 3).sum(axis=1)
    first_turns = np.concatenate([[0], np.cumsum(chunk.turns)[:-1]])
    lengths = np.add.reduceat(turn_lengths, first_turns)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    return pa.Table.from_arrays(
        [
            pa.array([s.id for s in chunk.samples], pa.string()),
            pa.array([s.source for s in chunk.samples], pa.string()),
            pa.ListArray.from_arrays(offsets, pa.array(values)),
            pa.ListArray.from_arrays(offsets, pa.array(mask)),
            pa.array(lengths.astype(np.int32)),
            pa.array([RETOKENIZED if m is None else FROM_SERVER for m in chunk.match_text], pa.string()),
            pa.array(chunk.match_text, pa.bool_()),
            pa.array([s.truncated or None for s in chunk.samples], pa.string()),
            pa.array([s.loop_rule or None for s in chunk.samples], pa.string()),
        ],
        schema=SCHEMA,
    )


def _digests(chunk: _Chunk, table: pa.Table) -> list[bytes]:
    """Each row's digest (``BuildTrace.renders``): its render's, or for a row from ids, taken from the
    table only when asked for (a build without a trace hashes nothing), its ids' and mask's."""
    ids, masks = table.column("input_ids"), table.column("loss_mask")
    return [
        ids_digest(ids[i].values.to_numpy(), masks[i].values.to_numpy()) if digest is None else digest
        for i, digest in enumerate(chunk.digests)
    ]


class _ShardWriter:
    """Parquet shards ``part-00000.parquet``... of at most ``rows_per_file`` rows each."""

    def __init__(self, directory: Path, rows_per_file: int):
        self._directory = directory
        self._rows_per_file = rows_per_file
        self._writer: pq.ParquetWriter | None = None
        self._files: list[dict[str, Any]] = []

    def write(self, table: pa.Table) -> None:
        while table.num_rows:
            if self._writer is None or self._files[-1]["rows"] == self._rows_per_file:
                self._open()
            part = table.slice(0, self._rows_per_file - self._files[-1]["rows"])
            table = table.slice(part.num_rows)
            self._writer.write_table(part, row_group_size=part.num_rows)
            self._files[-1]["rows"] += part.num_rows

    def _open(self) -> None:
        if self._writer is not None:
            self._writer.close()
        name = f"part-{len(self._files):05d}.parquet"
        self._writer = pq.ParquetWriter(self._directory / name, SCHEMA, **_PARQUET_OPTIONS)
        self._files.append({"name": name, "rows": 0})

    def close(self) -> list[dict[str, Any]]:
        if self._writer is None:
            self._open()  # an empty set still gets one (empty) shard, so that it loads
        self._writer.close()
        return [{**f, "sha256": _sha256(self._directory / f["name"])} for f in self._files]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
