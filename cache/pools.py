"""Torch memory pools of one window and the engine that copies blocks between them.

The only module of `cache/` that touches torch. Pools follow the seed: one per distinct KV-head
count among the window's layers, shaped `[num_blocks, layers_in_pool, kv_factor, block_size]`
with block_size = heads x head_dim x tokens_per_block; a block's token slots are laid out
`[heads, tokens_per_block, head_dim]`, so a partial copy of the first N tokens touches the
first N rows of every head, layer, K and V.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
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

    @property
    def primary_bytes(self) -> int:
        """Bytes of the primary (GPU) pool: 0 before it is allocated."""
        return 0 if self.primary is None else self.primary.numel() * self.primary.element_size()

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


def layer_pool(
    window_to_layers: Mapping[int, Sequence[int]],
    num_kv_heads_per_layer: Sequence[int],
    layer: int,
) -> tuple[int, int]:
    """(absolute pool index, layer index within the pool) of a layer, the pools of all windows
    numbered window by window."""
    offset = 0
    for layers in window_to_layers.values():
        groups, mapping = group_pools(layers, num_kv_heads_per_layer)
        if layer in mapping:
            pool, index = mapping[layer]
            return offset + pool, index
        offset += len(groups)
    raise ValueError(f"layer {layer} is outside 0..{len(num_kv_heads_per_layer) - 1}")


def allocate_window_pools(
    layers: Sequence[int],
    num_kv_heads_per_layer: Sequence[int],
    kv_factor: int,
    head_dim: int,
    tokens_per_block: int,
    num_primary: int,
    num_secondary: int,
    dtype: torch.dtype | None,
    device: str,
) -> list[KVCachePool]:
    """The pools of one window's layers, one per distinct KV-head count, allocated (float16
    unless `dtype` says otherwise)."""
    groups, _ = group_pools(layers, num_kv_heads_per_layer)
    pools = [KVCachePool(n, kv_factor, heads, head_dim, tokens_per_block) for heads, n in groups]
    dtype = torch.float16 if dtype is None else dtype
    allocate(pools, num_primary, num_secondary, dtype, torch.device(device))
    return pools


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
        # Touch every page now: a lazily mapped pool would fault on the first offload.
        for tensor in (pool.primary, pool.secondary):
            if tensor is not None and not tensor.is_cuda:
                tensor.zero_()


@dataclass(frozen=True, slots=True)
class _Copy:
    src: Slot
    dst: Slot
    num_tokens: int


class TorchTransferEngine:
    """Moves block contents between the slots of a window's pools, batched.

    Copies are queued and run in *waves*: a copy that reads a slot written earlier in the wave,
    or writes a slot read or written earlier, closes the wave first, so per-slot order is kept
    (a read waits for pending writes to that slot and vice versa). Inside a wave, copies of the
    same kind (tiers, tokens) run together: per pool, one narrow copy per run of consecutive
    slots, or one gather and one scatter when the slots are scattered. On CUDA the copies run on
    a dedicated stream that first waits for the compute stream, and the compute stream waits for
    it after each flush.

    File mode (the seed's GDS / POSIX fallback) keeps an offloaded block in
    `<directory>/block_<secondary slot>_pool_<pool>.bin` instead of host memory; where a
    secondary slot's content lives is remembered per slot, so an onboard finds it whatever mode
    the onboarding request uses.
    """

    def __init__(self, pools: Sequence[KVCachePool]) -> None:
        self.pools = list(pools)
        self._queue: list[_Copy] = []
        self._reads: set[Slot] = set()
        self._writes: set[Slot] = set()
        self._in_file: dict[int, str] = {}  # secondary slot -> directory holding its content
        first = self.pools[0].primary if self.pools else None
        self._stream: torch.cuda.Stream | None = None
        if first is not None and first.is_cuda:
            self._stream = torch.cuda.Stream(device=first.device)  # type: ignore[no-untyped-call]
        self.num_copies = 0

    def copy(self, src: Slot, dst: Slot, num_tokens: int = 0, directory: str | None = None) -> None:
        if src in self._writes or dst in self._reads or dst in self._writes:
            self.flush()
        to_file = directory is not None and not dst.is_primary
        if to_file or (not src.is_primary and src.index in self._in_file):
            self.flush()
            self._file_copy(src, dst, num_tokens, directory if to_file else None)
            return
        if not dst.is_primary:
            self._in_file.pop(dst.index, None)
        self._queue.append(_Copy(src, dst, num_tokens))
        self._reads.add(src)
        self._writes.add(dst)

    def flush(self) -> None:
        if not self._queue:
            return
        queue, self._queue = self._queue, []
        self._reads.clear()
        self._writes.clear()
        tokens_per_block = self.pools[0].tokens_per_block
        groups: dict[tuple[bool, bool, int], list[_Copy]] = {}
        for c in queue:
            n = c.num_tokens if 0 < c.num_tokens < tokens_per_block else 0
            groups.setdefault((c.src.is_primary, c.dst.is_primary, n), []).append(c)
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with context:
            for (src_primary, dst_primary, n), copies in groups.items():
                src_idx = [c.src.index for c in copies]
                dst_idx = [c.dst.index for c in copies]
                for pool in self.pools:
                    src, dst = pool.tensor(src_primary), pool.tensor(dst_primary)
                    _copy_blocks(pool, src, dst, src_idx, dst_idx, n)
        if stream is not None:
            torch.cuda.current_stream(stream.device).wait_stream(stream)
        self.num_copies += len(queue)

    def sync(self) -> None:
        self.flush()
        if self._stream is not None:
            self._stream.synchronize()

    @staticmethod
    def block_path(directory: str, slot: int, pool: int) -> str:
        return os.path.join(directory, f"block_{slot}_pool_{pool}.bin")

    def _file_copy(self, src: Slot, dst: Slot, num_tokens: int, directory: str | None) -> None:
        """Synchronous POSIX read/write of one block per pool (the seed's debug fallback);
        with `directory`, write `src` to the files of secondary slot `dst`."""
        source_dir = None if src.is_primary else self._in_file.get(src.index)
        for p, pool in enumerate(self.pools):
            like = pool.tensor(True)[0]
            if source_dir is None:
                data = pool.tensor(src.is_primary)[src.index].cpu()
            else:
                raw = np.fromfile(self.block_path(source_dir, src.index, p), dtype=np.uint8)
                data = torch.from_numpy(raw).view(like.dtype).view(like.shape)
            if directory is not None:
                os.makedirs(directory, exist_ok=True)
                data.contiguous().view(torch.uint8).numpy().tofile(
                    self.block_path(directory, dst.index, p)
                )
            else:
                target = pool.tensor(dst.is_primary)
                n = num_tokens if 0 < num_tokens < pool.tokens_per_block else 0
                _copy_blocks(pool, data.unsqueeze(0).to(target.device), target, [0], [dst.index], n)
        if not dst.is_primary:
            if directory is not None:
                self._in_file[dst.index] = directory
            else:
                self._in_file.pop(dst.index, None)
        self.num_copies += 1


def _runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs (src start, dst start, length) of pairs that one narrow copy can move: both
    sides step by +1, or both by -1 (a descending run is the same copy read backwards)."""
    a = np.asarray(src, dtype=np.int64)
    b = np.asarray(dst, dtype=np.int64)
    da, db = np.diff(a), np.diff(b)
    step = np.where((da == db) & (np.abs(da) == 1), da, 0)
    # a run continues while the step stays the same non-zero value
    breaks = np.flatnonzero((step == 0) | (np.concatenate(([0], step[:-1])) * step < 0)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(a)]))
    runs = []
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        first = s if e - s == 1 or a[s + 1] > a[s] else e - 1
        runs.append((int(a[first]), int(b[first]), e - s))
    return runs


def _copy_blocks(
    pool: KVCachePool,
    src: torch.Tensor,
    dst: torch.Tensor,
    src_idx: Sequence[int],
    dst_idx: Sequence[int],
    num_tokens: int,
) -> None:
    """dst[dst_idx] = src[src_idx] (only the first `num_tokens` token slots when non-zero)."""
    if num_tokens:
        shape = (
            -1,
            pool.num_layers,
            pool.kv_factor,
            pool.num_kv_heads,
            pool.tokens_per_block,
            pool.head_dim,
        )
        si = torch.tensor(src_idx, device=src.device)
        di = torch.tensor(dst_idx, device=dst.device)
        part = src.view(shape)[si][:, :, :, :, :num_tokens].to(dst.device, non_blocking=True)
        dst.view(shape)[di, :, :, :, :num_tokens] = part
        return
    runs = _runs(src_idx, dst_idx)
    if len(runs) * 4 <= len(src_idx) or len(src_idx) <= 2:
        for s, d, n in runs:
            dst.narrow(0, d, n).copy_(src.narrow(0, s, n), non_blocking=True)
        return
    # One indexed copy: gather straight into a contiguous destination range, or scatter from a
    # contiguous source range; a gather and a scatter only when both sides are scattered.
    n = len(src_idx)
    same_device = src.device == dst.device
    if same_device and _is_range(dst_idx):
        index = torch.tensor(src_idx, device=src.device)
        torch.index_select(src, 0, index, out=dst.narrow(0, dst_idx[0], n))
    elif _is_range(src_idx):
        part = src.narrow(0, src_idx[0], n).to(dst.device, non_blocking=True)
        dst.index_copy_(0, torch.tensor(dst_idx, device=dst.device), part)
    else:
        gathered = src.index_select(0, torch.tensor(src_idx, device=src.device))
        dst.index_copy_(0, torch.tensor(dst_idx, device=dst.device), gathered.to(dst.device))


def _is_range(index: Sequence[int]) -> bool:
    """True when the slots are consecutive and ascending."""
    a = np.asarray(index, dtype=np.int64)
    return len(a) > 0 and bool((np.diff(a) == 1).all())


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


def copy_offset_tables(
    output: torch.Tensor,
    slot_offset: int,
    tables: Sequence[tuple[torch.Tensor, Sequence[Sequence[int]]]],
) -> int:
    """copyBlockOffsets: each window's table (`offset_table`, with the block ids of its beams)
    into output[pool, slot_offset + beam, K/V, :n], the pools of all windows numbered in turn;
    returns the largest block count of a beam."""
    max_count = 0
    absolute = 0
    for table, ids_per_beam in tables:
        for pool in range(table.shape[0]):
            for beam, ids in enumerate(ids_per_beam):
                n = len(ids)
                output[absolute, slot_offset + beam, :, :n] = table[pool, beam, :, :n]
                max_count = max(max_count, n)
            absolute += 1
    return max_count


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
