"""The dry runs of an allocation: how many free primary blocks `add_sequence` (and one more
token, `blocks_needed_for_next_token`) will take in a window.

Where the seed throws half way through an allocation, kvmesh asks first, so that a request that
cannot get its blocks is refused before anything changes, and a request the seed admits is
never refused. The dry run walks the reuse tree with the allocation's own walk
(`ReuseTree.match`) and counts exactly: every matched position costs one free block except a
full match of a primary block that is already held (it is only claimed); an onboard takes a
free block that may be a block the walk would match next, so with onboards the dry run follows
those evictions block by block through the real queue order (`_count_with_onboards`), changing
nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from cache.block import KVCacheBlock
from cache.eviction import PRIMARY_LEVEL, SECONDARY_LEVEL
from cache.hashing import BlockHash, BlockKey
from cache.radix import TreeMatch
from cache.request import GenerationRequest
from cache.retention import DEFAULT_PRIORITY

if TYPE_CHECKING:
    from cache.window import WindowBlockManager


class BlockCount(NamedTuple):
    """The dry run's answer: free primary blocks add_sequence takes, and tokens it reuses."""

    num_blocks: int
    num_matched_tokens: int


def count_blocks_needed(
    window: WindowBlockManager,
    keys: Sequence[BlockKey],
    hashes: Sequence[BlockHash],
    sequence: GenerationRequest,
    num_context_blocks: int,
    cap: int,
    reuse: bool,
    share_last: bool,
) -> BlockCount:
    """Exactly the free primary blocks add_sequence will take from this window, and the
    tokens it will reuse when the sequence may reuse at most `cap` tokens."""
    beam = sequence.beam_width
    if not reuse:
        return BlockCount(num_context_blocks - 1 + (1 if share_last else beam), 0)
    num_shared = num_context_blocks - 1 if beam > 1 else num_context_blocks
    tail = (num_context_blocks - num_shared) * beam
    plan = window.tree.match(keys, hashes, num_shared, cap)
    if window.onboard_blocks and not all(block.is_primary for block in plan.blocks):
        cost, reached, matched = _count_with_onboards(window, plan, keys, hashes, num_shared, cap)
        return BlockCount(cost + num_shared - reached + tail, matched)
    # Nothing is evicted before the walk stops matching: a full match that is not a free
    # primary block (one held, or without onboarding one in the secondary pool) is only
    # claimed; every other position takes one free primary block.
    claimed = sum(1 for block in plan.blocks if block.q_level != PRIMARY_LEVEL)
    return BlockCount(num_shared - claimed + tail, plan.num_matched_tokens)


def _count_with_onboards(
    window: WindowBlockManager,
    plan: TreeMatch,
    keys: Sequence[BlockKey],
    hashes: Sequence[BlockHash],
    stop: int,
    cap: int,
) -> tuple[int, int, int]:
    """The dry run of a walk that onboards: (free blocks its full matches take, how many of
    them it reaches, tokens matched with the partial match after them).

    Each onboard's getFreeBlock takes the next free primary block (offloading it when it
    may, which drops the first free secondary block from the tree instead); a planned
    block dropped that way ends the walk, as a miss would. Nothing is changed: the queues
    are read in order and the dry run's own moves are kept aside.
    """
    policy = window.policy
    threshold = policy.secondary_offload_min_priority
    primary_queue = policy.iter_free(PRIMARY_LEVEL)
    secondary_queue = policy.iter_free(SECONDARY_LEVEL)
    taken: set[int] = set()  # out of their free queue: claimed, victims, offload targets
    gone: set[int] = set()  # dropped from the tree (with their subtrees)
    moved: dict[int, bool] = {}  # block id -> is_primary, where the dry run moved it
    queued: list[tuple[int, int, KVCacheBlock]] = []  # (priority, order) of secondary releases
    num_secondary_free = policy.get_num_free_blocks(SECONDARY_LEVEL)
    head: KVCacheBlock | None = next(secondary_queue, None)
    cost = 0
    reached = 0

    def release_to_secondary(block: KVCacheBlock, priority: int) -> None:
        nonlocal num_secondary_free
        moved[block.block_id] = False
        queued.append((priority, len(taken) + len(queued) + len(gone), block))
        num_secondary_free += 1

    def first_secondary() -> KVCacheBlock:
        nonlocal head, num_secondary_free
        while head is not None and head.block_id in taken:
            head = next(secondary_queue, None)
        best = min(queued, key=lambda entry: entry[:2]) if queued else None
        num_secondary_free -= 1
        if head is not None and (best is None or head.q_priority <= best[0]):
            block = head
            taken.add(block.block_id)
            head = next(secondary_queue, None)
            return block
        assert best is not None
        queued.remove(best)
        return best[2]

    for block in plan.blocks:
        block_id = block.block_id
        if block_id in gone:
            break
        reached += 1
        if moved.get(block_id, block.is_primary):
            if block.q_level == PRIMARY_LEVEL and block_id not in taken:
                cost += 1
            taken.add(block_id)
            continue
        # A secondary match: claimed out of the secondary queue, then onboarded.
        entry = next((e for e in queued if e[2] is block), None)
        if entry is not None:
            queued.remove(entry)
            num_secondary_free -= 1
        elif block.q_level == SECONDARY_LEVEL and block_id not in taken:
            num_secondary_free -= 1
        taken.add(block_id)
        cost += 1
        victim = next((b for b in primary_queue if b.block_id not in taken), None)
        if victim is None:  # the allocation runs out of blocks here
            return cost + len(plan.blocks) - reached, reached, plan.num_tokens
        taken.add(victim.block_id)
        if victim.key.tokens and victim.q_priority >= threshold and num_secondary_free > 0:
            fresh = first_secondary()
            gone.add(fresh.block_id)
            release_to_secondary(victim, victim.priority)  # it stays in the tree
        else:
            fresh = victim
            gone.add(fresh.block_id)
        release_to_secondary(fresh, DEFAULT_PRIORITY)  # it took the onboarded block's slot
        moved[block_id] = True
    matched = reached * window.tokens_per_block
    if reached == len(plan.blocks) and not gone:
        return cost, reached, plan.num_matched_tokens
    position = plan.start + reached
    if position < stop:
        parent = plan.blocks[reached - 1] if reached else window.tree.root
        found = window.tree.find_matching_block(
            parent,
            keys[position],
            hashes[position],
            window.enable_partial_reuse,
            window.copy_on_partial_reuse,
            gone,
        )
        if found.block is not None and matched + found.num_tokens <= cap:
            matched += found.num_tokens
    return cost, reached, matched


def would_leave_window(window: WindowBlockManager, sequence: GenerationRequest) -> bool:
    """Whether one more token pushes a block out of this window (only SWA may detach)."""
    front = sequence.num_front_blocks_removed[window.window_size]
    tpb = window.tokens_per_block
    return sequence.num_tokens + 1 - front * tpb >= window.window_size + tpb


def blocks_needed_for_next_token(window: WindowBlockManager, sequence: GenerationRequest) -> int:
    """Free primary blocks add_token needs in this window (after out-of-window blocks it
    detaches are freed)."""
    tpb = window.tokens_per_block
    num_tokens = sequence.num_tokens + 1
    if (num_tokens - 1) % tpb != 0:
        return 0
    required = 1 if sequence.beam_width == 1 else sequence.beam_width
    freed = 0
    front = sequence.num_front_blocks_removed[window.window_size]
    blocks = window.allocated_blocks_per_seq[sequence.request_id]
    while num_tokens - front * tpb >= window.window_size + tpb:
        if front < len(blocks) and blocks[front].ref_count == 1:
            freed += 1
        front += 1
    return max(0, required - freed)
