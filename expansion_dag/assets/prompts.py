"""Stage 2: prompts extracted from every source, cleaned, deduplicated and sampled.

One source at a time, and only the columns its extractor and filters read: the raw files are
read here, not loaded whole by the IO manager, so memory holds one source's needed columns and
the prompts extracted so far (first turns only), never all six sources' rows.
"""

import dagster as dg
import polars as pl
import pyarrow.parquet as pq

from expansion_dag.assets.metadata import markdown_table
from expansion_dag.assets.raw_datasets import raw_asset_key
from expansion_dag.catalog import Catalog, SourceSpec
from expansion_dag.extract import EXTRACTORS, ExtractResult, extract_prompts, select_prompts
from expansion_dag.resources.storage import ASSETS, StorageResource

GROUP = "prompts"


def _extract(storage: StorageResource, spec: SourceSpec) -> ExtractResult:
    """One source's prompts, from its raw asset's file, reading only the columns needed."""
    path = storage.path(ASSETS, f"{raw_asset_key(spec).path[-1]}.parquet")
    if not path.exists():
        raise dg.Failure(f"{path} is missing: materialize {raw_asset_key(spec).to_user_string()} first")
    with path.open("rb") as fh:
        parquet = pq.ParquetFile(fh)
        present = set(parquet.schema_arrow.names)
        # A missing prompt column is left for extract_prompts to name; filters on it too.
        wanted = [c for c in dict.fromkeys([EXTRACTORS[spec.extractor].column, *spec.filter_map()]) if c in present]
        raw = pl.from_arrow(parquet.read(columns=wanted))
    return extract_prompts(
        raw, source=spec.name, extractor=spec.extractor, turn=spec.turn, max_chars=spec.max_chars,
        filters=spec.filter_map(),
    )


def build_prompts_asset(catalog: Catalog) -> dg.AssetsDefinition:
    @dg.asset(name="prompts", group_name=GROUP, io_manager_key="parquet_io", deps=[raw_asset_key(s) for s in catalog.sources])
    def prompts(context: dg.AssetExecutionContext, storage: StorageResource) -> pl.DataFrame:
        """One chat prompt per row, ending at a user turn, with a stable content-hash id."""
        results = [_extract(storage, s) for s in catalog.sources]
        selection = select_prompts(results, catalog=catalog)
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
