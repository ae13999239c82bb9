"""WindowBlockManager: the blocks, reuse tree and eviction policy of one attention window size.

A line-by-line port of the seed's WindowBlockManager. The reuse (radix) tree hangs below a root
block; a block's children are indexed by their chained hash (a hit is confirmed by comparing
keys), so matching a request costs one dict lookup per block: requests hash their blocks once,
with the compiled hasher, and hand the hashes in alongside the keys.

Where the seed throws half way through an allocation, `count_blocks_needed` is asked first, so a
request that cannot get its blocks is refused before anything changes.
"""

from __future__ import annotations

from collections.abc import Sequence

from cache.block import ROOT_BLOCK_ID, KVCacheBlock
from cache.errors import OutOfBlocksError, PinConflictError, UnknownBlockError
from cache.events import EventDiff, KVCacheEventManager, UpdatedData
from cache.eviction import PRIMARY_LEVEL, SECONDARY_LEVEL, LRUEvictionPolicy
from cache.hashing import BlockKey, block_key_hash
from cache.request import GenerationRequest, LlmRequest
from cache.retention import DEFAULT_PRIORITY
from cache.transfer import Slot, TransferEngine

Retention = tuple[int | None, float | None]


def _slot(block: KVCacheBlock) -> Slot:
    return Slot(block.memory_index, block.is_primary)


class WindowBlockManager:
    def __init__(
        self,
        window_size: int,
        tokens_per_block: int,
        num_primary_blocks: int,
        num_secondary_blocks: int,
        *,
        is_swa: bool,
        onboard_blocks: bool,
        secondary_offload_min_priority: int | None,
        event_manager: KVCacheEventManager | None,
        enable_partial_reuse: bool,
        copy_on_partial_reuse: bool,
        transfer: TransferEngine,
        clock: object = None,
        report_leaf_takeover: bool = False,
    ) -> None:
        if num_primary_blocks <= 0:
            raise ValueError(f"window {window_size}: need at least one primary block")
        if num_secondary_blocks < 0:
            raise ValueError(f"window {window_size}: negative secondary block count")
        self.window_size = window_size
        self.tokens_per_block = tokens_per_block
        self.num_primary_blocks = num_primary_blocks
        self.num_secondary_blocks = num_secondary_blocks
        self.is_swa = is_swa
        self.onboard_blocks = onboard_blocks
        self.enable_partial_reuse = enable_partial_reuse
        self.copy_on_partial_reuse = copy_on_partial_reuse
        self.report_leaf_takeover = report_leaf_takeover
        self.transfer = transfer
        self.events = event_manager
        self.blocks: list[KVCacheBlock] = [
            KVCacheBlock(i, i, True) for i in range(num_primary_blocks)
        ] + [KVCacheBlock(num_primary_blocks + i, i, False) for i in range(num_secondary_blocks)]
        self.root = KVCacheBlock(ROOT_BLOCK_ID, 0, True)
        self.policy = LRUEvictionPolicy(
            self.blocks,
            secondary_offload_min_priority,
            clock,  # type: ignore[arg-type]
        )
        self.allocated_blocks_per_seq: dict[int, list[KVCacheBlock]] = {}
        self.block_to_sequence: dict[int, int] = {}
        self.pins: dict[int, int] = {}  # block id -> pins not yet undone
        self.valid_store_for_reuse: dict[int, bool] = {}
        self.scheduling_num_free_blocks = 0
        self.alloc_total_blocks = 0
        self.alloc_new_blocks = 0
        self.reused_blocks = 0
        self.missed_blocks = 0
        self.reused_tokens = 0
        self.total_input_tokens = 0
        if event_manager is not None:
            event_manager.enqueue_created([num_primary_blocks, num_secondary_blocks], window_size)

    # -- counts ----------------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return self.policy.get_num_free_blocks(PRIMARY_LEVEL)

    def get_num_free_secondary_blocks(self) -> int:
        return self.policy.get_num_free_blocks(SECONDARY_LEVEL)

    def has_free_blocks(self, num_required: int = 1) -> bool:
        return self.get_num_free_blocks() >= num_required

    def block(self, block_id: int) -> KVCacheBlock:
        if not 0 <= block_id < len(self.blocks):
            raise UnknownBlockError(
                f"block id {block_id} is out of range 0..{len(self.blocks) - 1} "
                f"(window {self.window_size})"
            )
        return self.blocks[block_id]

    # -- getting a block -------------------------------------------------------------------------

    def _free_children(self, block: KVCacheBlock, forget_keys: bool = False) -> int:
        """Remove `block` and its whole subtree from the reuse tree, leaves first; returns how
        many blocks left it. With `forget_keys` they also lose their keys (hold nothing)."""
        events = self.events
        if not block.next_blocks:
            if events is not None and block.key.tokens and block.prev_block is not None:
                events.enqueue_removed(block.hash, self.window_size)
            block.free_leaf_block()
            if forget_keys:
                block.forget_key()
            return 1
        # Iterative post-order: chains can be thousands of blocks deep.
        stack: list[tuple[KVCacheBlock, bool]] = [(block, False)]
        count = 0
        while stack:
            node, expanded = stack.pop()
            if not expanded and node.next_blocks:
                stack.append((node, True))
                stack.extend((child, False) for child in reversed(list(node.next_blocks.values())))
                continue
            if events is not None and node.key.tokens and node.prev_block is not None:
                events.enqueue_removed(node.hash, self.window_size)
            node.free_leaf_block()
            if forget_keys:
                node.forget_key()
            count += 1
        return count

    def get_free_block(
        self, sequence: GenerationRequest, priority: int, duration_s: float | None
    ) -> KVCacheBlock:
        """getFreeBlock: the next victim, offloaded to the secondary level when it may be."""
        policy = self.policy
        block, can_offload = policy.get_free_block(PRIMARY_LEVEL)
        has_content = bool(block.key.tokens)
        if not has_content:
            self.alloc_new_blocks += 1
        self.alloc_total_blocks += 1
        if (
            has_content
            and can_offload
            and self.onboard_blocks
            and policy.get_num_free_blocks(SECONDARY_LEVEL) > 0
        ):
            offload_block, _ = policy.get_free_block(SECONDARY_LEVEL)
            self.transfer.copy(_slot(block), _slot(offload_block), 0, sequence.transfer_directory)
            block.swap_memory_pool_block_offset(offload_block)
            if self.events is not None and block.in_radix_tree:
                self.events.enqueue_updated(
                    UpdatedData(block.hash, cache_level=EventDiff(PRIMARY_LEVEL, SECONDARY_LEVEL)),
                    self.window_size,
                )
            policy.claim_block(block)  # keeps its priority, loses its duration
            policy.release_block(block)  # now into the secondary queue
            block = offload_block
        if block.prev_block is not None or block.next_blocks:
            self._free_children(block)  # a cached block: it leaves the tree, with its subtree
        policy.claim_block(block, priority, duration_s)
        # A block taken from under a live sequence (rewound or out of window) makes that
        # sequence's store-for-reuse invalid.
        owner = self.block_to_sequence.get(block.block_id)
        rid = sequence.request_id
        if owner is not None and owner != rid and owner in self.valid_store_for_reuse:
            self.valid_store_for_reuse[owner] = False
        self.block_to_sequence[block.block_id] = rid
        return block

    def onboard_block(self, sequence: GenerationRequest, offload_block: KVCacheBlock) -> None:
        if self.onboard_blocks and not offload_block.is_primary:
            block = self.get_free_block(sequence, DEFAULT_PRIORITY, None)
            self.transfer.copy(_slot(offload_block), _slot(block))
            offload_block.swap_memory_pool_block_offset(block)
            # The seed reports every onboard; an exact stream skips blocks no longer in the tree
            # (a leaf just taken over, already reported removed).
            if self.events is not None and (
                offload_block.prev_block is not None or not self.report_leaf_takeover
            ):
                self.events.enqueue_updated(
                    UpdatedData(
                        offload_block.hash, cache_level=EventDiff(SECONDARY_LEVEL, PRIMARY_LEVEL)
                    ),
                    self.window_size,
                )
            self.policy.release_block(block)  # `block` now owns the secondary slot

    def offload_block(
        self,
        block: KVCacheBlock,
        directory: str | None = None,
        target: KVCacheBlock | None = None,
    ) -> None:
        """Move a primary block's contents to a free secondary slot (out-of-window blocks), or
        to the free secondary block `target`."""
        if self.onboard_blocks and block.is_primary:
            offload = (
                target if target is not None else self.policy.get_free_block(SECONDARY_LEVEL)[0]
            )
            self.policy.claim_block(offload)
            self.transfer.copy(_slot(block), _slot(offload), 0, directory)
            block.swap_memory_pool_block_offset(offload)
            if self.events is not None and block.in_radix_tree:
                self.events.enqueue_updated(
                    UpdatedData(block.hash, cache_level=EventDiff(PRIMARY_LEVEL, SECONDARY_LEVEL)),
                    self.window_size,
                )
            self.policy.release_block(offload)

    # -- sequences ---------------------------------------------------------------------------------

    def add_block_to_beam(
        self, block: KVCacheBlock, sequence: GenerationRequest, beam: int
    ) -> None:
        block.ref_count += 1
        ids = sequence.cache_block_ids[self.window_size][beam]
        block.prev_block_in_seq = self.blocks[ids[-1]] if ids else None
        ids.append(block.block_id)
        self.allocated_blocks_per_seq[sequence.request_id].append(block)

    def add_block_to_all_beams(self, block: KVCacheBlock, sequence: GenerationRequest) -> None:
        if sequence.beam_width == 1:  # the usual case, without the per-beam indirection
            block.ref_count += 1
            ids = sequence.cache_block_ids[self.window_size][0]
            block.prev_block_in_seq = self.blocks[ids[-1]] if ids else None
            ids.append(block.block_id)
            self.allocated_blocks_per_seq[sequence.request_id].append(block)
            return
        for beam in range(sequence.beam_width):
            self.add_block_to_beam(block, sequence, beam)

    def context_keys(
        self, request: LlmRequest, input_length: int, encoder: bool = False
    ) -> tuple[list[BlockKey], list[int]]:
        """The keys (and chained hashes) addSequence matches: input_length - 1 tokens, partial
        tail allowed, plus the empty key when exactly one token lies past the last full block."""
        tpb = self.tokens_per_block
        keys = request.block_keys(tpb, input_length - 1, True, encoder)
        hashes = request.block_hashes(tpb, input_length - 1, True, encoder)
        if input_length % tpb == 1:
            empty = request.empty_key(len(keys) * tpb)
            keys.append(empty)
            hashes.append(block_key_hash(empty, hashes[-1] if hashes else 0))
        return keys, hashes

    def _walk(
        self,
        keys: Sequence[BlockKey],
        hashes: Sequence[int],
        num_shared: int,
        cap: int,
    ) -> tuple[int, int, bool]:
        """Dry run of the matching walk: (primary blocks it will take, tokens matched, onboards?).

        Without onboards the walk evicts nothing before it stops matching, so the count is exact.
        An onboard may evict a block the walk would match next; from then on every position is
        counted as needing a block, which bounds the real cost from above.
        """
        need = 0
        matched_tokens = 0
        onboarded = False
        root: KVCacheBlock | None = self.root
        num_keys = len(keys)
        for bi in range(num_shared):
            match: KVCacheBlock | None = None
            partial, num_matched = False, 0
            if root is not None and bi < num_keys:
                partial, num_matched, match = root.find_matching_block(
                    keys[bi], hashes[bi], self.enable_partial_reuse, self.copy_on_partial_reuse
                )
            if match is None or matched_tokens + num_matched > cap:
                need += num_shared - bi
                return need, matched_tokens, onboarded
            matched_tokens += num_matched or len(keys[bi].tokens)
            copies = partial and (match.ref_count > 0 or bool(match.next_blocks))
            if copies:
                need += 1
            elif not match.is_primary:
                if self.onboard_blocks:
                    need += 1
                    onboarded = True
            elif match.ref_count == 0 or onboarded:
                need += 1
            root = None if partial else match
        return need, matched_tokens, onboarded

    def count_blocks_needed(
        self,
        keys: Sequence[BlockKey],
        hashes: Sequence[int],
        sequence: GenerationRequest,
        num_context_blocks: int,
        cap: int,
        reuse: bool,
        share_last: bool,
    ) -> tuple[int, int, bool]:
        """Primary blocks add_sequence will take from this window's free pool (an upper bound
        that is exact unless blocks must be onboarded), tokens matched, and whether it onboards."""
        beam = sequence.beam_width
        if not reuse:
            return num_context_blocks - 1 + (1 if share_last else beam), 0, False
        num_shared = num_context_blocks - 1 if beam > 1 else num_context_blocks
        need, matched, onboarded = self._walk(keys, hashes, num_shared, cap)
        return need + (num_context_blocks - num_shared) * beam, matched, onboarded

    def add_sequence(
        self,
        sequence: GenerationRequest,
        input_length: int,
        num_context_blocks: int,
        keys: list[BlockKey],
        hashes: list[int],
    ) -> int:
        """addSequence with reuse: match the tree, allocate the rest; returns tokens reused.

        `keys`/`hashes` come from `context_keys`.
        """
        if sequence.request_id in self.allocated_blocks_per_seq:
            raise RuntimeError(f"request {sequence.request_id} already holds blocks")
        self.allocated_blocks_per_seq[sequence.request_id] = []
        per_block = sequence.retention.per_block_retention(self.tokens_per_block, input_length)
        prepopulated = self._load_or_allocate_blocks(
            keys, hashes, num_context_blocks, sequence, per_block
        )
        self.reused_tokens += prepopulated
        self.total_input_tokens += input_length
        return prepopulated

    def _load_or_allocate_blocks(
        self,
        keys: list[BlockKey],
        hashes: list[int],
        num_context_blocks: int,
        sequence: GenerationRequest,
        per_block: list[Retention],
    ) -> int:
        tpb = self.tokens_per_block
        policy = self.policy
        events = self.events
        num_matched_tokens = 0
        search_root: KVCacheBlock | None = self.root
        beam_width = sequence.beam_width
        num_shared = num_context_blocks - 1 if beam_width > 1 else num_context_blocks
        num_keys = len(keys)
        ki = 0
        # Beam width 1 appends inline (add_block_to_all_beams, without the calls).
        beam0_ids = sequence.cache_block_ids[self.window_size][0]
        allocated = self.allocated_blocks_per_seq[sequence.request_id]
        last_block: KVCacheBlock | None = self.blocks[beam0_ids[-1]] if beam0_ids else None
        for bi in range(num_shared):
            priority, duration = per_block[bi]
            match: KVCacheBlock | None = None
            partial, num_matched = False, 0
            if search_root is not None and search_root.next_blocks and ki < num_keys:
                key = keys[ki]
                child = search_root.next_blocks.get(hashes[ki])
                if child is not None and child.is_full and (child.key is key or child.key == key):
                    match, num_matched = child, len(key.tokens)  # the common case, inlined
                else:
                    partial, num_matched, match = search_root.find_matching_block(
                        key, hashes[ki], self.enable_partial_reuse, self.copy_on_partial_reuse
                    )
            if match is not None and (
                num_matched_tokens + num_matched <= sequence.current_prepopulated_prompt_len
            ):
                num_matched_tokens += num_matched or len(keys[ki].tokens)
                if priority is not None and match.priority != priority and events is not None:
                    events.enqueue_updated(
                        UpdatedData(match.hash, priority=EventDiff(match.priority, priority)),
                        self.window_size,
                    )
                if partial:
                    if match.ref_count > 0 or match.next_blocks:
                        # Someone uses it or it has children: copy the reusable tokens.
                        new_block = self.get_free_block(sequence, match.priority, match.duration_s)
                        self.transfer.copy(_slot(match), _slot(new_block), num_matched)
                        match = new_block
                        match.set_block_key(keys[ki], len(keys[ki].tokens) == tpb)
                        match.hash = hashes[ki]
                    else:
                        # An unreferenced leaf: take it over privately. The seed reports
                        # nothing; consumers that must stay exact ask for a Removed event.
                        if self.report_leaf_takeover and events is not None:
                            events.enqueue_removed(match.hash, self.window_size)
                        match.free_leaf_block()
                        policy.claim_block(match, priority, duration)
                    search_root = None
                else:
                    policy.claim_block(match, priority, duration)
                    search_root = match
                if not match.is_primary:
                    self.onboard_block(sequence, match)
                block = match
                self.reused_blocks += 1
            else:
                block = self.get_free_block(
                    sequence, DEFAULT_PRIORITY if priority is None else priority, duration
                )
                search_root = None
                match = None
                self.missed_blocks += 1
            if beam_width == 1:  # add_block_to_all_beams, inlined for the usual case
                block.ref_count += 1
                block.prev_block_in_seq = last_block
                beam0_ids.append(block.block_id)
                allocated.append(block)
                last_block = block
            else:
                self.add_block_to_all_beams(block, sequence)
            if match is None:  # a fresh block takes the key of its position
                if ki < num_keys:
                    block.set_block_key(keys[ki], len(keys[ki].tokens) == tpb)
                    block.hash = hashes[ki]
                else:
                    prev = block.prev_block_in_seq
                    block.hash = block_key_hash(block.key, prev.hash if prev else 0)
            ki += 1
        # The last context block of a beam search is written by every beam: one per beam.
        for bi in range(num_shared, num_context_blocks):
            priority, duration = per_block[bi]
            for beam in range(beam_width):
                block = self.get_free_block(
                    sequence, DEFAULT_PRIORITY if priority is None else priority, duration
                )
                self.add_block_to_beam(block, sequence, beam)
                if ki < num_keys:
                    # The seed advances its key iterator once per beam here.
                    block.set_block_key(keys[ki], len(keys[ki].tokens) == tpb)
                    ki += 1
                prev = block.prev_block_in_seq
                block.hash = block_key_hash(block.key, prev.hash if prev else 0)
            self.missed_blocks += 1
            if ki < num_keys:
                ki += 1
        sequence.current_prepopulated_prompt_len = num_matched_tokens
        return num_matched_tokens

    def add_sequence_without_reuse(
        self, sequence: GenerationRequest, num_context_blocks: int, share_last: bool
    ) -> None:
        if sequence.request_id in self.allocated_blocks_per_seq:
            raise RuntimeError(f"request {sequence.request_id} already holds blocks")
        if num_context_blocks <= 0:
            raise ValueError("num_context_blocks must be greater than 0")
        self.allocated_blocks_per_seq[sequence.request_id] = []
        for _ in range(num_context_blocks - 1):
            self.allocate_block(sequence, share_among_beams=True)
        self.allocate_block(sequence, share_among_beams=share_last)

    def allocate_block(self, sequence: GenerationRequest, share_among_beams: bool) -> None:
        beam_width = sequence.beam_width
        required = 1 if share_among_beams else beam_width
        if not self.has_free_blocks(required):
            raise OutOfBlocksError(
                f"window {self.window_size}: request {sequence.request_id} needs {required} "
                f"new block(s), {self.get_num_free_blocks()} free"
            )
        priority, duration = sequence.decode_retention_priority, sequence.decode_duration_s
        if share_among_beams:
            block = self.get_free_block(sequence, priority, duration)
            for beam in range(beam_width):
                self.add_block_to_beam(block, sequence, beam)
        else:
            for beam in range(beam_width):
                block = self.get_free_block(sequence, priority, duration)
                self.add_block_to_beam(block, sequence, beam)

    def blocks_needed_for_next_token(self, sequence: GenerationRequest) -> int:
        """Free primary blocks add_token needs in this window (after out-of-window blocks it
        detaches are freed)."""
        num_tokens = sequence.num_tokens + 1
        if (num_tokens - 1) % self.tokens_per_block != 0:
            return 0
        required = 1 if sequence.beam_width == 1 else sequence.beam_width
        freed = 0
        front = sequence.num_front_blocks_removed[self.window_size]
        blocks = self.allocated_blocks_per_seq[sequence.request_id]
        while (
            num_tokens - front * self.tokens_per_block >= self.window_size + self.tokens_per_block
        ):
            if front < len(blocks) and blocks[front].ref_count == 1:
                freed += 1
            front += 1
        return max(0, required - freed)

    def would_leave_window(self, sequence: GenerationRequest) -> bool:
        """Whether one more token pushes a block out of this window (only SWA may detach)."""
        front = sequence.num_front_blocks_removed[self.window_size]
        tpb = self.tokens_per_block
        return sequence.num_tokens + 1 - front * tpb >= self.window_size + tpb

    def adjust_blocks_if_needed(self, sequence: GenerationRequest) -> None:
        tpb = self.tokens_per_block
        min_tokens_for_detach = self.window_size + tpb
        while (
            sequence.num_tokens - sequence.num_front_blocks_removed[self.window_size] * tpb
            >= min_tokens_for_detach
        ):
            if not self.is_swa:
                raise RuntimeError("a block only goes out of window with sliding-window attention")
            self.detach_front_block(sequence)
        if (sequence.num_tokens - 1) % tpb == 0:
            self.allocate_block(sequence, share_among_beams=sequence.beam_width == 1)

    def detach_front_block(self, sequence: GenerationRequest) -> None:
        if sequence.beam_width != 1:
            raise NotImplementedError("detaching out-of-window blocks needs beam width 1")
        blocks = self.allocated_blocks_per_seq[sequence.request_id]
        index = sequence.num_front_blocks_removed[self.window_size]
        block = blocks[index]
        block.dec_ref_count()
        if block.ref_count == 0:
            self.policy.release_block(block)
        sequence.num_front_blocks_removed[self.window_size] += 1

    # -- storing for reuse -------------------------------------------------------------------------

    def store_blocks(
        self,
        keys: Sequence[BlockKey],
        hashes: Sequence[int],
        blocks: Sequence[KVCacheBlock],
        pin_blocks: bool = False,
        cache_salt: str | None = None,
        root: KVCacheBlock | None = None,
    ) -> tuple[int, list[int]]:
        """storeBlocks: insert the blocks not yet in the tree; one Stored event for them all.

        The walk starts at the tree root, or at `root` when the caller knows that the blocks
        before `keys[0]` are stored and end at `root`.
        """
        search_root = self.root if root is None else root
        need_match = True
        stored: list[KVCacheBlock] = []
        pinned: list[int] = []
        tpb = self.tokens_per_block
        for i in range(min(len(keys), len(blocks))):
            key = keys[i]
            key_hash = hashes[i]
            if need_match:
                child = search_root.next_blocks.get(key_hash)
                if child is not None and key.tokens and (child.key is key or child.key == key):
                    search_root = child
                    if pin_blocks:
                        self._pin(child)
                        pinned.append(child.block_id)
                    continue
                need_match = False
            block = blocks[i]
            if block.prev_block is not None or block.next_blocks:
                # Stored before under another key (a partial block that has grown since, or
                # tokens rewritten after a rewind): its old entry, and anything below it, no
                # longer describe its contents. The seed keeps the stale entry and later fails
                # to evict the parent; we drop it and report it removed.
                self._free_children(block)
            block.set_block_key(key, len(key.tokens) == tpb)
            block.prev_block = search_root
            block.prev_block_in_seq = search_root
            block.hash = key_hash
            block.cache_salt = cache_salt
            search_root.next_blocks.setdefault(key_hash, block)
            stored.append(block)
            search_root = block
            if pin_blocks:
                self._pin(block)
                pinned.append(block.block_id)
        if self.events is not None:
            self.events.enqueue_stored(stored, self.window_size)
        return len(stored), pinned

    def _pin(self, block: KVCacheBlock) -> None:
        """Add a reference; a free (cached) block leaves its free queue first, so it is not
        counted free while pinned (the "ghost free block" newer TensorRT-LLM fixed)."""
        if block.ref_count == 0 and block.q_level >= 0:
            self.policy.claim_block(block, block.priority, block.duration_s)
        block.ref_count += 1
        self.pins[block.block_id] = self.pins.get(block.block_id, 0) + 1

    def store_context_blocks(self, sequence: GenerationRequest, request: LlmRequest) -> None:
        tpb = self.tokens_per_block
        usable = request.num_tokens - 1
        keys = request.block_keys(tpb, usable, False)
        hashes = request.block_hashes(tpb, usable, False)
        self.store_blocks(keys, hashes, self._beam0_blocks(sequence), False, request.cache_salt)

    def store_new_block(self, sequence: GenerationRequest, request: LlmRequest) -> None:
        tpb = self.tokens_per_block
        if request.num_tokens == 0:
            return
        usable = request.num_tokens - 1
        if usable % tpb != 0:
            return
        ids = sequence.cache_block_ids[self.window_size][0]
        keys = request.block_keys(tpb, usable, True)
        hashes = request.block_hashes(tpb, usable, True)
        n = len(keys)
        if n >= 2 and len(ids) >= n:
            prev, last = self.blocks[ids[n - 2]], self.blocks[ids[n - 1]]
            if prev.prev_block is not None and last.prev_block is not None:
                return  # already stored
            if prev.prev_block is not None and prev.hash == hashes[n - 2]:
                # Everything up to `prev` is stored: walking there from the root would only
                # retrace it (and cost O(length) at every block boundary).
                self.store_blocks(
                    keys[-1:], hashes[-1:], [last], False, request.cache_salt, root=prev
                )
                return
        self.store_blocks(keys, hashes, self._beam0_blocks(sequence), False, request.cache_salt)

    def store_blocks_for_reuse(
        self, sequence: GenerationRequest, request: LlmRequest, pin_blocks: bool
    ) -> list[int]:
        tpb = self.tokens_per_block
        usable = request.num_tokens - 1
        keys = request.block_keys(tpb, usable, True)
        hashes = request.block_hashes(tpb, usable, True)
        blocks = self._beam0_blocks(sequence)
        return self.store_blocks(keys, hashes, blocks, pin_blocks, request.cache_salt)[1]

    def _beam0_blocks(self, sequence: GenerationRequest) -> list[KVCacheBlock]:
        return [self.blocks[i] for i in sequence.cache_block_ids[self.window_size][0]]

    def is_sequence_valid_for_store_for_reuse(self, request_id: int) -> bool:
        return self.valid_store_for_reuse.get(request_id, False)

    def release_blocks(
        self, sequence: GenerationRequest, request: LlmRequest | None, pin_blocks: bool = False
    ) -> list[int]:
        """releaseBlocks: store for reuse (when `request` is given), then release last to first."""
        rid = sequence.request_id
        blocks = self.allocated_blocks_per_seq.pop(rid)
        pinned: list[int] = []
        if request is not None and self.is_sequence_valid_for_store_for_reuse(rid):
            tpb = self.tokens_per_block
            usable = request.num_tokens - 1
            keys = request.block_keys(tpb, usable, True)
            hashes = request.block_hashes(tpb, usable, True)
            pinned = self.store_blocks(keys, hashes, blocks, pin_blocks, request.cache_salt)[1]
        release = self.policy.release_block
        front = sequence.num_front_blocks_removed[self.window_size]
        for i in range(len(blocks) - 1, front - 1, -1):
            block = blocks[i]
            if block.ref_count > 0:  # an out-of-window block may hold none
                block.ref_count -= 1
            if block.ref_count == 0:
                release(block)
        sequence.cache_block_ids[self.window_size] = [[] for _ in range(sequence.beam_width)]
        return pinned

    def release_last_block(self, sequence: GenerationRequest) -> None:
        blocks = self.allocated_blocks_per_seq[sequence.request_id]
        block = blocks.pop()
        block.dec_ref_count()
        if block.ref_count == 0:
            self.policy.release_block(block, to_front=True)
        for beam_ids in sequence.cache_block_ids[self.window_size]:
            beam_ids.pop()

    def replace_shared_block(self, sequence: GenerationRequest, block_index: int) -> None:
        """Give every beam its own copy of a shared block (beam divergence)."""
        beam_width = sequence.beam_width
        allocated = self.allocated_blocks_per_seq[sequence.request_id]
        if not allocated[(block_index + 1) * beam_width - 1].is_shared:
            return
        shared = allocated[block_index * beam_width : (block_index + 1) * beam_width]
        # Room first (the seed releases, then checks): blocks whose last references these are
        # become free before the new ones are taken.
        drops: dict[int, int] = {}
        for block in shared:
            drops[block.block_id] = drops.get(block.block_id, 0) + 1
        freed = sum(self.blocks[i].ref_count == n for i, n in drops.items())
        if self.get_num_free_blocks() + freed < beam_width:
            raise OutOfBlocksError(
                f"window {self.window_size}: request {sequence.request_id} needs {beam_width} "
                f"blocks to give each beam its own block {block_index}, "
                f"{self.get_num_free_blocks() + freed} free"
            )
        key, is_full = shared[0].key, shared[0].is_full
        for block in shared:
            block.dec_ref_count()
            if block.ref_count == 0:
                self.policy.release_block(block)
        ids_per_beam = sequence.cache_block_ids[self.window_size]
        for beam in range(beam_width):
            block = self.get_free_block(sequence, DEFAULT_PRIORITY, None)
            block.ref_count += 1
            ids = ids_per_beam[beam]
            # as the seed: the beam's last block, which only feeds this unstored block's hash
            block.prev_block_in_seq = self.blocks[ids[-1]] if ids else None
            block.set_block_key(key, is_full)
            prev = block.prev_block_in_seq
            block.hash = block_key_hash(key, prev.hash if prev else 0)
            ids[block_index] = block.block_id
            allocated[block_index * beam_width + beam] = block

    # -- pinning, scheduling -----------------------------------------------------------------------

    def pin_blocks(self, sequence: GenerationRequest) -> None:
        for block in self.allocated_blocks_per_seq[sequence.request_id]:
            self._pin(block)

    def unpin_blocks_by_id(self, block_ids: Sequence[int]) -> None:
        # Validate everything first, so a bad id changes nothing.
        pending: dict[int, int] = {}
        for block_id in block_ids:
            self.block(block_id)
            pending[block_id] = pending.get(block_id, 0) + 1
            if pending[block_id] > self.pins.get(block_id, 0):
                raise UnknownBlockError(
                    f"block {block_id} is not pinned "
                    f"({self.pins.get(block_id, 0)} pin(s), {pending[block_id]} unpin(s) asked)"
                )
        for block_id in block_ids:
            block = self.blocks[block_id]
            self.pins[block_id] -= 1
            if not self.pins[block_id]:
                del self.pins[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.policy.release_block(block)

    def start_scheduling(self) -> None:
        self.scheduling_num_free_blocks = self.get_num_free_blocks()
        for blocks in self.allocated_blocks_per_seq.values():
            for block in blocks:
                block.scheduling_ref_count = block.ref_count

    def scheduling_release_blocks(self, request_id: int) -> None:
        for block in self.allocated_blocks_per_seq[request_id]:
            if block.scheduling_ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} has no scheduling reference")
            block.scheduling_ref_count -= 1
            if block.scheduling_ref_count == 0:
                self.scheduling_num_free_blocks += 1

    # -- lookups -----------------------------------------------------------------------------------

    def find_new_context_block(self, request: LlmRequest, tokens: Sequence[int]) -> BlockKey | None:
        tpb = self.tokens_per_block
        extra = None
        if request.extra_ids is not None:  # the tokens carry the request's extra ids
            extra = (request.extra_ids + [0] * len(tokens))[: len(tokens)]
        probe = LlmRequest(
            request.request_id,
            list(tokens),
            extra_ids=extra,
            lora_task_id=request.lora_task_id,
            cache_salt_id=request.cache_salt_id,
            multimodal=request.multimodal,
        )
        keys = probe.block_keys(tpb, len(tokens), False)
        hashes = probe.block_hashes(tpb, len(tokens), False)
        result_tokens: list[int] = []
        root: KVCacheBlock | None = self.root
        for key, key_hash in zip(keys, hashes, strict=True):
            result_tokens.extend(key.tokens)
            match = root.find_matching_block(key, key_hash, False, False)[2] if root else None
            if match is None:
                return BlockKey(tokens=result_tokens, lora_task_id=request.lora_task_id)
            root = match
        return None

    def find_blocks_in_reuse_tree_by_block_key(self, key: BlockKey) -> KVCacheBlock | None:
        tpb = self.tokens_per_block
        root: KVCacheBlock | None = self.root
        parent_hash = 0
        tokens = key.tokens
        extra = key.token_extra_ids()
        for start in range(0, len(tokens), tpb):
            part = BlockKey._make(
                tokens[start : start + tpb],
                key.extra_ids and extra[start : start + tpb],
                key.uses_extra_ids,
                key.lora_task_id,
                key.extra_keys,
                key.cache_salt_id,
            )
            part_hash = block_key_hash(part, parent_hash)
            match = root.find_matching_block(part, part_hash, True, True)[2] if root else None
            if match is None:
                return None
            root, parent_hash = match, match.hash
        return root

    def tree_blocks(self) -> list[KVCacheBlock]:
        """Every block in the reuse tree, parents before children."""
        out: list[KVCacheBlock] = []
        stack = list(self.root.next_blocks.values())
        while stack:
            block = stack.pop()
            out.append(block)
            stack.extend(block.next_blocks.values())
        return out

    def blocks_by_hash(self) -> dict[int, KVCacheBlock]:
        """The reuse tree's blocks by chained hash (admin lookups; O(tree))."""
        return {block.hash: block for block in self.tree_blocks()}

    def clear_reusable_blocks(self) -> int:
        """Drop from the tree every subtree that no sequence or pin holds; returns the blocks
        dropped (each reported Removed). Held blocks and their ancestors stay."""
        blocks = self.tree_blocks()  # parents before children
        held: set[int] = set()
        for block in reversed(blocks):
            if block.ref_count > 0 or any(c.block_id in held for c in block.next_blocks.values()):
                held.add(block.block_id)
        root = self.root
        roots = [
            block
            for block in blocks
            if block.block_id not in held
            and (
                (parent := block.prev_block) is root
                or (parent is not None and parent.block_id in held)
            )
        ]
        # An empty key: a later eviction has nothing to offload.
        return sum(self._free_children(block, forget_keys=True) for block in roots)

    def offload_reusable_blocks(self, max_blocks: int | None = None) -> int:
        """Move cached primary blocks that nobody holds to empty secondary slots, in eviction
        order (each reported Updated, primary -> secondary); returns how many moved."""
        if max_blocks is not None and max_blocks < 0:
            raise ValueError(f"max_blocks must be >= 0, got {max_blocks}")
        if not self.onboard_blocks or self.num_secondary_blocks == 0:
            return 0
        policy = self.policy
        sources = [
            block
            for block in map(self.blocks.__getitem__, policy.free_order(PRIMARY_LEVEL))
            if block.in_radix_tree
        ]
        targets = [
            block
            for block in map(self.blocks.__getitem__, policy.free_order(SECONDARY_LEVEL))
            if not block.key.tokens and block.prev_block is None and not block.next_blocks
        ]
        count = min(len(sources), len(targets))
        if max_blocks is not None:
            count = min(count, max_blocks)
        for block, target in zip(sources[:count], targets[:count], strict=True):
            policy.claim_block(block, block.priority, block.duration_s)
            self.offload_block(block, target=target)  # the empty target takes the primary slot
            policy.release_block(block)  # into the secondary queue, same priority
        self.transfer.flush()
        return count

    def _chains_by_hash(self, block_hashes: Sequence[int]) -> list[KVCacheBlock]:
        """The named blocks with their ancestors, each once, parents before children (all
        must be in the tree)."""
        by_hash = self.blocks_by_hash()
        missing = [h for h in block_hashes if h not in by_hash]
        if missing:
            raise UnknownBlockError(
                f"no block with hash {missing[0]} in the reuse tree (window {self.window_size})"
            )
        blocks: dict[int, KVCacheBlock] = {}  # a block shared by several chains counts once
        for block_hash in block_hashes:
            chain: list[KVCacheBlock] = []
            node: KVCacheBlock | None = by_hash[block_hash]
            while node is not None and node is not self.root:
                chain.append(node)
                node = node.prev_block
            for block in reversed(chain):
                blocks.setdefault(block.block_id, block)
        return list(blocks.values())

    def pin_blocks_by_hash(self, block_hashes: Sequence[int]) -> list[int]:
        """Pin cached blocks by hash, each with its ancestors (a prefix is reusable only whole,
        and evicting an ancestor would drop the pinned block from the tree); a block named or
        shared several times is pinned once per call; all or none. Returns the ids pinned."""
        blocks = self._chains_by_hash(block_hashes)
        for block in blocks:
            self._pin(block)
        return [block.block_id for block in blocks]

    def unpin_blocks_by_hash(self, block_hashes: Sequence[int]) -> list[int]:
        """Undo `pin_blocks_by_hash` for the same hashes (all or none).

        Invariant kept: a pinned block's parent holds at least as many pins as it does, so an
        evicted ancestor can never drop a pinned block from the tree. An unpin that would break
        it (other hashes than the pin used: an ancestor alone, one of two siblings) raises
        PinConflictError and changes nothing."""
        blocks = self._chains_by_hash(block_hashes)
        chosen = {block.block_id for block in blocks}
        pins = self.pins

        def after(block: KVCacheBlock) -> int:
            return pins.get(block.block_id, 0) - (block.block_id in chosen)

        for block in blocks:
            if after(block) < 0:
                raise UnknownBlockError(f"block {block.block_id} (hash {block.hash}) is not pinned")
            for child in block.next_blocks.values():
                if after(child) > after(block):
                    raise PinConflictError(
                        f"unpinning block {block.hash} would leave its pinned child {child.hash} "
                        "with an unpinned ancestor; unpin with the hashes the pin used"
                    )
        ids = [block.block_id for block in blocks]
        self.unpin_blocks_by_id(ids)
        return ids

    def reset_reuse_state(self) -> None:
        """Forget the reuse tree. Each forgotten block is reported Removed, so that consumers of
        the event stream stay exact (the seed swaps the root silently)."""
        for child in list(self.root.next_blocks.values()):
            self._free_children(child)
