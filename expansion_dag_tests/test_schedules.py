"""Nightly expansion: each night takes the next quota, re-runs generate nothing twice."""

import datetime as dt

import dagster as dg

from expansion_dag import definitions
from expansion_dag.ledger import nights
from expansion_dag.partitions import SHARD_KEYS
from expansion_dag.schedules import NIGHT_TAG, build_nightly_schedule, build_nightly_sensors
from expansion_dag.sim.config import SimServerConfig
from expansion_dag.sim.fleet import SimulatedFleet
from expansion_dag_tests.helpers import resources

QUOTA = 50
ASSETS = [*definitions.raw_datasets, definitions.prompts, definitions.budgeted_prompts,
          definitions.shard_prompts, definitions.completions, definitions.training_set]
schedule = build_nightly_schedule(prepare_job=definitions.prepare_job, raw_assets=definitions.raw_datasets,
                                  cron="0 2 * * *", timezone="UTC", quota=QUOTA)
shards_sensor, training_sensor = build_nightly_sensors(
    prepare_job=definitions.prepare_job, generate_job=definitions.generate_job,
    training_set_job=definitions.training_set_job,
)


def tick(instance, day):
    when = dt.datetime(2026, 11, day, 2, 0, tzinfo=dt.timezone.utc)
    return schedule.evaluate_tick(dg.build_schedule_context(instance=instance, scheduled_execution_time=when)).run_requests[0]


def run_request(instance, res, request, *, job_name, partition_key=None):
    """Launch a run request the way the daemon does: the named job, its tags and config."""
    jobs = dg.Definitions(
        assets=ASSETS, jobs=[definitions.prepare_job, definitions.generate_job, definitions.training_set_job],
        resources=res,
    )
    result = jobs.resolve_job_def(job_name).execute_in_process(
        instance=instance, partition_key=partition_key, tags=request.tags,
        run_config=request.run_config, asset_selection=request.asset_selection or None,
    )
    assert result.success
    return result


def run_night(instance, res, day):
    request = tick(instance, day)
    prepared = run_request(instance, res, request, job_name="prepare_job")
    # What the daemon would do next: the shard runs, then the training set.
    success = instance.all_logs(prepared.run_id, of_type=dg.DagsterEventType.RUN_SUCCESS)[0]
    context = dg.build_run_status_sensor_context(
        sensor_name="nightly_shards", dagster_instance=instance,
        dagster_run=instance.get_run_by_id(prepared.run_id), dagster_event=success.dagster_event,
    )
    shard_requests = shards_sensor(context)
    assert [r.partition_key for r in shard_requests] == SHARD_KEYS
    assert {r.tags[NIGHT_TAG] for r in shard_requests} == {request.tags[NIGHT_TAG]}
    skipped = training_sensor.evaluate_tick(dg.build_sensor_context(instance=instance))
    assert not skipped.run_requests and "waiting for shard-00" in skipped.skip_message
    for r in shard_requests:
        run_request(instance, res, r, job_name="generate_job", partition_key=r.partition_key)
    [training] = training_sensor.evaluate_tick(dg.build_sensor_context(instance=instance)).run_requests
    assert training.run_key == f"{request.tags[NIGHT_TAG]}:training_set"
    run_request(instance, res, training, job_name="training_set_job")
    return request


def completions_requests(fleet):
    return sum(fleet.stats(i)["completed"] for i in range(len(SHARD_KEYS)))


def test_nights_take_fresh_quotas_and_a_rerun_generates_nothing_twice(tmp_path, instance):
    config = SimServerConfig(port=0, max_running_requests=8, ttft_s=0.0, token_latency_s=0.0001,
                             output_median_tokens=80)
    with SimulatedFleet([config] * len(SHARD_KEYS)) as fleet:
        res = resources(fleet.urls, tmp_path)
        first = run_night(instance, res, 27)
        assert len(first.asset_selection) == len(definitions.raw_datasets) + 2  # nothing loaded yet
        assert completions_requests(fleet) == QUOTA

        second = run_night(instance, res, 28)
        # The sources did not change: the second night does not reload them.
        assert set(second.asset_selection) == {dg.AssetKey("prompts"), dg.AssetKey("budgeted_prompts")}
        assert completions_requests(fleet) == 2 * QUOTA

        taken = nights(tmp_path / "nights")
        assert list(taken) == ["2026-11-27", "2026-11-28"]
        assert len(taken["2026-11-27"]) == len(taken["2026-11-28"]) == QUOTA
        assert not set(taken["2026-11-27"]) & set(taken["2026-11-28"])

        # Night 27 again (a re-run): the same prompts, all already generated, so no request.
        request = tick(instance, 27)
        run_request(instance, res, request, job_name="prepare_job")
        for shard in SHARD_KEYS:
            run_request(instance, res, dg.RunRequest(partition_key=shard, tags=request.tags),
                        job_name="generate_job", partition_key=shard)
        assert completions_requests(fleet) == 2 * QUOTA

    store = res["storage"].completion_store()
    assert sum(len(store.scan(s).done) for s in SHARD_KEYS) == 2 * QUOTA
    assert all(store.scan(s).duplicates == 0 for s in SHARD_KEYS)
    nightly = instance.get_runs(filters=dg.RunsFilter(tags={NIGHT_TAG: "2026-11-28"}))
    assert len(nightly) == 1 + len(SHARD_KEYS) + 1
    event = instance.get_latest_materialization_event(dg.AssetKey("training_set"))
    assert "2026-11-28" in event.asset_materialization.metadata["nights"].value
