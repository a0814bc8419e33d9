"""The ``expansion-dag`` command: runs, plans and builds without the Dagster UI; ``run_expansion`` is
its run's one sequence, for whoever runs it from Python (the benchmarks measure each of its steps).
"""

from expansion_dag.cli.commands import STAGES, main, mirrored_fleet, run_expansion

__all__ = [
    "STAGES", "main", "mirrored_fleet", "run_expansion",
]
