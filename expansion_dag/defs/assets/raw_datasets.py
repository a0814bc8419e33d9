"""Stage 1: one raw dataset asset per catalog source, loaded with the `datasets` library."""

import dagster as dg
import polars as pl

from expansion_dag.prompts import Catalog, SourceSpec, load_source, source_fingerprint

GROUP = "sources"


def raw_asset_key(source: SourceSpec) -> dg.AssetKey:
    return dg.AssetKey(f"raw_{source.name}")


def build_raw_dataset_asset(source: SourceSpec) -> dg.AssetsDefinition:
    where = source.local_path or f"{source.hub_id} (config {source.config}, split {source.split})"

    @dg.asset(
        name=raw_asset_key(source).path[-1],
        group_name=GROUP,
        io_manager_key="parquet_io",
        description=f"Rows of source {source.name!r} as published: {where}.",
        # The scheduler reloads a source only when its revision or files change.
        code_version=source_fingerprint(source),
        tags={"expansion/source": source.name},
    )
    def raw_dataset(context: dg.AssetExecutionContext) -> pl.DataFrame:
        dataset = load_source(source)
        frame = pl.from_arrow(dataset.data.table)
        context.add_output_metadata(
            {
                "rows": frame.height,
                "columns": dg.MetadataValue.json(frame.columns),
                "loaded_from": where,
                "fingerprint": source_fingerprint(source),
            }
        )
        return frame

    return raw_dataset


def build_raw_dataset_assets(catalog: Catalog) -> list[dg.AssetsDefinition]:
    return [build_raw_dataset_asset(source) for source in catalog.sources]
