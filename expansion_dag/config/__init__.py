"""The run configuration file: its schema, validation and the bundled default.
"""

from expansion_dag.config.loading import current_config, load_config, parse_config
from expansion_dag.config.schema import (
    CONFIG_ENV,
    DEFAULT_STREAM_INTERVAL,
    SGLANG_LAUNCH_COMMAND,
    SIMULATOR_LAUNCH_COMMAND,
    ConfigError,
    FleetSettings,
    GenerationConfig,
    LeaseSettings,
    RunConfig,
    bundled_config_path,
    mask_url,
)

__all__ = [
    "CONFIG_ENV", "ConfigError", "DEFAULT_STREAM_INTERVAL", "FleetSettings", "GenerationConfig", "LeaseSettings",
    "RunConfig",
    "SGLANG_LAUNCH_COMMAND", "SIMULATOR_LAUNCH_COMMAND", "bundled_config_path", "current_config",
    "load_config", "mask_url", "parse_config"
]
