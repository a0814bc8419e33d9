"""Nightly expansion from the run configuration file: each night takes the next quota with the
file's settings, and a re-run generates nothing twice."""

import datetime as dt

import dagster as dg
import yaml

from expansion_dag.config import load_config
from expansion_dag.core import base_prompt_id
from expansion_dag.definitions import build_definitions
from expansion_dag.defs import NIGHT_TAG, SHARD_KEYS, build_nightly_sensors
from expansion_dag.prompts import nights
from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag.store import CompletionStore
from expansion_dag_tests.helpers import prompts_answered

QUOTA = 50
#: Values a user edits in the file; the requests the fleet receives must carry them.
EDITED = {"temperature": 0.33, "max_output_tokens": 300, "chat_template_kwargs": {"enable_thinking": False}}


def config_file(tmp_path, urls):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "fleet": {"mode": "attach", "urls": urls},
        "storage": {"root": str(tmp_path / "storage")},
        "generation": {**EDITED, "backoff_initial_s": 0.01, "progress_interval_s": 1.0},
        "schedule": {"cron": "0 2 * * *", "timezone": "UTC", "quota": QUOTA},
    }))
    return path


def tick(defs, instance, day):
    when = dt.datetime(2026, 11, day, 2, 0, tzinfo=dt.timezone.utc)
    context = dg.build_schedule_context(instance=instance, scheduled_execution_time=when)
    return defs.get_schedule_def("nightly_expansion").evaluate_tick(context).run_requests[0]


def run_request(defs, instance, request, *, job_name, partition_key=None):
    """Launch a run request the way the daemon does: the named job, its tags and config."""
    result = defs.resolve_job_def(job_name).execute_in_process(
        instance=instance, partition_key=partition_key, tags=request.tags,
        run_config=request.run_config, asset_selection=request.asset_selection or None,
    )
    assert result.success
    return result


def run_night(defs, instance, day):
    request = tick(defs, instance, day)
    prepared = run_request(defs, instance, request, job_name="prepare_job")
    # What the daemon would do next: the shard runs, then the training set.
    success = instance.all_logs(prepared.run_id, of_type=dg.DagsterEventType.RUN_SUCCESS)[0]
    context = dg.build_run_status_sensor_context(
        sensor_name="nightly_shards", dagster_instance=instance,
        dagster_run=instance.get_run_by_id(prepared.run_id), dagster_event=success.dagster_event,
    )
    shard_requests = defs.get_sensor_def("nightly_shards")(context)
    assert [r.partition_key for r in shard_requests] == SHARD_KEYS
    assert {r.tags[NIGHT_TAG] for r in shard_requests} == {request.tags[NIGHT_TAG]}
    training_sensor = defs.get_sensor_def("nightly_training_set")
    skipped = training_sensor.evaluate_tick(dg.build_sensor_context(instance=instance))
    assert not skipped.run_requests and "waiting for shard-00" in skipped.skip_message
    for r in shard_requests:
        run_request(defs, instance, r, job_name="generate_job", partition_key=r.partition_key)
    [training] = training_sensor.evaluate_tick(dg.build_sensor_context(instance=instance)).run_requests
    assert training.run_key == f"{request.tags[NIGHT_TAG]}:training_set"
    run_request(defs, instance, training, job_name="training_set_job")
    return request


def completions_requests(fleet):
    return sum(prompts_answered(fleet.stats(i)) for i in range(len(SHARD_KEYS)))


def answered(tmp_path) -> tuple[int, int]:
    """Prompts with an answer in the store (a conversation once, however many turns) and the answers."""
    records = list(CompletionStore(tmp_path / "storage" / "completions").latest_records())
    return len({base_prompt_id(r) for r in records}), len(records)


def test_nights_take_fresh_quotas_with_the_files_settings_and_a_rerun_generates_nothing_twice(tmp_path, instance):
    config = SimServerConfig(port=0, max_running_requests=8, ttft_s=0.0, token_latency_s=0.0001,
                             output_median_tokens=80)
    with SimulatedFleet([config] * len(SHARD_KEYS)) as fleet:
        run_config = load_config(config_file(tmp_path, fleet.urls))
        defs = build_definitions(run_config)
        first = run_night(defs, instance, 27)
        # Every raw dataset (nothing loaded yet), prompts and the budget; not shards nor training set.
        assert len(first.asset_selection) == len(defs.assets) - 4
        # A night's quota counts prompts; a conversation's every turn is a request of its own.
        prompts, answers = answered(tmp_path)
        assert prompts == QUOTA and completions_requests(fleet) == answers
        # The schedule's runs sent what the file says, to the servers it names.
        for i in range(len(SHARD_KEYS)):
            sent = fleet.stats(i)["last_chat_request"]
            assert sent["temperature"] == EDITED["temperature"]
            assert sent["chat_template_kwargs"] == EDITED["chat_template_kwargs"]
            assert 0 < sent["max_tokens"] <= EDITED["max_output_tokens"]
        runs = instance.get_runs(filters=dg.RunsFilter(tags={NIGHT_TAG: "2026-11-27"}))
        assert {r.tags["expansion/config_digest"] for r in runs} == {run_config.digest()}

        second = run_night(defs, instance, 28)
        # The sources did not change: the second night does not reload them.
        assert set(second.asset_selection) == {dg.AssetKey("prompts"), dg.AssetKey("budgeted_prompts")}
        prompts, answers = answered(tmp_path)
        assert prompts == 2 * QUOTA and completions_requests(fleet) == answers

        taken = nights(tmp_path / "storage" / "nights")
        assert list(taken) == ["2026-11-27", "2026-11-28"]
        assert len(taken["2026-11-27"]) == len(taken["2026-11-28"]) == QUOTA
        assert not set(taken["2026-11-27"]) & set(taken["2026-11-28"])

        # Night 27 again (a re-run): the same prompts, all already generated, so no request.
        request = tick(defs, instance, 27)
        run_request(defs, instance, request, job_name="prepare_job")
        for shard in SHARD_KEYS:
            run_request(defs, instance, dg.RunRequest(partition_key=shard, tags=request.tags),
                        job_name="generate_job", partition_key=shard)
        assert completions_requests(fleet) == answers

    store = defs.resources["storage"].completion_store()
    assert len(store.scan().done) == answers  # one completion a request: nothing generated twice
    assert store.scan().duplicates == 0
    nightly = instance.get_runs(filters=dg.RunsFilter(tags={NIGHT_TAG: "2026-11-28"}))
    assert len(nightly) == 1 + len(SHARD_KEYS) + 1
    event = instance.get_latest_materialization_event(dg.AssetKey("training_set"))
    assert "2026-11-28" in event.asset_materialization.metadata["nights"].value


def test_a_prepare_run_by_hand_after_the_nights_does_not_stall_the_nightly_training_set(instance):
    """The sensor judges the night by the night's own prepare run, whatever ran after it."""

    @dg.op
    def step():
        pass

    jobs = {name: dg.GraphDefinition(name=name, node_defs=[step]).to_job() for name in
            ("prepare_job", "generate_job", "training_set_job")}  # fmt: skip
    [_, sensor] = build_nightly_sensors(**jobs)
    night = "2026-11-28"
    assert jobs["prepare_job"].execute_in_process(instance=instance, tags={NIGHT_TAG: night}).success
    for shard in SHARD_KEYS[:-1]:
        instance.report_runless_asset_event(dg.AssetMaterialization("completions", partition=shard))
    # A person re-prepares by hand (no night) while the last shard still runs.
    assert jobs["prepare_job"].execute_in_process(instance=instance).success

    waiting = sensor.evaluate_tick(dg.build_sensor_context(instance=instance))
    assert not waiting.run_requests and waiting.skip_message == f"night {night}: waiting for {SHARD_KEYS[-1]}"
    instance.report_runless_asset_event(dg.AssetMaterialization("completions", partition=SHARD_KEYS[-1]))
    [request] = sensor.evaluate_tick(dg.build_sensor_context(instance=instance)).run_requests
    assert request.run_key == f"{night}:training_set"
