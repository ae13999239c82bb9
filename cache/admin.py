"""Admin over the windows, and the seed's lookup of the first block a prompt would not reuse.

What the worker's admin API asks of the manager, for every window at once: drop every cached
block nobody holds (`clear_reusable_blocks`), move cached primary blocks to free host slots
(`offload_reusable_blocks`), forget the reuse trees (`reset_reuse_state`). Each change is
reported as the events a consumer of the stream needs to stay exact. Also
`find_new_context_block`, which cuts tokens into keys and walks one window's tree.

Not compiled (`cache._native`): nothing here is on an allocation's path.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from cache.eviction import PRIMARY_LEVEL, SECONDARY_LEVEL
from cache.hashing import BlockKey
from cache.request import LlmRequest

if TYPE_CHECKING:
    from cache.window import WindowBlockManager


def clear_reusable_blocks(windows: Iterable[WindowBlockManager]) -> int:
    """Drop from each tree every subtree that no sequence or pin holds; returns the blocks
    dropped (each reported Removed, and left holding nothing, so that a later eviction has
    nothing to offload). Held blocks and their ancestors stay."""
    count = 0
    for window in windows:
        tree = window.tree
        removed: list[int] = []
        for block in tree.unheld_subtrees(lambda block: block.ref_count > 0):
            count += tree.remove_subtree(block, removed, forget_keys=True)
        window.events.enqueue_removed_many(removed, window.window_size)
    return count


def offload_reusable_blocks(
    windows: Iterable[WindowBlockManager], max_blocks: int | None = None
) -> int:
    """Move cached primary blocks that nobody holds to empty secondary slots, window by window,
    in eviction order, at most `max_blocks` in all (each reported Updated, primary ->
    secondary); returns how many moved."""
    if max_blocks is not None and max_blocks < 0:
        raise ValueError(f"max_blocks must be >= 0, got {max_blocks}")
    moved = 0
    for window in windows:
        moved += _offload_window(window, None if max_blocks is None else max_blocks - moved)
    return moved


def _offload_window(window: WindowBlockManager, max_blocks: int | None) -> int:
    if not window.onboard_blocks or window.num_secondary_blocks == 0:
        return 0
    policy = window.policy
    sources = [block for block in policy.iter_free(PRIMARY_LEVEL) if block.in_radix_tree]
    targets = [
        block
        for block in policy.iter_free(SECONDARY_LEVEL)
        if not block.key.tokens and block.prev_block is None and not block.next_blocks
    ]
    count = min(len(sources), len(targets))
    if max_blocks is not None:
        count = min(count, max_blocks)
    for block, target in zip(sources[:count], targets[:count], strict=True):
        policy.claim_block(block, block.priority, block.duration_s)
        window.offload_block(block, target=target)  # the empty target takes the primary slot
        policy.release_block(block)  # into the secondary queue, same priority
    window.transfer.flush()
    return count


def reset_reuse_state(windows: Iterable[WindowBlockManager]) -> None:
    """Forget the reuse trees. Each forgotten block is reported Removed, so that consumers of
    the event stream stay exact (the seed swaps the root silently)."""
    for window in windows:
        removed: list[int] = []
        window.tree.clear(removed)
        window.events.enqueue_removed_many(removed, window.window_size)


def find_new_context_block(
    window: WindowBlockManager, request: LlmRequest, tokens: Sequence[int]
) -> BlockKey | None:
    """The key of the first block of `tokens` the window's tree lacks (with the tokens before
    it), or None when the tree holds all their full blocks."""
    tpb = window.tokens_per_block
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
    found = window.tree.match(keys, hashes, exact=True).blocks
    if len(found) == len(keys):
        return None
    result_tokens = [t for key in keys[: len(found) + 1] for t in key.tokens]
    return BlockKey(tokens=result_tokens, lora_task_id=request.lora_task_id)
