"""Which prompts each nightly expansion takes: the next quota that nothing has generated yet.

The completion store is the ledger: a prompt whose completion key is done is never taken again.
A night's choice is written once (``<nights>/<night>.parquet``, a local folder or an fsspec URL)
and reused when that night is re-run or resumed, so a re-run works on the same prompts and, with
the store, generates nothing twice.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import polars as pl
from upath import UPath

from expansion_dag.core import as_upath, write_atomically


def night_path(nights_dir: str | os.PathLike[str], night: str) -> UPath:
    if not night or "/" in night or night.startswith("."):
        raise ValueError(f"not a usable night name: {night!r}")
    return as_upath(nights_dir) / f"{night}.parquet"


def _prompt_ids(path: UPath) -> pl.Series:
    with path.open("rb") as fh:
        return pl.read_parquet(fh)["prompt_id"]


def take_night(
    prompts: pl.DataFrame,
    keys: pl.Series,
    done: Iterable[str],
    *,
    nights_dir: str | os.PathLike[str],
    night: str,
    quota: int,
) -> pl.DataFrame:
    """The night's prompts: the recorded choice when the night ran before, else the next quota.

    ``keys`` holds each prompt's completion key (same order as ``prompts``). Prompts are taken in
    prompt-id order, a content hash, so every night draws evenly from all sources.
    """
    if quota < 1:
        raise ValueError(f"a night's quota must be positive, got {quota}")
    path = night_path(nights_dir, night)
    if path.exists():
        return prompts.filter(pl.col("prompt_id").is_in(_prompt_ids(path).implode()))
    fresh = (
        prompts.with_columns(keys.alias("_key"))
        .filter(~pl.col("_key").is_in(pl.Series(list(set(done)), dtype=pl.String).implode()))
        .drop("_key")
        .sort("prompt_id")
        .head(quota)
    )
    with write_atomically(path) as staged:  # a crash never leaves a half-written choice
        fresh.select("prompt_id").write_parquet(staged)
    return fresh


def nights(nights_dir: str | os.PathLike[str]) -> dict[str, list[str]]:
    """Every recorded night and its prompt ids, oldest first."""
    folder = as_upath(nights_dir)
    if not folder.exists():
        return {}
    return {p.stem: _prompt_ids(p).to_list() for p in sorted(folder.glob("*.parquet"), key=lambda p: p.name)}
