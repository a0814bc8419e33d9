"""Stage 4: generated completions, one partition per shard, each on its own GPU server.

The asset is a thin shell over ``expansion_dag.generation.engine``: it picks the prompts that have no
completion of the current identity anywhere in the store (whichever shard wrote it: shard
membership changes with the shard count and the budget's priors), runs them, and turns the shard
report into metadata. The checks judge the shard's records as the store holds them
(``expansion_dag.generation.shard_figures``), read back after the run; what only this run saw (its
context-length retries) is added to them. A shard whose failures exceed ``max_failure_rate`` fails
its materialization (so "backfill failed partitions" picks it up) after every success has been
written; the next run sends only what is missing.
"""

import json
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import dagster as dg
import polars as pl

from expansion_dag.core import DEFAULT_MODE, ModeIdentities, ShardAborted
from expansion_dag.defs import resource_fields, run_configuration_file, shard_index, shard_partitions
from expansion_dag.defs.assets.blocking_checks import record_verdicts
from expansion_dag.defs.assets.metadata import markdown_table
from expansion_dag.defs.assets.plan import ShardExpectation, plan_against_actual
from expansion_dag.defs.assets.progress import ShardProgressReporter
from expansion_dag.defs.resources import FleetResource, GenerationSettings, StorageResource
from expansion_dag.generation import (
    Estimate,
    Observed,
    Server,
    ShardFigures,
    ShardReport,
    ShardWork,
    bucket_label,
    cell_estimates,
    ended_record,
    generate_shard,
    learn,
    shard_figures,
)
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
        _spec(CHECK_CONTEXT_REJECTIONS, "No request was rejected for exceeding the context length."),
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
    # send is chosen, and sent, under the shard's lease (expansion_dag.store.lease).
    with storage.shard_lease(context.partition_key, run_id=context.run.run_id, log=context.log) as lease:
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
    fleet_info = fleet.info  # provisioned and probed as the run started
    url, fell_back = fleet.server_for_shard(shard_index(shard))
    if fell_back:
        context.log.warning(f"{shard}: its own server is down; running on healthy server {url}")
    server = fleet_info.server(url)
    if settings.stop_degenerate and server.stream_interval < fleet.stream_interval:
        # An attached SGLang server streams at its own launch setting; one event a token costs the
        # client about 6x the CPU of 256-token events (BENCHMARKS.md, waste and tail).
        context.log.warning(
            f"{url} streams {server.stream_interval} token(s) an event, fewer than the configured "
            f"{fleet.stream_interval}: launch it with --stream-interval {fleet.stream_interval} "
            "(SGLang takes it only at launch) to spare the client's CPU"
        )
    # Other servers lend idle slots; vLLM has no /v1/loads to say when they are idle.
    helpers = (
        [
            Server(url=s.url, slots=s.slots, dialect=s.dialect, stream_interval=s.stream_interval,
                   tool_choice=s.tool_choice)
            for s in fleet_info.servers
            if s.url != url
        ]
        if settings.spill_to_idle_servers and fleet.backend == "sglang"
        else []
    )
    sampling = settings.sampling()
    # The weights' probe goes with the identities: registering them stops the run before any request
    # when the store's answers of this identity came from other weights.
    probe = fleet.weights_probe([url], log=context.log)
    identities = ModeIdentities(settings.mix(), fleet_info.identity, fleet_info.simulated, probe=probe)
    has_conversations = "conversation" in shard_prompts.columns and shard_prompts["conversation"].null_count() < shard_prompts.height
    work = ShardWork(
        shard_prompts, identities, retry_outcomes=settings.retry_outcomes,
        planner=settings.turn_planner(int(shard_prompts["context_length"][0]), identities) if has_conversations else None,
    )
    store = storage.completion_store()
    # Expected answer lengths, learned from the mix's completions in the store (earlier nights,
    # other shards; the whole store: a prompt may have moved between shards) and refined by the
    # run: they order the queue, the typed priors only where nothing was learned. The same pass
    # finds what is done and what is final: prompts the model answered (a loop included) are not
    # asked again unless the user names their outcome.
    # The same pass notes what the plan would have said of this run's prompts, to put beside what they did.
    observed = Observed(identities.owns)
    lengths = learn(observed.reading(work.reading(store.latest_records(digest=True))), identities.owns)
    learned_from_store = lengths.answers
    items, endings = work.items(lambda keys: {r["key"]: r for r in store.latest_records() if r["key"] in keys})
    waiting = len(work.firsts) - len(items) - len(endings)
    context.log.info(
        f"{shard}: {len(work.firsts)} prompts ({work.conversations} of them conversations, asked turn by turn), "
        f"{waiting} done or final (answers stopped as loops are final: --retry-outcomes degenerate asks them again), "
        f"{len(items)} to send to {url} ({server.slots} slots)"
    )
    cells = [(i.source, i.prompt_tokens, i.expected_output_tokens) for i in items]
    estimates_before = cell_estimates(lengths, cells)
    expected = ShardExpectation(items, observed, settings, context.instance, simulated=fleet_info.simulated)
    aborted: str | None = None
    # Registering the identity refuses a simulated run in a real store (and the reverse) before any request.
    with store.writer(shard, identities=identities.identities, check=lease.check) as writer:
        for ended, item in endings:  # resumed conversations whose next turn no longer fits
            writer.append(ended_record(ended, item, url))
        progress = ShardProgressReporter(context, shard, plan=expected.shard_plan)
        try:
            report = generate_shard(
                items,
                [Server(url=url, slots=server.slots, dialect=server.dialect, stream_interval=server.stream_interval,
                        tool_choice=server.tool_choice)],
                writer=writer,
                model=fleet_info.model,
                sampling=sampling,
                config=settings.engine_config(),
                helpers=helpers,
                fleet_urls=[s.url for s in fleet_info.servers],
                api_key=fleet.api_key(),
                lengths=lengths,
                on_progress=progress,
                planner=work.planner,
                # The training set's own rules, on each answer as it arrives: the yield and its gate.
                judge=AnswerJudge(
                    settings.load_tokenizer(), settings.training_set_config(fleet_info.context_length), identities
                ),
            )
        except ShardAborted as exc:
            aborted = str(exc)
            report = exc.report if isinstance(exc.report, ShardReport) else ShardReport(total=len(items))
        progress.close()  # the last figures, whatever the throttle held back

    # The shard's standing across every run and every shard folder, not only this one.
    final = store.scan()
    # Where each prompt stands: its key, or for a conversation that of its furthest turn.
    shard_keys = work.frontier_keys(store.latest_records(digest=True))
    done = len(shard_keys & final.done)
    failed = len(shard_keys & final.failed)
    missing = len(shard_keys) - done - failed
    # Answers stopped as loops are the model's, not the fleet's: dropped and counted as waste,
    # they do not fail the shard (a loop share above max_failure_rate is normal for reasoning models).
    figures = stored_figures(store, shard, shard_keys, identities.owns, done_anywhere=final.done)
    effective = {
        "fleet": fleet.effective_config(fleet_info, url),
        "settings": settings.as_metadata(),
        # The resources as this run configured them (file, variables, launchpad), and the file.
        "fleet_resource": resource_fields(fleet),
        "storage_resource": resource_fields(storage),
        "run_configuration": run_configuration_file(),
    }
    previous = _previous_effective_config(context, shard)

    checks = [
        *stored_checks(figures, settings, context_retries=report.context_retries),
        _config_check(effective, previous),
        _duplicates_check(final.duplicates_by_shard[shard]),
    ]
    record_verdicts(storage, shard, context.run.run_id, checks, BLOCKING_CHECKS)  # what the training set reads
    metadata = _metadata(report, shard, url, fell_back, done, failed, missing, shard_keys & work.done, final, effective)
    metadata |= _mode_metadata(identities, shard_prompts)
    metadata |= _waste_metadata(report, settings.drop_truncated) | {"degenerate_total": figures.degenerate}
    # This run's stopped loops by the detector's rule that saw each.
    metadata["degenerate_by_rule"] = dg.MetadataValue.json(dict(report.degenerate_by_rule))
    metadata |= _yield_metadata(report)
    metadata |= plan_against_actual(expected, report, progress.first_speed)
    if work.conversations:
        metadata |= {"conversations": work.conversations, "conversations_ended_early": figures.ended}
    metadata |= _order_metadata(learned_from_store, estimates_before, cell_estimates(lengths, cells))
    failure_rate = figures.failure_rate
    if aborted or failure_rate > settings.max_failure_rate or missing:
        reason = aborted or (
            f"{figures.failed} of {figures.prompts} prompts failed ({failure_rate:.1%} > max_failure_rate "
            f"{settings.max_failure_rate:.1%})"
            if failure_rate > settings.max_failure_rate
            else f"{missing} prompts have neither a completion nor a failure record"
        )
        _log_failures(context, store, shard)
        # No materialization to carry them: the failed step records the shard's checks itself.
        yield from checks
        raise dg.Failure(
            description=f"{shard}: {reason}. {done} completions are kept; re-materialize to send only the rest.",
            metadata=metadata,
        )
    yield dg.MaterializeResult(metadata=metadata, check_results=checks)


def _mode_metadata(identities: ModeIdentities, prompts: pl.DataFrame) -> dict[str, Any]:
    """The shard's prompts per generation mode, and each mode's settings fingerprint."""
    if len(identities.by_mode) == 1:
        return {}
    counts = dict(prompts.group_by("mode").len().iter_rows()) if "mode" in prompts.columns else {DEFAULT_MODE: prompts.height}
    return {
        "prompts_by_mode": dg.MetadataValue.json({name: counts.get(name, 0) for name in identities.by_mode}),
        "mode_fingerprints": dg.MetadataValue.json({n: i.fingerprint for n, i in identities.by_mode.items()}),
    }


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


def _waste_metadata(report: ShardReport, drop_truncated: bool) -> dict[str, Any]:
    """What this run generated that the training set will not hold (``drop_truncated``: its setting)."""
    return {
        "output_tokens_generated": report.generated_output_tokens,
        "output_tokens_kept": report.kept_output_tokens(drop_truncated),
        "useful_token_share": round(report.useful_token_share(drop_truncated), 4),
        # Send to outcome, queueing at the server included; keyed by finish reason or failure kind.
        "dropped_slot_seconds_by_reason": dg.MetadataValue.json(report.dropped_slot_seconds(drop_truncated)),
    }


def _yield_metadata(report: ShardReport) -> dict[str, Any]:
    """This run's answers as the training set will judge them, and the yield gate's state."""
    answers = report.answer_yield
    return {
        "answer_yield": answers.summary(),
        "answers_judged": answers.judged,
        "answers_to_rows": answers.rows,
        "answers_left_out_by_reason": dg.MetadataValue.json(answers.left_out()),
        "yield_gate": answers.gate_state,
    }


def _order_metadata(
    learned_from_store: int,
    before: dict[tuple[str, int], tuple[int, Estimate]],
    after: dict[tuple[str, int], tuple[int, Estimate]],
) -> dict[str, Any]:
    def basis(estimate: Estimate) -> str:
        return "typed prior" if estimate.basis == "prior" else f"{estimate.answers} answers ({estimate.basis})"

    rows = [
        (cell[0], bucket_label(cell[1]), n, start.tokens, basis(start), after[cell][1].tokens, basis(after[cell][1]))
        for cell, (n, start) in before.items()
    ]
    return {
        "answer_lengths_learned_from_store": learned_from_store,
        "expected_answer_lengths": dg.MetadataValue.md(
            markdown_table(
                columns=["source", "prompt tokens", "prompts", "expected at start", "from", "expected at end", "from"],
                rows=rows,
            )
        ),
    }


def _rounded(value: float | None) -> float | str:
    return "n/a" if value is None else round(value, 4)


def _metadata(
    report: ShardReport,
    shard: str,
    url: str,
    fell_back: bool,
    done: int,
    failed: int,
    missing: int,
    done_before: set[str],
    final,
    effective: dict[str, Any],
) -> dict[str, Any]:
    simulated = bool(effective["fleet"].get("simulator"))
    label = " (simulator)" if simulated else ""
    clairvoyant = report.clairvoyant_makespan_s()
    # Idle servers that took some of this shard's prompts are listed too; their utilization is
    # the share of their slots this shard used.
    per_server = [
        (
            server_url,
            role,
            stats.slots,
            stats.requests,
            stats.output_tokens,
            round(stats.output_tokens / report.elapsed_s, 1) if report.elapsed_s else 0.0,
            round(stats.busy_slot_seconds / (stats.slots * report.elapsed_s), 4) if report.elapsed_s else 0.0,
        )
        for role, servers in (("own", report.servers), ("idle, helped", report.helpers))
        for server_url, stats in servers.items()
        if role == "own" or stats.requests
    ]
    truncation = [
        (source, total, report.truncated_by_source.get(source, 0), round(report.truncated_by_source.get(source, 0) / total, 4))
        for source, total in sorted(report.requests_by_source.items())
    ]
    return {
        "shard": shard,
        "server": url,
        "server_is_fallback": fell_back,
        "simulated_fleet": simulated,
        "completions_total": done,
        "failed_total": failed,
        "missing_total": missing,
        "completed_before_this_run": len(done_before),
        "torn_lines_ignored": final.torn_lines,
        "duplicate_lines_ignored": final.duplicates,
        "sent_this_run": report.done,
        "requests_by_outcome": dg.MetadataValue.json({"ok": report.ok, **dict(report.failures_by_kind)}),
        "finish_reasons": dg.MetadataValue.json(dict(report.finish_reasons)),
        "truncation_by_source": dg.MetadataValue.md(
            markdown_table(columns=["source", "completions", "finish_reason length", "rate"], rows=truncation)
        ),
        "output_tokens": report.output_tokens,
        "elapsed_s": round(report.elapsed_s, 2),
        # Figures from a simulated fleet say so: they are not GPU throughput.
        "output_tokens_per_s": round(report.output_tokens / report.elapsed_s, 1) if report.elapsed_s else 0.0,
        "fleet_utilization": round(report.utilization(), 4),
        # The client's own cost, to see how many servers one process can feed.
        "client_cpu_s": round(report.client_cpu_s, 2),
        "client_cpu_ms_per_request": round(1000 * report.client_cpu_s / report.done, 3) if report.done else 0.0,
        "servers": dg.MetadataValue.md(
            markdown_table(
                columns=["server", "role", "slots", "requests", "output tokens", f"output tok/s{label}", "utilization"],
                rows=per_server,
            )
        ),
        "requests_on_idle_servers": sum(s.requests for s in report.helpers.values()),
        # Per other server, why its load readings did or did not lead to borrowing it (its own
        # shard not started, using its slots, ...): readings counted by reason.
        "borrowing_by_server": dg.MetadataValue.json(
            {url: dict(s.borrowing) for url, s in report.helpers.items() if s.borrowing}
        ),
        "context_retries": report.context_retries,
        "queue_reorders": report.reorders,
        # Whose fault the failures were is the taxonomy's (expansion_dag.core.outcomes): a full queue is
        # backpressure, waited out or sent elsewhere, never a prompt's attempt.
        "attempts_sent": report.attempts,
        "queue_full_answers": report.backpressure,
        # How well the queue foresaw the long answers: the rank correlation of expected against
        # actual lengths, and the makespan against a clairvoyant longest-first schedule of the
        # answers' own service times on the own slots (under 1 when idle servers helped).
        "length_rank_correlation": _rounded(report.length_rank_correlation()),
        "clairvoyant_makespan_s": round(clairvoyant, 2),
        "makespan_over_clairvoyant_bound": _rounded(report.elapsed_s / clairvoyant if clairvoyant > 0 else None),
        "effective_config": dg.MetadataValue.json(json.loads(json.dumps(effective, default=str))),
        "aborted": report.aborted or "",
    }
