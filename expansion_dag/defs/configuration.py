"""The run configuration as the UI shows it on materializations and the drift check compares it."""

from typing import Any

import dagster as dg

from expansion_dag.config import current_config, mask_url


def run_configuration_file() -> dict[str, str]:
    """The code location's run configuration file and the digest of its resolved configuration."""
    config = current_config()
    return {"file": config.source, "digest": config.digest()}


def run_configuration_metadata() -> dict[str, dg.MetadataValue]:
    """The code location's resolved run configuration (secrets masked), for a materialization."""
    return {
        "run_configuration": dg.MetadataValue.json(current_config().masked()),
        **{f"run_configuration_{k}": dg.MetadataValue.text(v) for k, v in run_configuration_file().items()},
    }


def resource_fields(resource: dg.ConfigurableResource) -> dict[str, Any]:
    """A resource's fields as this run used them (file, variables and launchpad together), masked."""
    values = resource.model_dump(mode="json")
    for name, value in values.items():
        if isinstance(value, str) and "://" in value:
            values[name] = mask_url(value)
        elif isinstance(value, list):
            values[name] = [mask_url(v) if isinstance(v, str) and "://" in v else v for v in value]
    return values
