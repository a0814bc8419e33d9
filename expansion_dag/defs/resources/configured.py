"""Resources whose run configuration overrides only the fields it names.

A configured resource's values become the default of its *whole* config in Dagster 1.13, one level
up: run configuration that names one field (``{"slots_override": 16}`` in the launchpad) replaces
that default, so every other field falls back to the class's own (an attached fleet became
``mode: launch``, and the run configuration file's settings the class's). ``with_field_defaults``
makes, through pydantic's public ``create_model``, a subclass whose *fields* default to the
configured values, and an instance of it that sets none: each field named in the launchpad
overrides that field alone, and Dagster's private state is left as it builds it.
"""

from __future__ import annotations

import copy
from typing import Any, TypeVar

import dagster as dg
from pydantic import create_model

R = TypeVar("R", dg.ConfigurableResource, dg.ConfigurableIOManagerFactory)


def with_field_defaults(resource: R) -> R:
    """The resource as an instance of a subclass that defaults each field to its configured value."""
    cls = type(resource)
    fields: dict[str, Any] = {}
    for name in resource.model_fields_set:
        info = copy.copy(cls.model_fields[name])
        info.default, info.default_factory = getattr(resource, name), None
        fields[name] = (info.annotation, info)
    configured = create_model(cls.__name__, __base__=cls, __module__=cls.__module__, **fields)
    configured.__doc__ = cls.__doc__  # the UI shows the resource's own description
    return configured()
