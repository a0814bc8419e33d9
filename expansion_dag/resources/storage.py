"""Where every asset keeps its files: one storage root, and an IO manager for polars frames."""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg
import polars as pl
import pyarrow.parquet as pq
from pydantic import Field

from expansion_dag.store import CompletionStore


def default_storage_root() -> str:
    """``$EXPANSION_STORAGE``, else ``$DAGSTER_HOME/storage``, else ``./storage``."""
    if os.environ.get("EXPANSION_STORAGE"):
        return os.environ["EXPANSION_STORAGE"]
    if os.environ.get("DAGSTER_HOME"):
        return os.path.join(os.environ["DAGSTER_HOME"], "storage")
    return os.path.abspath("storage")


class StorageResource(dg.ConfigurableResource):
    """Side files of the assets: quarantine, set-aside prompts, the completion store, the training set."""

    root: str = Field(default_factory=default_storage_root)

    def path(self, *parts: str) -> Path:
        path = Path(self.root, *parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def folder(self, *parts: str) -> Path:
        path = Path(self.root, *parts)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def completion_store(self) -> CompletionStore:
        return CompletionStore(Path(self.root) / "completions")


class ParquetIOManager(dg.ConfigurableIOManager):
    """polars DataFrames as Parquet, one file per asset (per partition when partitioned)."""

    root: str = Field(default_factory=default_storage_root)

    def _path(self, context: dg.OutputContext | dg.InputContext) -> Path:
        key = context.asset_key.path
        base = Path(self.root, "assets", *key)
        if context.has_asset_partitions:
            return base / f"{context.asset_partition_key}.parquet"
        return base.with_suffix(".parquet")

    def handle_output(self, context: dg.OutputContext, obj: pl.DataFrame) -> None:
        path = self._path(context)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename: a crash never leaves a half file that a later step would read.
        tmp = path.with_suffix(".parquet.tmp")
        obj.write_parquet(tmp)
        os.replace(tmp, path)
        context.add_output_metadata({"path": dg.MetadataValue.path(str(path)), "rows": obj.height})

    def load_input(self, context: dg.InputContext) -> pl.DataFrame:
        path = self._path(context)
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: materialize {context.asset_key.to_user_string()} first")
        # Through pyarrow: raw rows may hold invalid UTF-8 on purpose (extraction quarantines
        # them), which polars' own reader refuses outright.
        return pl.from_arrow(pq.read_table(path))
