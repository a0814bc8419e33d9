"""The completion store: append-only segments per shard, the identity registry, and the shard lease
(one sender per shard) over compare-and-swap files, local or on S3.
"""

from expansion_dag.store.completions import DIGEST_FIELDS, SEGMENT_GLOB, CompletionStore, SegmentPart
from expansion_dag.store.conditional import conditional_file
from expansion_dag.store.identities import IdentityRegistry, MixedStoreError, RegistryError, WeightsChangedError
from expansion_dag.store.lease import (
    DEFAULT_LEASE_TIMEOUT_S,
    LEASES,
    Holder,
    LeaseLost,
    Log,
    ShardBusy,
    ShardLease,
    this_machine,
)
from expansion_dag.store.segments import DEFAULT_SEGMENT_INTERVAL_S, DEFAULT_SEGMENT_RECORDS, SegmentWriter

__all__ = [
    "CompletionStore", "DEFAULT_LEASE_TIMEOUT_S", "DEFAULT_SEGMENT_INTERVAL_S",
    "DEFAULT_SEGMENT_RECORDS", "DIGEST_FIELDS", "Holder", "IdentityRegistry", "LEASES", "LeaseLost", "Log",
    "MixedStoreError", "RegistryError", "SEGMENT_GLOB", "SegmentPart", "SegmentWriter", "ShardBusy",
    "ShardLease", "WeightsChangedError", "conditional_file", "this_machine"
]
