"""ReuseTree: the one walk over the flat hash map, confirmed against the per-node children."""

from __future__ import annotations

from cache.block import KVCacheBlock
from cache.hashing import BlockHash, BlockKey
from cache.radix import ReuseTree

TPB = 2


def key(*tokens: int) -> BlockKey:
    return BlockKey(tokens)


def grow(tree: ReuseTree, parent: KVCacheBlock, block_id: int, k: BlockKey, h: int) -> KVCacheBlock:
    block = KVCacheBlock(block_id, block_id, True)
    block.set_block_key(k, len(k.tokens) == TPB)
    tree.insert(parent, block, BlockHash(h))
    return block


def test_a_chain_is_matched_through_the_flat_map_and_confirmed() -> None:
    tree = ReuseTree(TPB, enable_partial_reuse=True, copy_on_partial_reuse=True)
    a = grow(tree, tree.root, 0, key(1, 2), 10)
    b = grow(tree, a, 1, key(3, 4), 11)
    c = grow(tree, b, 2, key(5), 12)  # not full: a partial match at best
    keys = [key(1, 2), key(3, 4), key(5)]
    hashes = [BlockHash(h) for h in (10, 11, 12)]
    match = tree.match(keys, hashes)
    assert (match.blocks, match.num_tokens, match.partial, match.num_partial_tokens) == (
        [a, b],
        4,
        c,
        1,
    )
    assert tree.match(keys, hashes, cap=3).blocks == [a]  # a second full block exceeds the cap
    exact = tree.match(keys, hashes, exact=True)  # storeBlocks: any equal key matches
    assert (exact.blocks, exact.num_tokens, exact.partial) == ([a, b, c], 5, None)
    assert tree.by_hash == {10: a, 11: b, 12: c}


def test_a_hash_collision_is_a_miss_and_the_children_are_walked() -> None:
    """Equal chained hashes with different keys: the flat map names one block; the walk
    confirms keys and parents, and falls back to the per-node children where they fail."""
    tree = ReuseTree(TPB, enable_partial_reuse=False, copy_on_partial_reuse=False)
    a = grow(tree, tree.root, 0, key(1, 2), 10)
    other = grow(tree, tree.root, 1, key(7, 7), 20)
    b = grow(tree, a, 2, key(3, 4), 30)
    clash = grow(tree, other, 3, key(9, 9), 30)  # same hash, another parent and key
    assert tree.by_hash[30] is b and other.next_blocks[30] is clash
    assert tree.match([key(7, 7), key(9, 9)], [BlockHash(20), BlockHash(30)]).blocks == [
        other,
        clash,
    ]
    assert tree.match([key(1, 2), key(9, 9)], [BlockHash(10), BlockHash(30)]).blocks == [a]
    # leaving the tree takes a block out of the flat map only if the map names it
    removed: list[int] = []
    assert tree.remove_subtree(other, removed) == 2
    assert removed == [30, 20]
    assert tree.by_hash == {10: a, 30: b}
    assert tree.blocks() == [a, b]


def test_insert_chain_moves_a_block_stored_under_another_key_and_clear_empties_the_tree() -> None:
    """storeBlocks' insertion: a block already in the tree (stored before under another key)
    leaves it with its subtree first, reported removed; `clear` drops everything, leaves first."""
    tree = ReuseTree(TPB, enable_partial_reuse=True, copy_on_partial_reuse=True)
    a = grow(tree, tree.root, 0, key(1, 2), 10)
    b = grow(tree, a, 1, key(3), 11)  # a partial block that grows later
    c = grow(tree, b, 2, key(9, 9), 12)
    removed: list[int] = []
    tree.insert_chain(a, [b], [key(3, 4)], [BlockHash(13)], removed)
    assert removed == [12, 11]  # b's old entry and its subtree
    assert (b.key, b.is_full, b.hash, b.prev_block) == (key(3, 4), True, 13, a)
    assert tree.by_hash == {10: a, 13: b} and c.prev_block is None
    assert tree.match([key(1, 2), key(3, 4)], [BlockHash(10), BlockHash(13)]).blocks == [a, b]
    d = KVCacheBlock(3, 3, True)
    tree.insert_chain(b, [d], [key(5)], [BlockHash(14)], removed)
    assert removed == [12, 11] and tree.blocks() == [a, b, d] and not d.is_full
    assert tree.clear(removed) == 3
    assert removed == [12, 11, 14, 13, 10]
    assert tree.by_hash == {} and tree.blocks() == [] and a.prev_block is None
