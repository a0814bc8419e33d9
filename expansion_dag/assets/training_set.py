"""Stage 5: the tokenized training set, merged from every shard's completions."""

import dagster as dg
import polars as pl
import pyarrow.parquet as pq

from expansion_dag.assets.metadata import markdown_table
from expansion_dag.ledger import nights
from expansion_dag.training_set import (
    MANIFEST_NAME,
    build_training_set,
    check_round_trip,
    data_files,
    export_conversations_jsonl,
    manifest_markdown,
    sample_rows,
)
from expansion_dag.resources.settings import GenerationSettings
from expansion_dag.resources.storage import StorageResource
from expansion_dag.urls import as_upath

GROUP = "training"
CHECK_LOSS_MASK = "loss_mask_not_empty"
CHECK_LENGTH = "within_context_length"
CHECK_ROUND_TRIP = "round_trip"
ROUND_TRIP_SAMPLE = 64


def _context_length(context: dg.AssetExecutionContext) -> int:
    """The context length the prompts were budgeted for, as probed from the fleet then."""
    event = context.instance.get_latest_materialization_event(dg.AssetKey("budgeted_prompts"))
    value = event.asset_materialization.metadata.get("context_length") if event and event.asset_materialization else None
    if value is None:
        raise dg.Failure("budgeted_prompts has no recorded context length: materialize it first")
    return int(value.value)


@dg.asset(
    group_name=GROUP,
    deps=["completions"],
    check_specs=[
        dg.AssetCheckSpec(CHECK_LOSS_MASK, asset="training_set", description="Every row trains on some tokens."),
        dg.AssetCheckSpec(CHECK_LENGTH, asset="training_set", description="No row is longer than the context."),
        dg.AssetCheckSpec(
            CHECK_ROUND_TRIP, asset="training_set", description="Sampled rows decode back to their conversation."
        ),
    ],
)
def training_set(context: dg.AssetExecutionContext, settings: GenerationSettings, storage: StorageResource):
    """Parquet shards of input_ids and loss_mask, one row per kept completion, plus a manifest."""
    store = storage.completion_store()
    tokenizer = settings.load_tokenizer()
    config = settings.training_set_config(_context_length(context))
    out_dir = storage.path("training_set")
    with storage.local_staging(out_dir, last=MANIFEST_NAME) as staging:
        manifest = build_training_set(store.iter_completions_sorted(), tokenizer, config, staging)
    jsonl = storage.path("exports", "conversations.jsonl")
    with storage.local_staging(jsonl) as staging:
        export_conversations_jsonl(store.iter_completions_sorted(), config, staging, tokenizer=tokenizer)

    rows = sample_rows(out_dir, ROUND_TRIP_SAMPLE)
    empty_masks = _rows_without_loss(out_dir)
    over = [r["id"] for r in rows if r["length"] > config.max_length]
    round_trip = check_round_trip(rows, store.iter_completions_sorted(), tokenizer, config)
    yield dg.AssetCheckResult(
        check_name=CHECK_LOSS_MASK, passed=empty_masks == 0, metadata={"rows_without_loss": empty_masks}
    )
    yield dg.AssetCheckResult(
        check_name=CHECK_LENGTH,
        passed=manifest.tokens_per_sample.get("max", 0) <= config.max_length and not over,
        metadata={"max_tokens_per_sample": manifest.tokens_per_sample.get("max", 0), "context_length": config.max_length},
    )
    yield dg.AssetCheckResult(
        check_name=CHECK_ROUND_TRIP,
        passed=round_trip.ok or manifest.samples == 0,
        metadata={
            "checked": round_trip.checked,
            "failed": round_trip.failed,
            "missing": round_trip.missing,
            "failing_ids": dg.MetadataValue.json(round_trip.failing_ids),
        },
    )
    yield dg.MaterializeResult(
        metadata={
            "samples": manifest.samples,
            "tokens": manifest.tokens,
            "assistant_tokens": manifest.assistant_tokens,
            "mean_tokens_per_sample": round(manifest.tokens_per_sample.get("mean", 0.0), 1),
            "left_out": dg.MetadataValue.json(manifest.left_out),
            "tokenizer": settings.tokenizer,
            "summary": dg.MetadataValue.md(manifest_markdown(manifest)),
            "path": dg.MetadataValue.path(str(out_dir)),
            "files": dg.MetadataValue.json(data_files(out_dir)),
            "conversations_jsonl": dg.MetadataValue.path(str(jsonl)),
            **_nights_metadata(storage),
        }
    )


def _nights_metadata(storage: StorageResource) -> dict:
    """Each nightly expansion's figures, so every night stays visible in the UI."""
    taken = nights(storage.path("nights"))
    if not taken:
        return {}
    store = storage.completion_store()
    tokens = {r["prompt_id"]: r.get("completion_tokens") or 0 for r in store.iter_completions_sorted()}
    failed = {r["prompt_id"] for shard in store.shards() for r in store.latest_failures(shard)}
    rows = [
        (
            night,
            len(ids),
            sum(1 for i in ids if i in tokens),
            sum(1 for i in ids if i in failed and i not in tokens),
            sum(tokens.get(i, 0) for i in ids),
        )
        for night, ids in taken.items()
    ]
    return {
        "nights": dg.MetadataValue.md(
            markdown_table(columns=["night", "prompts taken", "completions", "failures", "output tokens"], rows=rows)
        )
    }


def _rows_without_loss(out_dir) -> int:
    """Rows whose loss mask has no 1, over the whole set, read one row group at a time.

    Through fsspec (any storage root), not polars' own cloud readers.
    """
    empty = 0
    for url in data_files(out_dir):
        with as_upath(url).open("rb") as fh:
            for batch in pq.ParquetFile(fh).iter_batches(columns=["loss_mask"]):
                empty += pl.from_arrow(batch).select((pl.col("loss_mask").list.sum() == 0).sum()).item()
    return empty
