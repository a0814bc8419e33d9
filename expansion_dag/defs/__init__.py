"""The Dagster shell: assets, resources, partitions and schedules; ``expansion_dag.definitions``
wires them.
"""

from expansion_dag.defs.configuration import (
    resource_fields,
    run_configuration_file,
    run_configuration_metadata,
)
from expansion_dag.defs.partitions import SHARD_KEYS, shard_index, shard_partitions
from expansion_dag.defs.schedules import NIGHT_TAG, build_nightly_schedule, build_nightly_sensors

__all__ = [
    "NIGHT_TAG", "SHARD_KEYS", "build_nightly_schedule", "build_nightly_sensors", "resource_fields",
    "run_configuration_file", "run_configuration_metadata", "shard_index", "shard_partitions"
]
