"""The packages' export lists are exact: a name added to or dropped from ``cache`` or ``events``
is a change of the public API, made on purpose (here) and not by accident."""

from __future__ import annotations

import importlib

import pytest

CACHE_ALL = [
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

EVENTS_ALL = [
    "EnvelopeError",
    "EventCodecError",
    "EventsError",
    "InvalidEventError",
    "InvalidWorkerIdError",
    "OversizedEntryError",
    "PrefixIndex",
    "SnapshotError",
]

# The names other code is written against (README's "block manager in ten lines", docs/).
DESIGN_NAMES = {
    "cache": [
        "KVCacheManager",
        "LlmRequest",
        "RequestState",
        "RetentionConfig",
        "TokenRangeRetention",
        "MultimodalItem",
        "KvCacheStats",
        "CacheLevel",
        "BlockKey",
        "block_key_hash",
        "block_hashes_for_tokens",
        "OutOfBlocksError",
        "KVCacheEvent",
        "CacheType",
    ],
    "events": ["PrefixIndex"],
}


@pytest.mark.parametrize(("package", "names"), [("cache", CACHE_ALL), ("events", EVENTS_ALL)])
def test_the_export_list_is_exact(package: str, names: list[str]) -> None:
    module = importlib.import_module(package)
    assert module.__all__ == names
    assert [name for name in names if not hasattr(module, name)] == []


@pytest.mark.parametrize("package", sorted(DESIGN_NAMES))
def test_the_names_design_md_pins_are_exported(package: str) -> None:
    module = importlib.import_module(package)
    assert [name for name in DESIGN_NAMES[package] if name not in module.__all__] == []
