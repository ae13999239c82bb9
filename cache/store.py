"""Storing a sequence's blocks for reuse: the seed's storeBlocks and its callers.

A sequence's blocks join its window's reuse tree (`cache.radix`) under the request's keys and
chained hashes: on the fly as context blocks fill (`store_context_blocks`, `store_new_block`),
and when the request leaves (`store_request`, before the window releases them; or
`store_blocks_for_reuse`, without releasing). Blocks already in the tree are matched, not stored
again; each call reports the blocks it stored as one Stored event (and any stale entry it
dropped as Removed).

Compiled with window.py (`cache._native`): every finished request is stored through here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from cache.block import KVCacheBlock
from cache.hashing import BlockHash, BlockKey
from cache.pins import pin_block
from cache.request import GenerationRequest, LlmRequest

if TYPE_CHECKING:
    from cache.window import WindowBlockManager


class StoredBlocks(NamedTuple):
    """storeBlocks' result: blocks newly put in the tree, and the ids it pinned."""

    num_stored: int
    pinned_ids: list[int]


def store_blocks(
    window: WindowBlockManager,
    keys: Sequence[BlockKey],
    hashes: Sequence[BlockHash],
    blocks: Sequence[KVCacheBlock],
    pin_blocks: bool = False,
    cache_salt: str | None = None,
) -> StoredBlocks:
    """storeBlocks: insert the blocks not yet in the tree; one Stored event for them all.

    The walk starts at the tree root or (without a sliding window) below the last of `blocks`
    already stored (`_last_stored`): a request stores most of its blocks more than once, at
    every block boundary and when it leaves.
    """
    tree = window.tree
    count = min(len(keys), len(blocks))
    # A sliding window's sequence may hold one block twice (out of the window, then taken back
    # for a later position): its blocks are no chain that `_last_stored` could trust.
    known = _last_stored(blocks, hashes, count) if not window.is_swa else -1
    if known >= 0:
        # The walk from the root would retrace the tree's chain down to blocks[known] (the
        # request's blocks, or another's it reused): go on below it.
        found = tree.match(keys, hashes, count, start=known + 1, parent=blocks[known], exact=True)
        start = known + 1 + len(found.blocks)
        parent = found.blocks[-1] if found.blocks else blocks[known]
        matched = tree.chain(parent) if pin_blocks else []
    else:
        matched = tree.match(keys, hashes, count, exact=True).blocks
        start = len(matched)
        parent = matched[-1] if matched else tree.root
    pinned: list[int] = []
    if pin_blocks:
        for block in matched:
            pin_block(window, block)
            pinned.append(block.block_id)
    stored = list(blocks[start:count])
    removed: list[int] = []
    tree.insert_chain(parent, stored, keys[start:], hashes[start:], removed)
    for block in stored:
        block.cache_salt = cache_salt
    if pin_blocks:
        for block in stored:
            pin_block(window, block)
            pinned.append(block.block_id)
    window.events.enqueue_removed_many(removed, window.window_size)
    if stored:
        window.events.enqueue_stored(stored, window.window_size)
    return StoredBlocks(len(stored), pinned)


def _last_stored(blocks: Sequence[KVCacheBlock], hashes: Sequence[BlockHash], count: int) -> int:
    """The position of the last of the sequence's first `count` blocks that is in the tree,
    when the tree holds it under the hash the request gives that position; else -1.

    A block in the tree has its ancestors there too (blocks leave it a subtree at a time; a
    sliding window's sequence, which may hold one block twice, is not asked), and its chained
    hash names their keys: the walk of `store_blocks` from the root would find this very chain
    down to it. The request's own blocks are most of what it stores again (all of them when it
    leaves), so the walk's dictionary probe per block is saved. As in `_store_new_block`, equal
    chained hashes are taken for equal chains."""
    last = count - 1
    while last >= 0 and blocks[last].prev_block is None:
        last -= 1
    if last >= 0 and blocks[last].hash != hashes[last]:
        return -1
    return last


def _beam0_blocks(window: WindowBlockManager, sequence: GenerationRequest) -> list[KVCacheBlock]:
    return [window.blocks[i] for i in sequence.cache_block_ids[window.window_size][0]]


def store_context_blocks(
    windows: Iterable[WindowBlockManager], sequence: GenerationRequest, request: LlmRequest
) -> None:
    """Store the full blocks of the tokens computed so far (all but the last), in every window
    without sliding: an SWA block stored now could go out of window."""
    for window in windows:
        if not window.is_swa:
            tpb = window.tokens_per_block
            usable = request.num_tokens - 1
            keys = request.block_keys(tpb, usable, False)
            hashes = request.block_hashes(tpb, usable, False)
            blocks = _beam0_blocks(window, sequence)
            store_blocks(window, keys, hashes, blocks, False, request.cache_salt)


def store_new_block(
    windows: Iterable[WindowBlockManager], sequence: GenerationRequest, request: LlmRequest
) -> None:
    """Store the block a generated token has just filled (at a block boundary only), in every
    window without sliding."""
    for window in windows:
        if not window.is_swa:
            _store_new_block(window, sequence, request)


def _store_new_block(
    window: WindowBlockManager, sequence: GenerationRequest, request: LlmRequest
) -> None:
    tpb = window.tokens_per_block
    if request.num_tokens == 0:
        return
    usable = request.num_tokens - 1
    if usable % tpb != 0:
        return
    keys = request.block_keys(tpb, usable, True)
    hashes = request.block_hashes(tpb, usable, True)
    # store_blocks goes on below the last block stored so far: only the new one is looked up.
    store_blocks(window, keys, hashes, _beam0_blocks(window, sequence), False, request.cache_salt)


def store_request(
    window: WindowBlockManager, request: LlmRequest, blocks: Sequence[KVCacheBlock], pin: bool
) -> list[int]:
    """Store `blocks`, a sequence's in order, under the request's keys (the partial tail too);
    returns the ids pinned when `pin`. What releaseBlocks stores."""
    tpb = window.tokens_per_block
    usable = request.num_tokens - 1
    keys = request.block_keys(tpb, usable, True)
    hashes = request.block_hashes(tpb, usable, True)
    return store_blocks(window, keys, hashes, blocks, pin, request.cache_salt).pinned_ids


def store_blocks_for_reuse(
    windows: Iterable[WindowBlockManager],
    sequence: GenerationRequest,
    request: LlmRequest,
    pin: bool,
) -> list[int]:
    """`store_request` for the sequence's blocks in every window, without releasing them;
    returns the ids pinned in the last window when `pin`. A sliding window where the sequence
    is no longer valid for store-for-reuse (`is_sequence_valid_for_store_for_reuse`, what
    releaseBlocks asks: a block of its list taken again, by another sequence or by itself for
    a later position) stores nothing: the seed stores it anyway, and a block listed twice
    would hang below its own chain. Other windows are stored as the seed stores them."""
    pinned: list[int] = []
    for window in windows:
        pinned = []
        if not window.is_swa or window.is_sequence_valid_for_store_for_reuse(sequence.request_id):
            pinned = store_request(window, request, _beam0_blocks(window, sequence), pin)
    return pinned
