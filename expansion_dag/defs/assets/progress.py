"""A running shard's progress in the Dagster UI: asset observations of ``completions``, per shard.

Each report of the engine that ``expansion_dag.generation.progress.ObservationThrottle`` keeps becomes an
observation of the shard's partition carrying the figures of ``ShardProgress`` (done, total, rate,
ETA, failures, retries, yield): a bounded number over a day-long shard, the last one always
current, so the UI shows them while the shard runs, and ``expansion-dag run`` reads them back for
its table.
"""

import dagster as dg

from expansion_dag.generation import ObservationThrottle, Progress, ShardProgress, silence_retry_logging


class ShardProgressReporter:
    """The engine's ``on_progress`` for one shard's materialization; :meth:`close` observes the
    last report the throttle held back."""

    def __init__(self, context: dg.AssetExecutionContext, shard: str, throttle: ObservationThrottle | None = None):
        silence_retry_logging()  # the observations count retries; one log line per retry drowns them
        self._context = context
        self._shard = shard
        self._throttle = throttle or ObservationThrottle()

    def __call__(self, progress: Progress) -> None:
        figures = ShardProgress.from_engine(progress)
        if self._throttle.keep(figures):
            self._observe(figures)

    def close(self) -> None:
        held = self._throttle.last()
        if held is not None:
            self._observe(held)

    def _observe(self, figures: ShardProgress) -> None:
        self._context.log_event(
            dg.AssetObservation(asset_key=self._context.asset_key, partition=self._shard, metadata=figures.as_metadata())
        )
