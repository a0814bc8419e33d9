"""The Dagster instance on PostgreSQL, as deploy/postgres/dagster.yaml sets it up: the README's
`expansion-dag run` works on it, its runs, event logs and schedule state are in the database
afterwards, and a stopped database is a quick, clear error rather than a hang.
"""

import contextlib
import subprocess
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pytest

from expansion_dag_tests.deployment.support import BIN, ROOT, isolated_env, make_dagster_home
from expansion_dag_tests.helpers import assert_the_demo_runs_succeeded
from expansion_dag_tests.ports import free_port

pytestmark = pytest.mark.timeout(420)

SCHEDULE = "nightly_expansion"


@dataclass
class PgDeployment:
    home: Path  # DAGSTER_HOME, holding deploy/postgres/dagster.yaml
    env: dict[str, str]
    run: subprocess.CompletedProcess  # `expansion-dag run`
    schedule: subprocess.CompletedProcess  # `dagster schedule start nightly_expansion`


@pytest.fixture(scope="module")
def pg_deployment(postgres, tmp_path_factory) -> PgDeployment:
    """`expansion-dag run` on a fresh PostgreSQL instance, then the nightly schedule turned on."""
    work = tmp_path_factory.mktemp("pg")
    home = make_dagster_home(work / "home", ROOT / "deploy" / "postgres" / "dagster.yaml")
    env = isolated_env(DAGSTER_HOME=home, EXPANSION_SIM_BASE_PORT=free_port(2), **postgres.env)
    run = subprocess.run(
        [str(BIN / "expansion-dag"), "run"], cwd=work, env=env, capture_output=True, text=True, timeout=300
    )
    schedule = subprocess.run(
        [str(BIN / "dagster"), "schedule", "start", SCHEDULE, "-w", str(ROOT / "workspace.yaml")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    return PgDeployment(home, env, run, schedule)


@pytest.fixture
def pg_instance(pg_deployment, postgres, monkeypatch):
    """The instance reopened from its dagster.yaml, as the webserver or a later run would."""
    for name, value in {**postgres.env, "DAGSTER_HOME": str(pg_deployment.home)}.items():
        monkeypatch.setenv(name, value)
    with dg.DagsterInstance.get() as instance:
        yield instance


def query(postgres, sql: str) -> list[tuple]:
    """Straight from the database, over TCP with the role's password: what Dagster wrote there."""
    with contextlib.closing(postgres.connect()) as conn, conn.cursor() as cur:
        cur.execute(sql)
        return cur.fetchall()


def test_the_pipeline_runs_on_a_postgres_instance(pg_deployment):
    run = pg_deployment.run
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for job in ("prepare_job", "generate_job[shard-00]", "generate_job[shard-01]", "training_set_job"):
        assert any(line.startswith(f"{job} run") and line.endswith("success") for line in run.stdout.splitlines()), job


def test_runs_and_event_logs_are_in_postgres(pg_deployment, pg_instance, postgres):
    assert not (pg_deployment.home / "history").exists()  # nothing went to SQLite on the side
    assert_the_demo_runs_succeeded(pg_instance)
    assert query(postgres, "SELECT count(*) FROM runs") == [(4,)]
    materialized = query(
        postgres,
        "SELECT partition FROM event_logs WHERE dagster_event_type = 'ASSET_MATERIALIZATION' "
        "AND asset_key = '[\"completions\"]' ORDER BY partition",
    )
    assert materialized == [("shard-00",), ("shard-01",)]


def test_the_schedule_state_is_in_postgres(pg_deployment, pg_instance, postgres):
    schedule = pg_deployment.schedule
    assert schedule.returncode == 0, schedule.stdout[-3000:] + schedule.stderr[-3000:]
    assert query(
        postgres, f"SELECT instigator_type, status, position('\"{SCHEDULE}\"' in instigator_body) > 0 FROM instigators"
    ) == [("SCHEDULE", "RUNNING", True)]
    assert not (pg_deployment.home / "schedules").exists()  # nor the schedule's state


def test_a_stopped_database_is_a_quick_error_naming_the_connection(pg_deployment, postgres):
    postgres.stop()
    try:
        # The deadline is for a hang only: the refusal below comes back at once, and the retries
        # are counted, not timed.
        result = subprocess.run(
            [str(BIN / "expansion-dag"), "run"], cwd=pg_deployment.home.parent, env=pg_deployment.env,
            capture_output=True, text=True, timeout=120,
        )
    finally:
        postgres.start()
    assert result.returncode != 0
    # Refused, not timed out: the process ended on its own, after a bounded number of retries.
    assert f'connection to server at "127.0.0.1", port {postgres.port} failed: Connection refused' in result.stderr
    assert "too many retries for DB connection" in result.stderr
