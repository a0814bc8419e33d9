"""One thin Dagster module per stage, its checks beside it.
"""

from expansion_dag.defs.assets.budget import (
    CHECK_FITS,
    CHECK_IDS_UNIQUE,
    CHECK_NO_EMPTY,
    budgeted_prompts,
    shard_prompts,
)
from expansion_dag.defs.assets.completions import (
    CHECK_CONTEXT_REJECTIONS,
    CHECK_DRIFT,
    CHECK_FAILURE_RATE,
    CHECK_TRUNCATION,
    completions,
    stored_checks,
    stored_figures,
)
from expansion_dag.defs.assets.prompts import build_prompts_asset
from expansion_dag.defs.assets.raw_datasets import build_raw_dataset_assets
from expansion_dag.defs.assets.training_set import (
    CHECK_LENGTH,
    CHECK_LOSS_MASK,
    CHECK_NOT_EMPTY,
    CHECK_ROUND_TRIP,
    training_set,
    training_set_checks,
    training_set_parts,
)

__all__ = [
    "CHECK_CONTEXT_REJECTIONS", "CHECK_DRIFT", "CHECK_FAILURE_RATE", "CHECK_FITS", "CHECK_IDS_UNIQUE",
    "CHECK_LENGTH", "CHECK_LOSS_MASK", "CHECK_NOT_EMPTY", "CHECK_NO_EMPTY", "CHECK_ROUND_TRIP",
    "CHECK_TRUNCATION", "budgeted_prompts", "build_prompts_asset", "build_raw_dataset_assets",
    "completions", "shard_prompts", "stored_checks", "stored_figures", "training_set",
    "training_set_checks", "training_set_parts"
]
