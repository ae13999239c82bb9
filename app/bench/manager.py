"""``kvmesh bench manager``: block manager throughput on the workload of issue #3.

2,000 requests of 4,096 tokens (16 tokens a block, so 256 blocks each). The first 2,048 tokens of
every request are one of 10 shared prefixes, picked at random; the other 2,048 are random. Token
ids are drawn from 0..31999, all from seeded generators, so every run sees the same requests.
32 requests are live at once: before the 33rd is added the oldest is removed, storing its blocks
for reuse. One ``KVCacheManager`` with 16,384 primary blocks and no secondary level, events on;
after every removal and every ``add_sequence`` the events are drained with ``take_events()`` and
encoded with ``events.codec.encode_events``, as a worker publishing them would.

Timed: building each ``LlmRequest``, ``add_sequence`` (which hashes the prompt), the removals,
draining and encoding the events. Not timed: generating the token lists, and a warm-up of 50
requests on a separate manager (numba compiles the hasher on first use). The token lists are
frozen out of the garbage collector's sight (``gc.freeze``) so its passes over 8 million list
slots of input are not charged to the manager; the collector still runs on everything the
manager allocates.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections import deque
from typing import Any

import numpy as np

from cache import CACHE_IMPL, HASH_IMPL, KVCacheManager, LlmRequest
from events.codec import encode_events

SEED = 3  # issue #3
NUM_REQUESTS = 2_000
NUM_REQUESTS_QUICK = 100
NUM_WARMUP = 50
TOKENS_PER_REQUEST = 4_096
PREFIX_TOKENS = 2_048
NUM_PREFIXES = 10
VOCAB_SIZE = 32_000
TOKENS_PER_BLOCK = 16
NUM_PRIMARY_BLOCKS = 16_384
MAX_LIVE = 32
EVENT_BUFFER = 1_000_000


def make_manager() -> KVCacheManager:
    window = TOKENS_PER_REQUEST
    return KVCacheManager(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        tokens_per_block=TOKENS_PER_BLOCK,
        blocks_per_window={window: (NUM_PRIMARY_BLOCKS, 0)},
        max_num_sequences=MAX_LIVE,
        max_attention_window=[window],
        max_sequence_length=TOKENS_PER_REQUEST,
        event_buffer_max_size=EVENT_BUFFER,
        allocate_pools=False,
    )


def make_prompts(num_requests: int, seed: int = SEED) -> list[list[int]]:
    """The token lists of the workload: a shared prefix (one of 10) + random tokens each."""
    rng = np.random.default_rng(seed)
    prefixes: list[list[int]] = rng.integers(
        0, VOCAB_SIZE, size=(NUM_PREFIXES, PREFIX_TOKENS)
    ).tolist()
    choice: list[int] = rng.integers(0, NUM_PREFIXES, size=num_requests).tolist()
    suffixes: list[list[int]] = rng.integers(
        0, VOCAB_SIZE, size=(num_requests, TOKENS_PER_REQUEST - PREFIX_TOKENS)
    ).tolist()
    return [prefixes[c] + suffix for c, suffix in zip(choice, suffixes, strict=True)]


def replay(mgr: KVCacheManager, prompts: list[list[int]]) -> dict[str, int]:
    """Run the workload on `mgr`; returns the counters the report needs (the timed part)."""
    live: deque[tuple[int, LlmRequest]] = deque()
    blocks = 0
    event_bytes = 0
    num_events = 0
    for rid, tokens in enumerate(prompts):
        if len(live) == MAX_LIVE:
            old_rid, old_request = live.popleft()
            mgr.remove_sequence(old_rid, old_request)
            events = mgr.take_events()
            num_events += len(events)
            event_bytes += len(encode_events(events))
        request = LlmRequest(rid, tokens)
        mgr.add_sequence(request)
        blocks += request.alloc_total_blocks + request.reused_blocks
        live.append((rid, request))
        events = mgr.take_events()
        num_events += len(events)
        event_bytes += len(encode_events(events))
    return {"blocks": blocks, "event_bytes": event_bytes, "events": num_events}


def measure(num_requests: int, num_warmup: int = NUM_WARMUP) -> dict[str, Any]:
    warmup_prompts = make_prompts(num_warmup, seed=SEED + 1)
    replay(make_manager(), warmup_prompts)
    del warmup_prompts

    prompts = make_prompts(num_requests)
    mgr = make_manager()
    mgr.take_events()  # the `created` event belongs to construction, not to the workload
    gc.collect()
    gc.freeze()
    try:
        start = time.perf_counter()
        counters = replay(mgr, prompts)
        seconds = time.perf_counter() - start
    finally:
        gc.unfreeze()
    stats = mgr.get_kv_cache_stats()
    if mgr.num_dropped_events:
        raise RuntimeError(f"the event buffer dropped {mgr.num_dropped_events} events")
    return {
        "requests": num_requests,
        "seconds": round(seconds, 4),
        "requests_per_s": round(num_requests / seconds, 1),
        "us_per_request": round(seconds / num_requests * 1e6, 1),
        "blocks": counters["blocks"],
        "blocks_per_s": round(counters["blocks"] / seconds),
        "reused_blocks": stats.reused_blocks,
        "hit_rate": round(stats.cache_hit_rate, 6),
        "events": counters["events"],
        "event_bytes": counters["event_bytes"],
        "hash_impl": HASH_IMPL,
        "cache_impl": CACHE_IMPL,
        "warmup_requests": num_warmup,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    return measure(NUM_REQUESTS_QUICK if args.quick else NUM_REQUESTS)
