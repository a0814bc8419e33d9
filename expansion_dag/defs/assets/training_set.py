"""Stage 5: the tokenized training set, from the completions of the current identity in the store.

The current identity is the model the budget was probed from (simulated or not, as recorded in
``budgeted_prompts``' own columns, read as an input) with the current sampling settings and cap;
every other record is counted and left out. A shard whose blocking check failed (its failure rate
over the limit, requests rejected for the context) blocks the set, which names it, until a
backfill of that shard passes. The store is read once, in file order: the build writes, from that pass,
every output the ``training_formats`` setting names (the trainers' files beside the Parquet set),
the manifest and the dataset card, and keeps what the round trip (a digest of each row's render)
and the nightly table (each prompt's outcome) need. The checks read the written Parquet files back
and recompute from them; an empty set fails, naming what was left out and why.

The set is built in parts, a segment of the store each, and builds the parts it does not find.
``training_set_parts`` builds one shard's parts in a run of its own (a pod each on Kubernetes, a
backfill of its partitions); the set then only assembles them. Each build is a new version of the
set, published whole by switching a pointer (``expansion_dag.training.publish``); each builder
holds a claim on what it writes, so that no other builder removes it meanwhile.
"""

from collections.abc import Collection, Mapping
from typing import Any

import dagster as dg
import polars as pl
import pyarrow.parquet as pq

from expansion_dag.core import ModeIdentities, as_upath
from expansion_dag.defs import shard_partitions
from expansion_dag.defs.assets.budget import FLEET_IDENTITY, SIMULATED_FLEET
from expansion_dag.defs.assets.blocking_checks import failed_verdicts
from expansion_dag.defs.assets.metadata import markdown_table
from expansion_dag.defs.resources import GenerationSettings, StorageResource
from expansion_dag.prompts import nights
from expansion_dag.training import (
    PART_DONE,
    BuildTrace,
    Manifest,
    TrainingSetConfig,
    build_parts,
    build_training_set_in_parts,
    check_round_trip,
    data_files,
    dataset_card,
    manifest_markdown,
    part_names,
    sample_rows,
)

GROUP = "training"
CHECK_NOT_EMPTY = "has_samples"
CHECK_LOSS_MASK = "loss_mask_not_empty"
CHECK_LENGTH = "within_context_length"
CHECK_ROUND_TRIP = "round_trip"
ROUND_TRIP_SAMPLE = 64
FIGURES_BATCH_ROWS = 1024
PARTS_FOLDER = "training_set_parts"  # under the storage root


#: What the training set reads of ``budgeted_prompts``: what its prompts were budgeted for.
BUDGET_FACTS = ["context_length", FLEET_IDENTITY, SIMULATED_FLEET]


def _budget_facts(budget: pl.DataFrame) -> tuple[int, str, bool]:
    """The context length and the model (simulated or not) the prompts were budgeted for."""
    if budget.is_empty():
        raise dg.Failure("budgeted_prompts holds no prompt: materialize budgeted_prompts (prepare_job) with prompts first")
    row = budget.row(0, named=True)
    return int(row["context_length"]), str(row[FLEET_IDENTITY]), bool(row[SIMULATED_FLEET])


def _build_inputs(
    budgeted_prompts: pl.DataFrame, settings: GenerationSettings
) -> tuple[ModeIdentities, TrainingSetConfig]:
    """What the set takes (the identity the prompts were budgeted for) and how it is built."""
    context_length, model, simulated = _budget_facts(budgeted_prompts)
    return ModeIdentities(settings.mix(), model, simulated), settings.training_set_config(context_length)


@dg.asset(
    group_name=GROUP,
    partitions_def=shard_partitions,
    deps=["completions"],
    ins={"budgeted_prompts": dg.AssetIn(metadata={"columns": BUDGET_FACTS})},
)
def training_set_parts(
    context: dg.AssetExecutionContext, budgeted_prompts: pl.DataFrame, settings: GenerationSettings,
    storage: StorageResource,
) -> dg.MaterializeResult:
    """This shard's parts of the training set (a segment each), built once and kept for training_set."""
    store = storage.completion_store()
    parts, _ = store.parts([context.partition_key])
    tokenizer = settings.load_tokenizer()
    identities, config = _build_inputs(budgeted_prompts, settings)
    known = store.registry.known()
    names = part_names(parts, tokenizer, config, identities, known)
    with (
        storage.build_claim(run_id=context.run.run_id, log=context.log) as claim,
        storage.kept_parts(PARTS_FOLDER, last=PART_DONE, claim=claim, only=names) as parts_dir,
    ):
        summary = build_parts(
            parts, tokenizer, config, parts_dir=parts_dir, identities=identities, known=known,
            workers=settings.training_build_workers, owner=claim,
        )
    return dg.MaterializeResult(
        metadata={
            "parts": summary["parts"],
            "built": summary["built"],
            "reused": summary["reused"],
            "rebuilt_all_because": summary["rebuilt_all_because"] or "",
            "path": dg.MetadataValue.path(str(storage.path(PARTS_FOLDER))),
        }
    )


@dg.asset(
    group_name=GROUP,
    deps=["completions", "training_set_parts"],
    ins={"budgeted_prompts": dg.AssetIn(metadata={"columns": BUDGET_FACTS})},
    check_specs=[
        dg.AssetCheckSpec(CHECK_NOT_EMPTY, asset="training_set", description="The set has samples."),
        dg.AssetCheckSpec(CHECK_LOSS_MASK, asset="training_set", description="Every row trains on some tokens."),
        dg.AssetCheckSpec(
            CHECK_LENGTH,
            asset="training_set",
            description="No row is longer than the context; lengths, ids and masks agree.",
        ),
        dg.AssetCheckSpec(
            CHECK_ROUND_TRIP, asset="training_set", description="Sampled rows decode back to their conversation."
        ),
    ],
)
def training_set(
    context: dg.AssetExecutionContext, budgeted_prompts: pl.DataFrame, settings: GenerationSettings,
    storage: StorageResource,
):
    """Parquet shards of input_ids and loss_mask, one row per kept completion, plus a manifest."""
    blocked = failed_verdicts(storage)
    if blocked:
        raise dg.Failure(
            description=f"blocked by the failed checks of {', '.join(blocked)}: backfill the failed "
            "partitions of completions, then build the training set again",
            metadata={"blocked_by": dg.MetadataValue.json(blocked)},
        )
    store = storage.completion_store()
    tokenizer = settings.load_tokenizer()
    identities, config = _build_inputs(budgeted_prompts, settings)
    # One pass over the store, in file order: every output, and (in the trace) what the round trip
    # and the nightly table need. Written as a new version, published whole once built.
    trace = BuildTrace()
    parts, failures = store.parts()
    with (
        storage.build_claim(run_id=context.run.run_id, log=context.log) as claim,
        storage.kept_parts(PARTS_FOLDER, last=PART_DONE, claim=claim) as parts_dir,
        storage.training_set_version(claim, context.log) as version,
    ):
        manifest = build_training_set_in_parts(
            parts, failures, tokenizer, config, version.directory, parts_dir=parts_dir, identities=identities,
            known=store.registry.known(), trace=trace, workers=settings.training_build_workers, owner=claim,
        )
    # The checks read the version this run built, whichever is current by now.
    out_dir = version.url
    checks = training_set_checks(out_dir, trace.renders, tokenizer, config)
    if manifest.samples == 0:
        yield from checks  # no materialization to carry them
        raise dg.Failure(
            description=f"the training set has no samples: {_left_out_text(manifest)}",
            metadata=_left_out_metadata(manifest),
        )
    yield dg.MaterializeResult(
        check_results=checks,
        metadata={
            "samples": manifest.samples,
            "tokens": manifest.tokens,
            "assistant_tokens": manifest.assistant_tokens,
            # Issue 14's figure: the share of generated output tokens that reached the set.
            "output_tokens": manifest.output_tokens,
            "output_tokens_in_set": manifest.output_tokens_in_set,
            "useful_token_share": manifest.useful_token_share,
            "mean_tokens_per_sample": round(manifest.tokens_per_sample.get("mean", 0.0), 1),
            # A set of simulator answers says so wherever it is shown.
            "simulated": manifest.simulated,
            "model": manifest.identity["model"],
            "settings_fingerprint": manifest.identity["fingerprint"],
            **_left_out_metadata(manifest),
            "tokenizer": settings.tokenizer,
            "summary": dg.MetadataValue.md(manifest_markdown(manifest)),
            # This version's own folder: it never changes. The current set: storage.md.
            "path": dg.MetadataValue.path(str(out_dir)),
            "current": version.current,
            "files": dg.MetadataValue.json(data_files(out_dir)),
            # Each output by format, and what a trainer needs to know (README.md in the folder).
            "outputs": dg.MetadataValue.json(manifest.outputs),
            "dataset_card": dg.MetadataValue.md(dataset_card(manifest)),
            **_nights_metadata(storage, trace),
        }
    )


def _left_out_metadata(manifest: Manifest) -> dict[str, Any]:
    return {
        "left_out": dg.MetadataValue.json(manifest.left_out),
        "left_out_other_identities": dg.MetadataValue.json(manifest.other_identities),
    }


def _left_out_text(manifest: Manifest) -> str:
    reasons = ", ".join(f"{reason} {count:,}" for reason, count in manifest.left_out.items() if count)
    others = "; ".join(f"{label}: {count:,}" for label, count in manifest.other_identities.items())
    return (
        f"left out by reason: {reasons or 'nothing (the store holds no completion)'}"
        + (f"; other identities: {others}" if others else "")
        + f". Taken: {manifest.identity['model']} with settings {manifest.identity['fingerprint']}."
    )


def training_set_checks(
    out_dir,
    expected: Mapping[str, Collection[bytes]],
    tokenizer,
    config: TrainingSetConfig,
) -> list[dg.AssetCheckResult]:
    """Every check of a written set, from its files read back.

    The round trip decodes sampled rows against ``expected``, renders by row id (the build's trace,
    or ``expected_renders`` of the store's records).
    """
    manifest = Manifest.read(out_dir)
    figures = _stored_figures(out_dir, config.max_length)
    rows = sample_rows(out_dir, ROUND_TRIP_SAMPLE)
    round_trip = check_round_trip(rows, expected, tokenizer)
    return [
        dg.AssetCheckResult(
            check_name=CHECK_NOT_EMPTY,
            passed=figures["rows"] > 0,
            metadata={"rows": figures["rows"], **_left_out_metadata(manifest)},
            description=None if figures["rows"] else _left_out_text(manifest),
        ),
        dg.AssetCheckResult(
            check_name=CHECK_LOSS_MASK,
            passed=figures["rows_without_loss"] == 0,
            metadata={"rows_without_loss": figures["rows_without_loss"]},
        ),
        dg.AssetCheckResult(
            check_name=CHECK_LENGTH,
            passed=figures["rows_over_context"] == 0 and figures["rows_inconsistent"] == 0,
            metadata={
                "max_tokens_per_sample": figures["max_length"],
                "context_length": config.max_length,
                "rows_over_context": figures["rows_over_context"],
                "rows_whose_length_ids_and_mask_disagree": figures["rows_inconsistent"],
            },
        ),
        dg.AssetCheckResult(
            check_name=CHECK_ROUND_TRIP,
            passed=round_trip.ok,
            metadata={
                "checked": round_trip.checked,
                "failed": round_trip.failed,
                "missing": round_trip.missing,
                "failing_ids": dg.MetadataValue.json(round_trip.failing_ids),
            },
        ),
    ]


def _stored_figures(out_dir, max_length: int) -> dict[str, int]:
    """Row counts and lengths recomputed from the Parquet files, ``FIGURES_BATCH_ROWS`` rows at a time.

    Through fsspec (any storage root), not polars' own cloud readers.
    """
    figures = {"rows": 0, "rows_without_loss": 0, "rows_over_context": 0, "rows_inconsistent": 0, "max_length": 0}
    for url in data_files(out_dir):
        with as_upath(url).open("rb") as fh:
            # Small batches: a file holds up to rows_per_file rows of thousands of tokens each.
            batches = pq.ParquetFile(fh).iter_batches(batch_size=FIGURES_BATCH_ROWS, columns=["input_ids", "loss_mask", "length"])
            for batch in batches:
                ids = pl.col("input_ids").list.len()
                row = pl.from_arrow(batch).select(
                    pl.len().alias("rows"),
                    (pl.col("loss_mask").list.sum().fill_null(0) == 0).sum().alias("rows_without_loss"),
                    (ids > max_length).sum().alias("rows_over_context"),
                    ((ids != pl.col("loss_mask").list.len()) | (ids != pl.col("length"))).sum().alias("rows_inconsistent"),
                    ids.max().fill_null(0).alias("max_length"),
                ).row(0, named=True)
                for name, value in row.items():
                    figures[name] = max(figures[name], value) if name == "max_length" else figures[name] + value
    return figures


def _nights_metadata(storage: StorageResource, trace: BuildTrace) -> dict:
    """Each nightly expansion's figures (completions of the set's identity, as the build's pass saw them)."""
    taken = nights(storage.path("nights"))
    if not taken:
        return {}
    tokens, failed = trace.completion_tokens, trace.failed
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
