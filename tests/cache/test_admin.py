"""The worker's admin calls: clear_reusable_blocks, offload_reusable_blocks, pin_blocks_by_hash
and find_block_by_hash (exact block ids, events in order, free counts, later reuse).

Every test starts from the same reuse tree (window 32, 4 tokens per block):

    root -> [0-3] (block 0) -> [4-7] (block 1) -> [8-11] (block 2)
                            -> [9, 9, 9, 9] (block 4)

with primary free order [6, 7, 3, 2, 1, 5, 4, 0] (blocks 3 and 5 hold the empty-key tails).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cache import KVCacheManager, PinConflictError, UnknownBlockError
from cache.eviction import PRIMARY_LEVEL
from cache.window import WindowBlockManager
from tests.cache.factories import drain, ids, make_manager, req
from tests.cache.test_events import level_update

W = 32
H_0_3 = 733356887393045
H_4_7 = 6310903394565074474  # below H_0_3
H_8_11 = 13650271627978399492  # below H_4_7
H_9999 = 6310088215681156729  # below H_0_3
PROMPT = range(13)  # [0-3], [4-7], [8-11] and one token: 12 tokens reusable


def build(secondary: int = 0, **kwargs: Any) -> tuple[KVCacheManager, WindowBlockManager]:
    mgr = make_manager(8, secondary, max_sequence_length=W, events=256, **kwargs)
    a = req(0, PROMPT)
    mgr.add_sequence(a)
    mgr.remove_sequence(0, a)
    b = req(1, [0, 1, 2, 3, 9, 9, 9, 9, 5])
    mgr.add_sequence(b)
    mgr.remove_sequence(1, b)
    events = drain(mgr)
    assert [e["event_id"] for e in events] == [0, 1, 2]  # created, stored x2
    wm = mgr.windows[W]
    assert {b.block_id: b.hash for b in wm.tree_blocks()} == {
        0: H_0_3,
        1: H_4_7,
        2: H_8_11,
        4: H_9999,
    }
    assert wm.policy.free_order(PRIMARY_LEVEL) == [6, 7, 3, 2, 1, 5, 4, 0]
    assert mgr.get_num_free_blocks() == 8
    return mgr, wm


def removed(event_id: int, *hashes: int) -> dict[str, Any]:
    return {
        "event_id": event_id,
        "data": {"type": "removed", "block_hashes": list(hashes)},
        "window_size": W,
    }


def moved(event_id: int, h: int, old: int, new: int) -> dict[str, Any]:
    return level_update(event_id, h, old, new, window_size=W)


def found(mgr: KVCacheManager, *hashes: int) -> list[int | None]:
    """The block id holding each hash in the reuse tree (None where none does)."""
    out: list[int | None] = []
    for h in hashes:
        block = mgr.find_block_by_hash(h)
        out.append(None if block is None else block.block_id)
    return out


def slots(wm: WindowBlockManager, *block_ids: int) -> list[tuple[bool, int]]:
    return [(wm.blocks[i].is_primary, wm.blocks[i].memory_index) for i in block_ids]


# -- find_block_by_hash ----------------------------------------------------------------------------


def test_find_block_by_hash() -> None:
    mgr, wm = build()
    assert found(mgr, H_0_3, H_4_7, H_8_11, H_9999) == [0, 1, 2, 4]
    assert mgr.find_block_by_hash(H_8_11) is wm.blocks[2]
    assert mgr.find_block_by_hash(12345) is None
    assert mgr.find_block_by_hash(0) is None  # free blocks carry hash 0 or a stale one
    assert mgr.find_block_by_hash(H_0_3, window_size=W) is wm.blocks[0]
    assert drain(mgr) == []


# -- clear_reusable_blocks -----------------------------------------------------------------------


def test_clear_with_nothing_held_removes_the_whole_tree() -> None:
    mgr, wm = build()
    assert mgr.clear_reusable_blocks() == 4
    # one Removed event, leaves first: the [4-7] branch, then [9999], then the root's child
    assert drain(mgr) == [removed(3, H_8_11, H_4_7, H_9999, H_0_3)]
    assert wm.tree_blocks() == []
    assert found(mgr, H_0_3, H_4_7, H_8_11, H_9999) == [None] * 4
    # cached blocks were free already: same count, same order, now without content
    assert mgr.get_num_free_blocks() == 8
    assert wm.policy.free_order(PRIMARY_LEVEL) == [6, 7, 3, 2, 1, 5, 4, 0]
    assert all(not wm.blocks[i].key.tokens and wm.blocks[i].hash == 0 for i in (0, 1, 2, 4))
    assert mgr.verify_queue_integrity()
    # nothing left to clear
    assert mgr.clear_reusable_blocks() == 0
    assert drain(mgr) == []
    # the same prompt reuses nothing and evicts nothing
    again = req(2, PROMPT)
    assert mgr.add_sequence(again) == 0
    assert ids(mgr, 2) == [6, 7, 3, 2]
    assert drain(mgr) == []
    assert mgr.verify_queue_integrity()


def test_clear_keeps_the_chain_a_live_sequence_holds() -> None:
    mgr, wm = build()
    live = req(2, range(9))  # holds [0-3] and [4-7] (blocks 0, 1) and a fresh tail
    assert mgr.add_sequence(live) == 8
    assert ids(mgr, 2) == [0, 1, 6]
    assert mgr.get_num_free_blocks() == 5
    assert mgr.clear_reusable_blocks() == 2
    # the branches hanging off the held chain go: [9999] below block 0, [8-11] below block 1
    assert drain(mgr) == [removed(3, H_9999, H_8_11)]
    assert found(mgr, H_0_3, H_4_7, H_8_11, H_9999) == [0, 1, None, None]
    assert {b.block_id for b in wm.tree_blocks()} == {0, 1}
    assert mgr.get_num_free_blocks() == 5
    assert mgr.verify_queue_integrity()
    # releasing it stores nothing new (its two full blocks are in the tree already)
    mgr.remove_sequence(2, live)
    assert drain(mgr) == []
    assert mgr.get_num_free_blocks() == 8
    # the full prompt now reuses the held chain only
    again = req(3, PROMPT)
    assert mgr.add_sequence(again) == 8
    assert ids(mgr, 3) == [0, 1, 7, 3]
    assert drain(mgr) == []
    assert mgr.verify_queue_integrity()


def test_clear_keeps_a_pinned_chain() -> None:
    mgr, wm = build()
    # Pinning the leaf [8-11] pins its ancestors too: a prefix is reusable only whole.
    assert mgr.pin_blocks_by_hash([H_8_11]) == [0, 1, 2]
    assert [wm.blocks[i].ref_count for i in (0, 1, 2)] == [1, 1, 1]
    assert mgr.get_num_free_blocks() == 5
    assert mgr.clear_reusable_blocks() == 1
    assert drain(mgr) == [removed(3, H_9999)]
    assert found(mgr, H_0_3, H_4_7, H_8_11, H_9999) == [0, 1, 2, None]
    assert mgr.get_num_free_blocks() == 5
    assert mgr.verify_queue_integrity()
    # while the pin lasts the path is reusable
    probe = req(2, PROMPT)
    assert mgr.add_sequence(probe) == 12
    assert ids(mgr, 2)[:3] == [0, 1, 2]
    mgr.remove_sequence(2)
    assert drain(mgr) == []
    # unpinned, the whole path goes with the next clear
    assert mgr.unpin_blocks_by_hash([H_8_11]) == [0, 1, 2]
    assert mgr.get_num_free_blocks() == 8
    assert mgr.clear_reusable_blocks() == 3
    assert drain(mgr) == [removed(4, H_8_11, H_4_7, H_0_3)]
    assert wm.tree_blocks() == []
    assert mgr.add_sequence(req(3, PROMPT)) == 0
    assert mgr.verify_queue_integrity()


def test_offload_moves_every_cached_block_in_eviction_order_and_reuse_onboards() -> None:
    mgr, wm = build(secondary=4)
    assert mgr.offload_reusable_blocks() == 4
    # Free order [6, 7, 3, 2, 1, 5, 4, 0]: the cached ones are 2, 1, 4, 0.
    assert drain(mgr) == [
        moved(3, H_8_11, 0, 1),
        moved(4, H_4_7, 0, 1),
        moved(5, H_9999, 0, 1),
        moved(6, H_0_3, 0, 1),
    ]
    assert [wm.blocks[i].is_primary for i in (0, 1, 2, 4)] == [False] * 4
    assert mgr.get_num_free_blocks() == 8  # the empty blocks took the primary slots
    assert wm.get_num_free_secondary_blocks() == 4
    assert mgr.verify_queue_integrity()
    again = req(2, PROMPT)
    assert mgr.add_sequence(again) == 12
    assert drain(mgr) == [
        moved(7, H_0_3, 1, 0),
        moved(8, H_4_7, 1, 0),
        moved(9, H_8_11, 1, 0),
    ]
    assert mgr.verify_queue_integrity()


@pytest.mark.parametrize(
    ("max_blocks", "moved_hashes"), [(0, []), (1, [H_8_11]), (2, [H_8_11, H_4_7])]
)
def test_offload_at_most_max_blocks(max_blocks: int, moved_hashes: list[int]) -> None:
    mgr, _ = build(secondary=4)
    assert mgr.offload_reusable_blocks(max_blocks) == len(moved_hashes)
    assert drain(mgr) == [moved(3 + i, h, 0, 1) for i, h in enumerate(moved_hashes)]
    assert mgr.verify_queue_integrity()


@pytest.mark.parametrize(("secondary", "onboard"), [(0, True), (4, False)])
def test_offload_without_a_usable_host_tier_does_nothing(secondary: int, onboard: bool) -> None:
    mgr, wm = build(secondary=secondary, onboard_blocks=onboard)
    assert mgr.offload_reusable_blocks() == 0
    assert drain(mgr) == []
    assert [wm.blocks[i].is_primary for i in (0, 1, 2, 4)] == [True] * 4


def test_offload_never_overwrites_cached_host_blocks() -> None:
    mgr, wm = build(secondary=2)
    assert mgr.offload_reusable_blocks() == 2  # blocks 2 and 1 fill the host tier
    drain(mgr)
    assert mgr.offload_reusable_blocks() == 0  # 4 and 0 are still cached, nowhere to go
    assert drain(mgr) == []
    assert found(mgr, H_0_3, H_4_7, H_8_11, H_9999) == [0, 1, 2, 4]
    assert [wm.blocks[i].is_primary for i in (0, 1, 2, 4)] == [True, False, False, True]
    assert mgr.verify_queue_integrity()


def test_clear_also_frees_host_blocks_for_the_next_offload() -> None:
    mgr, wm = build(secondary=2)
    assert mgr.offload_reusable_blocks() == 2
    drain(mgr)
    assert mgr.clear_reusable_blocks() == 4
    assert drain(mgr) == [removed(5, H_8_11, H_4_7, H_9999, H_0_3)]
    assert wm.get_num_free_secondary_blocks() == 2
    # A new prefix, cached, can use the host slots that the clear emptied.
    mgr.add_sequence(first := req(3, range(50, 59)))
    mgr.remove_sequence(3, first)
    drain(mgr)
    assert mgr.offload_reusable_blocks() == 2
    assert [e["data"]["type"] for e in drain(mgr)] == ["updated", "updated"]
    assert mgr.verify_queue_integrity()


def test_offload_skips_blocks_held_by_a_sequence_or_a_pin() -> None:
    mgr, wm = build(secondary=4)
    live = req(2, range(9))
    assert mgr.add_sequence(live) == 8  # holds blocks 0 and 1
    assert mgr.pin_blocks_by_hash([H_9999]) == [0, 4]  # 0 is held already
    assert mgr.get_num_free_blocks() == 4
    assert mgr.offload_reusable_blocks() == 1
    assert drain(mgr) == [moved(3, H_8_11, 0, 1)]
    assert [wm.blocks[i].is_primary for i in (0, 1, 2, 4)] == [True, True, False, True]
    assert mgr.get_num_free_blocks() == 4
    assert mgr.verify_queue_integrity()


def test_offload_moves_the_block_data() -> None:
    mgr, wm = build(secondary=4, allocate_pools=True, dtype=torch.float32)
    (pool,) = mgr.pools[W]
    assert pool.primary is not None and pool.secondary is not None
    shape = pool.primary[0].shape
    numel = pool.primary[0].numel()

    def content(block_id: int) -> torch.Tensor:
        return torch.arange(numel, dtype=torch.float32).view(shape) + 1000.0 * (block_id + 1)

    for i in (0, 1, 2, 4):
        pool.primary[wm.blocks[i].memory_index] = content(i)
    assert mgr.offload_reusable_blocks() == 4
    for i in (0, 1, 2, 4):
        block = wm.blocks[i]
        assert not block.is_primary
        assert torch.equal(pool.secondary[block.memory_index], content(i))
    # the primary slots they left are what the empty host blocks now own
    assert sorted(wm.blocks[i].memory_index for i in (8, 9, 10, 11)) == [0, 1, 2, 4]
    # onboarding brings the same data back into (other) primary slots
    assert mgr.add_sequence(req(2, PROMPT)) == 12
    assert slots(wm, 0, 1, 2) == [(True, 6), (True, 7), (True, 3)]
    for i in (0, 1, 2):
        assert torch.equal(pool.primary[wm.blocks[i].memory_index], content(i))
    assert torch.equal(pool.secondary[wm.blocks[4].memory_index], content(4))
    assert mgr.verify_queue_integrity()


# -- pin_blocks_by_hash / unpin_blocks_by_id -----------------------------------------------------


def test_pinned_chain_survives_eviction_pressure_and_unpin_frees_it() -> None:
    mgr, wm = build()
    assert mgr.pin_blocks_by_hash([H_0_3, H_4_7, H_8_11]) == [0, 1, 2]
    assert wm.pins == {0: 1, 1: 1, 2: 1}
    assert mgr.get_num_free_blocks() == 5
    assert mgr.get_kv_cache_stats().free_num_blocks == 5
    assert wm.policy.free_order(PRIMARY_LEVEL) == [6, 7, 3, 5, 4]
    assert drain(mgr) == []
    assert mgr.verify_queue_integrity()
    # a stranger takes every free block: only the unpinned [9999] is evicted
    stranger = req(2, range(100, 120))
    assert mgr.add_sequence(stranger) == 0
    assert ids(mgr, 2) == [6, 7, 3, 5, 4]
    assert drain(mgr) == [removed(3, H_9999)]
    assert mgr.get_num_free_blocks() == 0
    assert found(mgr, H_0_3, H_4_7, H_8_11, H_9999) == [0, 1, 2, None]
    assert mgr.verify_queue_integrity()
    mgr.remove_sequence(2)
    assert mgr.get_num_free_blocks() == 5
    # unpinned, they rejoin the free queue (at its tail, in the order given)
    mgr.unpin_blocks_by_id([0, 1, 2])
    assert wm.pins == {}
    assert mgr.get_num_free_blocks() == 8
    assert wm.policy.free_order(PRIMARY_LEVEL) == [4, 5, 3, 7, 6, 0, 1, 2]
    assert mgr.verify_queue_integrity()
    with pytest.raises(UnknownBlockError, match="block 0 is not pinned"):
        mgr.unpin_blocks_by_id([0])
    again = req(3, PROMPT)
    assert mgr.add_sequence(again) == 12
    assert ids(mgr, 3) == [0, 1, 2, 4]
    assert drain(mgr) == []
    assert mgr.verify_queue_integrity()


def test_pinning_twice_needs_two_unpins() -> None:
    mgr, wm = build()
    # A block named twice, or shared by two named chains, is pinned once per call.
    assert mgr.pin_blocks_by_hash([H_9999, H_9999]) == [0, 4]
    assert mgr.pin_blocks_by_hash([H_9999, H_0_3]) == [0, 4]
    assert wm.pins == {0: 2, 4: 2}
    assert wm.blocks[4].ref_count == 2
    assert mgr.get_num_free_blocks() == 6
    assert mgr.unpin_blocks_by_hash([H_9999]) == [0, 4]
    assert mgr.get_num_free_blocks() == 6
    mgr.unpin_blocks_by_id([0, 4])
    assert mgr.get_num_free_blocks() == 8
    assert wm.pins == {}
    with pytest.raises(UnknownBlockError, match="is not pinned"):
        mgr.unpin_blocks_by_hash([H_9999])
    assert mgr.verify_queue_integrity()


def test_pin_with_an_unknown_hash_changes_nothing() -> None:
    mgr, wm = build()
    order = wm.policy.free_order(PRIMARY_LEVEL)
    for bad in ([987654321], [H_0_3, H_4_7, 987654321], [H_0_3, 0]):
        with pytest.raises(UnknownBlockError, match=str(bad[-1])):
            mgr.pin_blocks_by_hash(bad)
        assert wm.pins == {}
        assert [wm.blocks[i].ref_count for i in range(8)] == [0] * 8
        assert mgr.get_num_free_blocks() == 8
        assert wm.policy.free_order(PRIMARY_LEVEL) == order
        assert drain(mgr) == []
        assert mgr.verify_queue_integrity()
    assert mgr.pin_blocks_by_hash([]) == []
    assert mgr.get_num_free_blocks() == 8


def test_pinned_leaf_stays_in_the_tree_under_eviction_pressure() -> None:
    """A pin keeps its block reusable: eviction must not drop it from the tree through an
    unheld ancestor (the ancestors are pinned with it)."""
    mgr, wm = build()
    assert 2 in mgr.pin_blocks_by_hash([H_8_11])
    free = mgr.get_num_free_blocks()
    # a stranger takes every block that is counted free
    assert mgr.add_sequence(req(2, range(100, 100 + 4 * free))) == 0
    events = drain(mgr)
    dropped = [
        h for e in events if e["data"]["type"] == "removed" for h in e["data"]["block_hashes"]
    ]
    assert found(mgr, H_0_3, H_4_7, H_8_11) == [0, 1, 2], (
        f"pinned leaf dropped from the reuse tree by eviction of its ancestors; "
        f"removed hashes {dropped}, pins {wm.pins}"
    )
    assert H_8_11 not in dropped
    assert mgr.verify_queue_integrity()


def test_offload_with_a_negative_max_blocks_changes_nothing() -> None:
    """A refused call leaves no trace (cache/manager.py docstring)."""
    mgr, wm = build(secondary=5)
    with pytest.raises(ValueError, match="max_blocks must be >= 0, got -1"):
        mgr.offload_reusable_blocks(max_blocks=-1)
    assert [wm.blocks[i].is_primary for i in (0, 1, 2, 4)] == [True] * 4
    assert drain(mgr) == []
    assert mgr.verify_queue_integrity()


@pytest.mark.parametrize(
    ("pinned", "unpinned", "ancestor", "child"),
    [
        ([H_8_11], [H_4_7], H_4_7, H_8_11),  # an ancestor alone
        ([H_8_11, H_9999], [H_9999], H_0_3, H_4_7),  # one of two siblings (their root too)
    ],
)
def test_unpin_that_would_strand_a_pinned_block_is_refused(
    pinned: list[int], unpinned: list[int], ancestor: int, child: int
) -> None:
    mgr, wm = build()
    mgr.pin_blocks_by_hash(pinned)
    pins = dict(wm.pins)
    free = mgr.get_num_free_blocks()
    with pytest.raises(
        PinConflictError,
        match=f"unpinning block {ancestor} would leave its pinned child {child} with an "
        "unpinned ancestor",
    ):
        mgr.unpin_blocks_by_hash(unpinned)
    assert (wm.pins, mgr.get_num_free_blocks()) == (pins, free)
    assert mgr.unpin_blocks_by_hash(pinned) == sorted(pins)
    assert (wm.pins, mgr.get_num_free_blocks()) == ({}, 8)
    assert mgr.verify_queue_integrity()
