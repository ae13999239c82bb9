"""kvmesh's per-worker KV cache block manager: a Python port of TensorRT-LLM's kvCacheManager.cpp.

That C++ file is *the seed*, the specification this package follows: its names in snake_case,
its behaviour, its events (docs/architecture.md says what is ported and how; "as in the seed"
in a comment means as kvCacheManager.cpp does it). Pure and synchronous; torch only in
`cache.pools`. The public API is `__all__` below (tests/test_public_api.py pins it).
`CACHE_IMPL` says whether the hot modules run compiled by mypyc or as Python (`cache._native`).
"""

# First, before any module it decides on is imported: the compiled build or the sources.
from cache._native import select as _select_build

CACHE_IMPL = _select_build()

# ruff: noqa: E402 (the imports below must follow the choice above)
from cache.block import KVCacheBlock
from cache.errors import (
    DuplicateRequestError,
    InvalidRetentionConfigError,
    KVCacheError,
    OutOfBlocksError,
    PinConflictError,
    UnknownBlockError,
    UnknownRequestError,
)
from cache.events import (
    CreatedData,
    EventDiff,
    KVCacheEvent,
    RemovedData,
    StoredBlock,
    StoredData,
    UpdatedData,
)
from cache.eviction import PRIMARY_LEVEL, SECONDARY_LEVEL, LRUEvictionPolicy
from cache.hashing import (
    HASH_IMPL,
    BlockHash,
    BlockKey,
    MultimodalItem,
    block_hashes_for_tokens,
    block_key_hash,
    cache_salt_id,
)
from cache.manager import CacheType, KVCacheManager
from cache.request import LlmRequest, RequestState
from cache.retention import RetentionConfig, TokenRangeRetention, TransferMode
from cache.stats import KvCacheStats, WindowCapacity


class CacheLevel:
    """Cache tiers as they appear in events: 0 primary (GPU), 1 secondary (host)."""

    PRIMARY = PRIMARY_LEVEL
    SECONDARY = SECONDARY_LEVEL


__all__ = [
    "CACHE_IMPL",
    "HASH_IMPL",
    "BlockHash",
    "BlockKey",
    "CacheLevel",
    "CacheType",
    "CreatedData",
    "DuplicateRequestError",
    "EventDiff",
    "InvalidRetentionConfigError",
    "KVCacheBlock",
    "KVCacheError",
    "KVCacheEvent",
    "KVCacheManager",
    "KvCacheStats",
    "LRUEvictionPolicy",
    "LlmRequest",
    "MultimodalItem",
    "OutOfBlocksError",
    "PinConflictError",
    "RemovedData",
    "RequestState",
    "RetentionConfig",
    "StoredBlock",
    "StoredData",
    "TokenRangeRetention",
    "TransferMode",
    "UnknownBlockError",
    "UnknownRequestError",
    "UpdatedData",
    "WindowCapacity",
    "block_hashes_for_tokens",
    "block_key_hash",
    "cache_salt_id",
]
