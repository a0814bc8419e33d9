"""The run configuration file: its schema, validation and the bundled default, and what the layers
below are given from it (``derived``): every default is the schema's, stated once.
"""

from expansion_dag.config.derived import (
    budget_config,
    engine_config,
    fleet_settings,
    sampling_settings,
    storage_settings,
    training_set_config,
    turn_planner,
)
from expansion_dag.config.loading import current_config, load_config, parse_config
from expansion_dag.config.schema import (
    CONFIG_ENV,
    DEFAULT_STREAM_INTERVAL,
    ConfigError,
    FleetSettings,
    GenerationConfig,
    LeaseSettings,
    ModelConfig,
    RunConfig,
    SGLANG_LAUNCH_COMMAND,
    SIMULATOR_LAUNCH_COMMAND,
    ScheduleConfig,
    StorageSettings,
    bundled_config_path,
    mask_url,
    schema_default,
)

__all__ = [
    "CONFIG_ENV", "ConfigError", "DEFAULT_STREAM_INTERVAL", "FleetSettings", "GenerationConfig", "LeaseSettings",
    "ModelConfig", "RunConfig",
    "SGLANG_LAUNCH_COMMAND", "SIMULATOR_LAUNCH_COMMAND", "ScheduleConfig", "StorageSettings", "budget_config",
    "bundled_config_path", "current_config", "engine_config", "fleet_settings", "load_config", "mask_url",
    "parse_config", "sampling_settings", "schema_default", "storage_settings", "training_set_config", "turn_planner"
]
