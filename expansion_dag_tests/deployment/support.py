"""Real servers for the deployment tests: PostgreSQL from Debian's binaries, and `dagster dev`.

Each listens on 127.0.0.1 on a free port and is stopped by whoever started it; nothing here
outlives the test session.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psycopg2
import pytest

from expansion_dag_tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PG_INSTALL = Path("/usr/lib/postgresql")
LOCATION = "expansion_dag"
REPOSITORY = "__repository__"  # the repository Dagster makes of a `Definitions` object

T = TypeVar("T")


def isolated_env(**extra: object) -> dict[str, str]:
    """This environment without any DAGSTER_* or EXPANSION_* setting of the caller, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "EXPANSION_"))}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def wait_for(what: str, probe: Callable[[], T], timeout_s: float, interval_s: float = 0.5) -> T:
    """Poll ``probe`` until it returns something truthy; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


def make_dagster_home(path: Path, config: Path = ROOT / "dagster.yaml") -> Path:
    path.mkdir(parents=True)
    shutil.copy(config, path / "dagster.yaml")
    # Without it a fresh browser gets the "Join the Dagster community" popup over every page.
    (path / ".nux").mkdir()
    (path / ".nux" / "nux.yaml").write_text("seen: 1\n")
    return path


class PostgresServer:
    """A throwaway PostgreSQL cluster: TCP on 127.0.0.1 with passwords, trust on its own socket."""

    user = "expansion"
    db = "dagster"

    def __init__(self) -> None:
        initdbs = sorted(PG_INSTALL.glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name))
        if not initdbs:
            pytest.fail(
                f"no PostgreSQL server binaries under {PG_INSTALL}: run `bash .ci/system-packages` "
                "(as root) to install Debian's postgresql"
            )
        self.bin = initdbs[-1].parent
        self.as_owner: list[str] = []
        if os.geteuid() == 0:
            # The server refuses to run as root: it runs as Debian's `postgres` user.
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                pytest.fail("no `postgres` system user: run `bash .ci/system-packages` to install postgresql")
            self.as_owner = ["runuser", "-u", "postgres", "--"]
        # Not under pytest's tmp folders: those are private to root, and the server must reach it.
        self.base = Path(tempfile.mkdtemp(prefix="expansion-pg-"))
        if self.as_owner:
            shutil.chown(self.base, "postgres", "postgres")
        self.data = self.base / "data"
        self.log = self.base / "server.log"
        self.port = free_port()
        self.password = os.urandom(12).hex()

    def _pg(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [*self.as_owner, str(self.bin / tool), *args], capture_output=True, text=True, timeout=120
        )
        if check and result.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            pytest.fail(f"{tool} {' '.join(args)} failed:\n{result.stdout}{result.stderr}\n{log[-2000:]}")
        return result

    def create(self) -> None:
        self._pg("initdb", "-D", str(self.data), "-U", "postgres", "--auth-local=trust",
                 "--auth-host=scram-sha-256", "-E", "UTF8", "--no-locale")
        self.start()
        with contextlib.closing(self.connect(superuser=True)) as conn:
            conn.autocommit = True  # CREATE DATABASE refuses to run in a transaction
            with conn.cursor() as cur:
                cur.execute(f"CREATE ROLE {self.user} LOGIN PASSWORD %s", (self.password,))
                cur.execute(f"CREATE DATABASE {self.db} OWNER {self.user}")

    def connect(self, superuser: bool = False) -> psycopg2.extensions.connection:
        """The superuser over the socket (trust), or Dagster's role as Dagster connects: TCP, password."""
        if superuser:
            return psycopg2.connect(host=str(self.base), port=self.port, user="postgres", dbname="postgres")
        return psycopg2.connect(
            host="127.0.0.1", port=self.port, user=self.user, password=self.password, dbname=self.db
        )

    def start(self) -> None:
        options = f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1"
        self._pg("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "-o", options, "start")

    def stop(self, check: bool = True) -> None:
        self._pg("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop", check=check)

    def remove(self) -> None:
        if self.data.exists():
            self.stop(check=False)  # "no server running" is fine here
        shutil.rmtree(self.base, ignore_errors=True)

    @property
    def env(self) -> dict[str, str]:
        """The settings deploy/postgres/dagster.yaml reads."""
        return {
            "DAGSTER_PG_HOST": "127.0.0.1",
            "DAGSTER_PG_PORT": str(self.port),
            "DAGSTER_PG_USER": self.user,
            "DAGSTER_PG_PASSWORD": self.password,
            "DAGSTER_PG_DB": self.db,
        }


class DagsterDev:
    """`dagster dev -w workspace.yaml` (webserver and daemon) in its own process group."""

    def __init__(self, home: Path, env: dict[str, str], log: Path) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                [str(BIN / "dagster"), "dev", "-w", str(ROOT / "workspace.yaml"), "-h", "127.0.0.1", "-p", str(port)],
                cwd=ROOT, env={**env, "DAGSTER_HOME": str(home)},
                stdout=out, stderr=subprocess.STDOUT,
                # Its code server, webserver, daemon and run workers join this group: one signal
                # reaches them all.
                start_new_session=True,
            )
        try:
            wait_for("dagster dev to serve the expansion_dag code location", self._location_loaded, timeout_s=180)
        except BaseException:
            self.stop()
            raise

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def _location_loaded(self) -> bool:
        if self.process.poll() is not None:
            pytest.fail(f"dagster dev exited with {self.process.returncode}:\n{self.log_tail()}")
        try:
            data = self.graphql(
                "query($s: RepositorySelector!) { repositoryOrError(repositorySelector: $s) "
                "{ __typename ... on PythonError { message } } }",
                s={"repositoryLocationName": LOCATION, "repositoryName": REPOSITORY},
            )
        except httpx.HTTPError:
            return False  # not listening yet
        answer = data["repositoryOrError"]
        if answer["__typename"] == "PythonError":
            pytest.fail(f"the code location failed to load: {answer['message']}")
        return answer["__typename"] == "Repository"

    def stop(self) -> None:
        """SIGTERM to the group; SIGKILL to whatever is left after 30 s, so nothing outlives a test."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def graphql(self, query: str, **variables: Any) -> dict[str, Any]:
        response = httpx.post(f"{self.url}/graphql", json={"query": query, "variables": variables}, timeout=60)
        response.raise_for_status()
        body = response.json()
        if body.get("errors"):
            raise AssertionError(f"GraphQL errors: {body['errors']}")
        return body["data"]

    def _ok(self, answer: dict[str, Any], success: str) -> dict[str, Any]:
        if answer["__typename"] != success:
            raise AssertionError(f"{answer['__typename']}: {answer.get('message')}\n{self.log_tail()}")
        return answer

    def launch_run(self, job: str, run_config: dict[str, Any] | None = None, partition: str | None = None) -> str:
        """The Launchpad's "Launch run" (of one partition, when given)."""
        tags = [{"key": "dagster/partition", "value": partition}] if partition else []
        data = self.graphql(
            "mutation($p: ExecutionParams!) { launchRun(executionParams: $p) { __typename "
            "... on LaunchRunSuccess { run { runId } } ... on Error { message } } }",
            p={
                "selector": {"repositoryLocationName": LOCATION, "repositoryName": REPOSITORY, "jobName": job},
                "runConfigData": run_config or {},
                "executionMetadata": {"tags": tags},
            },
        )
        return self._ok(data["launchRun"], "LaunchRunSuccess")["run"]["runId"]

    def terminate(self, run_id: str) -> None:
        """The run page's "Terminate"."""
        self.graphql("mutation($id: String!) { terminateRun(runId: $id) { __typename } }", id=run_id)

    def latest_observation(self, asset: str, partition: str) -> tuple[str, dict[str, Any]] | None:
        """The asset partition's latest observation: its run, and its metadata (numbers; others None)."""
        data = self.graphql(
            "query($k: AssetKeyInput!, $p: [String!]) { assetOrError(assetKey: $k) { ... on Asset { "
            "assetObservations(partitions: $p, limit: 1) { runId metadataEntries { label "
            "... on IntMetadataEntry { intValue } ... on FloatMetadataEntry { floatValue } } } } } }",
            k={"path": [asset]}, p=[partition],
        )
        observations = data["assetOrError"]["assetObservations"]
        if not observations:
            return None
        entries = observations[0]["metadataEntries"]
        return observations[0]["runId"], {e["label"]: e.get("intValue", e.get("floatValue")) for e in entries}

    def run_status(self, run_id: str) -> str:
        data = self.graphql("query($id: ID!) { runOrError(runId: $id) { ... on Run { status } } }", id=run_id)
        return data["runOrError"]["status"]

    def launch_backfill(self, assets: list[str], partitions: list[str], run_config: dict[str, Any]) -> str:
        """The asset graph's "Materialize selected" over partitions: an asset backfill."""
        data = self.graphql(
            "mutation($p: LaunchBackfillParams!) { launchPartitionBackfill(backfillParams: $p) { __typename "
            "... on LaunchBackfillSuccess { backfillId } ... on Error { message } } }",
            p={"assetSelection": [{"path": [a]} for a in assets], "partitionNames": partitions,
               "runConfigData": run_config},
        )
        return self._ok(data["launchPartitionBackfill"], "LaunchBackfillSuccess")["backfillId"]

    def reexecute_backfill_from_failure(self, backfill_id: str) -> str:
        """The backfill page's "Re-execute from failure"."""
        data = self.graphql(
            "mutation($p: ReexecutionParams!) { reexecutePartitionBackfill(reexecutionParams: $p) { __typename "
            "... on LaunchBackfillSuccess { backfillId } ... on Error { message } } }",
            p={"parentRunId": backfill_id, "strategy": "FROM_FAILURE"},
        )
        return self._ok(data["reexecutePartitionBackfill"], "LaunchBackfillSuccess")["backfillId"]

    def backfill(self, backfill_id: str) -> dict[str, Any]:
        """Status and runs (with their partition) of a backfill."""
        data = self.graphql(
            "query($id: String!) { partitionBackfillOrError(backfillId: $id) { __typename "
            "... on PartitionBackfill { status runs { runId status tags { key value } } } ... on Error { message } } }",
            id=backfill_id,
        )
        return self._ok(data["partitionBackfillOrError"], "PartitionBackfill")

    def check_statuses(self, asset: str) -> dict[str, dict[str, list[str]]]:
        """Each check of a partitioned asset: its partitions by status, as the asset's Checks tab shows."""
        data = self.graphql(
            "query($k: AssetKeyInput!) { assetNodeOrError(assetKey: $k) { ... on AssetNode { "
            "assetChecksOrError { ... on AssetChecks { checks { name blocking partitionStatuses { "
            "... on AssetCheckDefaultPartitionStatuses { succeededPartitions failedPartitions "
            "executionFailedPartitions inProgressPartitions } } } } } } } }",
            k={"path": [asset]},
        )
        checks = data["assetNodeOrError"]["assetChecksOrError"]["checks"]
        return {c["name"]: {**c["partitionStatuses"], "blocking": c["blocking"]} for c in checks}

    def check_executions(self, asset: str, check: str) -> list[dict[str, Any]]:
        """A check's executions, newest first: run, partition, whether it passed."""
        data = self.graphql(
            "query($k: AssetKeyInput!, $c: String!) { assetCheckExecutions(assetKey: $k, checkName: $c, limit: 50) "
            "{ runId partition evaluation { success } } }",
            k={"path": [asset]}, c=check,
        )
        return data["assetCheckExecutions"]

    def step_failures(self, run_id: str) -> list[str]:
        """The error messages of a run's failed steps, as its run page shows them."""
        data = self.graphql(
            "query($id: ID!) { runOrError(runId: $id) { ... on Run { eventConnection { events { __typename "
            "... on ExecutionStepFailureEvent { error { message } } } } } } }",
            id=run_id,
        )
        events = data["runOrError"]["eventConnection"]["events"]
        return [e["error"]["message"] for e in events if e["__typename"] == "ExecutionStepFailureEvent"]

    def partition_statuses(self, asset: str) -> dict[str, list[str]]:
        """What the asset's Partitions tab counts: materialized, failed, materializing, missing."""
        data = self.graphql(
            "query($k: AssetKeyInput!) { assetNodeOrError(assetKey: $k) { ... on AssetNode { "
            "assetPartitionStatuses { ... on DefaultPartitionStatuses { materializedPartitions "
            "failedPartitions materializingPartitions unmaterializedPartitions } } } } }",
            k={"path": [asset]},
        )
        return data["assetNodeOrError"]["assetPartitionStatuses"]
