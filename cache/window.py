"""WindowBlockManager: the block pool and the sequences of one attention window size.

A port of the seed's WindowBlockManager. It owns the pool (every block made once, indexed by id;
the free queues of `cache.eviction`; the reuse tree of `cache.radix`), hands free blocks out
(offloading victims to the host tier), and keeps each live sequence's blocks: allocated with
reuse (the tree's one walk), grown token by token, detached out of a sliding window, split for
diverging beams, released. Events go into an `EventSink` (a do-nothing one when events are off).
Storing for reuse is `cache.store`, pins `cache.pins`, admin `cache.admin`; the manager checks
room first (`cache.precheck`, `cache.dryrun`), so an allocation here does not fail half way.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import NamedTuple

from cache.block import KVCacheBlock
from cache.errors import OutOfBlocksError, UnknownBlockError
from cache.events import EventDiff, EventSink, UpdatedData
from cache.eviction import PRIMARY_LEVEL, SECONDARY_LEVEL, LRUEvictionPolicy
from cache.hashing import BlockHash, BlockKey, block_key_hash
from cache.radix import ReuseTree, TreeMatch
from cache.request import GenerationRequest, LlmRequest
from cache.retention import DEFAULT_PRIORITY
from cache.transfer import Slot, TransferEngine

Retention = tuple[int | None, float | None]

_key = attrgetter("key")


class ContextKeys(NamedTuple):
    """The keys addSequence matches and their chained hashes, position by position."""

    keys: list[BlockKey]
    hashes: list[BlockHash]


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
        events: EventSink,
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
        self.events = events
        self.blocks: list[KVCacheBlock] = [
            KVCacheBlock(i, i, True) for i in range(num_primary_blocks)
        ] + [KVCacheBlock(num_primary_blocks + i, i, False) for i in range(num_secondary_blocks)]
        self.tree = ReuseTree(tokens_per_block, enable_partial_reuse, copy_on_partial_reuse)
        self.policy = LRUEvictionPolicy(self.blocks, secondary_offload_min_priority, clock)  # type: ignore[arg-type]
        self.allocated_blocks_per_seq: dict[int, list[KVCacheBlock]] = {}
        self.pins: dict[int, int] = {}  # block id -> pins not yet undone
        self.valid_store_for_reuse: dict[int, bool] = {}
        self.scheduling_num_free_blocks = 0
        self.alloc_total_blocks = 0
        self.alloc_new_blocks = 0
        self.reused_blocks = 0
        self.missed_blocks = 0
        self.reused_tokens = 0
        self.total_input_tokens = 0
        events.enqueue_created([num_primary_blocks, num_secondary_blocks], window_size)

    @property
    def root(self) -> KVCacheBlock:
        """The root of the reuse tree (holds no tokens; its children start prefixes)."""
        return self.tree.root

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

    def _move_to_secondary(
        self, block: KVCacheBlock, target: KVCacheBlock, directory: str | None
    ) -> None:
        """`block`'s contents move to the secondary block `target`, which takes its primary
        slot in exchange (reported Updated when `block` is in the tree)."""
        self.transfer.copy(_slot(block), _slot(target), 0, directory)
        block.swap_memory_pool_block_offset(target)
        if block.in_radix_tree:
            self.events.enqueue_updated(
                UpdatedData(block.hash, cache_level=EventDiff(PRIMARY_LEVEL, SECONDARY_LEVEL)),
                self.window_size,
            )

    def _offload_victim(self, block: KVCacheBlock, sequence: GenerationRequest) -> KVCacheBlock:
        """getFreeBlock's offload: `block`'s contents move to the first free secondary block,
        which is returned in its place (still queued)."""
        policy = self.policy
        target, _ = policy.get_free_block(SECONDARY_LEVEL)
        self._move_to_secondary(block, target, sequence.transfer_directory)
        policy.claim_block(block)  # keeps its priority, loses its duration
        policy.release_block(block)  # now into the secondary queue
        return target

    def get_free_block(
        self, sequence: GenerationRequest, priority: int, duration_s: float | None
    ) -> KVCacheBlock:
        """getFreeBlock: the next victim, offloaded to the secondary level when it may be."""
        return self.get_free_blocks(sequence, [(priority, duration_s)])[0]

    def _take_from_owner(self, block: KVCacheBlock, sequence: GenerationRequest) -> None:
        # A block taken from under a live sequence (rewound or out of window) makes that
        # sequence's store-for-reuse invalid; so does one the sequence let go out of this window
        # itself, whoever held it since (the seed exempts it: the list would hold it twice, and
        # storing it would hang the block below its own chain).
        owner, rid, valid = block.owner, sequence.request_id, self.valid_store_for_reuse
        if owner is not None and owner != rid and owner in valid:
            valid[owner] = False
        front = sequence.num_front_blocks_removed.get(self.window_size, 0) if self.is_swa else 0
        if front and valid.get(rid, False):  # identity: a block has no __eq__ (one C scan)
            valid[rid] = block not in self.allocated_blocks_per_seq[rid][:front]
        block.owner = rid

    def get_free_blocks(
        self, sequence: GenerationRequest, retentions: Sequence[Retention]
    ) -> list[KVCacheBlock]:
        """getFreeBlock once per retention (priority, duration), in one pass: the victims leave
        the primary queues at once (popleft_n; only heads are taken, and nothing done to a
        victim puts a block in a primary queue, so they are the blocks the calls one by one
        would take). A victim with contents is offloaded to the secondary level when it may
        be; a cached block leaves the tree with its subtree (reported Removed, in order)."""
        policy = self.policy
        victims = policy.take_free_blocks(PRIMARY_LEVEL, len(retentions))
        threshold = policy.secondary_offload_min_priority
        may_offload = self.onboard_blocks and self.num_secondary_blocks > 0
        tree = self.tree
        removed: list[int] = []
        window = self.window_size
        num_new = 0
        out: list[KVCacheBlock] = []
        for block, (priority, duration) in zip(victims, retentions, strict=True):
            if not block.key.tokens:
                num_new += 1
            elif (
                may_offload
                and block.q_priority >= threshold
                and policy.get_num_free_blocks(SECONDARY_LEVEL) > 0
            ):
                self.events.enqueue_removed_many(removed, window)  # events stay in order
                removed = []
                block = self._offload_victim(block, sequence)
            if block.prev_block is not None or block.next_blocks:
                tree.remove_subtree(block, removed)  # a cached block, with its subtree
            if block.q_level >= 0:  # an offload target, still queued
                policy.claim_block(block)
            block.expiry_token += 1
            block.priority = DEFAULT_PRIORITY if priority is None else priority
            block.duration_s = duration
            self._take_from_owner(block, sequence)
            out.append(block)
        self.events.enqueue_removed_many(removed, window)
        self.alloc_new_blocks += num_new
        self.alloc_total_blocks += len(victims)
        return out

    def onboard_block(self, sequence: GenerationRequest, offload_block: KVCacheBlock) -> None:
        if self.onboard_blocks and not offload_block.is_primary:
            block = self.get_free_block(sequence, DEFAULT_PRIORITY, None)
            self.transfer.copy(_slot(offload_block), _slot(block))
            offload_block.swap_memory_pool_block_offset(block)
            # The seed reports every onboard; an exact stream skips blocks no longer in the tree
            # (a leaf just taken over, already reported removed).
            if offload_block.prev_block is not None or not self.report_leaf_takeover:
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
            self._move_to_secondary(block, offload, directory)
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

    def _add_blocks_to_all_beams(
        self, blocks: Sequence[KVCacheBlock], sequence: GenerationRequest
    ) -> None:
        """addBlockToAllBeams for each block in turn."""
        if sequence.beam_width != 1:
            for block in blocks:
                for beam in range(sequence.beam_width):
                    self.add_block_to_beam(block, sequence, beam)
            return
        ids = sequence.cache_block_ids[self.window_size][0]
        last = self.blocks[ids[-1]] if ids else None
        for block in blocks:
            block.ref_count += 1
            block.prev_block_in_seq = last
            last = block
        ids.extend([block.block_id for block in blocks])
        self.allocated_blocks_per_seq[sequence.request_id].extend(blocks)

    def context_keys(
        self, request: LlmRequest, input_length: int, encoder: bool = False
    ) -> ContextKeys:
        """The keys (and chained hashes) addSequence matches: input_length - 1 tokens, partial
        tail allowed, plus the empty key when exactly one token lies past the last full block."""
        tpb = self.tokens_per_block
        hashes = request.block_hashes(tpb, input_length - 1, True, encoder)
        # Keys the tree holds already are lent to the request: matching compares by identity.
        keys = request.block_keys(tpb, input_length - 1, True, encoder, self.tree.by_hash)
        if input_length % tpb == 1:
            empty = request.empty_key(len(keys) * tpb)
            keys.append(empty)
            hashes.append(BlockHash(block_key_hash(empty, hashes[-1] if hashes else 0)))
        return ContextKeys(keys, hashes)

    def add_sequence(
        self,
        sequence: GenerationRequest,
        input_length: int,
        num_context_blocks: int,
        keys: list[BlockKey],
        hashes: list[BlockHash],
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

    def _claim_matches(
        self,
        plan: TreeMatch,
        sequence: GenerationRequest,
        per_block: list[Retention],
        keys: list[BlockKey],
    ) -> tuple[int, bool]:
        """Claim the full matches of `plan` in order and give them to the sequence; returns
        how many it took, and whether it onboarded. Stops at a planned block an onboard has
        dropped from the tree since the plan was made.

        Each matched position's key is replaced in `keys` by the (equal) key of its block, so
        that later walks with these keys compare by identity."""
        events = self.events
        window = self.window_size
        policy = self.policy
        onboard = self.onboard_blocks
        position = plan.start
        onboarded = False
        taken: list[KVCacheBlock] = []
        for block in plan.blocks:
            if onboarded and block.prev_block is None:
                break
            priority, duration = per_block[position]
            if priority is not None and block.priority != priority:
                events.enqueue_updated(
                    UpdatedData(block.hash, priority=EventDiff(block.priority, priority)),
                    window,
                )
            if block.q_level >= 0:
                policy.claim_block(block, priority, duration)
            else:  # claim_block without the call: held blocks are in no queue
                block.expiry_token += 1
                if priority is not None:
                    block.priority = priority
                block.duration_s = duration
            if onboard and not block.is_primary:
                self._add_blocks_to_all_beams(taken, sequence)
                taken = []
                self.onboard_block(sequence, block)
                onboarded = True
            taken.append(block)
            position += 1
        self._add_blocks_to_all_beams(taken, sequence)
        num_taken = position - plan.start
        keys[plan.start : position] = map(_key, plan.blocks[:num_taken])
        self.reused_blocks += num_taken
        return num_taken, onboarded

    def _load_or_allocate_blocks(
        self,
        keys: list[BlockKey],
        hashes: list[BlockHash],
        num_context_blocks: int,
        sequence: GenerationRequest,
        per_block: list[Retention],
    ) -> int:
        tpb = self.tokens_per_block
        tree = self.tree
        beam_width = sequence.beam_width
        num_shared = num_context_blocks - 1 if beam_width > 1 else num_context_blocks
        num_keys = len(keys)
        cap = sequence.current_prepopulated_prompt_len
        plan = tree.match(keys, hashes, num_shared, cap)
        num_matched_tokens = 0
        while True:
            num_taken, onboarded = self._claim_matches(plan, sequence, per_block, keys)
            num_matched_tokens += num_taken * tpb
            if not onboarded:
                break
            # An onboard may have dropped blocks from the tree: walk on from here.
            ids = sequence.cache_block_ids[self.window_size][0]
            plan = tree.match(
                keys,
                hashes,
                num_shared,
                cap - num_matched_tokens,
                start=plan.start + num_taken,
                parent=self.blocks[ids[-1]] if ids else tree.root,
            )
        position = plan.end
        partial = plan.partial
        if partial is not None:
            num_matched = plan.num_partial_tokens
            num_matched_tokens += num_matched
            priority, duration = per_block[position]
            if priority is not None and partial.priority != priority:
                self.events.enqueue_updated(
                    UpdatedData(partial.hash, priority=EventDiff(partial.priority, priority)),
                    self.window_size,
                )
            key = keys[position]
            if partial.ref_count > 0 or partial.next_blocks:
                # Someone uses it or it has children: copy the reusable tokens.
                block = self.get_free_block(sequence, partial.priority, partial.duration_s)
                self.transfer.copy(_slot(partial), _slot(block), num_matched)
                block.set_block_key(key, len(key.tokens) == tpb)
                block.hash = hashes[position]
            else:
                # An unreferenced leaf: take it over privately. The seed reports nothing;
                # consumers that must stay exact ask for a Removed event.
                if self.report_leaf_takeover:
                    self.events.enqueue_removed(partial.hash, self.window_size)
                tree.detach_leaf(partial)
                self.policy.claim_block(partial, priority, duration)
                block = partial
            if not block.is_primary:
                self.onboard_block(sequence, block)
            self._add_blocks_to_all_beams([block], sequence)
            self.reused_blocks += 1
            position += 1
        # No match from here on: a fresh block per position, keyed by its position.
        if position < num_shared:
            fresh = self.get_free_blocks(
                sequence,
                [
                    (DEFAULT_PRIORITY if priority is None else priority, duration)
                    for priority, duration in per_block[position:num_shared]
                ],
            )
            self._add_blocks_to_all_beams(fresh, sequence)
            set_keys = max(0, min(num_shared, num_keys) - position)
            for block, key, key_hash in zip(
                fresh[:set_keys], keys[position:], hashes[position:], strict=False
            ):
                block.set_block_key(key, len(key.tokens) == tpb)
                block.hash = key_hash
            for block in fresh[set_keys:]:  # past the keys: the hash of the key it holds
                prev = block.prev_block_in_seq
                block.hash = BlockHash(block_key_hash(block.key, prev.hash if prev else 0))
            self.missed_blocks += len(fresh)
        # The last context block of a beam search is written by every beam: one per beam.
        ki = num_shared
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
                block.hash = BlockHash(block_key_hash(block.key, prev.hash if prev else 0))
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

    # -- releasing ------------------------------------------------------------------------------

    def is_sequence_valid_for_store_for_reuse(self, request_id: int) -> bool:
        return self.valid_store_for_reuse.get(request_id, False)

    def release_blocks(self, sequence: GenerationRequest) -> None:
        """releaseBlocks' release: the sequence's blocks, last to first (the manager stores them
        for reuse first, with `cache.store.store_request`)."""
        blocks = self.allocated_blocks_per_seq.pop(sequence.request_id)
        front = sequence.num_front_blocks_removed[self.window_size]
        freed: list[KVCacheBlock] = []
        append = freed.append
        for block in reversed(blocks[front:] if front else blocks):
            ref = block.ref_count
            if ref > 1:
                block.ref_count = ref - 1
            elif ref >= 0:  # the last reference, or none (an out-of-window block may hold none)
                block.ref_count = 0
                append(block)
        self.policy.release_blocks(freed)
        sequence.cache_block_ids[self.window_size] = [[] for _ in range(sequence.beam_width)]

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
            block.hash = BlockHash(block_key_hash(key, prev.hash if prev else 0))
            ids[block_index] = block.block_id
            allocated[block_index * beam_width + beam] = block

    # -- scheduling -----------------------------------------------------------------------------

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

    # -- listing ----------------------------------------------------------------------------------

    def tree_blocks(self) -> list[KVCacheBlock]:
        """Every block in the reuse tree, parents before children."""
        return self.tree.blocks()
