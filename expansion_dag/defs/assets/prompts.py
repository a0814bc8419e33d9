"""Stage 2: prompts extracted from every source, cleaned, deduplicated and sampled.

One source at a time, only the columns its extractor and filters read, in batches of rows: the
raw files are read here, not loaded whole by the IO manager, so memory holds one batch of one
source and the prompts extracted so far (up to their turn), never all six sources' rows.
"""

import dagster as dg
import polars as pl
import pyarrow.parquet as pq

from expansion_dag.defs.assets.metadata import markdown_table
from expansion_dag.defs.assets.raw_datasets import raw_asset_key
from expansion_dag.defs.resources import ASSETS, StorageResource
from expansion_dag.prompts import (
    EXTRACTORS,
    Catalog,
    ExtractResult,
    SourceSpec,
    extract_prompts,
    select_prompts,
)

GROUP = "prompts"
EXTRACT_BATCH_ROWS = 65_536


def _extract(storage: StorageResource, spec: SourceSpec) -> ExtractResult:
    """One source's prompts from its raw asset's file: the columns needed, ``EXTRACT_BATCH_ROWS`` rows at a time.

    Rows are independent, so batches give the same prompts and quarantine as the whole table;
    memory holds one batch's intermediates and the prompts so far, not the source's full columns.
    """
    path = storage.path(ASSETS, f"{raw_asset_key(spec).path[-1]}.parquet")
    if not path.exists():
        raise dg.Failure(f"{path} is missing: materialize {raw_asset_key(spec).to_user_string()} first")
    prompts, quarantine, rows, filtered = [], [], 0, 0
    with path.open("rb") as fh:
        # Pre-buffering keeps every column chunk read until the reader ends: the whole file's
        # compressed columns by the last batch. Without it each chunk is read whole, then let go.
        parquet = pq.ParquetFile(fh, pre_buffer=False)
        present = set(parquet.schema_arrow.names)
        # A missing prompt column is left for extract_prompts to name; filters on it too.
        wanted = [c for c in dict.fromkeys([EXTRACTORS[spec.extractor].column, *spec.filter_map()]) if c in present]
        batches = (
            parquet.iter_batches(batch_size=EXTRACT_BATCH_ROWS, columns=wanted)
            if parquet.metadata.num_rows
            else [parquet.schema_arrow.empty_table().select(wanted)]  # a source without rows still gets checked
        )
        for batch in batches:
            part = extract_prompts(
                pl.from_arrow(batch), source=spec.name, extractor=spec.extractor, turn=spec.turn,
                max_chars=spec.max_chars, filters=spec.filter_map(), conversation=spec.conversation,
            )
            shift = pl.col("row_index") + rows
            prompts.append(part.prompts.with_columns(shift))
            quarantine.append(part.quarantine.with_columns(shift))
            rows += part.rows_read
            filtered += part.filtered
    return ExtractResult(
        source=spec.name, prompts=pl.concat(prompts), quarantine=pl.concat(quarantine), rows_read=rows, filtered=filtered
    )


def build_prompts_asset(catalog: Catalog) -> dg.AssetsDefinition:
    @dg.asset(name="prompts", group_name=GROUP, io_manager_key="parquet_io", deps=[raw_asset_key(s) for s in catalog.sources])
    def prompts(context: dg.AssetExecutionContext, storage: StorageResource) -> pl.DataFrame:
        """One chat prompt per row, ending at a user turn, with a stable content-hash id."""
        results = [_extract(storage, s) for s in catalog.sources]
        selection = select_prompts(results, plan=catalog)
        quarantine_path = storage.write_parquet(selection.quarantine, "quarantine", "prompts.parquet")
        accounting = pl.DataFrame([s.as_dict() for s in selection.stats.values()])
        by_reason = (
            dict(selection.quarantine.group_by("reason").len().sort("reason").iter_rows())
            if selection.quarantine.height
            else {}
        )
        context.add_output_metadata(
            {
                "prompts": selection.prompts.height,
                "prompts_by_source": dg.MetadataValue.json(
                    {s.source: s.prompts_out for s in selection.stats.values()}
                ),
                "duplicates": sum(s.duplicates for s in selection.stats.values()),
                "quarantined": selection.quarantine.height,
                "quarantined_by_reason": dg.MetadataValue.json(by_reason),
                "quarantine_file": dg.MetadataValue.path(str(quarantine_path)),
                "accounting": dg.MetadataValue.md(markdown_table(accounting)),
            }
        )
        return selection.prompts

    return prompts
