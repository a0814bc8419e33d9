"""Shared fixtures: an isolated Dagster instance, an S3-compatible server (moto) and a fresh bucket
on it; no test may reach a hub. And how the suite is split between pytest-xdist's workers
(pyproject.toml's addopts)."""

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import dagster as dg  # noqa: E402
import pytest  # noqa: E402

from expansion_dag_tests.ports import free_port  # noqa: E402

TESTS = Path(__file__).parent
#: The longest groups, measured (`--junitxml`), go out first: each worker starts on one of the
#: longest, and no long group is left to run alone at the end. The rest keep collection order.
LONGEST_FIRST = ("real_engine", "deployment", "cli/test_cli.py", "cli/test_cli_fleet.py",
                 "generation/test_one_sender.py", "cli/test_rehearsal.py", "trainers",
                 "defs/assets/test_completions.py", "defs/assets/test_kill_resume.py")
#: The environment suites: each folder's conftest starts session fixtures (a PostgreSQL server, a vLLM
#: server, `dagster dev`) that all its tests share.
SUITES = tuple(path.parent.name for path in TESTS.glob("*/conftest.py"))


def _group(item: pytest.Item) -> str:
    """An environment suite's tests share its session fixtures: one worker runs all of them, and
    starts each fixture once. Any other file is a group of its own, for its module-scoped fixtures."""
    relative = item.path.relative_to(TESTS)
    return relative.parts[0] if relative.parts[0] in SUITES else relative.as_posix()


# First: pytest-xdist's own hook reads the groups to schedule them.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_group(item), len(rank)))  # stable: collection order within
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_group(item)))


def pytest_xdist_node_collection_finished(node, ids: list[str]) -> None:
    """Every test a worker collected must carry its group: pytest-xdist drops groups without a
    word (as with pytest 9.2), and each worker would then start the session fixtures, `dagster dev`
    and a vLLM server included, of every group it is sent tests from."""
    ungrouped = [nodeid for nodeid in ids if "@" not in nodeid]
    if ungrouped and node.config.getvalue("dist") == "loadgroup":
        pytest.exit(f"pytest-xdist did not group {len(ungrouped)} tests, e.g. {ungrouped[0]}", returncode=3)


@pytest.fixture
def instance(tmp_path):
    home = tmp_path / "dagster_home"
    home.mkdir()
    with dg.instance_for_test(temp_dir=str(home)) as inst:
        yield inst


CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


# Here, once: a second definition (a module's own) would start a second server, and s3fs's cached
# filesystem of one module would then talk to the other's.
@pytest.fixture(scope="session")
def s3_endpoint():
    """moto in server mode, on 127.0.0.1 only; its URL."""
    port = free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, "moto_server did not start"
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}"
    server.terminate()
    server.wait(timeout=10)


@pytest.fixture
def bucket(s3_endpoint, monkeypatch):
    """A fresh bucket; the endpoint reaches s3fs (and every child process) as AWS_ENDPOINT_URL."""
    for name, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": s3_endpoint}.items():
        monkeypatch.setenv(name, value)
    import s3fs

    name = f"test-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(name)
    return name
