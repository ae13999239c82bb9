"""KVCacheManager: the per-worker KV cache manager (the seed's KVCacheManager + BlockManager).

Owns one WindowBlockManager per distinct attention window size, the live sequences, the event
buffer and the statistics. Synchronous and single-writer: the worker calls it from one task.

Failure leaves no trace: every operation checks what it needs (request ids, free blocks) before
it changes anything, so a refused call changes neither blocks, tree, statistics nor events.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

from cache import capacity
from cache.block import KVCacheBlock
from cache.dryrun import count_blocks_needed
from cache.errors import DuplicateRequestError, OutOfBlocksError, UnknownRequestError
from cache.events import EventSink, KVCacheEvent, KVCacheEventManager, NullEventSink
from cache.hashing import BlockHash, BlockKey
from cache.request import INT_MAX, GenerationRequest, LlmRequest, RequestState
from cache.transfer import NoOpTransferEngine, TransferEngine
from cache.window import WindowBlockManager


class CacheType(Enum):
    SELF = "self"
    CROSS = "cross"
    SELFKONLY = "selfkonly"

    @property
    def kv_factor(self) -> int:
        return 1 if self is CacheType.SELFKONLY else 2


@dataclass(slots=True)
class KvCacheStats:
    max_num_blocks: int
    free_num_blocks: int
    used_num_blocks: int
    tokens_per_block: int
    alloc_total_blocks: int
    alloc_new_blocks: int
    reused_blocks: int
    missed_blocks: int
    cache_hit_rate: float
    num_free_blocks_per_window_size: dict[int, int] = field(default_factory=dict)
    allocated_bytes: int = 0


@dataclass(frozen=True, slots=True)
class WindowCapacity:
    """Blocks of one attention window (or of all windows summed), per level."""

    primary: int
    secondary: int
    free_primary: int
    free_secondary: int


class WindowPlan(NamedTuple):
    """What add_sequence does in one window: its share of the input, and the keys it matches."""

    window: WindowBlockManager
    input_length: int
    num_context_blocks: int
    keys: list[BlockKey]
    hashes: list[BlockHash]
    max_num_blocks: int  # free blocks it takes at most (one per position, per beam at the tail)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def group_layers_by_window_size(
    max_attention_window: Sequence[int], num_layers: int
) -> dict[int, list[int]]:
    """groupLayersByWindowSize: windows cycle over the layers; sorted by window size."""
    groups: dict[int, list[int]] = {}
    for layer in range(num_layers):
        groups.setdefault(max_attention_window[layer % len(max_attention_window)], []).append(layer)
    return dict(sorted(groups.items()))


class KVCacheManager:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int | Sequence[int],
        head_dim: int,
        tokens_per_block: int,
        blocks_per_window: Mapping[int, tuple[int, int]],
        max_num_sequences: int = 64,
        max_beam_width: int = 1,
        max_attention_window: Sequence[int] | None = None,
        max_sequence_length: int | None = None,
        dtype: Any = None,
        device: str = "cpu",
        enable_block_reuse: bool = True,
        enable_partial_reuse: bool = True,
        copy_on_partial_reuse: bool = True,
        onboard_blocks: bool = True,
        secondary_offload_min_priority: int | None = None,
        event_buffer_max_size: int = 0,
        allocate_pools: bool = True,
        cache_type: CacheType = CacheType.SELF,
        clock: Callable[[], float] | None = None,
        transfer_engine: TransferEngine | None = None,
        sink_token_length: int = 0,
        report_leaf_takeover: bool = False,
    ) -> None:
        """See DESIGN.md 1.1 for the arguments. Beyond the seed:

        `transfer_engine` moves block contents when `allocate_pools` is False (default: none);
        `report_leaf_takeover` emits a Removed event when a request takes a cached leaf over
        for partial reuse (and then no Updated if that leaf is onboarded). The seed stays
        silent there (TensorRT-LLM does too), which leaves the old hash in every consumer's
        index; a worker feeding a cluster index turns it on.
        """
        if tokens_per_block <= 0:
            raise ValueError(f"tokens_per_block must be positive, got {tokens_per_block}")
        if num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {num_layers}")
        heads = [num_kv_heads] * num_layers if isinstance(num_kv_heads, int) else list(num_kv_heads)
        if len(heads) != num_layers:
            raise ValueError(f"num_kv_heads lists {len(heads)} layers, num_layers is {num_layers}")
        if sink_token_length % tokens_per_block:
            raise ValueError("streamLLM sink tokens are not supported")
        if max_sequence_length is None:
            if max_attention_window is None:
                raise ValueError("give max_sequence_length or max_attention_window")
            max_sequence_length = max(max_attention_window)
        if max_attention_window is None:
            max_attention_window = [max_sequence_length]
        self.num_layers = num_layers
        self.num_kv_heads_per_layer = heads
        self.head_dim = head_dim
        self.tokens_per_block = tokens_per_block
        self.max_num_sequences = max_num_sequences
        self.max_beam_width = max_beam_width
        self.max_sequence_length = max_sequence_length
        self.max_attention_window = max(max_attention_window)
        self.cache_type = cache_type
        self.enable_block_reuse = enable_block_reuse
        self.device = device
        self.dtype = dtype
        self.events: EventSink = (
            KVCacheEventManager(event_buffer_max_size)
            if event_buffer_max_size > 0
            else NullEventSink()
        )
        self.clock = clock or time.monotonic
        self.window_to_layers = group_layers_by_window_size(max_attention_window, num_layers)
        self.windows: dict[int, WindowBlockManager] = {}
        self.max_token_num: dict[int, int] = {}
        self.pools: dict[int, list[Any]] = {}
        self.allocated_bytes = 0
        for window, layers in self.window_to_layers.items():
            if window not in blocks_per_window:
                raise ValueError(f"blocks_per_window has no entry for window size {window}")
            primary, secondary = blocks_per_window[window]
            if window > max_sequence_length:
                warnings.warn(
                    f"window size {window} is greater than max sequence length "
                    f"{max_sequence_length}",
                    stacklevel=2,
                )
            engine = transfer_engine
            if allocate_pools:
                engine = self._allocate_pools(window, layers, primary, secondary)
            self.windows[window] = WindowBlockManager(
                window,
                tokens_per_block,
                primary,
                secondary,
                is_swa=window < max_sequence_length,
                onboard_blocks=onboard_blocks,
                secondary_offload_min_priority=secondary_offload_min_priority,
                events=self.events,
                enable_partial_reuse=enable_partial_reuse,
                copy_on_partial_reuse=copy_on_partial_reuse,
                transfer=engine or NoOpTransferEngine(),
                clock=self.clock,
                report_leaf_takeover=report_leaf_takeover,
            )
            self.max_token_num[window] = max(window, max_sequence_length)
        self.sequences: dict[int, GenerationRequest] = {}

    def _allocate_pools(
        self, window: int, layers: Sequence[int], primary: int, secondary: int
    ) -> TransferEngine:
        import torch

        from cache import pools as pools_mod

        groups, _ = pools_mod.group_pools(layers, self.num_kv_heads_per_layer)
        pools = [
            pools_mod.KVCachePool(
                n, self.cache_type.kv_factor, heads, self.head_dim, self.tokens_per_block
            )
            for heads, n in groups
        ]
        dtype = self.dtype if self.dtype is not None else torch.float16
        pools_mod.allocate(pools, primary, secondary, dtype, torch.device(self.device))
        self.pools[window] = pools
        for pool in pools:
            assert pool.primary is not None
            self.allocated_bytes += pool.primary.numel() * pool.primary.element_size()
        return pools_mod.TorchTransferEngine(pools)

    # -- capacity (the seed's static helpers) ----------------------------------------------------

    calculate_max_block_requirements_per_beam = staticmethod(
        capacity.calculate_max_block_requirements_per_beam
    )
    calculate_max_block_requirements = staticmethod(capacity.calculate_max_block_requirements)
    calculate_max_attention_window = staticmethod(capacity.calculate_max_attention_window)
    calculate_window_size_to_share = staticmethod(capacity.calculate_window_size_to_share)
    calculate_max_num_blocks = staticmethod(capacity.calculate_max_num_blocks)
    group_layers_by_window_size = staticmethod(group_layers_by_window_size)

    def get_max_capacity_batch_size(self, input_length: int, output_length: int) -> int:
        """How many sequences of this shape fit at once (the tightest window decides)."""
        return min(
            wm.num_primary_blocks
            // capacity.calculate_max_block_requirements(
                input_length, output_length, 0, window, self.max_beam_width, self.tokens_per_block
            )
            for window, wm in self.windows.items()
        )

    # -- pools and block offset tables -----------------------------------------------------------

    @property
    def num_pools(self) -> int:
        return sum(len(p) for p in self.pools.values())

    def get_layer_pool(self, layer: int) -> tuple[int, int]:
        """(absolute pool index, layer index within the pool) of a layer."""
        from cache.pools import group_pools

        offset = 0
        for layers in self.window_to_layers.values():
            groups, mapping = group_pools(layers, self.num_kv_heads_per_layer)
            if layer in mapping:
                pool, index = mapping[layer]
                return offset + pool, index
            offset += len(groups)
        raise ValueError(f"layer {layer} is outside 0..{self.num_layers - 1}")

    def get_primary_pool(self, layer: int) -> Any:
        """The primary pool tensor that holds `layer` (and its index inside it)."""
        pool, _ = self.get_layer_pool(layer)
        return [p for pools in self.pools.values() for p in pools][pool].primary

    def max_blocks_per_seq(self) -> int:
        return _ceil_div(self.max_sequence_length, self.tokens_per_block)

    def get_block_offsets(self, request_id: int, window_size: int | None = None) -> Any:
        """The kernel-facing block table of a sequence for one window (see pools.offset_table)."""
        from cache.pools import offset_table

        wm = self._window(window_size)
        if wm.window_size not in self.pools:
            raise RuntimeError("block offsets need allocated pools")
        ids = self._sequence(request_id).cache_block_ids[wm.window_size]
        slots = [[wm.blocks[i].memory_index for i in beam] for beam in ids]
        return offset_table(
            slots,
            self.pools[wm.window_size],
            self.max_blocks_per_seq(),
            self.cache_type is CacheType.SELFKONLY,
        )

    def copy_block_offsets(self, output: Any, output_slot_offset: int, request_id: int) -> int:
        """copyBlockOffsets: write the sequence's table into output[pool, slot + beam, K/V, :n]
        for every window's pools; returns the largest block count of a beam."""
        max_count = 0
        absolute = 0
        sequence = self._sequence(request_id)
        for window in self.windows:
            table = self.get_block_offsets(request_id, window)
            for pool in range(table.shape[0]):
                for beam, ids in enumerate(sequence.cache_block_ids[window]):
                    n = len(ids)
                    output[absolute, output_slot_offset + beam, :, :n] = table[pool, beam, :, :n]
                    max_count = max(max_count, n)
                absolute += 1
        return max_count

    def get_block_offsets_of_batch(
        self, output: Any, request_ids: Sequence[int], beam_width: int
    ) -> None:
        for i, request_id in enumerate(request_ids):
            self.copy_block_offsets(output, i * beam_width, request_id)

    # -- helpers ---------------------------------------------------------------------------------

    @property
    def is_cross_kv(self) -> bool:
        return self.cache_type is CacheType.CROSS

    @property
    def is_variable_window(self) -> bool:
        return len(self.windows) > 1

    def _sequence(self, request_id: int) -> GenerationRequest:
        try:
            return self.sequences[request_id]
        except KeyError:
            raise UnknownRequestError(f"no live sequence with request id {request_id}") from None

    def _window(self, window_size: int | None) -> WindowBlockManager:
        if window_size is None:
            return next(iter(self.windows.values()))
        try:
            return self.windows[window_size]
        except KeyError:
            raise ValueError(
                f"unknown window size {window_size}; windows are {list(self.windows)}"
            ) from None

    # -- sequences ---------------------------------------------------------------------------------

    def add_sequence(self, request: LlmRequest) -> int:
        """Allocate a sequence's context blocks, reusing cached prefixes; returns tokens reused."""
        rid = request.request_id
        if rid in self.sequences:
            raise DuplicateRequestError(f"request id {rid} is already live")
        if request.beam_width > self.max_beam_width:
            raise ValueError(
                f"request {rid}: beam width {request.beam_width} exceeds {self.max_beam_width}"
            )
        encoder = self.is_cross_kv
        if encoder and request.encoder_tokens is None:
            raise ValueError(f"request {rid}: a cross-attention cache needs encoder tokens")
        input_length = request.encoder_output_len if encoder else request.num_tokens
        if input_length <= 0:
            raise ValueError(f"request {rid} has no tokens")
        reuse = self.enable_block_reuse  # dummies match too; only storing skips them
        sequence = GenerationRequest(
            rid, input_length, request.beam_width, list(self.windows), request.retention
        )
        tpb = self.tokens_per_block

        # Plan every window before touching any: refuse here, not half way. Each position of a
        # sequence takes at most one free primary block (a beam-search tail one per beam); when
        # every window has that many free, no dry run of the matching walk is needed.
        beam = request.beam_width
        plans: list[WindowPlan] = []
        key_cache: dict[int, tuple[list[BlockKey], list[BlockHash]]] = {}
        for window, wm in self.windows.items():
            effective = min(input_length, self.max_token_num[window])
            num_context_blocks = _ceil_div(effective, tpb)
            keys: list[BlockKey] = []
            hashes: list[BlockHash] = []
            if reuse:
                if effective not in key_cache:
                    key_cache[effective] = wm.context_keys(request, effective, encoder)
                keys, hashes = key_cache[effective]
            shared = num_context_blocks - 1 if beam > 1 else num_context_blocks
            bound = shared + (num_context_blocks - shared) * beam
            plans.append(WindowPlan(wm, effective, num_context_blocks, keys, hashes, bound))
        if any(plan.max_num_blocks > plan.window.get_num_free_blocks() for plan in plans):
            self._check_room(request, sequence, plans, reuse, encoder)

        before = self._counters()
        for wm in self.windows.values():
            wm.valid_store_for_reuse[rid] = True
        self.sequences[rid] = sequence
        for wm, effective, num_context_blocks, keys, hashes, _ in plans:
            if reuse:
                prepopulated = wm.add_sequence(
                    sequence, effective, num_context_blocks, keys, hashes
                )
                request.set_prepopulated_prompt_len(prepopulated)
            else:
                if request.retention is not None and self.enable_block_reuse is False:
                    warnings.warn(
                        f"request {rid} has a retention config but block reuse is disabled",
                        stacklevel=2,
                    )
                wm.add_sequence_without_reuse(
                    sequence, num_context_blocks, encoder or effective % tpb == 0
                )
        if reuse:
            for plan in plans:  # the keys now hold the tree's objects where they matched
                request.share_block_keys(tpb, plan.keys, encoder)
        self._flush_transfers()
        after = self._counters()
        request.alloc_total_blocks += after[0] - before[0]
        request.alloc_new_blocks += after[1] - before[1]
        request.reused_blocks += after[2] - before[2]
        request.missed_blocks += after[3] - before[3]
        return request.prepopulated_prompt_len

    def _check_room(
        self,
        request: LlmRequest,
        sequence: GenerationRequest,
        plans: Sequence[WindowPlan],
        reuse: bool,
        encoder: bool,
    ) -> None:
        """Raise OutOfBlocksError, before any change, exactly when add_sequence would run out
        of blocks in some window (the seed would throw there, half way)."""
        cap = INT_MAX  # a window reuses at most what the windows before it reused
        for plan in plans:
            wm = plan.window
            share_last = encoder or plan.input_length % self.tokens_per_block == 0
            need, matched = count_blocks_needed(
                wm,
                plan.keys,
                plan.hashes,
                sequence,
                plan.num_context_blocks,
                cap,
                reuse,
                share_last,
            )
            free = wm.get_num_free_blocks()
            if need > free:
                raise OutOfBlocksError(
                    f"request {request.request_id} needs {need} blocks in window "
                    f"{wm.window_size}, {free} free"
                )
            if reuse:
                cap = matched

    def _counters(self) -> tuple[int, int, int, int]:
        ws = self.windows.values()
        return (
            sum(w.alloc_total_blocks for w in ws),
            sum(w.alloc_new_blocks for w in ws),
            sum(w.reused_blocks for w in ws),
            sum(w.missed_blocks for w in ws),
        )

    def add_token(self, request_id: int) -> None:
        """Grow the sequence by one token, allocating a block at a block boundary."""
        sequence = self._sequence(request_id)
        for window, wm in self.windows.items():
            if not wm.is_swa and wm.would_leave_window(sequence):
                raise ValueError(
                    f"request {request_id}: {sequence.num_tokens + 1} tokens exceed what window "
                    f"{window} holds (max_sequence_length {self.max_sequence_length})"
                )
            need = wm.blocks_needed_for_next_token(sequence)
            if need > wm.get_num_free_blocks():
                raise OutOfBlocksError(
                    f"request {request_id} needs {need} new block(s) in window {window}, "
                    f"{wm.get_num_free_blocks()} free"
                )
        sequence.num_tokens += 1
        for wm in self.windows.values():
            wm.adjust_blocks_if_needed(sequence)
        self._flush_transfers()

    def add_tokens(self, request_id: int, num_tokens: int) -> None:
        """Grow the sequence by `num_tokens` tokens: what `add_token` called that often does
        (the same blocks in the same order, the same events), in one step per block boundary.

        Refused before any change: the error is the one the first failing `add_token` would
        raise, but no token is added. Sliding-window sequences (blocks leave the window as
        they grow) take the per-token path, after a dry run of the same checks."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        sequence = self._sequence(request_id)
        if num_tokens == 0:
            return
        if any(wm.is_swa for wm in self.windows.values()):
            self._check_tokens_swa(sequence, num_tokens)
            for _ in range(num_tokens):
                self.add_token(request_id)
            return
        tpb = self.tokens_per_block
        start = sequence.num_tokens
        end = start + num_tokens
        # add_token allocates when the new count t has (t - 1) % tpb == 0.
        first = start + (-start) % tpb + 1
        num_new = 0 if first > end else (end - first) // tpb + 1
        per_boundary = 1 if sequence.beam_width == 1 else sequence.beam_width
        # (token count at which add_token would fail, window order, error): the first one wins.
        failures: list[tuple[int, int, Exception]] = []
        for order, (window, wm) in enumerate(self.windows.items()):
            front = sequence.num_front_blocks_removed[window]
            too_long = front * tpb + window + tpb  # would_leave_window from this count on
            if too_long <= end:
                failures.append(
                    (
                        too_long,
                        order,
                        ValueError(
                            f"request {request_id}: {too_long} tokens exceed what window "
                            f"{window} holds (max_sequence_length {self.max_sequence_length})"
                        ),
                    )
                )
            free = wm.get_num_free_blocks()
            if num_new * per_boundary > free:
                boundary = free // per_boundary  # boundaries that still fit
                failures.append(
                    (
                        first + boundary * tpb,
                        order,
                        OutOfBlocksError(
                            f"request {request_id} needs {num_new * per_boundary} new block(s) "
                            f"in window {window} for {num_tokens} tokens, {free} free"
                        ),
                    )
                )
        if failures:
            raise min(failures, key=lambda f: (f[0], f[1]))[2]
        share = sequence.beam_width == 1
        count = first
        for _ in range(num_new):
            sequence.num_tokens = count
            for wm in self.windows.values():
                wm.allocate_block(sequence, share_among_beams=share)
            count += tpb
        sequence.num_tokens = end
        self._flush_transfers()

    def _check_tokens_swa(self, sequence: GenerationRequest, num_tokens: int) -> None:
        """Dry run of `num_tokens` add_token checks with sliding windows: a block that leaves
        the window frees its slot when this sequence alone holds it (ref_count 1)."""
        tpb = self.tokens_per_block
        rid = sequence.request_id
        per_boundary = 1 if sequence.beam_width == 1 else sequence.beam_width
        fronts = dict(sequence.num_front_blocks_removed)
        avail = {window: wm.get_num_free_blocks() for window, wm in self.windows.items()}
        for count in range(sequence.num_tokens + 1, sequence.num_tokens + num_tokens + 1):
            for window, wm in self.windows.items():
                front = fronts[window]
                if not wm.is_swa and count - front * tpb >= window + tpb:
                    raise ValueError(
                        f"request {rid}: {count} tokens exceed what window {window} holds "
                        f"(max_sequence_length {self.max_sequence_length})"
                    )
                if (count - 1) % tpb:
                    continue
                blocks = wm.allocated_blocks_per_seq[rid]
                while count - front * tpb >= window + tpb:
                    # Past the blocks held now: one this dry run allocated, held by it alone.
                    if front >= len(blocks) or blocks[front].ref_count == 1:
                        avail[window] += 1
                    front += 1
                fronts[window] = front
                if per_boundary > avail[window]:
                    raise OutOfBlocksError(
                        f"request {rid} needs {per_boundary} new block(s) in window {window} "
                        f"at token {count}, {avail[window]} free"
                    )
                avail[window] -= per_boundary

    def _flush_transfers(self) -> None:
        """Issue the copies an operation queued before the caller can read the pools."""
        for wm in self.windows.values():
            wm.transfer.flush()

    def remove_token(self, request_id: int) -> None:
        sequence = self._sequence(request_id)
        if sequence.num_tokens == 0:
            return
        if sequence.beam_width != 1:
            raise ValueError("remove_token does not support beam width > 1")
        sequence.num_tokens -= 1
        for window, wm in self.windows.items():
            if (sequence.num_tokens % window) % self.tokens_per_block == 0:
                wm.release_last_block(sequence)

    def rewind_kv_cache(self, request_id: int, rewind_length: int) -> None:
        """Speculative-decoding rollback: remove `rewind_length` tokens."""
        self._sequence(request_id)
        for _ in range(rewind_length):
            self.remove_token(request_id)

    def remove_sequence(
        self, request_id: int, request: LlmRequest | None = None, pin_blocks: bool = False
    ) -> list[int]:
        """Release a sequence, storing its blocks for reuse first when reuse is on and the
        request is given. With `pin_blocks`, the stored chain stays pinned; its ids are returned
        (unpin them with `unpin_blocks_by_id`)."""
        sequence = self._sequence(request_id)
        del self.sequences[request_id]
        store = (
            request is not None
            and self.enable_block_reuse
            and not request.is_dummy
            and sequence.beam_width == 1
            and all(
                wm.is_sequence_valid_for_store_for_reuse(request_id) for wm in self.windows.values()
            )
        )
        pinned: list[int] = []
        for wm in self.windows.values():
            pinned = wm.release_blocks(sequence, request if store else None, pin_blocks)
            wm.valid_store_for_reuse.pop(request_id, None)
        return pinned

    def store_context_blocks(self, request: LlmRequest) -> None:
        sequence = self.sequences.get(request.request_id)
        if sequence is None:
            warnings.warn(
                f"store_context_blocks: no sequence for request {request.request_id}",
                stacklevel=2,
            )
            return
        if self.enable_block_reuse and not request.is_dummy:
            for wm in self.windows.values():
                if not wm.is_swa:  # an SWA block stored now could go out of window
                    wm.store_context_blocks(sequence, request)

    def store_new_block(self, request: LlmRequest) -> None:
        sequence = self._sequence(request.request_id)
        if sequence.beam_width > 1 or not self.enable_block_reuse:
            return
        for wm in self.windows.values():
            if not wm.is_swa:
                wm.store_new_block(sequence, request)

    def store_blocks_for_reuse(
        self, request_id: int, request: LlmRequest, pin_blocks: bool = False
    ) -> list[int]:
        sequence = self._sequence(request_id)
        pinned: list[int] = []
        for wm in self.windows.values():
            pinned = wm.store_blocks_for_reuse(sequence, request, pin_blocks)
        return pinned

    def replace_shared_block(
        self, request_id: int, block_index: int, window_size: int | None = None
    ) -> None:
        """Beam search divergence: give every beam its own copy of a shared block."""
        wm = self._window(window_size)
        wm.replace_shared_block(self._sequence(request_id), block_index)
        self._flush_transfers()

    def pin_blocks(self, request_id: int) -> None:
        sequence = self._sequence(request_id)
        for wm in self.windows.values():
            wm.pin_blocks(sequence)

    def unpin_blocks_by_id(self, block_ids: Sequence[int]) -> None:
        if block_ids:
            self._window(None).unpin_blocks_by_id(block_ids)

    def get_last_block_id(self, request_id: int) -> int | None:
        ids = self._sequence(request_id).cache_block_ids[next(iter(self.windows))]
        return ids[0][-1] if ids and ids[0] else None

    def get_cache_block_ids(
        self, request_id: int, window_size: int | None = None
    ) -> list[list[int]]:
        window = self._window(window_size).window_size
        return [list(ids) for ids in self._sequence(request_id).cache_block_ids[window]]

    def get_num_tokens(self, request_id: int) -> int:
        return self._sequence(request_id).num_tokens

    # -- scheduling ------------------------------------------------------------------------------

    def start_scheduling(self) -> None:
        for wm in self.windows.values():
            wm.start_scheduling()

    def scheduling_remove_sequence(self, request_id: int) -> None:
        self._sequence(request_id)
        for wm in self.windows.values():
            wm.scheduling_release_blocks(request_id)

    def get_scheduling_num_free_blocks(self, window_size: int | None = None) -> int:
        return self._window(window_size).scheduling_num_free_blocks

    def get_needed_blocks_one_step(
        self,
        request: LlmRequest,
        two_steps_look_ahead: bool = False,
        window_size: int | None = None,
    ) -> int:
        window = self._window(window_size).window_size
        tpb = self.tokens_per_block
        if (
            request.state is RequestState.CONTEXT_INIT and request.is_first_context_chunk
        ) or request.state is RequestState.DISAGG_GENERATION_INIT:
            chunk = request.max_new_tokens
            prompt = request.encoder_output_len if self.is_cross_kv else request.prompt_len
            prompt_cache_len = min(prompt + request.num_draft_tokens, window + chunk)
            shared = prompt_cache_len // tpb
            unshared = _ceil_div(prompt_cache_len % tpb, tpb) * request.beam_width
            return shared + unshared
        if request.state is RequestState.GENERATION_IN_PROGRESS:
            if self.is_cross_kv:
                return 0
            current = self._sequence(request.request_id).num_tokens
            generated = current - request.prompt_len
            max_to_add = request.max_new_tokens - generated
            per_step = request.num_draft_tokens + 1
            to_add = min((2 if two_steps_look_ahead else 1) * per_step, max_to_add)
            following = current + to_add
            if following > self.max_token_num[window]:
                return 0
            return (_ceil_div(following, tpb) - _ceil_div(current, tpb)) * request.beam_width
        return 0

    def get_remaining_blocks_to_completion(
        self, request: LlmRequest, window_size: int | None = None
    ) -> int:
        window = self._window(window_size).window_size
        tpb = self.tokens_per_block
        beam = request.beam_width
        if self.is_cross_kv:
            if request.state is RequestState.CONTEXT_INIT and request.context_current_position == 0:
                return _ceil_div(request.encoder_output_len, tpb)
            return 0
        num_context = min(request.prompt_len, window) // tpb
        total_per_beam = _ceil_div(min(request.prompt_len + request.max_new_tokens, window), tpb)
        gen_per_beam = total_per_beam - num_context
        sequence = self.sequences.get(request.request_id)
        allocated = len(sequence.cache_block_ids[window][0]) if sequence else 0
        sliding = request.prompt_len + request.max_new_tokens > window
        current_blocks = _ceil_div(request.num_tokens, tpb)
        max_blocks = _ceil_div(request.prompt_len + request.max_new_tokens, tpb)
        extra = 1 if sliding and max_blocks > current_blocks and max_blocks > total_per_beam else 0
        if allocated < num_context:
            return num_context - allocated + (gen_per_beam + extra) * beam
        return (total_per_beam - allocated + extra) * beam

    # -- reuse tree --------------------------------------------------------------------------------

    def find_new_context_block(self, tokens: Sequence[int], request: LlmRequest) -> BlockKey | None:
        if self.is_variable_window:
            raise ValueError("find_new_context_block does not work with variable window attention")
        return self._window(None).find_new_context_block(request, tokens)

    def find_blocks_in_reuse_tree_by_block_key(
        self, key: BlockKey, window_size: int | None = None
    ) -> Any:
        return self._window(window_size).find_blocks_in_reuse_tree_by_block_key(key)

    # -- admin: the worker's REST calls --------------------------------------------------------

    def clear_reusable_blocks(self) -> int:
        """Free every cached block that no sequence or pin holds (reported Removed)."""
        return sum(wm.clear_reusable_blocks() for wm in self.windows.values())

    def offload_reusable_blocks(self, max_blocks: int | None = None) -> int:
        """Offload unheld cached primary blocks to free host slots (reported Updated)."""
        if max_blocks is not None and max_blocks < 0:
            raise ValueError(f"max_blocks must be >= 0, got {max_blocks}")
        moved = 0
        for wm in self.windows.values():
            left = None if max_blocks is None else max_blocks - moved
            moved += wm.offload_reusable_blocks(left)
        return moved

    def pin_blocks_by_hash(
        self, block_hashes: Sequence[int], window_size: int | None = None
    ) -> list[int]:
        """Pin cached blocks, with their ancestors, so that they are not evicted."""
        return self._window(window_size).pin_blocks_by_hash(block_hashes)

    def unpin_blocks_by_hash(
        self, block_hashes: Sequence[int], window_size: int | None = None
    ) -> list[int]:
        """Undo `pin_blocks_by_hash` for the same hashes."""
        return self._window(window_size).unpin_blocks_by_hash(block_hashes)

    def find_block_by_hash(self, block_hash: int, window_size: int | None = None) -> Any:
        """The block of the reuse tree with this chained hash, or None."""
        return self._window(window_size).find_block_by_hash(block_hash)

    def refresh_blocks(self) -> None:
        for wm in self.windows.values():
            wm.policy.refresh()
            wm.transfer.sync()

    def verify_queue_integrity(self, window_size: int | None = None) -> bool:
        if window_size is not None:
            return self._window(window_size).policy.verify_queue_integrity()
        return all(wm.policy.verify_queue_integrity() for wm in self.windows.values())

    def reset_reuse_state(self) -> None:
        for wm in self.windows.values():
            wm.reset_reuse_state()

    def get_priority_by_block_id(self, block_id: int, window_size: int | None = None) -> int:
        return self._window(window_size).block(block_id).priority

    # -- counts and statistics ---------------------------------------------------------------------

    @property
    def window_sizes(self) -> tuple[int, ...]:
        """The attention window sizes this manager holds blocks for, ascending."""
        return tuple(sorted(self.windows))

    def window_capacity(self, window_size: int | None = None) -> WindowCapacity:
        """Blocks per level of one window, or of all windows summed when ``window_size`` is None."""
        windows = self.windows.values() if window_size is None else [self._window(window_size)]
        return WindowCapacity(
            primary=sum(wm.num_primary_blocks for wm in windows),
            secondary=sum(wm.num_secondary_blocks for wm in windows),
            free_primary=sum(wm.get_num_free_blocks() for wm in windows),
            free_secondary=sum(wm.get_num_free_secondary_blocks() for wm in windows),
        )

    def tree_blocks(self, window_size: int | None = None) -> list[KVCacheBlock]:
        """Every block in one window's reuse tree, pre-order: a block before its children."""
        return self._window(window_size).tree_blocks()

    def get_num_free_blocks(self) -> int:
        return sum(wm.get_num_free_blocks() for wm in self.windows.values())

    def get_max_num_blocks(self) -> int:
        return sum(wm.num_primary_blocks for wm in self.windows.values())

    def get_num_allocated_blocks(self) -> int:
        return self.get_max_num_blocks() - self.get_num_free_blocks()

    def get_kv_cache_stats(self) -> KvCacheStats:
        total, new, reused, missed = self._counters()
        free = self.get_num_free_blocks()
        maximum = self.get_max_num_blocks()
        return KvCacheStats(
            max_num_blocks=maximum,
            free_num_blocks=free,
            used_num_blocks=maximum - free,
            tokens_per_block=self.tokens_per_block,
            alloc_total_blocks=total,
            alloc_new_blocks=new,
            reused_blocks=reused,
            missed_blocks=missed,
            cache_hit_rate=reused / (reused + missed) if reused else 0.0,
            num_free_blocks_per_window_size={
                w: wm.get_num_free_blocks() for w, wm in self.windows.items()
            },
            allocated_bytes=self.allocated_bytes,
        )

    # -- events ------------------------------------------------------------------------------------

    def flush_iteration_events(self) -> None:
        self.events.flush()

    def get_latest_events(self, timeout: float | None = None) -> list[KVCacheEvent]:
        return self.events.get_events(timeout)

    def take_events(self) -> list[KVCacheEvent]:
        """Flush this iteration's events and drain them all (the publisher's call)."""
        self.flush_iteration_events()
        return self.get_latest_events()

    @property
    def num_dropped_events(self) -> int:
        return self.events.num_dropped

    @property
    def last_event_id(self) -> int:
        """The id of the newest event handed out so far; -1 before the first (or events off)."""
        return self.events.next_event_id - 1
