"""Stage 2: prompts extracted from every source, cleaned, deduplicated and sampled."""

import dagster as dg
import polars as pl

from expansion_dag.assets.metadata import markdown_table
from expansion_dag.assets.raw_datasets import raw_asset_key
from expansion_dag.catalog import Catalog
from expansion_dag.extract import extract_prompts, select_prompts
from expansion_dag.resources.storage import StorageResource

GROUP = "prompts"


def build_prompts_asset(catalog: Catalog) -> dg.AssetsDefinition:
    ins = {f"raw_{s.name}": dg.AssetIn(key=raw_asset_key(s)) for s in catalog.sources}

    @dg.asset(name="prompts", group_name=GROUP, io_manager_key="parquet_io", ins=ins)
    def prompts(context: dg.AssetExecutionContext, storage: StorageResource, **raw: pl.DataFrame) -> pl.DataFrame:
        """One chat prompt per row, ending at a user turn, with a stable content-hash id."""
        results = [
            extract_prompts(
                raw[f"raw_{s.name}"],
                source=s.name,
                extractor=s.extractor,
                turn=s.turn,
                max_chars=s.max_chars,
                filters=s.filter_map(),
            )
            for s in catalog.sources
        ]
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
