"""The metadata of a shard's materialization: what the run sent and got, where its tokens went,
how the queue foresaw the answers' lengths, and its modes."""

from __future__ import annotations

import json
from typing import Any

import dagster as dg
import polars as pl

from expansion_dag.core import DEFAULT_MODE, ModeIdentities
from expansion_dag.defs.assets.metadata import markdown_table
from expansion_dag.defs.assets.shard_steps import Standing, Target, Todo
from expansion_dag.generation import Estimate, ShardReport, ShardWork, bucket_label, cell_estimates


def shard_metadata(
    report: ShardReport, shard: str, target: Target, standing: Standing, work: ShardWork, identities: ModeIdentities,
    prompts: pl.DataFrame, todo: Todo, effective: dict[str, Any], drop_truncated: bool,
) -> dict[str, Any]:
    """Everything a shard's materialization reports but the plan's figures."""
    metadata = _metadata(report, shard, target, standing, standing.keys & work.done, effective)
    metadata |= _mode_metadata(identities, prompts)
    metadata |= _waste_metadata(report, drop_truncated) | {"degenerate_total": standing.figures.degenerate}
    # This run's stopped loops by the detector's rule that saw each.
    metadata["degenerate_by_rule"] = dg.MetadataValue.json(dict(report.degenerate_by_rule))
    if report.loop_retried:  # generation.loop_retries: loops asked again, and the second answers that ended
        metadata["loop_retries"] = dg.MetadataValue.json(dict(report.loop_retried))
    metadata |= _yield_metadata(report)
    if work.conversations:
        metadata |= {"conversations": work.conversations, "conversations_ended_early": standing.figures.ended}
    after = cell_estimates(todo.lengths, todo.cells)
    return metadata | _order_metadata(todo.learned_from_store, todo.estimates_before, after)


def _mode_metadata(identities: ModeIdentities, prompts: pl.DataFrame) -> dict[str, Any]:
    """The shard's prompts per generation mode, and each mode's settings fingerprint."""
    if len(identities.by_mode) == 1:
        return {}
    counts = dict(prompts.group_by("mode").len().iter_rows()) if "mode" in prompts.columns else {DEFAULT_MODE: prompts.height}
    return {
        "prompts_by_mode": dg.MetadataValue.json({name: counts.get(name, 0) for name in identities.by_mode}),
        "mode_fingerprints": dg.MetadataValue.json({n: i.fingerprint for n, i in identities.by_mode.items()}),
    }


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
        # Of those, stopped loops whose text before the loop becomes a row, cut (``loop_prefix: keep``).
        "answers_to_rows_cut_at_loop": answers.loop_rows,
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
    report: ShardReport, shard: str, target: Target, standing: Standing, done_before: set[str], effective: dict[str, Any]
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
        "server": target.url,
        "server_is_fallback": target.fell_back,
        # A loop is seen only as an event comes: the tokens an event holds, and whether the client
        # asks for it in each request (vLLM) or the server streams at its launch setting (SGLang).
        "stream_interval": target.server.stream_interval,
        "stream_interval_set_by": "request" if target.server.dialect.stream_interval_per_request else "server launch",
        "simulated_fleet": simulated,
        "completions_total": standing.done,
        "failed_total": standing.failed,
        "missing_total": standing.missing,
        "completed_before_this_run": len(done_before),
        "torn_lines_ignored": standing.final.torn_lines,
        "duplicate_lines_ignored": standing.final.duplicates,
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
