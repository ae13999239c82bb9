"""Torch memory pools of one window and the engine that copies blocks between them.

The only module of `cache/` that touches torch. Pools follow the seed: one per distinct KV-head
count among the window's layers, shaped `[num_blocks, layers_in_pool, kv_factor, block_size]`
with block_size = heads x head_dim x tokens_per_block; a block's token slots are laid out
`[heads, tokens_per_block, head_dim]`, so a partial copy of the first N tokens touches the
first N rows of every head, layer, K and V.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cache.transfer import Slot


@dataclass(slots=True)
class KVCachePool:
    num_layers: int
    kv_factor: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int
    primary: torch.Tensor | None = None
    secondary: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return self.num_kv_heads * self.head_dim * self.tokens_per_block

    def tensor(self, is_primary: bool) -> torch.Tensor:
        pool = self.primary if is_primary else self.secondary
        if pool is None:
            raise RuntimeError("pool not allocated")
        return pool


def group_pools(
    layers: Sequence[int], num_kv_heads_per_layer: Sequence[int]
) -> tuple[list[tuple[int, int]], dict[int, tuple[int, int]]]:
    """Pools as (num_kv_heads, num_layers) sorted by head count, and layer -> (pool, index)."""
    per_heads: dict[int, int] = {}
    index_in_pool: dict[int, int] = {}
    for layer in layers:
        heads = num_kv_heads_per_layer[layer]
        index_in_pool[layer] = per_heads.get(heads, 0)
        per_heads[heads] = index_in_pool[layer] + 1
    pools = sorted(per_heads.items())
    pool_of_heads = {heads: i for i, (heads, _) in enumerate(pools)}
    mapping = {
        layer: (pool_of_heads[num_kv_heads_per_layer[layer]], index_in_pool[layer])
        for layer in layers
    }
    return pools, mapping


def allocate(
    pools: Sequence[KVCachePool],
    num_primary: int,
    num_secondary: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    pin = device.type == "cuda"
    for pool in pools:
        shape = (pool.num_layers, pool.kv_factor, pool.block_size)
        pool.primary = torch.zeros((num_primary, *shape), dtype=dtype, device=device)
        if num_secondary > 0:
            pool.secondary = torch.zeros(
                (num_secondary, *shape), dtype=dtype, device="cpu", pin_memory=pin
            )


class TorchTransferEngine:
    """Copies whole blocks, or their first N token slots, across every pool of a window."""

    def __init__(self, pools: Sequence[KVCachePool]) -> None:
        self.pools = list(pools)

    def copy(self, src: Slot, dst: Slot, num_tokens: int = 0) -> None:
        for pool in self.pools:
            src_block = pool.tensor(src.is_primary)[src.index]
            dst_block = pool.tensor(dst.is_primary)[dst.index]
            if 0 < num_tokens < pool.tokens_per_block:
                shape = (
                    pool.num_layers,
                    pool.kv_factor,
                    pool.num_kv_heads,
                    pool.tokens_per_block,
                    pool.head_dim,
                )
                dst_block.view(shape)[:, :, :, :num_tokens].copy_(
                    src_block.view(shape)[:, :, :, :num_tokens], non_blocking=True
                )
            else:
                dst_block.copy_(src_block, non_blocking=True)

    def sync(self) -> None:
        if any(p.primary is not None and p.primary.is_cuda for p in self.pools):
            torch.cuda.synchronize()


KV_CACHE_INDEX_SENTINEL = 2**31 - 1  # unused slots of a block offset table


def offset_table(
    memory_indices: Sequence[Sequence[int]],
    pools: Sequence[KVCachePool],
    max_blocks_per_seq: int,
    k_only: bool,
) -> torch.Tensor:
    """The seed's per-sequence cacheBlockIndices for one window: int32
    [pools, beams, 2 (K, V), max_blocks_per_seq]; entry = (slot x layers_in_pool + 0) x kv_factor
    + field, field 0 for K and 1 for V (0 for both in a K-only cache); unused slots hold the
    sentinel."""
    beams = len(memory_indices)
    table = torch.full(
        (len(pools), beams, 2, max_blocks_per_seq), KV_CACHE_INDEX_SENTINEL, dtype=torch.int32
    )
    for beam, slots in enumerate(memory_indices):
        if not slots:
            continue
        mem = torch.tensor(slots, dtype=torch.int64)
        n = len(slots)
        for p, pool in enumerate(pools):
            base = mem * pool.num_layers * pool.kv_factor
            table[p, beam, 0, :n] = base
            table[p, beam, 1, :n] = base + (0 if k_only else 1)
    return table


def free_device_memory_bytes(device: str) -> int:
    """Free memory of a CUDA device, or of the host for "cpu"."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read available host memory")
