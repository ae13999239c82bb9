"""KVCacheManager: the per-worker KV cache manager (the seed's KVCacheManager + BlockManager).

The package's facade: its methods are the public API (`cache.__all__`). It owns one
WindowBlockManager per distinct attention window size (`cache.window`), the live sequences, the
event buffer and the torch pools, and hands each call to the module that owns the work: storing
for reuse (`cache.store`), pins (`cache.pins`), admin (`cache.admin`), the checks before a change
(`cache.precheck`), capacity arithmetic (`cache.capacity`), statistics (`cache.stats`).
Synchronous and single-writer: the worker calls it from one task.

Failure leaves no trace: every operation checks what it needs (request ids, free blocks) before
it changes anything, so a refused call changes neither blocks, tree, statistics nor events.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from typing import Any

from cache import admin, capacity, pins, precheck, stats, store
from cache.block import KVCacheBlock
from cache.errors import UnknownRequestError
from cache.events import EventSink, KVCacheEvent, KVCacheEventManager, NullEventSink
from cache.hashing import BlockKey
from cache.request import GenerationRequest, LlmRequest
from cache.stats import KvCacheStats, WindowCapacity
from cache.transfer import NoOpTransferEngine, TransferEngine
from cache.window import WindowBlockManager


class CacheType(Enum):
    SELF = "self"
    CROSS = "cross"
    SELFKONLY = "selfkonly"

    @property
    def kv_factor(self) -> int:
        return 1 if self is CacheType.SELFKONLY else 2


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


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
        """The arguments are the seed's (README's example shows them). Beyond the seed:

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
        self.window_to_layers = capacity.group_layers_by_window_size(
            max_attention_window, num_layers
        )
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
        from cache import pools as pools_mod

        self.pools[window] = pools = pools_mod.allocate_window_pools(
            layers,
            self.num_kv_heads_per_layer,
            self.cache_type.kv_factor,
            self.head_dim,
            self.tokens_per_block,
            primary,
            secondary,
            self.dtype,
            self.device,
        )
        self.allocated_bytes += sum(pool.primary_bytes for pool in pools)
        return pools_mod.TorchTransferEngine(pools)

    # -- capacity (the seed's static helpers) ----------------------------------------------------

    calculate_max_block_requirements_per_beam = staticmethod(
        capacity.calculate_max_block_requirements_per_beam
    )
    calculate_max_block_requirements = staticmethod(capacity.calculate_max_block_requirements)
    calculate_max_attention_window = staticmethod(capacity.calculate_max_attention_window)
    calculate_window_size_to_share = staticmethod(capacity.calculate_window_size_to_share)
    calculate_max_num_blocks = staticmethod(capacity.calculate_max_num_blocks)
    group_layers_by_window_size = staticmethod(capacity.group_layers_by_window_size)

    def get_max_capacity_batch_size(self, input_length: int, output_length: int) -> int:
        """How many sequences of this shape fit at once (the tightest window decides)."""
        blocks = {window: wm.num_primary_blocks for window, wm in self.windows.items()}
        beam, tpb = self.max_beam_width, self.tokens_per_block
        return capacity.max_capacity_batch_size(blocks, input_length, output_length, beam, tpb)

    # -- pools and block offset tables -----------------------------------------------------------

    @property
    def num_pools(self) -> int:
        return sum(len(p) for p in self.pools.values())

    def get_layer_pool(self, layer: int) -> tuple[int, int]:
        """(absolute pool index, layer index within the pool) of a layer."""
        from cache.pools import layer_pool

        return layer_pool(self.window_to_layers, self.num_kv_heads_per_layer, layer)

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
        from cache.pools import copy_offset_tables

        ids = self._sequence(request_id).cache_block_ids
        tables = [(self.get_block_offsets(request_id, w), ids[w]) for w in self.windows]
        return copy_offset_tables(output, output_slot_offset, tables)

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
        rid, encoder = request.request_id, self.is_cross_kv
        input_length = precheck.check_request(request, self.sequences, self.max_beam_width, encoder)
        reuse = self.enable_block_reuse  # dummies match too; only storing skips them
        sequence = GenerationRequest(
            rid, input_length, request.beam_width, list(self.windows), request.retention
        )
        tpb = self.tokens_per_block

        # Plan every window before touching any: refuse here, not half way. A window with as
        # many free blocks as its plan may take needs no dry run of the matching walk.
        plans = precheck.plan_windows(
            self.windows, self.max_token_num, request, input_length, reuse, encoder
        )
        if any(plan.max_num_blocks > plan.window.get_num_free_blocks() for plan in plans):
            self._check_room(request, sequence, plans, reuse, encoder)

        before = stats.counters(self.windows.values())
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
        stats.add_to_request(request, before, stats.counters(self.windows.values()))
        return request.prepopulated_prompt_len

    def _check_room(
        self,
        request: LlmRequest,
        sequence: GenerationRequest,
        plans: Sequence[precheck.WindowPlan],
        reuse: bool,
        encoder: bool,
    ) -> None:
        """Refuse before any change what add_sequence would run out of blocks for (the seed
        would throw half way); tests replace it to reach the seed's own failure."""
        precheck.check_room(request, sequence, plans, reuse, encoder, self.tokens_per_block)

    def add_token(self, request_id: int) -> None:
        """Grow the sequence by one token, allocating a block at a block boundary."""
        sequence = self._sequence(request_id)
        precheck.check_add_token(self.windows, sequence, self.max_sequence_length)
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
        tpb, max_len = self.tokens_per_block, self.max_sequence_length
        if any(wm.is_swa for wm in self.windows.values()):
            precheck.check_add_tokens_swa(self.windows, sequence, num_tokens, tpb, max_len)
            for _ in range(num_tokens):
                self.add_token(request_id)
            return
        end = sequence.num_tokens + num_tokens
        boundaries = precheck.check_add_tokens(self.windows, sequence, num_tokens, tpb, max_len)
        share = sequence.beam_width == 1
        for count in boundaries:
            sequence.num_tokens = count
            for wm in self.windows.values():
                wm.allocate_block(sequence, share_among_beams=share)
        sequence.num_tokens = end
        self._flush_transfers()

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
        for_reuse = (
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
            if for_reuse and request is not None:  # releaseBlocks: store, then release
                blocks = wm.allocated_blocks_per_seq[request_id]
                pinned = store.store_request(wm, request, blocks, pin_blocks)
            wm.release_blocks(sequence)
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
            store.store_context_blocks(self.windows.values(), sequence, request)

    def store_new_block(self, request: LlmRequest) -> None:
        sequence = self._sequence(request.request_id)
        if sequence.beam_width == 1 and self.enable_block_reuse:
            store.store_new_block(self.windows.values(), sequence, request)

    def store_blocks_for_reuse(
        self, request_id: int, request: LlmRequest, pin_blocks: bool = False
    ) -> list[int]:
        sequence = self._sequence(request_id)
        return store.store_blocks_for_reuse(self.windows.values(), sequence, request, pin_blocks)

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
            pins.pin_sequence(wm, sequence)

    def unpin_blocks_by_id(self, block_ids: Sequence[int]) -> None:
        if block_ids:
            pins.unpin_by_id(self._window(None), block_ids)

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
        sequence, tpb = self.sequences.get(request.request_id), self.tokens_per_block
        limit, cross = self.max_token_num[window], self.is_cross_kv
        return capacity.needed_blocks_one_step(
            request, sequence, window, tpb, cross, limit, two_steps_look_ahead
        )

    def get_remaining_blocks_to_completion(
        self, request: LlmRequest, window_size: int | None = None
    ) -> int:
        window = self._window(window_size).window_size
        sequence, tpb = self.sequences.get(request.request_id), self.tokens_per_block
        return capacity.remaining_blocks_to_completion(
            request, sequence, window, tpb, self.is_cross_kv
        )

    # -- reuse tree --------------------------------------------------------------------------------

    def find_new_context_block(self, tokens: Sequence[int], request: LlmRequest) -> BlockKey | None:
        if self.is_variable_window:
            raise ValueError("find_new_context_block does not work with variable window attention")
        return admin.find_new_context_block(self._window(None), request, tokens)

    def find_blocks_in_reuse_tree_by_block_key(
        self, key: BlockKey, window_size: int | None = None
    ) -> Any:
        return self._window(window_size).tree.find_by_key(key)

    # -- admin: the worker's REST calls --------------------------------------------------------

    def clear_reusable_blocks(self) -> int:
        """Free every cached block that no sequence or pin holds (reported Removed)."""
        return admin.clear_reusable_blocks(self.windows.values())

    def offload_reusable_blocks(self, max_blocks: int | None = None) -> int:
        """Offload unheld cached primary blocks to free host slots (reported Updated)."""
        return admin.offload_reusable_blocks(self.windows.values(), max_blocks)

    def pin_blocks_by_hash(
        self, block_hashes: Sequence[int], window_size: int | None = None
    ) -> list[int]:
        """Pin cached blocks, with their ancestors, so that they are not evicted."""
        return pins.pin_by_hash(self._window(window_size), block_hashes)

    def unpin_blocks_by_hash(
        self, block_hashes: Sequence[int], window_size: int | None = None
    ) -> list[int]:
        """Undo `pin_blocks_by_hash` for the same hashes."""
        return pins.unpin_by_hash(self._window(window_size), block_hashes)

    def find_block_by_hash(self, block_hash: int, window_size: int | None = None) -> Any:
        """The block of the reuse tree with this chained hash, or None."""
        return self._window(window_size).tree.find_by_hash(block_hash)

    def refresh_blocks(self) -> None:
        for wm in self.windows.values():
            wm.policy.refresh()
            wm.transfer.sync()

    def verify_queue_integrity(self, window_size: int | None = None) -> bool:
        if window_size is not None:
            return self._window(window_size).policy.verify_queue_integrity()
        return all(wm.policy.verify_queue_integrity() for wm in self.windows.values())

    def reset_reuse_state(self) -> None:
        """Forget every reuse tree (each block reported Removed)."""
        admin.reset_reuse_state(self.windows.values())

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
        return stats.window_capacity(windows)

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
        return stats.kv_cache_stats(self.windows, self.tokens_per_block, self.allocated_bytes)

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
