"""The plan (``expansion_dag.generation.plan``) in the Dagster layer: the budget asset's metadata before any GPU
time, and each shard's figures beside what its run then did, so that the next plan can be judged."""

from collections.abc import Callable, Sequence
from typing import Any

import dagster as dg
import polars as pl

from expansion_dag.core import OK, ModeIdentities
from expansion_dag.defs.assets.metadata import markdown_table
from expansion_dag.defs.resources import FleetResource, GenerationSettings
from expansion_dag.generation import (
    Observed,
    Plan,
    ShardPlan,
    ShardProgress,
    ShardReport,
    Throughput,
    WorkItem,
    expected_per_prompt,
    make_plan,
    prompt_keys,
)
from expansion_dag.servers import FleetInfo, read_throughputs
from expansion_dag.store import CompletionStore

PLAN_THROUGHPUT = "plan_tokens_per_s_per_server"


def priors(settings: GenerationSettings) -> Callable[[str], int]:
    return lambda source: settings.expected_output_by_source.get(source, settings.expected_output_tokens)


def throughput(fleet: FleetResource, fleet_info: FleetInfo, settings: GenerationSettings) -> Throughput:
    """Output tokens a second per server: what busy servers say now, else the setting."""
    busy = [t for t in read_throughputs(fleet_info.servers, api_key=fleet.api_key()).values() if t]
    if busy:
        label = " (simulator: not a GPU figure)" if fleet_info.simulated else ""
        return Throughput(sum(busy) / len(busy), f"live: /v1/loads gen_throughput of {len(busy)} busy server(s){label}")
    if settings.plan_output_tokens_per_s is not None:
        return Throughput(settings.plan_output_tokens_per_s, "setting: generation.plan_output_tokens_per_s")
    says = ("no server is busy enough to say (/v1/loads gen_throughput)"
            if any(s.dialect.loads_path for s in fleet_info.servers) else "the servers have no loads API to say it")
    return Throughput(None, f"{says} and generation.plan_output_tokens_per_s is not set")


def budget_plan(
    prompts: pl.DataFrame, store: CompletionStore, identities: ModeIdentities, fleet: FleetResource,
    fleet_info: FleetInfo, settings: GenerationSettings,
) -> Plan:
    """The plan for the budgeted ``prompts`` the store has no answer to yet."""
    observed = Observed(identities.owns)
    done = {r["key"] for r in observed.reading(store.latest_records(digest=True)) if r.get("status") == OK}
    answered = prompt_keys(prompts, identities).is_in(done) if prompts.height else pl.Series([], dtype=pl.Boolean)
    unreachable = (
        [f"{len(fleet_info.unreachable)} server(s) do not answer: {', '.join(fleet_info.unreachable)}"]
        if fleet_info.unreachable else []
    )
    return make_plan(
        prompts.filter(~answered) if prompts.height else prompts, observed, priors(settings),
        servers=len(fleet_info.servers), throughput=throughput(fleet, fleet_info, settings),
        simulated=fleet_info.simulated, done=int(answered.sum()), drop_truncated=settings.drop_truncated,
        problems=unreachable,
    )


def plan_metadata(plan: Plan) -> dict[str, Any]:
    return {"plan": dg.MetadataValue.md(plan.markdown()), **plan.figures()}


def planned_throughput(instance: dg.DagsterInstance) -> float | None:
    """The throughput the budget's plan used (None: it had none)."""
    event = instance.get_latest_materialization_event(dg.AssetKey("budgeted_prompts"))
    metadata = event.asset_materialization.metadata if event and event.asset_materialization else {}
    value = metadata[PLAN_THROUGHPUT].value if PLAN_THROUGHPUT in metadata else None
    return float(value) if value else None  # type: ignore[arg-type]


class ShardExpectation:
    """What the plan expects of the prompts a shard's run sends: each one's output tokens and chance
    of being cut, and the throughput the budget's plan used."""

    def __init__(
        self, items: Sequence[WorkItem], observed: Observed, settings: GenerationSettings,
        instance: dg.DagsterInstance, *, simulated: bool,
    ):
        frame = pl.DataFrame({"source": [i.source for i in items], "max_tokens": [i.max_tokens for i in items]},
                             schema={"source": pl.String, "max_tokens": pl.Int64})
        self.tokens, self.cut = expected_per_prompt(frame, observed, priors(settings))
        self.shard_plan = ShardPlan(float(self.tokens.sum()), planned_throughput(instance), simulated)


def plan_against_actual(
    expected: ShardExpectation, report: ShardReport, first_speed: ShardProgress | None
) -> dict[str, Any]:
    """The plan's figures for the prompts this run sent, the run's first measured speed and the time
    to finish it gave, beside what they did."""
    if not expected.tokens.size or not report.ok:
        return {}
    plan = expected.shard_plan
    planned_per_answer = float(expected.tokens.mean())
    actual_per_answer = report.output_tokens / report.ok
    planned_wall = plan.output_tokens / plan.tokens_per_s if plan.tokens_per_s else None
    servers = max(len(report.servers), 1)
    actual_speed = report.output_tokens / report.elapsed_s / servers if report.elapsed_s else 0.0
    said = (
        f"{first_speed.speed_tokens_per_s:,.1f} at {first_speed.elapsed_s:,.1f} s" if first_speed else "never measured"
    )
    said_wall = first_speed.elapsed_s + (first_speed.finish_s or 0.0) if first_speed else None
    rows = [
        ("output tokens an answer", round(planned_per_answer, 1), "", round(actual_per_answer, 1)),
        ("share cut at the cap", round(float(expected.cut.mean()), 4), "",
         round(report.finish_reasons["length"] / report.ok, 4)),
        ("output tokens/s per server", plan.tokens_per_s or "no throughput", said, round(actual_speed, 1)),
        ("wall time of the shard, s", round(planned_wall, 1) if planned_wall else "no throughput",
         round(said_wall, 1) if said_wall is not None else "never measured", round(report.elapsed_s, 1)),
    ]
    speed = {
        "speed_first_measured_at_s": first_speed.elapsed_s,
        "speed_first_tokens_per_s_per_server": first_speed.speed_tokens_per_s,
        "speed_first_wall_estimate_s": round(said_wall, 1),
        "speed_first_wall_estimate_error": round(said_wall / report.elapsed_s - 1, 4) if report.elapsed_s else 0.0,
        "speed_first_gpu_hours": first_speed.gpu_hours,
    } if first_speed is not None and said_wall is not None else {}
    return {
        "plan_against_actual": dg.MetadataValue.md(
            markdown_table(columns=["figure", "plan", "measured in the run", "actual"], rows=rows)
        ),
        "plan_output_tokens_per_answer": round(planned_per_answer, 1),
        "actual_output_tokens_per_answer": round(actual_per_answer, 1),
        **speed,
        # The GPU-hours the shard's own servers took, beside what its first measured speed said.
        "gpu_hours": round(report.elapsed_s * servers / 3600, 4),
    }
