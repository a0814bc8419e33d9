"""A running shard's progress in the Dagster UI: asset observations of ``completions``, per shard.

Each report of the engine that ``expansion_dag.generation.progress.ObservationThrottle`` keeps becomes an
observation of the shard's partition carrying the figures of ``ShardProgress`` (done, total, rate,
ETA, failures, retries, yield, and the speed measured with the time to finish and GPU-hours it
gives): a bounded number over a day-long shard, the last one always current, so the UI shows them
while the shard runs, and ``expansion-dag run`` reads them back for its table.
"""

import dagster as dg

from expansion_dag.generation import ObservationThrottle, Progress, ShardPlan, ShardProgress, silence_retry_logging


class ShardProgressReporter:
    """The engine's ``on_progress`` for one shard's materialization; :meth:`close` observes the
    last report the throttle held back. With the ``plan`` of the prompts it sends, each report also
    carries the measured speed, the time to finish and the GPU-hours; ``first_speed`` keeps the
    first report that had them, to set beside what the run then took."""

    def __init__(
        self, context: dg.AssetExecutionContext, shard: str, throttle: ObservationThrottle | None = None,
        plan: ShardPlan | None = None,
    ):
        silence_retry_logging()  # the observations count retries; one log line per retry drowns them
        self._context = context
        self._shard = shard
        self._throttle = throttle or ObservationThrottle()
        self._plan = plan
        self.first_speed: ShardProgress | None = None

    def __call__(self, progress: Progress) -> None:
        figures = ShardProgress.from_engine(progress, self._plan)
        if self.first_speed is None and figures.finish_s is not None:
            self.first_speed = figures
        if self._throttle.keep(figures):
            self._observe(figures)

    @staticmethod
    def waiting(context: dg.AssetExecutionContext, shard: str, holder: str, gives_up_at: float) -> None:
        """The shard waits for another run's lease: said where its progress is shown."""
        figures = ShardProgress.waiting_for(holder, gives_up_at)
        context.log_event(dg.AssetObservation(asset_key=context.asset_key, partition=shard, metadata=figures.as_metadata()))

    def close(self) -> None:
        held = self._throttle.last()
        if held is not None:
            self._observe(held)

    def _observe(self, figures: ShardProgress) -> None:
        self._context.log_event(
            dg.AssetObservation(asset_key=self._context.asset_key, partition=self._shard, metadata=figures.as_metadata())
        )
