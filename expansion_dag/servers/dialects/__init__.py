"""The table of differences between servers (SGLang's versions, vLLM): data every job of the layer reads."""

from expansion_dag.servers.dialects.table import DIALECTS, SGLANG, SGLANG_MIN_VERSION, VLLM, Dialect, dialect_for

__all__ = [
    "DIALECTS", "Dialect", "SGLANG", "SGLANG_MIN_VERSION", "VLLM", "dialect_for",
]
