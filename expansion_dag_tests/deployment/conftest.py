"""Deployment fixtures: a real PostgreSQL server, and the pipeline run through `dagster dev` as a
user runs it from the UI (a backfill, a dead server, a re-execution from failure).

Both are session-scoped: starting `dagster dev` costs ~20 s, and the UI test looks at the very
instance the backfill test drove.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag.store import CompletionStore
from expansion_dag_tests.deployment.support import (
    DagsterDev,
    PostgresServer,
    isolated_env,
    make_dagster_home,
    wait_for,
)

SHARDS = ["shard-00", "shard-01"]
KILLED = 1  # shard-01's server dies mid-backfill
#: About 3 s a request (160 tokens at 20 ms) on 32 slots: a shard of ~90 prompts takes ~15 s, so
#: the kill lands mid-shard.
SLOW_SERVER = SimServerConfig(port=0, max_running_requests=32, ttft_s=0.05, token_latency_s=0.02,
                              output_median_tokens=160, output_sigma=0.5)
#: The backfill's run config (the re-execution inherits it): the requests in flight at the kill go
#: through their retries in under a second instead of ~17 s, so the failed run ends within one of
#: the daemon's 30 s passes over backfills rather than two.
# Pinned shards: the killed server's shard must fail, and every answer is its own server's.
FAST_RETRIES = {"resources": {"settings": {"config": {"backoff_initial_s": 0.05, "spill_to_idle_servers": False}}}}
BACKFILL_DONE = {"COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED"}
RUN_DONE = {"SUCCESS", "FAILURE", "CANCELED"}
# The daemon looks at backfills every 30 s: a backfill needs two of its passes at least.
BACKFILL_TIMEOUT_S = 240


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    server = PostgresServer()
    try:
        server.create()
        yield server
    finally:
        server.remove()


@dataclass
class UIPipeline:
    """What the user saw while running the pipeline from the UI, and the instance left behind."""

    dev: DagsterDev
    fleet: SimulatedFleet  # the simulated servers, in shard order
    urls: list[str]
    storage: Path
    done_at_kill: int  # completions of the killed shard when its server died
    first_backfill: dict[str, Any]
    after_first: dict[str, list[str]]  # completions' partition statuses
    checks_after_first: dict[str, dict[str, list[str]]]  # completions' checks, partitions by status
    blocked_training: tuple[str, list[str]]  # a training_set_job run between the backfills: status, step errors
    second_backfill: dict[str, Any]
    after_second: dict[str, list[str]]
    checks_after_second: dict[str, dict[str, list[str]]]
    parts_backfill: dict[str, Any]  # training_set_parts, a run per shard
    training_run: str  # status of the training_set_job run launched afterwards


def _finished(dev: DagsterDev, backfill_id: str) -> dict[str, Any] | None:
    backfill = dev.backfill(backfill_id)
    return backfill if backfill["status"] in BACKFILL_DONE else None


def _run_finished(dev: DagsterDev, run_id: str) -> str | None:
    status = dev.run_status(run_id)
    return status if status in RUN_DONE else None


@pytest.fixture(scope="session")
def ui_pipeline(tmp_path_factory) -> Iterator[UIPipeline]:
    tmp = tmp_path_factory.mktemp("ui")
    storage = tmp / "storage"
    store = CompletionStore(storage / "completions")
    home = make_dagster_home(tmp / "home")
    with SimulatedFleet([SLOW_SERVER] * len(SHARDS)) as fleet:
        env = isolated_env(
            EXPANSION_PROFILE="production",
            EXPANSION_FLEET_URLS=",".join(fleet.urls),
            EXPANSION_FLEET_FALLBACK="0",  # the shard must fail, not move to the healthy server
            EXPANSION_STORAGE=storage,
        )
        dev = DagsterDev(home, env, tmp / "dagster-dev.log")
        try:
            # The Launchpad, with the in-process executor: nine small steps, no process each.
            prepare = dev.launch_run("prepare_job", {"execution": {"config": {"in_process": {}}}})
            assert wait_for("prepare_job to finish", lambda: _run_finished(dev, prepare), 180) == "SUCCESS"

            first_id = dev.launch_backfill(["shard_prompts", "completions"], SHARDS, FAST_RETRIES)

            def both_generating() -> bool:
                assert _finished(dev, first_id) is None, "the backfill ended before the kill"
                return all(len(store.scan(s).done) >= 5 for s in SHARDS)

            # Both shards past their fleet probe and writing: then the kill lands mid-shard.
            wait_for("both shards to write completions", both_generating, 180)
            done_at_kill = len(store.scan(SHARDS[KILLED]).done)
            fleet.kill(KILLED)
            first = wait_for("the backfill to finish", lambda: _finished(dev, first_id), BACKFILL_TIMEOUT_S, 1)
            after_first = dev.partition_statuses("completions")
            checks_after_first = dev.check_statuses("completions")
            # The training set, asked for while shard-01's checks stand failed: it must refuse.
            blocked = dev.launch_run("training_set_job")
            blocked_status = wait_for("the blocked training_set_job to finish", lambda: _run_finished(dev, blocked), 180)

            fleet.restart(KILLED)
            second_id = dev.reexecute_backfill_from_failure(first_id)

            def all_materialized() -> bool:
                ended = _finished(dev, second_id)
                assert ended is None or ended["status"] == "COMPLETED_SUCCESS", f"the re-execution ended {ended}"
                return sorted(dev.partition_statuses("completions")["materializedPartitions"]) == SHARDS

            wait_for("every shard to be materialized", all_materialized, BACKFILL_TIMEOUT_S, 1)
            # Each shard's parts of the training set in a run of its own, launched while the daemon
            # closes the re-execution: the waits overlap. The set then only assembles them.
            parts_id = dev.launch_backfill(["training_set_parts"], SHARDS, {})
            second = wait_for("the re-execution to finish", lambda: _finished(dev, second_id), BACKFILL_TIMEOUT_S, 1)
            parts = wait_for("the parts backfill to finish", lambda: _finished(dev, parts_id), BACKFILL_TIMEOUT_S, 1)
            training = dev.launch_run("training_set_job")
            training_status = wait_for("training_set_job to finish", lambda: _run_finished(dev, training), 180)
            yield UIPipeline(
                dev=dev,
                fleet=fleet,
                urls=fleet.urls,
                storage=storage,
                done_at_kill=done_at_kill,
                first_backfill=first,
                after_first=after_first,
                checks_after_first=checks_after_first,
                blocked_training=(blocked_status, dev.step_failures(blocked)),
                second_backfill=second,
                after_second=dev.partition_statuses("completions"),
                checks_after_second=dev.check_statuses("completions"),
                parts_backfill=parts,
                training_run=training_status,
            )
        except BaseException:
            print(dev.log_tail())  # shown with the failure: what the daemon and the runs said
            raise
        finally:
            dev.stop()
