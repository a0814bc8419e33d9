"""Shared fixtures: an isolated Dagster instance; no test may reach a hub. And how the suite is
split between pytest-xdist's two workers (pyproject.toml's addopts)."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import dagster as dg  # noqa: E402
import pytest  # noqa: E402

TESTS = Path(__file__).parent
#: The longest groups, measured (`--durations`), go out first: each worker starts on one of the
#: two longest, and no long group is left to run alone at the end. The rest keep collection order.
LONGEST_FIRST = ("deployment", "real_engine", "test_cli.py", "test_rehearsal.py", "assets", "trainers")


def _group(item: pytest.Item) -> str:
    """A sub-package's tests share its conftest's session fixtures (a PostgreSQL server, a vLLM
    server, `dagster dev`): one worker runs all of them, and starts each fixture once. A top-level
    file is a group of its own, for its module-scoped fixtures."""
    return item.path.relative_to(TESTS).parts[0]


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
