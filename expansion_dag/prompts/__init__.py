"""The prompt stages: the source catalog, the extractors, extraction of each source's rows into
prompts (the Hermes tool-call parser apart), selection across sources, token budgets into shards,
and the prompt ledger.
"""

from expansion_dag.prompts.budget import (
    PROMPT_OVER_INPUT_LIMIT,
    PROMPT_TOO_LONG,
    BudgetConfig,
    assign_shards,
    budget_prompts,
    count_all_prompt_tokens,
    shard_keys,
)
from expansion_dag.prompts.catalog import (
    Catalog,
    CatalogError,
    SourceLoadError,
    SourceSpec,
    load_catalog,
    load_source,
    package_dir,
    source_fingerprint,
)
from expansion_dag.prompts.extract import ExtractResult, extract_prompts
from expansion_dag.prompts.extractors import (
    EXTRACTORS,
    PROMPT_SCHEMA,
    QUARANTINE_SCHEMA,
    REASONS,
    SourceSchemaError,
)
from expansion_dag.prompts.ledger import nights, take_night
from expansion_dag.prompts.selection import SourceStats, select_prompts

__all__ = [
    "BudgetConfig", "Catalog", "CatalogError", "EXTRACTORS", "ExtractResult", "PROMPT_OVER_INPUT_LIMIT",
    "PROMPT_SCHEMA", "PROMPT_TOO_LONG", "QUARANTINE_SCHEMA", "REASONS", "SourceLoadError",
    "SourceSchemaError", "SourceSpec", "SourceStats", "assign_shards", "budget_prompts",
    "count_all_prompt_tokens", "extract_prompts", "load_catalog", "load_source", "nights",
    "package_dir", "select_prompts", "shard_keys", "source_fingerprint", "take_night"
]
