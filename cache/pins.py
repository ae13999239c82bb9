"""Pins: references that keep cached blocks out of the free queues until they are undone.

A pin is a reference like a sequence's (it counts in `ref_count`), recorded per block id in the
window's `pins` (block id -> pins not yet undone), so that an unpin undoes exactly a pin and a
bad unpin is refused before anything changes. Blocks are pinned three ways: a live sequence's
blocks (`pin_sequence`), a stored chain as a request leaves (`remove_sequence(pin_blocks=True)`,
through `cache.store`), and cached blocks by hash with their ancestors (the worker's admin API,
`pin_by_hash`). The counts live in `WindowBlockManager.pins`; the rules live here.

Not compiled (`cache._native`): nothing here is on an allocation's path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from cache.block import KVCacheBlock
from cache.errors import PinConflictError, UnknownBlockError
from cache.request import GenerationRequest

if TYPE_CHECKING:
    from cache.window import WindowBlockManager


def pin_block(window: WindowBlockManager, block: KVCacheBlock) -> None:
    """Add a reference; a free (cached) block leaves its free queue first, so it is not
    counted free while pinned (the "ghost free block" newer TensorRT-LLM fixed)."""
    if block.ref_count == 0 and block.q_level >= 0:
        window.policy.claim_block(block, block.priority, block.duration_s)
    block.ref_count += 1
    window.pins[block.block_id] = window.pins.get(block.block_id, 0) + 1


def pin_sequence(window: WindowBlockManager, sequence: GenerationRequest) -> None:
    """Pin every block the sequence holds in this window."""
    for block in window.allocated_blocks_per_seq[sequence.request_id]:
        pin_block(window, block)


def unpin_by_id(window: WindowBlockManager, block_ids: Sequence[int]) -> None:
    """Undo one pin per id (an id named twice, twice); all or none."""
    pins = window.pins
    # Validate everything first, so a bad id changes nothing.
    pending: dict[int, int] = {}
    for block_id in block_ids:
        window.block(block_id)
        pending[block_id] = pending.get(block_id, 0) + 1
        if pending[block_id] > pins.get(block_id, 0):
            raise UnknownBlockError(
                f"block {block_id} is not pinned "
                f"({pins.get(block_id, 0)} pin(s), {pending[block_id]} unpin(s) asked)"
            )
    for block_id in block_ids:
        block = window.blocks[block_id]
        pins[block_id] -= 1
        if not pins[block_id]:
            del pins[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            window.policy.release_block(block)


def _chains_by_hash(window: WindowBlockManager, block_hashes: Sequence[int]) -> list[KVCacheBlock]:
    """The named blocks with their ancestors, each once, parents before children (all
    must be in the tree)."""
    tree = window.tree
    named: list[KVCacheBlock] = []
    for block_hash in block_hashes:
        block = tree.find_by_hash(block_hash)
        if block is None:
            raise UnknownBlockError(
                f"no block with hash {block_hash} in the reuse tree (window {window.window_size})"
            )
        named.append(block)
    blocks: dict[int, KVCacheBlock] = {}  # a block shared by several chains counts once
    for block in named:
        for node in tree.chain(block):
            blocks.setdefault(node.block_id, node)
    return list(blocks.values())


def pin_by_hash(window: WindowBlockManager, block_hashes: Sequence[int]) -> list[int]:
    """Pin cached blocks by hash, each with its ancestors (a prefix is reusable only whole,
    and evicting an ancestor would drop the pinned block from the tree); a block named or
    shared several times is pinned once per call; all or none. Returns the ids pinned."""
    blocks = _chains_by_hash(window, block_hashes)
    for block in blocks:
        pin_block(window, block)
    return [block.block_id for block in blocks]


def unpin_by_hash(window: WindowBlockManager, block_hashes: Sequence[int]) -> list[int]:
    """Undo `pin_by_hash` for the same hashes (all or none).

    Invariant kept: a pinned block's parent holds at least as many pins as it does, so an
    evicted ancestor can never drop a pinned block from the tree. An unpin that would break
    it (other hashes than the pin used: an ancestor alone, one of two siblings) raises
    PinConflictError and changes nothing."""
    blocks = _chains_by_hash(window, block_hashes)
    chosen = {block.block_id for block in blocks}
    pins = window.pins

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
    ids: list[int] = [block.block_id for block in blocks]
    unpin_by_id(window, ids)
    return ids
