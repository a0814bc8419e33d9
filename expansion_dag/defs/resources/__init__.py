"""The Dagster resources: the fleet, generation settings, storage.
"""

from expansion_dag.defs.resources.configured import with_field_defaults
from expansion_dag.defs.resources.fleet import FleetResource
from expansion_dag.defs.resources.settings import GenerationSettings
from expansion_dag.defs.resources.storage import ASSETS, ParquetIOManager, StorageResource

__all__ = [
    "ASSETS", "FleetResource", "GenerationSettings", "ParquetIOManager", "StorageResource",
    "with_field_defaults"
]
