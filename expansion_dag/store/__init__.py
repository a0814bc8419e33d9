"""The completion store: append-only segments per shard, the identity registry, and the shard lease
(one sender per shard) over compare-and-swap files, local or on S3.
"""

from expansion_dag.store.completions import DIGEST_FIELDS, SEGMENT_GLOB, CompletionStore, ScanResult
from expansion_dag.store.conditional import ConditionalWritesIgnored, conditional_file
from expansion_dag.store.identities import MixedStoreError, RegistryError, WeightsChangedError
from expansion_dag.store.kept_parts import kept_parts
from expansion_dag.store.lines import BAD_LINE_REASONS, decode_line, encode_line
from expansion_dag.store.lease import LEASES, BuildClaim, Holder, LeaseLost, Log, ShardBusy, ShardLease, process_id
from expansion_dag.store.segments import DEFAULT_SEGMENT_INTERVAL_S, DEFAULT_SEGMENT_RECORDS, SegmentWriter

__all__ = [
    "BAD_LINE_REASONS", "BuildClaim", "CompletionStore", "ConditionalWritesIgnored", "DEFAULT_SEGMENT_INTERVAL_S",
    "DEFAULT_SEGMENT_RECORDS", "DIGEST_FIELDS", "Holder", "LEASES", "LeaseLost", "Log", "MixedStoreError",
    "RegistryError", "SEGMENT_GLOB", "ScanResult", "SegmentWriter", "ShardBusy", "ShardLease", "WeightsChangedError",
    "conditional_file", "decode_line", "encode_line", "kept_parts", "process_id",
]
