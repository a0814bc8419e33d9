"""Where every asset keeps its files: one storage root, and an IO manager for polars frames.

The root is a local folder or an fsspec URL (``s3://bucket/prefix``); see ``expansion_dag/core/urls.py``
for credentials and endpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import dagster as dg
import polars as pl
import pyarrow.parquet as pq
from pydantic import Field
from upath import UPath

from expansion_dag.config import StorageSettings
from expansion_dag.core import as_upath, default_local_dir, write_atomically
from expansion_dag.defs import run_configuration_metadata
from expansion_dag.store import (
    DEFAULT_SEGMENT_INTERVAL_S,
    DEFAULT_SEGMENT_RECORDS,
    BuildClaim,
    CompletionStore,
    Log,
    ShardLease,
    kept_parts,
)
from expansion_dag.training import Version, publishing

ASSETS = "assets"  # where the IO manager keeps asset files: <root>/assets/<asset>[/<partition>].parquet


def _read_parquet(path: UPath, columns: list[str] | None = None) -> pl.DataFrame:
    # Through pyarrow: raw rows may hold invalid UTF-8 on purpose (extraction quarantines them),
    # which polars' own reader refuses outright.
    with path.open("rb") as fh:
        return pl.from_arrow(pq.read_table(fh, columns=columns))


class StorageResource(dg.ConfigurableResource, StorageSettings):
    """Side files of the assets: quarantine, set-aside prompts, the completion store, the training set."""

    # Given by the run configuration (storage.root, resolved): no default here.
    root: str = Field(description="A local folder or an fsspec URL (s3://bucket/prefix).")
    segment_records: int = Field(
        default=DEFAULT_SEGMENT_RECORDS, ge=1, description="Remote root: completions per uploaded segment, at most."
    )
    segment_interval_s: float = Field(
        default=DEFAULT_SEGMENT_INTERVAL_S,
        gt=0,
        description="Remote root: seconds after its first completion that a segment is uploaded, at most.",
    )

    @property
    def machine_dir(self) -> str:
        """This machine's folder (``local_dir``, else the default one)."""
        return self.local_dir or default_local_dir()

    def path(self, *parts: str) -> UPath:
        return as_upath(self.root).joinpath(*parts)

    def kept_parts(self, name: str, *, last: str, claim: BuildClaim, only: Collection[str] | None = None
                   ) -> AbstractContextManager[Path]:
        """A local folder of parts that outlives runs and machines (``expansion_dag.store.kept_parts``)."""
        return kept_parts(as_upath(self.root), name, last=last, claim=claim, local_dir=self.machine_dir, only=only)

    def build_claim(self, *, run_id: str, log: Log) -> BuildClaim:
        """The claim a build of the training set (or of its parts) holds on the folders it writes."""
        return BuildClaim(as_upath(self.root), run_id=run_id, log=log, timeout_s=self.lease_timeout_s,
                          local_dir=self.machine_dir)

    @contextmanager
    def training_set_version(self, claim: BuildClaim, log: Log) -> Iterator[Version]:
        """A new version of the training set to build, published whole when the block succeeds
        (``expansion_dag.training.publish``)."""
        with publishing(self.root, claim=claim, keep=self.training_set_versions,
                        scratch=Path(self.machine_dir, "staging"), log=log) as version:
            yield version

    def read_asset(self, asset: str, partition: str | None = None) -> pl.DataFrame:
        """An asset's file as the IO manager stored it, read back (checks verify what was written)."""
        name = f"{partition or asset}.parquet"
        return _read_parquet(self.path(ASSETS, asset, name) if partition else self.path(ASSETS, name))

    def write_parquet(self, frame: pl.DataFrame, *parts: str) -> UPath:
        """Write a frame under the root, whole or not at all; returns where."""
        target = self.path(*parts)
        with write_atomically(target) as path:
            frame.write_parquet(path)
        return target

    def shard_lease(self, shard: str, *, run_id: str, log: Log,
                    on_wait: Callable[[str, float], None] | None = None) -> ShardLease:
        """The lease a run holds while it chooses and sends ``shard``'s prompts (``expansion_dag.store.lease``);
        ``on_wait(holder, gives_up_at)`` when it starts waiting for a holder."""
        return ShardLease(as_upath(self.root), shard, run_id=run_id, log=log, timeout_s=self.lease_timeout_s,
                          wait=self.when_shard_busy == "wait", local_dir=self.machine_dir,
                          wait_s=self.shard_busy_wait_s, on_wait=on_wait)

    def completion_store(self) -> CompletionStore:
        return CompletionStore(
            self.path("completions"),
            local_dir=self.machine_dir,
            segment_records=self.segment_records,
            segment_interval_s=self.segment_interval_s,
        )


class ParquetIOManager(dg.ConfigurableIOManagerFactory):
    """polars DataFrames as Parquet under ``<root>/assets``, one file per asset (per partition when partitioned)."""

    root: str = Field(description="The storage root (storage.root, resolved).")

    def create_io_manager(self, context: dg.InitResourceContext) -> _PolarsParquetIOManager:
        return _PolarsParquetIOManager(as_upath(self.root) / ASSETS)


class _PolarsParquetIOManager(dg.UPathIOManager):
    extension = ".parquet"

    def dump_to_path(self, context: dg.OutputContext, obj: pl.DataFrame, path: UPath) -> None:
        # A crash never leaves a half file that a later step would read.
        with write_atomically(path) as staged:
            obj.write_parquet(staged)

    def load_from_path(self, context: dg.InputContext, path: UPath) -> pl.DataFrame:
        # An input that names its ``columns`` (``AssetIn`` metadata) reads only those.
        columns = (context.definition_metadata or {}).get("columns")
        try:
            return _read_parquet(path, columns)
        except FileNotFoundError as exc:
            missing = f"{path} is missing: materialize {context.asset_key.to_user_string()} first"
            raise FileNotFoundError(missing) from exc

    def get_metadata(self, context: dg.OutputContext, obj: pl.DataFrame) -> dict[str, dg.MetadataValue]:
        # Every stored asset shows the run configuration it was made under, as the shards do.
        return {"rows": dg.MetadataValue.int(obj.height), **run_configuration_metadata()}
