"""Scenario D4: offload of evicted blocks to the secondary level and onboard on reuse."""

from __future__ import annotations

from typing import Any

from cache import KVCacheManager, RetentionConfig, TokenRangeRetention
from cache.eviction import PRIMARY_LEVEL, SECONDARY_LEVEL
from cache.transfer import RecordingTransferEngine, Slot, TransferRecord
from tests.cache.factories import drain, ids, make_manager, req


def test_offload_swaps_slots_and_reports_the_move() -> None:
    engine = RecordingTransferEngine()
    mgr = make_manager(4, 2, events=64, transfer_engine=engine)
    a = req(0, range(9))  # stores [0-3], [4-7]; block 2 (empty key) is freed
    mgr.add_sequence(a)
    mgr.remove_sequence(0, a)
    tree = {b.block_id: b.hash for b in mgr.windows[1024].tree_blocks()}
    assert sorted(tree) == [0, 1]
    drain(mgr)
    # a 13-token stranger needs all four primary blocks: the cached two are offloaded
    b = req(1, range(100, 113))
    mgr.add_sequence(b)
    assert ids(mgr, 1) == [3, 2, 4, 5]
    assert engine.records == [
        TransferRecord("offload", Slot(1, True), Slot(0, False), 0),
        TransferRecord("offload", Slot(0, True), Slot(1, False), 0),
    ]
    wm = mgr.windows[1024]
    # the cached blocks kept their ids and tree places; their slots moved to the host pool
    assert [(wm.blocks[i].is_primary, wm.blocks[i].memory_index) for i in (0, 1)] == [
        (False, 1),
        (False, 0),
    ]
    assert [(wm.blocks[i].is_primary, wm.blocks[i].memory_index) for i in (4, 5)] == [
        (True, 1),
        (True, 0),
    ]
    assert [e["data"]["cache_level"] for e in drain(mgr)] == [
        {"type": "event_diff", "old_value": 0, "new_value": 1}
    ] * 2
    assert wm.policy.free_order(SECONDARY_LEVEL) == [1, 0]
    # reuse onboards them again, in match order
    mgr.remove_sequence(1)
    c = req(2, range(9))
    assert mgr.add_sequence(c) == 8
    # Each onboard takes a primary block; a victim that still holds tokens (request 1's, never
    # stored) is itself offloaded first, as in the seed, though it is not in the tree.
    assert engine.records[2:] == [
        TransferRecord("onboard", Slot(1, False), Slot(0, True), 0),
        TransferRecord("offload", Slot(1, True), Slot(1, False), 0),
        TransferRecord("onboard", Slot(0, False), Slot(1, True), 0),
        TransferRecord("offload", Slot(2, True), Slot(1, False), 0),
    ]
    events = drain(mgr)
    assert [
        (e["data"]["block_hash"], e["data"]["cache_level"]["old_value"])
        for e in events
        if e["data"]["type"] == "updated"
    ] == [(tree[0], 1), (tree[1], 1)]
    assert ids(mgr, 2)[:2] == [0, 1]
    assert all(mgr.windows[1024].blocks[i].is_primary for i in (0, 1))
    assert mgr.verify_queue_integrity()


def test_low_priority_blocks_are_dropped_not_offloaded() -> None:
    engine = RecordingTransferEngine()
    mgr = make_manager(4, 2, events=64, transfer_engine=engine)
    low = RetentionConfig(ranges=[TokenRangeRetention(0, None, 10)])
    a = req(0, range(9), retention=low)
    mgr.add_sequence(a)
    mgr.remove_sequence(0, a)
    drain(mgr)
    mgr.add_sequence(req(1, range(100, 113)))
    assert engine.records == []
    removed = [e["data"] for e in drain(mgr) if e["data"]["type"] == "removed"]
    assert len(removed) == 1 and len(removed[0]["block_hashes"]) == 2  # appended to one event


def test_no_offload_without_onboarding_or_secondary_pool() -> None:
    for kwargs in ({"onboard_blocks": False}, {}):
        engine = RecordingTransferEngine()
        secondary = 2 if kwargs else 0
        mgr = make_manager(4, secondary, events=64, transfer_engine=engine, **kwargs)
        a = req(0, range(9))
        mgr.add_sequence(a)
        mgr.remove_sequence(0, a)
        drain(mgr)
        mgr.add_sequence(req(1, range(100, 113)))
        assert engine.records == []
        assert [e["data"]["type"] for e in drain(mgr)] == ["removed"]


def test_custom_offload_threshold() -> None:
    engine = RecordingTransferEngine()
    mgr = make_manager(4, 2, transfer_engine=engine, secondary_offload_min_priority=40)
    a = req(0, range(9))  # default priority 35 < 40
    mgr.add_sequence(a)
    mgr.remove_sequence(0, a)
    mgr.add_sequence(req(1, range(100, 113)))
    assert engine.records == []


def test_partial_copy_is_issued_for_a_shared_block() -> None:
    """B2 without data: the copy job (src, dst, tokens) and dst as the request's block."""
    engine = RecordingTransferEngine()
    mgr = make_manager(8, tokens_per_block=8, transfer_engine=engine)
    a = req(0, range(17))
    mgr.add_sequence(a)
    mgr.store_context_blocks(a)  # blocks 0 and 1 stored; block 1 stays held by `a`
    b = req(1, range(12))
    assert mgr.add_sequence(b) == 11
    assert ids(mgr, 1) == [0, 3]
    assert engine.records == [TransferRecord("copy", Slot(1, True), Slot(3, True), 3)]


LOW = RetentionConfig(ranges=[TokenRangeRetention(0, None, 10)])


def _onboard_next_to_a_pinned_block(mgr: KVCacheManager) -> list[dict[str, Any]]:
    """Request 0's prefix [1-4][5-8] cached, [1-4] offloaded, [5-8] pinned, 2 primary free.

    Every window of `mgr` must start with 6 primary and 2 secondary blocks (window 32 may have
    one more primary block); returns the events of the setup."""
    a = req(0, range(1, 10))
    mgr.add_sequence(a)
    assert mgr.remove_sequence(0, a, pin_blocks=True) == [0, 1]
    mgr.unpin_blocks_by_id([0])  # [1-4] free and cached; [5-8] stays pinned
    low = req(1, range(100, 120), retention=LOW)  # five blocks: the fifth victim is [1-4]
    mgr.add_sequence(low)
    assert ids(mgr, 1) == [3, 4, 5, 2, 6]
    mgr.remove_sequence(1)  # not stored: five empty blocks at priority 10
    mgr.add_sequence(req(2, range(200, 209)))
    assert ids(mgr, 2) == [6, 2, 5]
    return drain(mgr)


def test_onboard_next_to_a_referenced_block_needs_two_blocks() -> None:
    """The seed needs 2 free blocks: one to onboard [1-4] (its getFreeBlock cannot take the
    pinned [5-8], which is only claimed) and one for the empty tail key; it admits the request
    with 8 tokens reused. The dry run used to count [5-8] too, once an onboard had happened."""
    engine = RecordingTransferEngine()
    mgr = make_manager(6, 2, events=64, transfer_engine=engine)
    setup = _onboard_next_to_a_pinned_block(mgr)
    wm = mgr.windows[1024]
    b0, b1 = wm.blocks[0].hash, wm.blocks[1].hash
    assert [e["data"]["type"] for e in setup] == [
        "created",
        "stored",
        "updated",  # [1-4] offloaded when request 1 took its primary block
    ]
    assert setup[2]["data"]["block_hash"] == b0
    assert (wm.blocks[0].is_primary, wm.get_num_free_blocks()) == (False, 2)
    assert wm.policy.free_order(PRIMARY_LEVEL) == [4, 3]
    assert wm.policy.free_order(SECONDARY_LEVEL) == [7, 0]

    d = req(3, range(1, 10))
    assert mgr.add_sequence(d) == 8
    assert d.prepopulated_prompt_len == 8
    assert ids(mgr, 3) == [0, 1, 3]
    # both blocks taken held request 1's keys (never stored): allocated, but not new
    assert (d.reused_blocks, d.missed_blocks, d.alloc_total_blocks, d.alloc_new_blocks) == (
        2,
        1,
        2,
        0,
    )
    assert mgr.get_num_free_blocks() == 0
    assert [wm.blocks[i].ref_count for i in (0, 1, 3)] == [1, 2, 1]
    assert (wm.blocks[0].is_primary, wm.blocks[0].memory_index) == (True, 4)
    assert wm.policy.free_order(SECONDARY_LEVEL) == [7, 4]
    assert engine.records[-1:] == [TransferRecord("onboard", Slot(0, False), Slot(4, True), 0)]
    assert drain(mgr) == [
        {
            "event_id": 3,
            "data": {
                "type": "updated",
                "block_hash": b0,
                "cache_level": {"type": "event_diff", "new_value": 0, "old_value": 1},
                "priority": None,
            },
            "window_size": 1024,
        }
    ]
    assert {b.block_id for b in wm.tree_blocks()} == {0, 1}
    assert b1 == wm.blocks[1].hash
    assert mgr.verify_queue_integrity()


def test_onboard_in_one_window_leaves_the_next_window_exact() -> None:
    """After an onboard in window 16, window 32 is still counted exactly: there [1-4] and
    [5-8] are both pinned (the unpin reached window 16 only) and the request needs one block."""
    mgr = KVCacheManager(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        tokens_per_block=4,
        blocks_per_window={16: (6, 2), 32: (7, 2)},
        max_attention_window=[16, 32],
        max_sequence_length=32,
        event_buffer_max_size=64,
        allocate_pools=False,
    )
    _onboard_next_to_a_pinned_block(mgr)
    w16, w32 = mgr.windows[16], mgr.windows[32]
    assert [w16.get_num_free_blocks(), w32.get_num_free_blocks()] == [2, 2]
    assert mgr.get_cache_block_ids(2, 32) == [[2, 6, 5]]
    assert [w32.blocks[i].ref_count for i in (0, 1)] == [1, 1]

    d = req(3, range(1, 10))
    assert mgr.add_sequence(d) == 8
    assert mgr.get_cache_block_ids(3, 16) == [[0, 1, 3]]
    assert mgr.get_cache_block_ids(3, 32) == [[0, 1, 4]]
    assert [w16.get_num_free_blocks(), w32.get_num_free_blocks()] == [0, 1]
    assert [e["data"]["type"] for e in drain(mgr)] == ["updated"]
    assert mgr.verify_queue_integrity()
