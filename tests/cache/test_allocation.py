"""Scenarios A1, A3, G1, H9 and the ground rules of section 0 (R1, R5, R6)."""

from __future__ import annotations

import pytest

from cache import DuplicateRequestError, OutOfBlocksError, UnknownRequestError
from cache.request import chop_vector_into_blocks
from tests.cache.factories import add_tokens, ids, make_manager, req


def test_a1_beam_sharing_duplicate_id_and_exhaustion() -> None:
    mgr = make_manager(
        24, tokens_per_block=64, max_sequence_length=192, max_beam_width=8, enable_block_reuse=False
    )
    # prompt not block-aligned: 2 shared blocks + one last block per beam
    r = req(0, range(191), beam_width=8)
    mgr.add_sequence(r)
    assert mgr.get_num_free_blocks() == 14
    beams = mgr.get_cache_block_ids(0)
    assert [len(b) for b in beams] == [3] * 8
    assert len({i for b in beams for i in b}) == 10
    assert all(b[:2] == beams[0][:2] for b in beams)
    mgr.remove_sequence(0, r)
    assert mgr.get_num_free_blocks() == 24
    # block-aligned prompt: the last block is shared too
    r = req(1, range(192), beam_width=8)
    mgr.add_sequence(r)
    assert mgr.get_num_free_blocks() == 21
    beams = mgr.get_cache_block_ids(1)
    assert all(b == beams[0] for b in beams)
    mgr.remove_sequence(1, r)
    assert mgr.get_num_free_blocks() == 24
    # two sequences of 10 blocks fit; a duplicate id and a third sequence do not
    mgr.add_sequence(req(2, range(191), beam_width=8))
    mgr.add_sequence(req(3, range(191), beam_width=8))
    assert mgr.get_num_free_blocks() == 4
    with pytest.raises(DuplicateRequestError, match="request id 3 is already live"):
        mgr.add_sequence(req(3, range(191), beam_width=8))
    with pytest.raises(OutOfBlocksError, match="request 4 needs 10 blocks in window 192, 4 free"):
        mgr.add_sequence(req(4, range(191), beam_width=8))
    assert mgr.get_num_free_blocks() == 4
    assert mgr.verify_queue_integrity()


@pytest.mark.parametrize("reuse", [False, True])
def test_a3_rewind_tokens(reuse: bool) -> None:
    mgr = make_manager(
        80, tokens_per_block=64, max_sequence_length=640, num_layers=4, enable_block_reuse=reuse
    )
    r = req(0, range(575))
    mgr.add_sequence(r)
    assert mgr.get_num_allocated_blocks() == 9
    add_tokens(mgr, r, [575])
    assert mgr.get_num_allocated_blocks() == 9
    add_tokens(mgr, r, [576])
    assert mgr.get_num_allocated_blocks() == 10
    add_tokens(mgr, r, [577, 578, 579])
    assert mgr.get_num_allocated_blocks() == 10
    assert mgr.get_num_tokens(0) == 580
    mgr.rewind_kv_cache(0, 4)
    assert mgr.get_num_tokens(0) == 576
    assert mgr.get_num_allocated_blocks() == 9
    mgr.remove_sequence(0)
    for rid in range(1, 9):
        s = req(rid, range(rid * 1000, rid * 1000 + 575))
        used = mgr.get_num_allocated_blocks()
        mgr.add_sequence(s)
        assert mgr.get_num_allocated_blocks() == used + 9
        add_tokens(mgr, s, [1, 2])
        assert mgr.get_num_allocated_blocks() == used + 10
        mgr.rewind_kv_cache(rid, 2)
        assert mgr.get_num_allocated_blocks() == used + 9
    assert mgr.get_num_allocated_blocks() == 72
    assert mgr.verify_queue_integrity()


def test_rewound_block_goes_to_the_front_of_the_free_queue() -> None:
    mgr = make_manager(8, enable_block_reuse=False)
    r = req(0, range(4))
    mgr.add_sequence(r)
    add_tokens(mgr, r, [4])  # 5 tokens: a second block
    assert ids(mgr, 0) == [0, 1]
    mgr.rewind_kv_cache(0, 1)
    assert ids(mgr, 0) == [0]
    assert mgr.windows[1024].policy.free_order(0) == [1, 2, 3, 4, 5, 6, 7]
    with pytest.raises(UnknownRequestError, match="request id 9"):
        mgr.rewind_kv_cache(9, 1)


def test_g1_pin_and_unpin_blocks_by_id() -> None:
    mgr = make_manager(4)
    r = req(0, range(8))
    mgr.add_sequence(r)
    assert mgr.get_num_free_blocks() == 2
    mgr.pin_blocks(0)
    assert mgr.get_last_block_id(0) == 1
    pinned = ids(mgr, 0)
    mgr.remove_sequence(0, r)
    assert mgr.get_num_free_blocks() == 2
    mgr.unpin_blocks_by_id(pinned)
    assert mgr.get_num_free_blocks() == 4
    assert mgr.verify_queue_integrity()


def test_store_for_reuse_with_pin_creates_no_ghost_free_blocks() -> None:
    mgr = make_manager(4)
    r = req(0, range(8))
    mgr.add_sequence(r)
    pinned = mgr.store_blocks_for_reuse(0, r, pin_blocks=True)
    assert pinned == [0, 1]
    mgr.remove_sequence(0, r)
    assert mgr.get_num_free_blocks() == 2
    with pytest.raises(ValueError, match=r"block id 7 is out of range 0\.\.3"):
        mgr.unpin_blocks_by_id([0, 7])
    assert mgr.get_num_free_blocks() == 2  # the bad call changed nothing
    mgr.unpin_blocks_by_id(pinned)
    assert mgr.get_num_free_blocks() == 4
    with pytest.raises(ValueError, match="block 0 is not pinned"):
        mgr.unpin_blocks_by_id([0])


def test_remove_sequence_can_pin_what_it_stores() -> None:
    mgr = make_manager(4)
    r = req(0, range(8))
    mgr.add_sequence(r)
    pinned = mgr.remove_sequence(0, r, pin_blocks=True)
    assert pinned == [0, 1]
    assert mgr.get_num_free_blocks() == 2
    mgr.unpin_blocks_by_id(pinned)
    assert mgr.get_num_free_blocks() == 4


def test_h9_chop_vector_into_blocks() -> None:
    items = list(range(10))
    assert chop_vector_into_blocks(items, 10, 4, False) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert chop_vector_into_blocks(items, 10, 4, True) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert chop_vector_into_blocks(items, 7, 4, True) == [[0, 1, 2, 3], [4, 5, 6]]


def test_r1_last_token_is_never_matched_and_the_empty_key() -> None:
    mgr = make_manager(8)
    r = req(0, range(8))
    mgr.add_sequence(r)
    mgr.remove_sequence(0, r)  # stores [0-3] and [4, 5, 6]: token 7 has no KV state
    tree = sorted(b.tokens for b in mgr.windows[1024].tree_blocks())
    assert tree == [(0, 1, 2, 3), (4, 5, 6)]
    # 9 tokens: two full keys and the empty key, which never matches
    r = req(1, range(9))
    assert mgr.add_sequence(r) == 7
    assert len(ids(mgr, 1)) == 3


def test_r5_release_order_puts_leaves_before_parents() -> None:
    mgr = make_manager(6)
    r = req(0, range(12))
    mgr.add_sequence(r)
    assert ids(mgr, 0) == [0, 1, 2]
    mgr.remove_sequence(0, r)
    assert mgr.windows[1024].policy.free_order(0) == [3, 4, 5, 2, 1, 0]


def test_r6_stats_count_takes_from_the_pool() -> None:
    mgr = make_manager(8)
    a = req(0, range(12))
    mgr.add_sequence(a)
    mgr.remove_sequence(0, a)
    b = req(1, [0, 1, 2, 3, 4, 5, 9, 9, 9, 9, 9, 9])
    assert mgr.add_sequence(b) == 6  # one full block, then 2 tokens of [4, 5, 6, 7]
    # block 1 has a child, so its two tokens are copied into a fresh block
    assert (b.reused_blocks, b.missed_blocks, b.alloc_total_blocks, b.alloc_new_blocks) == (
        2,
        1,
        2,
        2,
    )
    stats = mgr.get_kv_cache_stats()
    assert (stats.alloc_total_blocks, stats.alloc_new_blocks) == (5, 5)
    assert (stats.reused_blocks, stats.missed_blocks) == (2, 4)
    assert stats.used_num_blocks == 3
    assert stats.num_free_blocks_per_window_size == {1024: 5}


def test_a_block_stored_partial_and_grown_is_stored_again_cleanly() -> None:
    """store_blocks_for_reuse on a live sequence stores its partial last block; when that block
    fills up and is stored again, its old entry goes (reported removed) and eviction works."""
    mgr = make_manager(4, events=64)
    r = req(0, range(7))
    mgr.add_sequence(r)
    mgr.store_blocks_for_reuse(0, r)  # [0-3] and the partial [4, 5]
    stored = [e for e in mgr.take_events() if e.type == "stored"]
    old_hash = stored[0].data.blocks[1].block_hash  # type: ignore[union-attr]
    add_tokens(mgr, r, [7, 8])  # the block now holds [4, 5, 6, 7]
    mgr.remove_sequence(0, r)
    events = [e.to_dict()["data"] for e in mgr.take_events()]
    assert [e["type"] for e in events] == ["removed", "stored"]
    assert events[0]["block_hashes"] == [old_hash]
    assert [len(b["tokens"]) for b in events[1]["blocks"]] == [4]
    assert len(mgr.windows[1024].blocks[0].next_blocks) == 1
    mgr.add_sequence(req(1, range(100, 116)))  # evicts both: no stale entry left behind
    assert mgr.windows[1024].tree_blocks() == []


def test_request_remove_tokens_trims_cached_keys_and_hashes() -> None:
    r = req(0, range(12))
    assert len(r.block_keys(4, 12, False)) == 3
    r.remove_tokens(5)
    for t in (70, 71, 72, 73, 74):
        r.add_new_token(t)
    keys = r.block_keys(4, 12, False)
    assert [k.tokens for k in keys] == [(0, 1, 2, 3), (4, 5, 6, 70), (71, 72, 73, 74)]
    fresh = req(1, [*range(7), 70, 71, 72, 73, 74])
    assert r.block_hashes(4, 12, False) == fresh.block_hashes(4, 12, False)
    with pytest.raises(ValueError, match="cannot remove 13 of 12 tokens"):
        r.remove_tokens(13)
