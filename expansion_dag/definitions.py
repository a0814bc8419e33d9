"""The one place that wires the code location: assets, checks, jobs, schedules and resources.

Deployment choices read from the environment when the code location loads:
- ``EXPANSION_PROFILE``: ``local`` (default: a simulated fleet launched by the fleet resource) or
  ``production`` (real SGLang servers, attached by URL or launched one per GPU). Both profiles
  bind the same resource keys, so assets never know which one runs.
- ``EXPANSION_CATALOG``: ``samples`` (default, bundled files), ``production`` (hub datasets), or
  a path to a catalog YAML file.
- ``EXPANSION_SHARDS``: shard (GPU server) count, see ``partitions.py``.
- ``EXPANSION_STORAGE``: storage root, see ``resources/storage.py``.
- ``EXPANSION_LAUNCH_SCOPE`` and ``EXPANSION_GPU_RUN_TAGS``: Kubernetes launch mode, where each
  run starts one server on its own GPU (see README "Scaling out").
- ``EXPANSION_NIGHTLY_CRON`` / ``EXPANSION_NIGHTLY_TIMEZONE`` / ``EXPANSION_NIGHTLY_QUOTA``: when the
  nightly expansion runs (default 02:00 UTC) and how many new prompts a night takes (1000).
"""

from __future__ import annotations

import json
import os

import dagster as dg
import yaml

from expansion_dag.assets.budget import budgeted_prompts, shard_prompts
from expansion_dag.assets.completions import completions
from expansion_dag.assets.prompts import build_prompts_asset
from expansion_dag.assets.raw_datasets import build_raw_dataset_assets
from expansion_dag.assets.training_set import training_set
from expansion_dag.catalog import load_catalog
from expansion_dag.partitions import SHARD_KEYS
from expansion_dag.resources.fleet import SIMULATOR_LAUNCH_COMMAND, FleetResource
from expansion_dag.resources.settings import GenerationSettings
from expansion_dag.resources.storage import ParquetIOManager, StorageResource, default_storage_root
from expansion_dag.schedules import build_nightly_schedule, build_nightly_sensors
from expansion_dag.urls import as_upath, default_local_dir, is_local

PROFILES = ("local", "production")


def fleet_for(profile: str, storage_root: str) -> FleetResource:
    fallback = os.environ.get("EXPANSION_FLEET_FALLBACK", "1") != "0"
    # Pid files, locks and server logs belong to this machine, not to a (possibly remote) root.
    state_dir = os.path.join(storage_root if is_local(as_upath(storage_root)) else default_local_dir(), "fleet")
    if profile == "local":
        # A dry run (``expansion-dag dry-run --mirror ...``) sets these to a real fleet's probe.
        return FleetResource(
            mode="launch",
            launch_command=SIMULATOR_LAUNCH_COMMAND,
            model_path=os.environ.get("EXPANSION_SIM_MODEL_PATH", "Qwen/Qwen3-8B"),
            context_length=int(os.environ.get("EXPANSION_SIM_CONTEXT_LENGTH", "8192")),
            max_running_requests=int(os.environ.get("EXPANSION_SIM_SLOTS", "16")),
            num_servers=len(SHARD_KEYS),
            base_port=int(os.environ.get("EXPANSION_SIM_BASE_PORT", "30000")),
            fallback_to_healthy=fallback,
            startup_timeout_s=120.0,
            state_dir=state_dir,
        )
    urls = [u for u in os.environ.get("EXPANSION_FLEET_URLS", "").split(",") if u.strip()]
    return FleetResource(
        mode="attach" if urls else "launch",
        urls=urls,
        backend=os.environ.get("EXPANSION_BACKEND", "sglang"),
        model_path=os.environ.get("EXPANSION_MODEL_PATH", "Qwen/Qwen3-8B"),
        num_servers=len(SHARD_KEYS),
        launch_scope=os.environ.get("EXPANSION_LAUNCH_SCOPE", "fleet"),
        # "0" makes a shard whose server is down fail instead of running on another server.
        fallback_to_healthy=fallback,
        state_dir=state_dir,
    )


def resources_for(profile: str) -> dict[str, object]:
    if profile not in PROFILES:
        raise ValueError(f"EXPANSION_PROFILE must be one of {PROFILES}, got {profile!r}")
    root = default_storage_root()
    settings = GenerationSettings(tokenizer=os.environ.get("EXPANSION_TOKENIZER", GenerationSettings().tokenizer))
    return {
        "fleet": fleet_for(profile, root),
        "settings": settings,
        "storage": StorageResource(root=root),
        "parquet_io": ParquetIOManager(root=root),
    }


def gpu_run_tags() -> dict[str, str]:
    """Tags for runs that start their own SGLang server (Kubernetes launch mode): a GPU per run pod.

    Read from the YAML file named by ``EXPANSION_GPU_RUN_TAGS`` (deploy/k8s/gpu-run-tags.yaml);
    unset (local, attach mode) means no extra tags.
    """
    path = os.environ.get("EXPANSION_GPU_RUN_TAGS")
    if not path:
        return {}
    with open(path) as fh:
        tags = yaml.safe_load(fh) or {}
    # Run tags are strings; the K8sRunLauncher parses this one back from JSON.
    return {key: value if isinstance(value, str) else json.dumps(value) for key, value in tags.items()}


catalog = load_catalog(os.environ.get("EXPANSION_CATALOG", "samples"))
raw_datasets = build_raw_dataset_assets(catalog)
prompts = build_prompts_asset(catalog)

prepare_job = dg.define_asset_job(
    "prepare_job",
    selection=dg.AssetSelection.assets(*raw_datasets, prompts, budgeted_prompts),
    description="Load the sources, extract prompts and budget them into shards.",
    tags=gpu_run_tags(),  # budgeting probes a server for the context length
)
generate_job = dg.define_asset_job(
    "generate_job",
    selection=dg.AssetSelection.assets(shard_prompts, completions),
    description="Generate one shard's completions on its GPU server (one run per shard).",
    tags=gpu_run_tags(),
)
training_set_job = dg.define_asset_job(
    "training_set_job",
    selection=dg.AssetSelection.assets(training_set),
    description="Merge every shard's completions into the tokenized training set.",
)

nightly_expansion = build_nightly_schedule(
    prepare_job=prepare_job,
    raw_assets=raw_datasets,
    cron=os.environ.get("EXPANSION_NIGHTLY_CRON", "0 2 * * *"),
    timezone=os.environ.get("EXPANSION_NIGHTLY_TIMEZONE", "UTC"),
    quota=int(os.environ.get("EXPANSION_NIGHTLY_QUOTA", "1000")),
)

defs = dg.Definitions(
    assets=[*raw_datasets, prompts, budgeted_prompts, shard_prompts, completions, training_set],
    jobs=[prepare_job, generate_job, training_set_job],
    schedules=[nightly_expansion],
    sensors=build_nightly_sensors(prepare_job=prepare_job, generate_job=generate_job, training_set_job=training_set_job),
    resources=resources_for(os.environ.get("EXPANSION_PROFILE", "local")),
)
