"""Checking a built set against its records: rows sampled from its shards, decoded and compared
with the renders their records give.

``check_round_trip`` assumes a lossless (byte-level) tokenizer, as Qwen's, Llama 3's and GPT's
are: decoding the ids must give back the render character for character.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from transformers import PreTrainedTokenizerBase

from expansion_dag.core import ModeIdentities, as_upath
from expansion_dag.training.config import TrainingSetConfig
from expansion_dag.training.manifest import Manifest
from expansion_dag.training.mode_rules import _mode_rules
from expansion_dag.training.parquet import _digests, _table
from expansion_dag.training.rows import _prepared, _tokenize, ids_digest, render_digest
from expansion_dag.training.samples import _Sample, _screen

MAX_FAILING_IDS = 10


@dataclass(frozen=True)
class RoundTripResult:
    checked: int
    passed: int
    failed: int  # rows that decode differently from their record's render
    missing: int  # rows whose record was not among the records given
    failing_ids: list[str]  # the first MAX_FAILING_IDS failed or missing rows

    @property
    def ok(self) -> bool:
        return self.checked > 0 and self.passed == self.checked


def sample_rows(out_dir: str | os.PathLike[str], n: int) -> list[dict[str, Any]]:
    """``n`` rows spread evenly over the set, reading only the row groups that hold them."""
    manifest = Manifest.read(out_dir)
    if manifest.samples == 0 or n <= 0:
        return []
    wanted = sorted({i * manifest.samples // n for i in range(min(n, manifest.samples))})
    rows: list[dict[str, Any]] = []
    first = 0  # global index of the current row group's first row
    for entry in manifest.files:
        with (as_upath(out_dir) / entry["name"]).open("rb") as fh:
            parquet = pq.ParquetFile(fh)
            for group in range(parquet.num_row_groups):
                size = parquet.metadata.row_group(group).num_rows
                local = [i - first for i in wanted if first <= i < first + size]
                if local:
                    rows.extend(parquet.read_row_group(group).take(local).to_pylist())
                first += size
    return rows


def expected_renders(
    records: Iterable[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    config: TrainingSetConfig,
    *,
    identities: ModeIdentities,
    ids: Collection[str] | None = None,
) -> dict[str, list[bytes]]:
    """Render digests of the rows the records of ``identities`` give (those whose row id is in
    ``ids``: the prompt's, or the conversation's), rendered afresh.

    What ``BuildTrace.renders`` holds, computed from records instead of by a build: a row from a
    server's ids has the digest of those ids and their mask (``ids_digest``).
    """
    candidates: list[_Sample] = []
    rules = _mode_rules(tokenizer, identities)
    for record in records:
        if ids is None or (record.get("conversation_id") or record.get("prompt_id")) in ids:
            screened = _screen(record, config, identities, rules)
            if not isinstance(screened, str):
                candidates.append(screened)
    expected: dict[str, list[bytes]] = {}
    rows, _ = _prepared(candidates, tokenizer, rules, measure=0)
    chunk = _tokenize(rows, tokenizer, config)
    for sample, digest in zip(chunk.samples, _digests(chunk, _table(chunk, config)) if chunk.samples else ()):
        expected.setdefault(sample.id, []).append(digest)
    return expected


def check_round_trip(
    rows: Iterable[Mapping[str, Any]],
    expected: Mapping[str, Collection[bytes]],
    tokenizer: PreTrainedTokenizerBase,
) -> RoundTripResult:
    """Check rows against the renders their records give (``expected``: a build's trace, or ``expected_renders``).

    A row passes when its ids decode to the conversation's render and its masked ids decode to
    exactly the assistant's part (answer, kept reasoning and end-of-turn token), or, for a row from
    a server's ids, when its ids and mask are those the record's ids give. A row whose id has
    no expected render (e.g. made from another identity's answer) is missing. A prompt answered
    more than once passes if any of its renders matches.
    """
    rows = list(rows)
    decode = tokenizer.backend_tokenizer.decode
    passed = failed = missing = 0
    failing: list[str] = []
    for row in rows:
        ids = [int(i) for i in row["input_ids"]]
        mask = [int(m) for m in row["loss_mask"]]
        if row["id"] not in expected:
            missing += 1
            ok = False
        else:
            full = decode(ids, skip_special_tokens=False)
            written = decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
            digests = (render_digest(full, written), ids_digest(np.asarray(ids), np.asarray(mask)))
            ok = len(ids) == len(mask) == row["length"] and any(d in expected[row["id"]] for d in digests)
            passed += ok
            failed += not ok
        if not ok and len(failing) < MAX_FAILING_IDS:
            failing.append(row["id"])
    return RoundTripResult(
        checked=len(rows), passed=passed, failed=failed, missing=missing, failing_ids=failing
    )
