"""The shard partitions: one per GPU server. Imported by assets, jobs, schedules and tests.

The count is deployment configuration (``EXPANSION_SHARDS``), read when the code location loads,
because Dagster needs the partition keys before any run.
"""

from __future__ import annotations

import os

import dagster as dg

from expansion_dag.budget import shard_keys

DEFAULT_SHARDS = 2


def configured_shards() -> int:
    raw = os.environ.get("EXPANSION_SHARDS", str(DEFAULT_SHARDS))
    try:
        count = int(raw)
    except ValueError:
        raise ValueError(f"EXPANSION_SHARDS must be a whole number, got {raw!r}") from None
    if not 1 <= count <= 999:
        raise ValueError(f"EXPANSION_SHARDS must be between 1 and 999, got {count}")
    return count


SHARD_KEYS = shard_keys(configured_shards())
shard_partitions = dg.StaticPartitionsDefinition(SHARD_KEYS)


def shard_index(key: str) -> int:
    return SHARD_KEYS.index(key)
