"""The ``expansion-dag`` command: runs, plans and builds without the Dagster UI.
"""

from expansion_dag.cli.commands import STAGES, Stage, main, run_expansion

__all__ = [
    "STAGES", "Stage", "main", "run_expansion"
]
