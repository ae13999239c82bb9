"""Small factories shared by the cache tests."""

from __future__ import annotations

from typing import Any

from cache import KVCacheManager, LlmRequest


def make_manager(
    primary: int,
    secondary: int = 0,
    *,
    tokens_per_block: int = 4,
    max_sequence_length: int = 1024,
    events: int = 0,
    **kwargs: Any,
) -> KVCacheManager:
    window = kwargs.pop("window", max_sequence_length)
    kwargs.setdefault("allocate_pools", False)
    return KVCacheManager(
        num_layers=kwargs.pop("num_layers", 2),
        num_kv_heads=kwargs.pop("num_kv_heads", 2),
        head_dim=kwargs.pop("head_dim", 8),
        tokens_per_block=tokens_per_block,
        blocks_per_window={window: (primary, secondary)},
        max_attention_window=[window],
        max_sequence_length=max_sequence_length,
        event_buffer_max_size=events,
        **kwargs,
    )


def req(request_id: int, tokens: list[int] | range, **kwargs: Any) -> LlmRequest:
    return LlmRequest(request_id=request_id, tokens=list(tokens), **kwargs)


def add_tokens(mgr: KVCacheManager, request: LlmRequest, tokens: list[int] | range) -> None:
    for token in tokens:
        request.add_new_token(token)
        mgr.add_token(request.request_id)


def ids(mgr: KVCacheManager, request_id: int) -> list[int]:
    return mgr.get_cache_block_ids(request_id)[0]


def drain(mgr: KVCacheManager) -> list[dict[str, Any]]:
    mgr.flush_iteration_events()
    return [e.to_dict() for e in mgr.get_latest_events()]
