"""Stage 3: token-budgeted prompts, then one partition of them per shard.

The shard checks read the shard's file back as stored (the IO manager has written it when the
``Output`` is yielded) and recompute from it: a sample of prompts is re-counted with the tokenizer.
"""

import json

import dagster as dg
import polars as pl
from pydantic import Field

from expansion_dag.config import ScheduleConfig, schema_default
from expansion_dag.core import ModeIdentities
from expansion_dag.defs import SHARD_KEYS, shard_partitions
from expansion_dag.defs.assets.metadata import markdown_table
from expansion_dag.defs.assets.plan import budget_plan, plan_metadata
from expansion_dag.defs.resources import FleetResource, GenerationSettings, StorageResource
from expansion_dag.generation import prompt_keys
from expansion_dag.prompts import BudgetConfig, budget_prompts, count_all_prompt_tokens, take_night
from expansion_dag.servers import template_tools

GROUP = "budget"
FLEET_IDENTITY = "fleet_identity"
SIMULATED_FLEET = "simulated_fleet"
FITS_SAMPLE = 64  # shard prompts re-counted by the fits_context check


class NightConfig(dg.Config):
    """Set by the nightly schedule; a run without it budgets every prompt."""

    night: str = Field(default="", description="The night (YYYY-MM-DD) whose quota this run takes.")
    quota: int = Field(
        default=schema_default(ScheduleConfig, "quota"),
        description="Prompts a night takes that nothing has generated yet (the schedule passes schedule.quota).",
    )


@dg.asset(group_name=GROUP, io_manager_key="parquet_io")
def budgeted_prompts(
    context: dg.AssetExecutionContext,
    config: NightConfig,
    prompts: pl.DataFrame,
    fleet: FleetResource,
    settings: GenerationSettings,
    storage: StorageResource,
) -> pl.DataFrame:
    """Every prompt (or the night's quota) with its exact token count, its own max_tokens and its shard."""
    fleet_info = fleet.info  # provisioned and probed as the run started
    context.log.info(
        f"probed context length {fleet_info.context_length} and model {fleet_info.model_path} "
        f"from {len(fleet_info.servers)} {'simulated ' if fleet_info.simulated else ''}server(s)"
    )
    mix = settings.mix()
    identities = ModeIdentities(mix, fleet_info.identity, fleet_info.simulated)
    # Before any work: simulated and real completions never share a store.
    for identity in identities.identities:
        storage.completion_store().registry.refuse_other_kind(identity)
    # Every server answers the weights probe alike, or the night stops here (one serving other weights).
    fleet.weights_probe(log=context.log)
    # Each prompt's generation mode: a seeded draw from its id (expansion_dag.core.modes).
    prompts = prompts.with_columns(pl.Series("mode", mix.names(prompts["prompt_id"].to_list()), dtype=pl.String))
    if "tools" in prompts.columns:
        # Tools as the fleet's servers hand them to the chat template, which is how they are
        # counted here and for each later turn, and rendered in the training set.
        dialect = fleet_info.servers[0].dialect
        prompts = prompts.with_columns(
            pl.col("tools").map_elements(
                lambda text: json.dumps(template_tools(json.loads(text), dialect)), return_dtype=pl.String
            )
        )
    night_metadata: dict = {}
    take = None
    if config.night:

        def take(fitting: pl.DataFrame) -> pl.DataFrame:
            keys = prompt_keys(fitting, identities)
            taken = take_night(
                fitting,
                keys,
                storage.completion_store().done_keys(),
                nights_dir=storage.path("nights"),
                night=config.night,
                quota=config.quota,
            )
            night_metadata.update(night=config.night, night_quota=config.quota, prompts_taken=taken.height)
            context.log.info(f"night {config.night}: took {taken.height} prompts (quota {config.quota})")
            return taken

    result = budget_prompts(
        prompts,
        settings.load_tokenizer(),
        context_length=fleet_info.context_length,
        num_shards=len(SHARD_KEYS),
        config=settings.budget_config(),
        select=take,
        max_prompt_tokens=fleet_info.max_prompt_tokens,
    )
    set_aside_path = storage.write_parquet(result.set_aside.drop("messages"), "set_aside", "budgeted_prompts.parquet")
    shards = result.shard_stats()
    # What the run will send, cost and yield, before any GPU time (`expansion-dag plan` prints it).
    plan = budget_plan(result.prompts, storage.completion_store(), identities, fleet, fleet_info, settings)
    context.log.info("\n".join(plan.lines()))
    context.add_output_metadata(
        {
            "prompts": result.prompts.height,
            "set_aside": result.set_aside.height,
            "set_aside_by_reason": dg.MetadataValue.json(
                dict(result.set_aside.group_by("reason").len().iter_rows()) if result.set_aside.height else {}
            ),
            "set_aside_file": dg.MetadataValue.path(str(set_aside_path)),
            "context_length": fleet_info.context_length,
            "context_length_source": "probed: /v1/models max_model_len"
            + (" (simulated fleet)" if fleet_info.simulated else ""),
            # The training set takes the completions of this model (simulated or not).
            FLEET_IDENTITY: fleet_info.identity,
            SIMULATED_FLEET: fleet_info.simulated,
            "prompt_tokens": int(result.prompts["prompt_tokens"].sum() or 0),
            "max_tokens_total": int(result.prompts["max_tokens"].sum() or 0),
            "expected_tokens": int(result.prompts["expected_tokens"].sum() or 0),
            "shard_balance_largest_over_mean": round(result.balance(), 4),
            "shards": dg.MetadataValue.md(markdown_table(shards)),
            **night_metadata,
            **plan_metadata(plan),
            **(
                {"prompts_by_mode": dg.MetadataValue.json(dict(result.prompts.group_by("mode").len().sort("mode").iter_rows())),
                 "modes": dg.MetadataValue.json(mix.describe())}
                if len(mix.modes) > 1
                else {}
            ),
        }
    )
    # What a prompt was budgeted for travels with it: the context length, and the model (simulated
    # or not) whose completions the training set takes (it reads these columns alone).
    return result.prompts.with_columns(
        pl.lit(result.context_length, pl.Int64).alias("context_length"),
        pl.lit(fleet_info.identity, pl.String).alias(FLEET_IDENTITY),
        pl.lit(fleet_info.simulated, pl.Boolean).alias(SIMULATED_FLEET),
    )


CHECK_IDS_UNIQUE = "ids_unique"
CHECK_NO_EMPTY = "no_empty_prompt"
CHECK_FITS = "fits_context"


@dg.asset(
    group_name=GROUP,
    partitions_def=shard_partitions,
    io_manager_key="parquet_io",
    check_specs=[
        dg.AssetCheckSpec(CHECK_IDS_UNIQUE, asset="shard_prompts", description="No prompt id appears twice."),
        dg.AssetCheckSpec(CHECK_NO_EMPTY, asset="shard_prompts", description="Every prompt has text."),
        dg.AssetCheckSpec(
            CHECK_FITS, asset="shard_prompts", description="prompt_tokens + max_tokens <= context_length for every row."
        ),
    ],
)
def shard_prompts(
    context: dg.AssetExecutionContext,
    budgeted_prompts: pl.DataFrame,
    settings: GenerationSettings,
    storage: StorageResource,
):
    """The prompts of one shard, the work its GPU server will do."""
    shard = context.partition_key
    rows = budgeted_prompts.filter(pl.col("shard") == shard)
    yield dg.Output(
        rows,
        metadata={
            "prompts": rows.height,
            "prompt_tokens": int(rows["prompt_tokens"].sum() or 0),
            "expected_tokens": int(rows["expected_tokens"].sum() or 0),
            "max_tokens_total": int(rows["max_tokens"].sum() or 0),
        },
    )
    # Written by now: the checks look at the file the completions will read.
    stored = storage.read_asset("shard_prompts", shard)
    yield from shard_checks(stored, settings.load_tokenizer(), settings.budget_config(), expected_rows=rows.height)


def shard_checks(stored: pl.DataFrame, tokenizer, budget: BudgetConfig, *, expected_rows: int):
    """The three shard checks over a shard's prompts as stored."""
    duplicates = stored.height - stored["prompt_id"].n_unique()
    yield dg.AssetCheckResult(
        check_name=CHECK_IDS_UNIQUE,
        passed=duplicates == 0,
        metadata={"duplicate_ids": duplicates, "rows_stored": stored.height, "rows_assigned": expected_rows},
    )
    text = pl.col("messages").list.eval(pl.element().struct.field("content").str.strip_chars().str.len_chars())
    empty = stored.filter(text.list.sum().fill_null(0) == 0).height
    yield dg.AssetCheckResult(check_name=CHECK_NO_EMPTY, passed=empty == 0, metadata={"empty_prompts": empty})
    over = stored.filter(pl.col("prompt_tokens") + pl.col("max_tokens") > pl.col("context_length"))
    # An independent count: the stored token counts are only trusted where the tokenizer agrees.
    sample = stored.gather(sorted({i * stored.height // FITS_SAMPLE for i in range(min(FITS_SAMPLE, stored.height))}))
    # Each row as it was budgeted: with its mode's template arguments and its tools.
    recounted = sample.with_columns(count_all_prompt_tokens(sample, tokenizer, budget).alias("recount"))
    miscounted = recounted.filter(pl.col("recount") != pl.col("prompt_tokens"))
    over_by_recount = recounted.filter(pl.col("recount") + pl.col("max_tokens") > pl.col("context_length"))
    failing = pl.concat([over["prompt_id"], miscounted["prompt_id"], over_by_recount["prompt_id"]]).unique(
        maintain_order=True
    )
    yield dg.AssetCheckResult(
        check_name=CHECK_FITS,
        passed=failing.is_empty(),
        metadata={
            "over_context": over.height,
            "recounted": recounted.height,
            "recount_differs": miscounted.height,
            "over_context_by_recount": over_by_recount.height,
            "example_ids": dg.MetadataValue.json(failing.head(5).to_list()),
        },
    )
