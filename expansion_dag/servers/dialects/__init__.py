"""The table of differences between servers (SGLang's versions, vLLM): data every job of the layer reads."""

from expansion_dag.servers.dialects.table import (
    BACKENDS,
    DIALECTS,
    SGLANG,
    SGLANG_MIN_VERSION,
    SLOTS_FLAGS,
    VLLM,
    Dialect,
    dialect_for,
)

__all__ = [
    "BACKENDS", "DIALECTS", "Dialect", "SGLANG", "SGLANG_MIN_VERSION", "SLOTS_FLAGS", "VLLM", "dialect_for",
]
