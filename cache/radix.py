"""ReuseTree: the reuse (radix) tree of one attention window, and the one walk that matches it.

The tree hangs below a root block. A block's children are indexed by their chained hash (the hash
of their key chained onto the parent's), and a hit is confirmed by comparing keys, so a hash
collision is a miss, as the seed's map keyed by BlockKey would have it.

A chained hash names a whole prefix, so the tree also keeps one flat map from chained hash to
block (vLLM's BlockHashToBlockMap). Matching a request looks its hashes up in that map in turn
and only *confirms* each block (its parent, fullness and key); the per-node children are walked
one block at a time only where the confirmation fails or a partial match is possible. `match`
is the one walk: the dry run of an allocation, the allocation itself and the lookups all use it.

Invariants: a block is in the tree iff `prev_block` is not None (the root's children have the
root as parent); `parent.next_blocks[block.hash] is block` for every reachable block; `by_hash`
maps a hash to a reachable block with that hash (the first stored, where hashes collide).

This module owns those links: `prev_block`, `next_blocks` and `by_hash` are written only by the
methods below (`insert`, `insert_chain`, `remove_subtree`, `detach_leaf`, `clear`); everyone else
reads them.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import NamedTuple

from cache.block import ROOT_BLOCK_ID, KVCacheBlock
from cache.hashing import BlockHash, BlockKey, block_key_hash

NO_CAP = 2**62


class BlockMatch(NamedTuple):
    """findMatchingBlock's result: the block (None: no match), tokens matched, partial?"""

    block: KVCacheBlock | None
    num_tokens: int
    partial: bool


NO_MATCH = BlockMatch(None, 0, False)


class TreeMatch(NamedTuple):
    """What the tree holds of a request, from position `start` on.

    `blocks` are full matches, in order, holding `num_tokens` tokens; `partial` is a block matched
    partially (or an exact hit on a block that is not full) right after them, `num_partial_tokens`
    of its tokens; None when the walk stopped on a miss or on the token cap.
    """

    start: int
    blocks: list[KVCacheBlock]
    num_tokens: int
    partial: KVCacheBlock | None
    num_partial_tokens: int

    @property
    def end(self) -> int:
        """The position of the first key the full matches do not cover."""
        return self.start + len(self.blocks)

    @property
    def num_matched_tokens(self) -> int:
        return self.num_tokens + self.num_partial_tokens


class ReuseTree:
    def __init__(
        self, tokens_per_block: int, enable_partial_reuse: bool, copy_on_partial_reuse: bool
    ) -> None:
        self.root = KVCacheBlock(ROOT_BLOCK_ID, 0, True)
        self.tokens_per_block = tokens_per_block
        self.enable_partial_reuse = enable_partial_reuse
        self.copy_on_partial_reuse = copy_on_partial_reuse
        self.by_hash: dict[int, KVCacheBlock] = {}

    # -- matching ----------------------------------------------------------------------------

    def find_matching_block(
        self,
        parent: KVCacheBlock,
        key: BlockKey,
        key_hash: BlockHash,
        partial_reuse: bool,
        copy_on_partial_reuse: bool,
        gone: Container[int] = (),
    ) -> BlockMatch:
        """KVCacheBlock::findMatchingBlock below `parent`.

        `gone` names blocks to treat as already dropped from the tree (a dry run that foresees
        evictions); their subtrees must be named too, or be unreachable through them.
        """
        children = parent.next_blocks
        if not key.tokens or not children:
            return NO_MATCH
        block = children.get(key_hash)
        if block is not None and block.block_id not in gone and block.key == key:
            return BlockMatch(block, len(key.tokens), not block.is_full)
        if partial_reuse:
            best_matched = 0
            best: KVCacheBlock | None = None
            for child in children.values():
                if child.block_id in gone:
                    continue
                if copy_on_partial_reuse or (
                    child.ref_count == 0
                    and (
                        not child.next_blocks
                        or (
                            bool(gone)
                            and all(c.block_id in gone for c in child.next_blocks.values())
                        )
                    )
                ):
                    matched = child.key.partial_match(key)
                    if matched > best_matched:
                        best_matched, best = matched, child
            if best is not None:
                return BlockMatch(best, best_matched, True)
        return NO_MATCH

    def match(
        self,
        keys: Sequence[BlockKey],
        hashes: Sequence[BlockHash],
        stop: int | None = None,
        cap: int = NO_CAP,
        *,
        start: int = 0,
        parent: KVCacheBlock | None = None,
        exact: bool = False,
    ) -> TreeMatch:
        """The walk of loadOrAllocateBlocks over keys[start:stop] below `parent` (the root):
        full matches while they fit in `cap` tokens, then at most one partial match (with the
        tree's partial-reuse settings).

        `exact`: the walk of storeBlocks and the lookups instead: every block whose key equals
        the next key matches, full or not, and nothing matches partially (no cap).
        """
        parent = self.root if parent is None else parent
        stop = len(keys) if stop is None else min(stop, len(keys))
        tpb = self.tokens_per_block
        # A full match holds tokens_per_block tokens, so the cap bounds the full matches.
        limit = stop if exact else min(stop, start + max(0, cap) // tpb)
        blocks: list[KVCacheBlock] = []
        short = 0  # tokens the matched blocks that are not full lack
        if limit > start and parent.next_blocks:
            # The flat map names each candidate; the chain (parents), fullness and key confirm
            # it. Stops at the first miss: past it the chain cannot go on.
            by_hash = self.by_hash
            prev = parent
            for i in range(start, limit):
                block = by_hash.get(hashes[i])
                if block is None or block.prev_block is not prev:
                    break
                full = block.is_full
                if not (full or exact):  # not full: at best a partial match
                    break
                key = block.key
                # A key the request shares with the tree compares by identity.
                if key is not keys[i] and key != keys[i]:
                    break
                if not full:  # (exact) blocks that are not full match here too
                    short += tpb - len(key.tokens)
                blocks.append(block)
                prev = block
        num_tokens = len(blocks) * tpb - short
        pos = start + len(blocks)
        if blocks:
            parent = blocks[-1]
        # One block at a time from here: a miss in the flat map (or a chain it could not
        # confirm, after a hash collision) may still be a hit or a partial match below `parent`.
        find = self.find_matching_block
        partial_reuse = self.enable_partial_reuse and not exact
        copy = self.copy_on_partial_reuse
        while pos < stop:
            key = keys[pos]
            found_match = find(parent, key, hashes[pos], partial_reuse, copy)
            block = found_match.block
            if block is None or num_tokens + found_match.num_tokens > cap:
                break
            if found_match.partial and not exact:
                return TreeMatch(start, blocks, num_tokens, block, found_match.num_tokens)
            blocks.append(block)
            num_tokens += found_match.num_tokens
            parent = block
            pos += 1
        return TreeMatch(start, blocks, num_tokens, None, 0)

    def find_by_hash(self, block_hash: int) -> KVCacheBlock | None:
        return self.by_hash.get(block_hash)

    def find_by_key(self, key: BlockKey) -> KVCacheBlock | None:
        """The block at the end of `key`'s tokens cut into blocks, each matched below the last
        (partial matches allowed); the root itself for an empty key, as in the seed."""
        tpb = self.tokens_per_block
        node = self.root
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
            part_hash = BlockHash(block_key_hash(part, parent_hash))
            match = self.find_matching_block(node, part, part_hash, True, True).block
            if match is None:
                return None
            node, parent_hash = match, match.hash
        return node

    # -- changing the tree -----------------------------------------------------------------------

    def insert(self, parent: KVCacheBlock, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Hang `block` (its key already set) below `parent` under `block_hash`."""
        block.prev_block = parent
        block.prev_block_in_seq = parent
        block.hash = block_hash
        # A block whose hash collides with a sibling's hangs below its parent unindexed, as
        # before; the flat map only ever names blocks their parent indexes.
        if parent.next_blocks.setdefault(block_hash, block) is block:
            self.by_hash.setdefault(block_hash, block)

    def insert_chain(
        self,
        parent: KVCacheBlock,
        blocks: Sequence[KVCacheBlock],
        keys: Sequence[BlockKey],
        hashes: Sequence[BlockHash],
        removed: list[int],
    ) -> None:
        """storeBlocks' insertion: hang `blocks` one below the other under `parent`, block i
        with keys[i] and hashes[i] (as many as `blocks`).

        A block that is in the tree already was stored before under another key (a partial
        block that has grown since, or tokens rewritten after a rewind): its old entry, and
        anything below it, no longer describe its contents, so they leave the tree first, their
        hashes going to `removed`. (The seed keeps the stale entry and later fails to evict the
        parent.)"""
        tpb = self.tokens_per_block
        for block, key, block_hash in zip(blocks, keys, hashes, strict=False):
            if block.prev_block is not None or block.next_blocks:
                self.remove_subtree(block, removed)
            block.key = key
            block.is_full = len(key.tokens) == tpb
            self.insert(parent, block, block_hash)
            parent = block

    def remove_subtree(
        self,
        block: KVCacheBlock,
        removed: list[int],
        forget_keys: bool = False,
    ) -> int:
        """Drop `block` and its whole subtree from the tree, leaves first; returns how many
        blocks left it. The hashes of those that hold tokens and were in the tree go to
        `removed`, in order (the seed's Removed events). With `forget_keys` they also lose
        their keys (they hold nothing)."""
        if not block.next_blocks:
            if block.key.tokens and block.prev_block is not None:
                removed.append(block.hash)
            self._detach_leaf(block)
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
            if node.key.tokens and node.prev_block is not None:
                removed.append(node.hash)
            self._detach_leaf(node)
            if forget_keys:
                node.forget_key()
            count += 1
        return count

    def detach_leaf(self, block: KVCacheBlock) -> None:
        """freeLeafBlock: take a leaf out of the tree (a partial match taken over privately)."""
        if block.next_blocks:
            raise RuntimeError(f"block {block.block_id} is not a leaf")
        self._detach_leaf(block)

    def clear(self, removed: list[int]) -> int:
        """Drop every block from the tree (`remove_subtree` of each child of the root); returns
        how many left it."""
        return sum(
            self.remove_subtree(child, removed) for child in list(self.root.next_blocks.values())
        )

    def _detach_leaf(self, block: KVCacheBlock) -> None:
        parent = block.prev_block
        if parent is not None:
            block_hash = block.hash
            if parent.next_blocks.get(block_hash) is block:
                del parent.next_blocks[block_hash]
            if self.by_hash.get(block_hash) is block:
                del self.by_hash[block_hash]
            block.prev_block = None

    # -- reading the tree ------------------------------------------------------------------------

    def blocks(self) -> list[KVCacheBlock]:
        """Every block in the tree, pre-order: a block before its children."""
        out: list[KVCacheBlock] = []
        stack = list(self.root.next_blocks.values())
        while stack:
            block = stack.pop()
            out.append(block)
            stack.extend(block.next_blocks.values())
        return out

    def chain(self, block: KVCacheBlock) -> list[KVCacheBlock]:
        """`block` and its ancestors below the root, root side first."""
        chain: list[KVCacheBlock] = []
        node: KVCacheBlock | None = block
        while node is not None and node is not self.root:
            chain.append(node)
            node = node.prev_block
        chain.reverse()
        return chain

    def unheld_subtrees(self, is_held: Callable[[KVCacheBlock], bool]) -> list[KVCacheBlock]:
        """Roots of the largest subtrees in which no block is held; held blocks and their
        ancestors stay."""
        blocks = self.blocks()  # parents before children
        held: set[int] = set()
        for block in reversed(blocks):
            if is_held(block) or any(c.block_id in held for c in block.next_blocks.values()):
                held.add(block.block_id)
        root = self.root
        return [
            block
            for block in blocks
            if block.block_id not in held
            and (
                (parent := block.prev_block) is root
                or (parent is not None and parent.block_id in held)
            )
        ]
