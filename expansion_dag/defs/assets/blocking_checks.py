"""The verdicts of ``completions``' blocking checks, kept under the storage root beside what they judged.

The training set must not be built while a shard's latest run failed one of them. Dagster keeps
check results in its event log, but its public Python API has no read of them per partition (its
storage layer has one, which is not public and which Dagster+ refuses). So the run that judges the
checks also writes their verdicts where the training set reads everything else:
``blocking_checks/<shard>.json``, replaced whole by each run of the shard that reaches its checks.
"""

import json
from collections.abc import Collection, Iterable

import dagster as dg

from expansion_dag.core import entry_name, listing, write_atomically
from expansion_dag.defs.resources import StorageResource

FOLDER = "blocking_checks"  # under the storage root
SUFFIX = ".json"


def record_verdicts(
    storage: StorageResource, shard: str, run_id: str, checks: Iterable[dg.AssetCheckResult], blocking: Collection[str]
) -> None:
    """Keep the verdicts of the ``blocking`` checks among ``checks``, this run's of ``shard``."""
    verdicts = {c.check_name: c.passed for c in checks if c.check_name in blocking}
    with write_atomically(storage.path(FOLDER, shard + SUFFIX)) as path:
        path.write_text(json.dumps({"run_id": run_id, "passed": verdicts}, sort_keys=True))


def failed_verdicts(storage: StorageResource) -> list[str]:
    """Each shard whose latest run failed a blocking check, and the check: ``shard-01: failure_rate``."""
    failed = []
    for entry in listing(storage.path(FOLDER)):
        name = entry_name(entry)
        if entry["type"] != "file" or not name.endswith(SUFFIX):
            continue  # a writer's staged copy (.<name>.tmp-...), never finished
        verdicts = json.loads(storage.path(FOLDER, name).read_text())["passed"]
        failed += [f"{name.removesuffix(SUFFIX)}: {check}" for check, passed in verdicts.items() if not passed]
    return sorted(failed)
