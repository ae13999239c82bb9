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
