"""Nightly expansion, without a person: prepare, then every shard, then the training set.

1. ``nightly_expansion`` (a schedule: the run configuration's ``schedule`` section, cron, time zone
   and quota, default 02:00 UTC and 1000) launches ``prepare_job`` for the night:
   only the raw datasets whose source revision or files changed, then prompts, then the night's
   budget (the next ``quota`` prompts nothing has generated, see ``ledger.py``).
2. ``nightly_shards`` (on that run's success) launches one ``generate_job`` run per shard.
3. ``nightly_training_set`` launches ``training_set_job`` once every shard has a completions
   materialization newer than the night's prepare run, whether the shard succeeded at once or
   after a backfill of failed partitions.
Run keys carry the night, so a re-evaluated tick never launches a night twice. The jobs are passed in.

Why these are written here rather than as Dagster's declarative automation (``AutomationCondition``,
read in dagster 1.13):

- the prepare run carries run configuration, the night and its quota (``NightConfig``); runs that
  automation conditions request carry none;
- a night's shard runs belong to that night's prepare run alone: ``eager()`` on the shards would
  also send eight GPU runs after any prepare a person materializes by hand, and their run keys
  (the night) are what keep a re-evaluated tick from launching a night twice;
- the training set waits for every shard of *the night*, however long it runs: ``on_cron`` counts
  updates since the latest cron tick, so a night that runs longer than a day (the reference run
  takes one) would be forgotten at the next tick, and ``all_deps_match`` holds when *one*
  partition of the shards matches, not all eight.
"""

from collections.abc import Sequence

import dagster as dg

from expansion_dag.defs.partitions import SHARD_KEYS

NIGHT_TAG = "expansion/night"
CODE_VERSION_TAG = "dagster/code_version"


def stale_raw_assets(instance: dg.DagsterInstance, raw_assets: Sequence[dg.AssetsDefinition]) -> list[dg.AssetKey]:
    """Raw datasets never loaded, or whose source fingerprint (their code version) has changed."""
    stale = []
    for assets_def in raw_assets:
        key = assets_def.key
        event = instance.get_latest_materialization_event(key)
        loaded = event.asset_materialization.tags.get(CODE_VERSION_TAG) if event and event.asset_materialization else None
        if loaded != assets_def.code_versions_by_key[key]:
            stale.append(key)
    return stale


def latest_nightly_prepare(instance: dg.DagsterInstance, job_name: str) -> dg.DagsterRun | None:
    """The latest night's successful prepare run. Prepare runs a person starts carry no night, and
    one that succeeds after the night's must not hide the night from the training set's sensor."""
    nights = sorted(value for key, values in instance.get_run_tags(tag_keys=[NIGHT_TAG]) for value in values)
    for night in reversed(nights):
        runs = instance.get_runs(
            filters=dg.RunsFilter(job_name=job_name, statuses=[dg.DagsterRunStatus.SUCCESS], tags={NIGHT_TAG: night}),
            limit=1,
        )
        if runs:
            return runs[0]
    return None


def build_nightly_schedule(
    *,
    prepare_job,
    raw_assets: Sequence[dg.AssetsDefinition],
    cron: str,
    timezone: str,
    quota: int,
) -> dg.ScheduleDefinition:
    @dg.schedule(
        name="nightly_expansion",
        cron_schedule=cron,
        execution_timezone=timezone,
        job=prepare_job,
        description=f"Each night, take the next {quota:,} prompts nothing has generated and expand them.",
    )
    def nightly_expansion(context: dg.ScheduleEvaluationContext) -> dg.RunRequest:
        night = context.scheduled_execution_time.strftime("%Y-%m-%d")
        keys = [*stale_raw_assets(context.instance, raw_assets), dg.AssetKey("prompts"), dg.AssetKey("budgeted_prompts")]
        return dg.RunRequest(
            run_key=f"{night}:prepare",
            asset_selection=keys,
            tags={NIGHT_TAG: night},
            run_config={"ops": {"budgeted_prompts": {"config": {"night": night, "quota": quota}}}},
        )

    return nightly_expansion


def build_nightly_sensors(
    *,
    prepare_job,
    generate_job,
    training_set_job,
) -> list[dg.SensorDefinition]:
    @dg.run_status_sensor(
        name="nightly_shards",
        run_status=dg.DagsterRunStatus.SUCCESS,
        monitored_jobs=[prepare_job],
        request_job=generate_job,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="After a night's prepare run, one generation run per shard.",
    )
    def nightly_shards(context: dg.RunStatusSensorContext):
        night = context.dagster_run.tags.get(NIGHT_TAG)
        if not night:
            return dg.SkipReason("not a nightly run")
        return [
            dg.RunRequest(run_key=f"{night}:{shard}", partition_key=shard, tags={NIGHT_TAG: night})
            for shard in SHARD_KEYS
        ]

    @dg.sensor(
        name="nightly_training_set",
        job=training_set_job,
        minimum_interval_seconds=60,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Once every shard of the night is generated, rebuild the training set.",
    )
    def nightly_training_set(context: dg.SensorEvaluationContext):
        prepared = latest_nightly_prepare(context.instance, prepare_job.name)
        if prepared is None:
            return dg.SkipReason("no nightly prepare run yet")
        night = prepared.tags[NIGHT_TAG]
        stats = context.instance.get_run_stats(prepared.run_id)
        waiting = [
            shard
            for shard in SHARD_KEYS
            if not context.instance.fetch_materializations(
                dg.AssetRecordsFilter(
                    asset_key=dg.AssetKey("completions"),
                    asset_partitions=[shard],
                    after_timestamp=stats.end_time or 0.0,
                ),
                limit=1,
            ).records
        ]
        if waiting:
            return dg.SkipReason(f"night {night}: waiting for {', '.join(waiting)}")
        return dg.RunRequest(run_key=f"{night}:training_set", tags={NIGHT_TAG: night})

    return [nightly_shards, nightly_training_set]
