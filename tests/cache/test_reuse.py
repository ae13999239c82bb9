"""Scenarios B1, B3, B9, B10 of TRTLLM_SCENARIOS.md: the reuse walk, exactly."""

from __future__ import annotations

from typing import Any

from cache import BlockKey, KVCacheManager, LlmRequest
from tests.cache.factories import add_tokens, drain, ids, make_manager, req


def test_b1_block_manager_reuse_walk() -> None:
    mgr = make_manager(8)
    # 1. first request: nothing to reuse
    a = req(0, range(9))
    assert mgr.add_sequence(a) == 0
    assert ids(mgr, 0) == [0, 1, 2]
    add_tokens(mgr, a, [9, 10])
    assert (mgr.get_num_allocated_blocks(), mgr.get_num_free_blocks()) == (3, 5)
    # 2. release stores [0-3], [4-7], [8, 9]
    mgr.remove_sequence(0, a)
    assert (mgr.get_num_allocated_blocks(), mgr.get_num_free_blocks()) == (0, 8)
    # 3. same prompt: two full blocks reused, the empty third key misses
    b = req(1, range(9))
    assert mgr.add_sequence(b) == 8
    assert ids(mgr, 1) == [0, 1, 3]
    add_tokens(mgr, b, [9, 10])
    assert mgr.get_num_free_blocks() == 5
    # 4. B's third block duplicates block 2: freed, not stored
    mgr.remove_sequence(1, b)
    assert mgr.get_num_free_blocks() == 8
    # 5. C's key [8] partially matches the free leaf block 2, which it takes over
    c = req(2, range(10))
    assert mgr.add_sequence(c) == 9
    assert ids(mgr, 2) == [0, 1, 2]
    assert mgr.get_num_free_blocks() == 5
    # 6. block 2 has left the tree
    d = req(3, range(11))
    assert mgr.add_sequence(d) == 8
    assert ids(mgr, 3) == [0, 1, 4]
    add_tokens(mgr, d, [11])
    assert (mgr.get_num_allocated_blocks(), mgr.get_num_free_blocks()) == (4, 4)
    # 7.
    mgr.remove_sequence(2, c)
    assert mgr.get_num_free_blocks() == 5
    mgr.remove_sequence(3, d)
    assert mgr.get_num_free_blocks() == 8
    # 8. 5 tokens: one full block and the empty key
    e = req(4, range(5))
    assert mgr.add_sequence(e) == 4
    assert ids(mgr, 4) == [0, 5]
    add_tokens(mgr, e, [5])
    assert (mgr.get_num_allocated_blocks(), mgr.get_num_free_blocks()) == (2, 6)
    # 9. F's third key [8, 9] best-matches block 4 (2 tokens)
    f = req(5, [*range(10), 11])
    assert mgr.add_sequence(f) == 10
    assert ids(mgr, 5) == [0, 1, 4]
    add_tokens(mgr, f, [12])
    assert (mgr.get_num_allocated_blocks(), mgr.get_num_free_blocks()) == (4, 4)
    # 10.
    mgr.remove_sequence(4, e)
    mgr.remove_sequence(5, f)
    assert mgr.get_num_free_blocks() == 8
    # 11.
    g = req(6, [*range(10), 12])
    assert mgr.add_sequence(g) == 10
    assert ids(mgr, 6) == [0, 1, 4]
    assert (mgr.get_num_allocated_blocks(), mgr.get_num_free_blocks()) == (3, 5)
    # 12. release with a shorter token list: only [0-3], [4-7] considered
    mgr.remove_sequence(6, req(6, range(9)))
    assert mgr.get_num_free_blocks() == 8
    # 13. block 4 is no longer matchable; [8, 9] partially matches block 2 ([8])
    g2 = req(7, [*range(10), 12])
    assert mgr.add_sequence(g2) == 9
    assert ids(mgr, 7) == [0, 1, 2]
    mgr.remove_sequence(7, g2)
    # 14. incidental reuse: [0, 0, 0, 0] shares one token with [0, 1, 2, 3], which has children
    zeros = req(8, [0] * 31)
    assert mgr.add_sequence(zeros) == 1
    assert mgr.get_num_free_blocks() == 0
    mgr.remove_sequence(8, zeros)
    assert mgr.get_num_free_blocks() == 8
    # 15. one token: nothing reusable
    one = req(9, [0])
    assert mgr.add_sequence(one) == 0
    assert mgr.get_num_allocated_blocks() == 1
    assert mgr.verify_queue_integrity()


def test_b3_find_blocks_in_reuse_tree_by_block_key() -> None:
    mgr = make_manager(8, tokens_per_block=8)
    r = req(0, range(17))
    mgr.add_sequence(r)
    first, second = ids(mgr, 0)[:2]
    mgr.remove_sequence(0, r)
    found = mgr.find_blocks_in_reuse_tree_by_block_key(BlockKey(tokens=range(16)))
    assert found is not None
    assert found.block_id == second
    assert found.prev_block.block_id == first
    assert found.prev_block.prev_block.block_id == -1
    assert found.prev_block.prev_block.prev_block is None


def test_b9_per_request_stats() -> None:
    mgr = make_manager(16)
    first = req(0, range(9))
    mgr.add_sequence(first)
    counts = (
        first.reused_blocks,
        first.alloc_total_blocks,
        first.alloc_new_blocks,
        first.missed_blocks,
    )
    assert counts == (0, 3, 3, 3)
    mgr.remove_sequence(0, first)
    again = req(1, range(9))
    mgr.add_sequence(again)
    counts = (
        again.reused_blocks,
        again.alloc_total_blocks,
        again.alloc_new_blocks,
        again.missed_blocks,
    )
    assert counts == (2, 1, 1, 1)
    stats = mgr.get_kv_cache_stats()
    assert (stats.reused_blocks, stats.missed_blocks) == (2, 4)
    assert stats.cache_hit_rate == 2 / 6


def test_b10_prefix_sharing_behaviour() -> None:
    mgr = make_manager(32)
    r = req(0, range(8))
    assert mgr.add_sequence(r) == 0
    mgr.remove_sequence(0, r)
    # identical prompt: everything but the last token
    r = req(1, range(8))
    assert mgr.add_sequence(r) == 7
    mgr.remove_sequence(1, r)
    # different tokens
    r = req(2, range(100, 108))
    assert mgr.add_sequence(r) == 0
    mgr.remove_sequence(2, r)
    # shares the first block only
    r = req(3, [0, 1, 2, 3, 50, 51, 52, 53])
    assert mgr.add_sequence(r) == 4
    mgr.remove_sequence(3, r)
    # two live requests sharing a two-block prefix use fewer than six blocks
    before = mgr.get_num_free_blocks()
    x, y = req(4, [*range(8), 8, 9, 10, 11]), req(5, [*range(8), 20, 21, 22, 23])
    mgr.add_sequence(x)
    mgr.add_sequence(y)
    assert before - mgr.get_num_free_blocks() < 6
    mgr.remove_sequence(4, x)
    mgr.remove_sequence(5, y)
    # a cached stem serves two continuations
    for rid, tail in ((6, [10, 11, 12, 13]), (7, [20, 21, 22, 23])):
        r = req(rid, [*range(8), *tail])
        assert mgr.add_sequence(r) >= 7
        mgr.remove_sequence(rid, r)
    # reset forgets the tree
    mgr.reset_reuse_state()
    r = req(8, range(8))
    assert mgr.add_sequence(r) == 0
    mgr.remove_sequence(8, r)
    # 20 rapid cycles leave every block free
    for i in range(20):
        r = req(100 + i, range(i, i + 13))
        mgr.add_sequence(r)
        assert mgr.get_num_free_blocks() + mgr.get_num_allocated_blocks() == 32
        mgr.remove_sequence(100 + i, r)
    assert mgr.get_num_free_blocks() == 32
    assert mgr.verify_queue_integrity()


# -- storing again what a request stored as it went (cache/store.py: `_last_stored`) --------------


def _stored(events: list[dict[str, Any]]) -> list[tuple[int | None, list[list[int]]]]:
    """Each stored event's parent hash and its blocks' tokens."""
    return [
        (
            e["data"]["parent_hash"],
            [[t["token_id"] for t in b["tokens"]] for b in e["data"]["blocks"]],
        )
        for e in events
        if e["data"]["type"] == "stored"
    ]


def _prefilled(mgr: KVCacheManager, request: LlmRequest) -> int:
    """Add `request` (9-11 tokens from 0) and store its prompt's full blocks, [0-3] [4-7], as
    one Stored event; the hash of [4-7]."""
    mgr.add_sequence(request)
    mgr.store_context_blocks(request)
    events = drain(mgr)
    assert _stored(events) == [(None, [[0, 1, 2, 3], [4, 5, 6, 7]])]
    h_4_7: int = events[0]["data"]["blocks"][1]["block_hash"]
    return h_4_7


def test_a_release_goes_on_below_its_last_stored_block_and_keeps_anothers_block_there() -> None:
    mgr = make_manager(8, events=64)
    drain(mgr)
    # B stores [0-3] [4-7] at prefill (blocks 0, 1)
    b = req(1, range(9))
    h_4_7 = _prefilled(mgr, b)
    # A reuses them and stores its own [8-11] (block 3) below block 1
    a = req(0, range(13))
    assert mgr.add_sequence(a) == 8
    assert ids(mgr, 0) == [0, 1, 3, 4]
    mgr.store_context_blocks(a)
    assert _stored(drain(mgr)) == [(h_4_7, [[8, 9, 10, 11]])]
    # B computes [8-11] too (its block 2) and leaves: block 1 is its last block in the tree,
    # and below it [8-11] is A's block already, so B stores nothing and frees 2 and 5
    add_tokens(mgr, b, [9, 10, 11, 12])
    assert ids(mgr, 1) == [0, 1, 2, 5]
    mgr.remove_sequence(1, b)
    assert drain(mgr) == []
    assert mgr.get_num_free_blocks() == 4
    # the tree holds A's chain: a new request reuses blocks 0, 1, 3
    c = req(2, range(13))
    assert mgr.add_sequence(c) == 12
    assert ids(mgr, 2)[:3] == [0, 1, 3]


def test_a_release_with_pins_pins_the_whole_chain_from_the_root() -> None:
    mgr = make_manager(8, events=64)
    drain(mgr)
    a = req(0, range(10))
    h_4_7 = _prefilled(mgr, a)
    add_tokens(mgr, a, [10])
    # stored from block 1 on (its partial tail [8, 9]), pinned from the root: 0, 1, then 2
    assert mgr.remove_sequence(0, a, pin_blocks=True) == [0, 1, 2]
    assert _stored(drain(mgr)) == [(h_4_7, [[8, 9]])]
    assert mgr.get_num_free_blocks() == 5
