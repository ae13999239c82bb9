"""Scenario D4: offload of evicted blocks to the secondary level and onboard on reuse."""

from __future__ import annotations

from cache import RetentionConfig, TokenRangeRetention
from cache.eviction import SECONDARY_LEVEL
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
