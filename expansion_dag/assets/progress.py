"""A running shard's progress in the Dagster UI: asset observations of ``completions``, per shard.

Each report of the engine becomes an observation of the shard's partition carrying the figures of
``expansion_dag.progress.ShardProgress`` (done, total, rate, ETA, failures, retries), so the UI
shows them while the shard runs, and ``expansion-dag run`` reads them back for its table.
"""

from collections.abc import Callable

import dagster as dg

from expansion_dag.shard_report import Progress
from expansion_dag.progress import ShardProgress, silence_retry_logging


def shard_progress_reporter(context: dg.AssetExecutionContext, shard: str) -> Callable[[Progress], None]:
    """The engine's ``on_progress`` for one shard's materialization."""
    silence_retry_logging()  # the observations count retries; one log line per retry drowns them

    def report(progress: Progress) -> None:
        figures = ShardProgress.from_engine(progress)
        context.log_event(
            dg.AssetObservation(asset_key=context.asset_key, partition=shard, metadata=figures.as_metadata())
        )

    return report
