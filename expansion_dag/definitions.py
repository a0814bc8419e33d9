"""The one place that wires the code location: assets, checks, jobs, schedules and resources.

Everything about the deployment comes from the run configuration file (``expansion_dag/config/schema.py``;
``configs/default.yaml`` documents every field): ``$EXPANSION_CONFIG``, else the bundled default,
which runs the demo on a simulated fleet. ``EXPANSION_*`` variables override single fields. The
same resource keys are bound whatever the fleet's mode, so assets never know which one runs, and
each resource's run configuration (the launchpad) overrides only the fields it names.
"""

from __future__ import annotations

import json

import dagster as dg
import yaml

from expansion_dag.config import RunConfig, current_config, fleet_settings, storage_settings
from expansion_dag.defs import SHARD_KEYS, build_nightly_schedule, build_nightly_sensors
from expansion_dag.defs.assets import (
    budgeted_prompts,
    build_prompts_asset,
    build_raw_dataset_assets,
    completions,
    shard_prompts,
    training_set,
    training_set_parts,
)
from expansion_dag.defs.resources import (
    FleetResource,
    GenerationSettings,
    ParquetIOManager,
    StorageResource,
    with_field_defaults,
)
from expansion_dag.prompts import load_catalog

#: Run tags every job's runs carry: the file, a digest to compare runs, and the resolved configuration.
CONFIG_FILE_TAG = "expansion/config_file"
CONFIG_DIGEST_TAG = "expansion/config_digest"
CONFIG_TAG = "expansion/config"


def fleet_for(config: RunConfig) -> FleetResource:
    return FleetResource(**fleet_settings(config).model_dump())


def resources_for(config: RunConfig) -> dict[str, object]:
    """The resources of a configuration; launchpad run config for one overrides only the fields it names."""
    storage = storage_settings(config)
    resources = {
        "fleet": fleet_for(config),
        "settings": GenerationSettings(tokenizer=config.model.tokenizer, **config.generation.model_dump()),
        "storage": StorageResource(**storage),
        "parquet_io": ParquetIOManager(root=storage["root"]),
    }
    return {key: with_field_defaults(resource) for key, resource in resources.items()}


def config_tags(config: RunConfig) -> dict[str, str]:
    """The resolved configuration (secrets masked) as run tags, and a digest to compare runs by."""
    return {
        CONFIG_FILE_TAG: config.source,
        CONFIG_DIGEST_TAG: config.digest(),
        CONFIG_TAG: json.dumps(config.masked(), sort_keys=True, separators=(",", ":")),
    }


def gpu_run_tags(config: RunConfig) -> dict[str, str]:
    """Tags for runs that start their own SGLang server (Kubernetes launch mode): a GPU per run pod.

    Read from the YAML file named by ``fleet.launch.run_tags_file`` (deploy/k8s/gpu-run-tags.yaml);
    none (local, attach mode) means no extra tags.
    """
    path = config.fleet.launch.run_tags_file
    if not path:
        return {}
    with open(path) as fh:
        tags = yaml.safe_load(fh) or {}
    # Run tags are strings; the K8sRunLauncher parses this one back from JSON.
    return {key: value if isinstance(value, str) else json.dumps(value) for key, value in tags.items()}


def build_definitions(config: RunConfig) -> dg.Definitions:
    """The code location for one run configuration."""
    if config.fleet.shards != len(SHARD_KEYS):
        raise ValueError(
            f"{config.source}: fleet.shards is {config.fleet.shards} but the shard partitions were made for "
            f"{len(SHARD_KEYS)} when expansion_dag.defs.partitions was imported (from $EXPANSION_CONFIG)"
        )
    catalog = load_catalog(config.catalog)
    raw_datasets = build_raw_dataset_assets(catalog)
    prompts = build_prompts_asset(catalog)
    tags = config_tags(config)
    server_tags = {**gpu_run_tags(config), **tags}  # budgeting probes a server for the context length

    prepare_job = dg.define_asset_job(
        "prepare_job",
        selection=dg.AssetSelection.assets(*raw_datasets, prompts, budgeted_prompts),
        description="Load the sources, extract prompts and budget them into shards.",
        tags=server_tags,
    )
    generate_job = dg.define_asset_job(
        "generate_job",
        selection=dg.AssetSelection.assets(shard_prompts, completions),
        description="Generate one shard's completions on its GPU server (one run per shard).",
        tags=server_tags,
    )
    training_parts_job = dg.define_asset_job(
        "training_parts_job",
        selection=dg.AssetSelection.assets(training_set_parts),
        description="Build one shard's parts of the training set (one run per shard; training_set_job then "
        "assembles them instead of building them itself).",
        tags=tags,
    )
    training_set_job = dg.define_asset_job(
        "training_set_job",
        selection=dg.AssetSelection.assets(training_set),
        description="Merge every shard's completions into the tokenized training set.",
        tags=tags,
    )
    nightly_expansion = build_nightly_schedule(
        prepare_job=prepare_job,
        raw_assets=raw_datasets,
        cron=config.schedule.cron,
        timezone=config.schedule.timezone,
        quota=config.schedule.quota,
    )
    return dg.Definitions(
        assets=[*raw_datasets, prompts, budgeted_prompts, shard_prompts, completions, training_set_parts, training_set],
        jobs=[prepare_job, generate_job, training_parts_job, training_set_job],
        schedules=[nightly_expansion],
        sensors=build_nightly_sensors(
            prepare_job=prepare_job, generate_job=generate_job, training_set_job=training_set_job
        ),
        resources=resources_for(config),
    )


defs = build_definitions(current_config())
