"""``kvmesh bench transfer``: offload and onboard bandwidth against a plain torch copy.

Pools of 1,024 blocks of a 32-layer, 8-KV-head, 128-dim, 16-token fp16 model (2 MiB a block) on
the primary device and as many in the secondary (host) pool. Request A fills every primary block
and is released, so all its blocks are cached. Request B (a different prompt, at priority 0 so
that its own blocks are dropped rather than offloaded later) then needs every primary block:
the manager offloads A's 1,024 blocks. Request A again finds them all in the secondary pool: the
manager onboards them. Each phase is timed around its ``add_sequence`` (manager work included),
and compared with one ``copy_`` of the same bytes between the two pools in the same run. The
onboarded bytes are checked against what A wrote.

Keys: ``offload_gbps``, ``onboard_gbps``, ``copy_gbps`` (GB/s, 1e9 bytes), ``ratio`` (the
slower of offload/onboard over the plain copy), ``blocks``, ``block_bytes``, ``device``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from cache import KVCacheManager, LlmRequest, RetentionConfig, TokenRangeRetention

NUM_LAYERS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
TOKENS_PER_BLOCK = 16
NUM_BLOCKS = 1_024
NUM_BLOCKS_QUICK = 32
REPEATS = 3


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _one_round(num_blocks: int, device: str) -> dict[str, float]:
    window = num_blocks * TOKENS_PER_BLOCK
    mgr = KVCacheManager(
        num_layers=NUM_LAYERS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        tokens_per_block=TOKENS_PER_BLOCK,
        blocks_per_window={window: (num_blocks, num_blocks)},
        max_sequence_length=window,
        dtype=torch.float16,
        device=device,
    )
    pool = mgr.pools[window][0]
    primary, secondary = pool.primary, pool.secondary
    assert primary is not None and secondary is not None
    wm = mgr.windows[window]
    prompt_a = list(range(window))
    a = LlmRequest(0, prompt_a)
    mgr.add_sequence(a)
    for block_id in mgr.get_cache_block_ids(0)[0]:
        primary[wm.blocks[block_id].memory_index].fill_(float(block_id % 251))
    mgr.remove_sequence(0, a)

    drop = RetentionConfig(ranges=[TokenRangeRetention(0, None, 0)], decode_priority=0)
    b = LlmRequest(1, list(range(window, 2 * window)), retention=drop)
    _sync(device)
    start = time.perf_counter()
    mgr.add_sequence(b)
    _sync(device)
    offload_s = time.perf_counter() - start
    offloaded = sum(not blk.is_primary for blk in wm.tree_blocks())
    mgr.remove_sequence(1)

    again = LlmRequest(2, prompt_a)
    _sync(device)
    start = time.perf_counter()
    mgr.add_sequence(again)
    _sync(device)
    onboard_s = time.perf_counter() - start
    for block_id in mgr.get_cache_block_ids(2)[0]:
        value = primary[wm.blocks[block_id].memory_index]
        if not bool((value == float(block_id % 251)).all()):
            raise AssertionError(f"block {block_id} lost its contents in offload/onboard")

    start = time.perf_counter()
    secondary.copy_(primary)
    _sync(device)
    to_host_s = time.perf_counter() - start
    start = time.perf_counter()
    primary.copy_(secondary)
    _sync(device)
    to_device_s = time.perf_counter() - start
    nbytes = primary.numel() * primary.element_size()
    return {
        "offloaded": offloaded,
        "offload_gbps": nbytes / offload_s / 1e9,
        "onboard_gbps": nbytes / onboard_s / 1e9,
        "copy_gbps": nbytes / ((to_host_s + to_device_s) / 2) / 1e9,
        "block_bytes": nbytes // num_blocks,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    num_blocks = NUM_BLOCKS_QUICK if getattr(args, "quick", False) else NUM_BLOCKS
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rounds = [_one_round(num_blocks, device) for _ in range(REPEATS)]
    if any(r["offloaded"] != num_blocks for r in rounds):
        raise AssertionError("the eviction did not offload every cached block")
    best = {
        key: max(r[key] for r in rounds) for key in ("offload_gbps", "onboard_gbps", "copy_gbps")
    }
    return {
        "offload_gbps": round(best["offload_gbps"], 3),
        "onboard_gbps": round(best["onboard_gbps"], 3),
        "copy_gbps": round(best["copy_gbps"], 3),
        "ratio": round(min(best["offload_gbps"], best["onboard_gbps"]) / best["copy_gbps"], 3),
        "blocks": num_blocks,
        "block_bytes": int(rounds[0]["block_bytes"]),
        "device": device,
        "repeats": REPEATS,
    }
