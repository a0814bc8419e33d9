"""Which prompts each nightly expansion takes: the next quota that nothing has generated yet.

The completion store is the ledger: a prompt whose completion key is done is never taken again.
A night's choice is written once (``<nights>/<night>.parquet``) and reused when that night is
re-run or resumed, so a re-run works on the same prompts and, with the store, generates nothing
twice.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import polars as pl


def night_path(nights_dir: str | os.PathLike[str], night: str) -> Path:
    if not night or "/" in night or night.startswith("."):
        raise ValueError(f"not a usable night name: {night!r}")
    return Path(nights_dir) / f"{night}.parquet"


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
        chosen = pl.read_parquet(path)["prompt_id"]
        return prompts.filter(pl.col("prompt_id").is_in(chosen.implode()))
    fresh = (
        prompts.with_columns(keys.alias("_key"))
        .filter(~pl.col("_key").is_in(pl.Series(list(set(done)), dtype=pl.String).implode()))
        .drop("_key")
        .sort("prompt_id")
        .head(quota)
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fresh.select("prompt_id").write_parquet(tmp)
    os.replace(tmp, path)  # a crash never leaves a half-written choice
    return fresh


def nights(nights_dir: str | os.PathLike[str]) -> dict[str, list[str]]:
    """Every recorded night and its prompt ids, oldest first."""
    folder = Path(nights_dir)
    if not folder.exists():
        return {}
    return {p.stem: pl.read_parquet(p)["prompt_id"].to_list() for p in sorted(folder.glob("*.parquet"))}
