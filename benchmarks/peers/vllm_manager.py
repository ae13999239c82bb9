"""vLLM's v1 ``KVCacheManager`` on kvmesh's ``bench manager`` workload.

Run with an interpreter that has vLLM (see README.md):
``python vllm_manager.py DIR [--events-off] [--hash sha256|sha256_cbor|xxhash]``.
Per request, as vLLM's scheduler does for a new prompt: build the ``Request`` (its block hasher
hashes the prompt), ``get_computed_blocks``, ``allocate_slots`` for the uncached tokens (which
caches the full blocks), and after 32 live requests ``free`` the oldest. Events on: after each
step ``take_events()`` is encoded with msgspec as a ``KVEventBatch``, as vLLM's ZMQ publisher
does. The timed part and the garbage-collector freeze match kvmesh's benchmark.
"""

import argparse
import gc
import json
import pickle
import time
from collections import deque
from pathlib import Path

import msgspec
import torch
from vllm.distributed.kv_events import KVEventBatch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request


def make_manager(w: dict, events: bool) -> KVCacheManager:
    bs = w["tokens_per_block"]
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=8, dtype=torch.float16)
    config = KVCacheConfig(
        num_blocks=w["num_blocks"],
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )
    max_len = max(len(p) for p in w["prompts"]) + bs
    return KVCacheManager(
        config,
        max_model_len=max_len,
        scheduler_block_size=bs,
        hash_block_size=bs,
        enable_caching=True,
        enable_kv_cache_events=events,
    )


def replay(mgr: KVCacheManager, w: dict, prompts: list, hasher, events: bool) -> tuple[int, int]:
    encoder = msgspec.msgpack.Encoder()
    params = SamplingParams(max_tokens=1)
    live: deque[Request] = deque()
    hit_tokens = 0
    event_bytes = 0

    def drain() -> None:
        nonlocal event_bytes
        if events and (batch := mgr.take_events()):
            event_bytes += len(encoder.encode(KVEventBatch(ts=time.time(), events=batch)))

    for rid, tokens in enumerate(prompts):
        if len(live) == w["max_live"]:
            mgr.free(live.popleft())
            drain()
        request = Request(str(rid), tokens, params, None, block_hasher=hasher)
        blocks, computed, *_ = mgr.get_computed_blocks(request)
        hit_tokens += computed
        if mgr.allocate_slots(request, len(tokens) - computed, computed, blocks) is None:
            raise RuntimeError(f"request {rid}: no room")
        request.num_computed_tokens = len(tokens)
        live.append(request)
        drain()
    return hit_tokens, event_bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir", type=Path)
    parser.add_argument("--events-off", action="store_true")
    parser.add_argument("--hash", default="sha256")
    args = parser.parse_args()
    with open(args.dir / "manager.pkl", "rb") as f:
        w = pickle.load(f)
    events = not args.events_off
    hash_fn = get_hash_fn_by_name(args.hash)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(w["tokens_per_block"], hash_fn)
    replay(make_manager(w, events), w, w["warmup"], hasher, events)
    mgr = make_manager(w, events)
    gc.collect()
    gc.freeze()
    start = time.perf_counter()
    hit_tokens, event_bytes = replay(mgr, w, w["prompts"], hasher, events)
    seconds = time.perf_counter() - start
    gc.unfreeze()
    n = len(w["prompts"])
    total = sum(len(p) for p in w["prompts"])
    print(
        json.dumps(
            {
                "peer": "vllm KVCacheManager",
                "hash": args.hash,
                "events": events,
                "requests_per_s": round(n / seconds, 1),
                "us_per_request": round(seconds / n * 1e6, 1),
                "hit_rate": round(hit_tokens / total, 6),
                "event_bytes": event_bytes,
            }
        )
    )


if __name__ == "__main__":
    main()
