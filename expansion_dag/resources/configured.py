"""Resources whose run configuration overrides only the fields it names.

Dagster 1.13 builds a configured resource's config schema (``ConfigurableResourceFactory.__init__``)
from the class's field defaults, then sets the values given to the instance as the default of the
*whole* config, one level up (``_curry_config_schema``). Run configuration that names one field
(``{"slots_override": 16}`` in the launchpad) replaces that whole default, so every other field
falls back to the class default: an attached fleet became ``mode: launch``, and the settings of
the run configuration file became the class's. ``with_field_defaults`` rebuilds the schema with
the instance's values as each field's own default, so a named field overrides that field alone.
"""

from __future__ import annotations

from typing import TypeVar

import dagster as dg
from dagster._config.pythonic_config.config import infer_schema_from_config_class
from dagster._config.pythonic_config.conversion_utils import _curry_config_schema

R = TypeVar("R", dg.ConfigurableResource, dg.ConfigurableIOManagerFactory)


def with_field_defaults(resource: R) -> R:
    """The resource, its config schema defaulting each field to the value it was configured with."""
    state = resource._state__internal__
    values = state.resolved_config_dict
    schema = infer_schema_from_config_class(
        type(resource), fields_to_omit=set(state.nested_resources), default=values
    )
    resource._state__internal__ = state._replace(schema=schema, config_schema=_curry_config_schema(schema, values))
    return resource
