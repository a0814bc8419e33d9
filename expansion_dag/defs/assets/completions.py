"""Stage 4: generated completions, one partition per shard, each on its own GPU server.

The asset is a thin shell over ``expansion_dag.generation.engine``, its body the steps in order
(``_generate``): it picks the prompts that have no
completion of the current identity anywhere in the store (whichever shard wrote it: shard
membership changes with the shard count and the budget's priors), runs them, and turns the shard
report into metadata. The checks judge the shard's records as the store holds them
(``expansion_dag.generation.shard_figures``), read back after the run; what only this run saw (its
context-length retries) is added to them. A shard whose failures exceed ``max_failure_rate`` fails
its materialization (so "backfill failed partitions" picks it up) after every success has been
written; the next run sends only what is missing.
"""

import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import dagster as dg
import polars as pl

from expansion_dag.core import ModeIdentities, ShardAborted, WeightsProbe
from expansion_dag.defs import resource_fields, run_configuration_file, shard_index, shard_partitions
from expansion_dag.defs.assets.blocking_checks import record_verdicts
from expansion_dag.defs.assets.completion_metadata import shard_metadata
from expansion_dag.defs.assets.plan import ShardExpectation, plan_against_actual
from expansion_dag.defs.assets.progress import ShardProgressReporter
from expansion_dag.defs.assets.shard_steps import Standing, Target, Todo
from expansion_dag.defs.resources import FleetResource, GenerationSettings, StorageResource
from expansion_dag.generation import (
    Observed,
    Server,
    ShardFigures,
    ShardReport,
    ShardWork,
    WeightsWatch,
    cell_estimates,
    ended_record,
    generate_shard,
    learn,
    shard_figures,
)
from expansion_dag.servers import ServerInfo, probe_weights
from expansion_dag.store import CompletionStore, ShardLease
from expansion_dag.training import AnswerJudge

GROUP = "generation"
CHECK_FAILURE_RATE = "failure_rate"
CHECK_CONTEXT_REJECTIONS = "no_context_length_rejections"
CHECK_TRUNCATION = "truncation_rate"
CHECK_DRIFT = "budget_drift"
CHECK_CONFIG = "configuration_unchanged"
CHECK_DUPLICATES = "no_duplicate_completions"


#: A shard that fails one of these must not reach the training set (``defs/assets/training_set.py``).
BLOCKING_CHECKS = (CHECK_FAILURE_RATE, CHECK_CONTEXT_REJECTIONS)


def _spec(name: str, description: str) -> dg.AssetCheckSpec:
    """A check of each shard on its own: one status per partition, judged with its materialization."""
    with warnings.catch_warnings():
        # Partitioned checks are a preview in Dagster 1.13; the pinned version is what the tests
        # (GraphQL and the UI in Chromium) prove them on.
        warnings.simplefilter("ignore", dg.PreviewWarning)
        return dg.AssetCheckSpec(
            name, asset="completions", description=description, blocking=name in BLOCKING_CHECKS,
            partitions_def=shard_partitions,
        )


@dg.asset(
    group_name=GROUP,
    partitions_def=shard_partitions,
    check_specs=[
        _spec(CHECK_FAILURE_RATE, "Failed prompts (answers stopped as loops aside) stay under settings.max_failure_rate."),
        _spec(CHECK_CONTEXT_REJECTIONS, "No prompt was lost to the context: refused over it, cut by a cap the "
              "server forced, or sent to a server whose context is not the probed one."),
        _spec(CHECK_TRUNCATION, "Answers cut at max_tokens stay under settings.max_truncation_rate (warning)."),
        _spec(CHECK_DRIFT, "The server counts prompt tokens as this project does (warning)."),
        _spec(CHECK_CONFIG, "Fleet and generation settings match this shard's previous run (warning)."),
        _spec(CHECK_DUPLICATES, "No request of this shard's folder was answered twice (warning)."),
    ],
)
def completions(
    context: dg.AssetExecutionContext,
    shard_prompts: pl.DataFrame,
    fleet: FleetResource,
    settings: GenerationSettings,
    storage: StorageResource,
):
    """Model-written answers for one shard's prompts, kept in the completion store as they arrive."""
    # One sender per shard, whoever starts it (the CLI, the UI, a schedule, another host): what to
    # send is chosen, and sent, under the shard's lease (expansion_dag.store.lease). The fleet was
    # provisioned before, as the run started (a resource): a wait here is bounded and shown
    # (storage.shard_busy_wait_s; docs/operations.md, who owns the fleet).
    waiting = functools.partial(ShardProgressReporter.waiting, context, context.partition_key)
    with storage.shard_lease(context.partition_key, run_id=context.run.run_id, log=context.log,
                             on_wait=waiting) as lease:
        yield from _generate(context, shard_prompts, fleet, settings, storage, lease)


def _generate(
    context: dg.AssetExecutionContext,
    shard_prompts: pl.DataFrame,
    fleet: FleetResource,
    settings: GenerationSettings,
    storage: StorageResource,
    lease: ShardLease,
):
    shard = context.partition_key
    target = _choose_server(context, fleet, settings, shard)
    helpers = _helpers(fleet, settings, target.url)
    identities, work = _identities_and_work(context, shard_prompts, fleet, settings, target.url)
    weights = _weights_watch(fleet, settings, target.url, identities.identities[0].probe)  # one probe, every mode
    store = storage.completion_store()
    todo = _scan_store(context, store, work, identities, target)
    expected = ShardExpectation(todo.items, todo.observed, settings, context.instance, simulated=fleet.info.simulated)
    report, aborted, progress = _run_engine(
        context, store, lease, work, identities, todo, target, helpers, fleet, settings, expected, weights
    )
    standing = _read_standing(store, work, shard, identities)
    effective = _effective_config(fleet, settings, storage, target.url)
    checks = [
        *stored_checks(standing.figures, settings, context_retries=report.context_retries),
        _config_check(effective, _previous_effective_config(context, shard)),
        _duplicates_check(standing.final.duplicates_by_shard[shard]),
    ]
    record_verdicts(storage, shard, context.run.run_id, checks, BLOCKING_CHECKS)  # what the training set reads
    metadata = shard_metadata(
        report, shard, target, standing, work, identities, shard_prompts, todo, effective, settings.drop_truncated
    )
    metadata |= plan_against_actual(expected, report, progress.first_speed)
    yield from _verdict(context, store, shard, settings, standing, aborted, checks, metadata)


def _choose_server(
    context: dg.AssetExecutionContext, fleet: FleetResource, settings: GenerationSettings, shard: str
) -> Target:
    url, fell_back = fleet.server_for_shard(shard_index(shard))
    if fell_back:
        context.log.warning(f"{shard}: its own server is down; running on healthy server {url}")
    server = fleet.info.server(url)  # provisioned and probed as the run started
    if settings.stop_degenerate and server.stream_interval < fleet.stream_interval:
        # An attached SGLang server streams at its own launch setting; one event a token costs the
        # client tens of ms an answer (BENCHMARKS.md, waste and tail).
        context.log.warning(
            f"{url} streams {server.stream_interval} token(s) an event, fewer than the configured "
            f"{fleet.stream_interval}: launch it with --stream-interval {fleet.stream_interval} "
            "(SGLang takes it only at launch) to spare the client's CPU"
        )
    return Target(url, fell_back, server)


def _engine_server(server: ServerInfo) -> Server:
    return Server(url=server.url, slots=server.slots, dialect=server.dialect, stream_interval=server.stream_interval,
                  tool_choice=server.tool_choice, context_length=server.context_length,
                  identity=server.identity)  # fmt: skip


def _helpers(fleet: FleetResource, settings: GenerationSettings, url: str) -> list[Server]:
    """The other servers, which lend idle slots: those whose load says when they are idle (vLLM's does not)."""
    if not settings.spill_to_idle_servers:
        return []
    return [_engine_server(s) for s in fleet.info.servers if s.url != url and s.dialect.has_loads]


def _identities_and_work(
    context: dg.AssetExecutionContext, shard_prompts: pl.DataFrame, fleet: FleetResource,
    settings: GenerationSettings, url: str,
) -> tuple[ModeIdentities, ShardWork]:
    # The weights' probe goes with the identities: registering them stops the run before any request
    # when the store's answers of this identity came from other weights.
    probe = fleet.weights_probe([url], log=context.log)
    identities = ModeIdentities(settings.mix(), fleet.info.identity, fleet.info.simulated, probe=probe)
    conversation = shard_prompts.get_column("conversation") if "conversation" in shard_prompts.columns else None
    has_conversations = conversation is not None and conversation.null_count() < shard_prompts.height
    work = ShardWork(
        shard_prompts, identities, retry_outcomes=settings.retry_outcomes,
        planner=settings.turn_planner(int(shard_prompts["context_length"][0]), identities) if has_conversations else None,
    )
    return identities, work


def _weights_watch(
    fleet: FleetResource, settings: GenerationSettings, url: str, probe: WeightsProbe | None
) -> WeightsWatch | None:
    """The weights' probe of the run's start, asked again every ``weights_reprobe_s`` while it goes."""
    if probe is None or not settings.weights_reprobe_s:
        return None
    server, api_key = fleet.info.server(url), fleet.api_key()
    return WeightsWatch(url, probe, lambda: probe_weights(server, api_key), settings.weights_reprobe_s)


def _scan_store(
    context: dg.AssetExecutionContext, store: CompletionStore, work: ShardWork, identities: ModeIdentities,
    target: Target,
) -> Todo:
    # Expected answer lengths, learned from the mix's completions in the store (earlier nights,
    # other shards; the whole store: a prompt may have moved between shards) and refined by the
    # run: they order the queue, the typed priors only where nothing was learned. The same pass
    # finds what is done and what is final: prompts the model answered (a loop included) are not
    # asked again unless the user names their outcome. It also notes what the plan would have said
    # of this run's prompts, to put beside what they did.
    observed = Observed(identities.owns)
    lengths = learn(observed.reading(work.reading(store.latest_records(digest=True))), identities.owns)
    learned_from_store = lengths.answers
    items, endings = work.items(lambda keys: {r["key"]: r for r in store.latest_records() if r["key"] in keys})
    waiting = len(work.firsts) - len(items) - len(endings)
    context.log.info(
        f"{context.partition_key}: {len(work.firsts)} prompts ({work.conversations} of them conversations, asked "
        f"turn by turn), {waiting} done or final (answers stopped as loops are final: --retry-outcomes degenerate "
        f"asks them again), {len(items)} to send to {target.url} ({target.server.slots} slots)"
    )
    cells = [(i.source, i.prompt_tokens, i.expected_output_tokens) for i in items]
    return Todo(items, endings, lengths, observed, learned_from_store, cells, cell_estimates(lengths, cells))


def _run_engine(
    context: dg.AssetExecutionContext, store: CompletionStore, lease: ShardLease, work: ShardWork,
    identities: ModeIdentities, todo: Todo, target: Target, helpers: list[Server], fleet: FleetResource,
    settings: GenerationSettings, expected: ShardExpectation, weights: WeightsWatch | None,
) -> tuple[ShardReport, str | None, ShardProgressReporter]:
    """The shard's prompts through the engine, every answer written under the lease; the report,
    and why the engine stopped the shard early (None: it did not)."""
    shard, info = context.partition_key, fleet.info
    # Registering the identity refuses a simulated run in a real store (and the reverse) before any request.
    with store.writer(shard, identities=identities.identities, check=lease.check) as writer:
        for ended, item in todo.endings:  # resumed conversations whose next turn no longer fits
            writer.append(ended_record(ended, item, target.url))
        progress = ShardProgressReporter(context, shard, plan=expected.shard_plan)
        aborted = None
        try:
            report = generate_shard(
                todo.items, [_engine_server(target.server)], writer=writer, model=info.model,
                sampling=settings.sampling(), config=settings.engine_config(), helpers=helpers,
                fleet_urls=[s.url for s in info.servers], api_key=fleet.api_key(), lengths=todo.lengths,
                on_progress=progress, planner=work.planner, weights=weights,
                # The training set's own rules, on each answer as it arrives: the yield and its gate.
                judge=AnswerJudge(settings.load_tokenizer(), settings.training_set_config(info.context_length), identities),
            )
        except ShardAborted as exc:
            aborted = str(exc)
            report = exc.report if isinstance(exc.report, ShardReport) else ShardReport(total=len(todo.items))
        progress.close()  # the last figures, whatever the throttle held back
    return report, aborted, progress


def _read_standing(store: CompletionStore, work: ShardWork, shard: str, identities: ModeIdentities) -> Standing:
    final = store.scan()
    # Where each prompt stands: its key, or for a conversation that of its furthest turn.
    keys = work.frontier_keys(store.latest_records(digest=True))
    # Answers stopped as loops are the model's, not the fleet's: dropped and counted as waste,
    # they do not fail the shard (a loop share above max_failure_rate is normal for reasoning models).
    figures = stored_figures(store, shard, keys, identities.owns, done_anywhere=final.done)
    return Standing(final, keys, figures)


def _effective_config(
    fleet: FleetResource, settings: GenerationSettings, storage: StorageResource, url: str
) -> dict[str, Any]:
    return {
        "fleet": fleet.effective_config(fleet.info, url),
        "settings": settings.as_metadata(),
        # The resources as this run configured them (file, variables, launchpad), and the file.
        "fleet_resource": resource_fields(fleet),
        "storage_resource": resource_fields(storage),
        "run_configuration": run_configuration_file(),
    }


def _verdict(
    context: dg.AssetExecutionContext, store: CompletionStore, shard: str, settings: GenerationSettings,
    standing: Standing, aborted: str | None, checks: list[dg.AssetCheckResult], metadata: dict[str, Any],
):
    """The materialization, or the failure that backfilling failed partitions picks up."""
    figures = standing.figures
    failure_rate = figures.failure_rate
    if not (aborted or failure_rate > settings.max_failure_rate or standing.missing):
        yield dg.MaterializeResult(metadata=metadata, check_results=checks)
        return
    reason = aborted or (
        f"{figures.failed} of {figures.prompts} prompts failed ({failure_rate:.1%} > max_failure_rate "
        f"{settings.max_failure_rate:.1%})"
        if failure_rate > settings.max_failure_rate
        else f"{standing.missing} prompts have neither a completion nor a failure record"
    )
    _log_failures(context, store, shard)
    # No materialization to carry them: the failed step records the shard's checks itself.
    yield from checks
    raise dg.Failure(
        description=f"{shard}: {reason}. {standing.done} completions are kept; re-materialize to send only the rest.",
        metadata=metadata,
    )


def _log_failures(context: dg.AssetExecutionContext, store, shard: str) -> None:
    failures = store.latest_failures(shard)[:5]
    for record in failures:
        context.log.error(
            f"{shard}: prompt {record['prompt_id']} failed on {record['server']} after "
            f"{record['attempts']} attempt(s): {record['error']} {record.get('http_status') or ''} {record['message']}"
        )


def _previous_effective_config(context: dg.AssetExecutionContext, shard: str) -> dict[str, Any] | None:
    result = context.instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=context.asset_key, asset_partitions=[shard]), limit=1
    )
    if not result.records:
        return None
    materialization = result.records[0].asset_materialization
    value = materialization.metadata.get("effective_config") if materialization else None
    return value.value if value is not None else None


def config_differences(previous: dict[str, Any] | None, current: dict[str, Any]) -> list[str]:
    """Each setting that changed, as 'section.name: old -> new'."""
    if previous is None:
        return []
    changes = []
    for section in sorted(set(previous) | set(current)):
        old, new = previous.get(section) or {}, current.get(section) or {}
        for name in sorted(set(old) | set(new)):
            if old.get(name) != new.get(name):
                changes.append(f"{section}.{name}: {old.get(name)!r} -> {new.get(name)!r}")
    return changes


def stored_figures(
    store: CompletionStore, shard: str, keys: set[str], owns: Callable[[Mapping[str, Any]], bool], *,
    done_anywhere: set[str] | None = None,
) -> ShardFigures:
    """The figures of the shard's prompts (``keys``) as the records ``owns`` accepts in its folder say, in one pass.

    ``done_anywhere``: the keys completed in any folder (a whole-store scan when not given).
    """
    done = store.scan().done if done_anywhere is None else done_anywhere
    return shard_figures(store.latest_records(shards=[shard], digest=True), keys, owns, done)


def stored_checks(figures: ShardFigures, settings: GenerationSettings, *, context_retries: int = 0):
    """The four data checks, judged on the stored ``figures``.

    ``context_retries``: this run's, which no record keeps; reported, not judged.
    """
    yield dg.AssetCheckResult(
        check_name=CHECK_FAILURE_RATE,
        passed=figures.failure_rate <= settings.max_failure_rate,
        metadata={
            "failed_prompts": figures.failed,
            "prompts": figures.prompts,
            "failure_rate": round(figures.failure_rate, 6),
            "threshold": settings.max_failure_rate,
            "failures_by_kind": dg.MetadataValue.json(dict(figures.failures_by_kind)),
        },
    )
    rejections = figures.context_length_failures
    yield dg.AssetCheckResult(
        check_name=CHECK_CONTEXT_REJECTIONS,
        passed=rejections == 0,
        metadata={"context_length_failures": rejections, "context_length_400s_retried": context_retries},
    )
    yield dg.AssetCheckResult(
        check_name=CHECK_TRUNCATION,
        passed=figures.truncation_rate <= settings.max_truncation_rate,
        severity=dg.AssetCheckSeverity.WARN,
        metadata={
            "truncated": figures.truncated,
            "completions": figures.ok,
            "truncation_rate": round(figures.truncation_rate, 4),
            "threshold": settings.max_truncation_rate,
        },
    )
    yield dg.AssetCheckResult(
        check_name=CHECK_DRIFT,
        passed=figures.drifted == 0,
        severity=dg.AssetCheckSeverity.WARN,
        metadata={
            "completions_with_drift": figures.drifted,
            "context_retries": context_retries,
            "drift_histogram": dg.MetadataValue.json(
                {str(k): v for k, v in sorted(figures.prompt_token_drift.items())}
            ),
        },
    )


def _config_check(effective: dict[str, Any], previous: dict[str, Any] | None) -> dg.AssetCheckResult:
    changes = config_differences(previous, effective)
    return dg.AssetCheckResult(
        check_name=CHECK_CONFIG,
        passed=not changes,
        severity=dg.AssetCheckSeverity.WARN,
        metadata={
            "changes": dg.MetadataValue.md("\n".join(f"- {c}" for c in changes) or "no change"),
            "first_run": previous is None,
        },
    )


def _duplicates_check(duplicates: int) -> dg.AssetCheckResult:
    # A second answer of a key costs its GPU time and is dropped on read; the shard lease makes it 0.
    return dg.AssetCheckResult(
        check_name=CHECK_DUPLICATES,
        passed=duplicates == 0,
        severity=dg.AssetCheckSeverity.WARN,
        metadata={"duplicate_completions": duplicates},
    )
