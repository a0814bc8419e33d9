"""The ``expansion-dag`` command: runs, plans and builds without the Dagster UI.
"""

from expansion_dag.cli.commands import main

__all__ = [
    "main"
]
