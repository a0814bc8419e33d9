"""The shard partitions: one per GPU server. Imported by assets, jobs, schedules and tests.

The count is the run configuration's ``fleet.shards`` (``$EXPANSION_CONFIG``, or
``$EXPANSION_SHARDS``), read when the code location loads, because Dagster needs the partition
keys before any run.
"""

from __future__ import annotations

import dagster as dg

from expansion_dag.config import current_config
from expansion_dag.prompts import shard_keys

SHARD_KEYS = shard_keys(current_config().fleet.shards)
shard_partitions = dg.StaticPartitionsDefinition(SHARD_KEYS)


def shard_index(key: str) -> int:
    return SHARD_KEYS.index(key)
