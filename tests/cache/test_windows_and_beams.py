"""Variable sliding-window attention, beam search and the scheduling dry run."""

from __future__ import annotations

from cache import KVCacheManager
from cache.admin import reset_reuse_state
from tests.cache.factories import add_tokens, drain, make_manager, req


def vswa(events: int = 256, full_blocks: int = 16, swa_blocks: int = 16) -> KVCacheManager:
    # layer 0 attends 8 tokens (SWA), layer 1 the whole 32
    return KVCacheManager(
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
        tokens_per_block=4,
        blocks_per_window={8: (swa_blocks, 0), 32: (full_blocks, 0)},
        max_attention_window=[8, 32],
        max_sequence_length=32,
        event_buffer_max_size=events,
        allocate_pools=False,
    )


def test_one_window_manager_per_window_size() -> None:
    mgr = vswa()
    assert [(w, wm.is_swa) for w, wm in mgr.windows.items()] == [(8, True), (32, False)]
    assert KVCacheManager.group_layers_by_window_size([8, 32], 4) == {8: [0, 2], 32: [1, 3]}
    events = drain(mgr)
    assert [(e["event_id"], e["window_size"], e["data"]["type"]) for e in events] == [
        (0, 8, "created"),
        (1, 32, "created"),
    ]


def test_vswa_allocation_events_and_prepopulated_length() -> None:
    mgr = vswa()
    drain(mgr)
    r = req(0, range(12))
    mgr.add_sequence(r)
    assert mgr.get_cache_block_ids(0, 8) == [[0, 1, 2]]
    assert mgr.get_cache_block_ids(0, 32) == [[0, 1, 2]]
    assert mgr.get_kv_cache_stats().num_free_blocks_per_window_size == {8: 13, 32: 13}
    mgr.store_context_blocks(r)  # the SWA window does not store on the fly
    assert [(e["window_size"], e["data"]["type"]) for e in drain(mgr)] == [(32, "stored")]
    mgr.remove_sequence(0, r)
    stored = [(e["window_size"], len(e["data"]["blocks"])) for e in drain(mgr)]
    assert stored == [(8, 3), (32, 1)]  # window 32 had stored two full blocks already
    again = req(1, range(12))
    assert mgr.add_sequence(again) == 11
    # a prompt that matches only in the full-attention window: the minimum wins
    mgr.remove_sequence(1, again)
    reset_reuse_state([mgr.windows[8]])
    third = req(2, range(12))
    assert mgr.add_sequence(third) == 0


def test_swa_sequence_that_lost_a_block_is_not_stored() -> None:
    mgr = vswa(full_blocks=32)
    r = req(0, range(4))
    mgr.add_sequence(r)
    add_tokens(mgr, r, range(4, 12))  # 12 tokens: the first block left the 8-token window
    assert mgr.windows[8].allocated_blocks_per_seq[0][0].ref_count == 0
    assert mgr.windows[8].policy.free_order(0)[-1] == 0  # released, at the tail
    mgr.add_sequence(req(1, range(100, 132)))  # 8 blocks per window
    assert mgr.windows[8].valid_store_for_reuse[0] is True
    # the next request takes the detached block: r's SWA blocks are no longer all valid
    mgr.add_sequence(req(2, range(200, 224)))  # 6 blocks, the last one is block 0
    assert 0 in mgr.get_cache_block_ids(2, 8)[0]
    assert mgr.windows[8].valid_store_for_reuse[0] is False
    drain(mgr)
    mgr.remove_sequence(0, r)
    assert [e["data"]["type"] for e in drain(mgr)] == []  # no window stores it
    assert mgr.verify_queue_integrity()


def test_beam_search_shares_context_and_diverges() -> None:
    mgr = make_manager(16, max_beam_width=2)
    r = req(0, range(8), beam_width=2)
    mgr.add_sequence(r)
    # with reuse on, the last context block is written per beam even when aligned (the seed)
    assert mgr.get_cache_block_ids(0) == [[0, 1], [0, 2]]
    assert mgr.get_num_free_blocks() == 13
    # decoding: a new block per beam at the boundary
    add_tokens(mgr, r, [8])
    assert mgr.get_cache_block_ids(0) == [[0, 1, 3], [0, 2, 4]]
    # the beams diverge inside block 0: each gets its own copy, the shared one is freed
    mgr.replace_shared_block(0, 0)
    assert mgr.get_cache_block_ids(0) == [[5, 1, 3], [6, 2, 4]]
    assert mgr.get_num_free_blocks() == 10
    mgr.replace_shared_block(0, 1)  # block 1 belongs to beam 0 only: nothing to do
    assert mgr.get_cache_block_ids(0) == [[5, 1, 3], [6, 2, 4]]
    mgr.remove_sequence(0, r)  # beam search is never stored for reuse
    assert mgr.get_num_free_blocks() == 16
    assert mgr.windows[1024].tree_blocks() == []


def test_scheduling_dry_run() -> None:
    mgr = make_manager(16)
    a, b = req(0, range(8)), req(1, range(100, 112))
    mgr.add_sequence(a)
    mgr.add_sequence(b)
    mgr.start_scheduling()
    assert mgr.get_scheduling_num_free_blocks() == 11
    mgr.scheduling_remove_sequence(1)
    assert mgr.get_scheduling_num_free_blocks() == 14
    assert mgr.get_num_free_blocks() == 11  # nothing really released


def test_needed_and_remaining_blocks() -> None:
    from cache import RequestState

    mgr = make_manager(64)
    r = req(0, range(10), max_new_tokens=7)
    assert mgr.get_needed_blocks_one_step(r) == 3  # 7 chunk tokens: min(10, 1024 + 7) -> 2 + 1
    assert mgr.get_remaining_blocks_to_completion(r) == 5  # ceil(17 / 4), nothing allocated
    mgr.add_sequence(r)
    r.state = RequestState.GENERATION_IN_PROGRESS
    assert mgr.get_remaining_blocks_to_completion(r) == 2
    assert mgr.get_needed_blocks_one_step(r) == 0  # 10 -> 11 tokens: same block
    add_tokens(mgr, r, [10, 11])
    assert mgr.get_needed_blocks_one_step(r) == 1  # 12 -> 13 tokens crosses a boundary
    assert mgr.get_needed_blocks_one_step(r, two_steps_look_ahead=True) == 1


def test_swa_sequence_that_takes_back_its_own_block_is_not_stored() -> None:
    # 3 blocks in the sliding window: its fourth block is its own first one, gone out of window
    # (the seed exempts the owner from the invalidation, and stores [0, 1, 2, 0])
    mgr = vswa(swa_blocks=3)
    drain(mgr)
    r = req(0, range(4))
    mgr.add_sequence(r)
    add_tokens(mgr, r, range(4, 14))
    assert mgr.get_cache_block_ids(0, 8) == [[0, 1, 2, 0]]
    assert (mgr.windows[8].valid_store_for_reuse, mgr.windows[32].valid_store_for_reuse) == (
        {0: False},
        {0: True},
    )
    # only the full-attention window stores (and pins) its blocks
    assert mgr.store_blocks_for_reuse(0, r, pin_blocks=True) == [0, 1, 2, 3]
    stored = [(e["window_size"], e["data"]["type"], len(e["data"]["blocks"])) for e in drain(mgr)]
    assert stored == [(32, "stored", 4)]
    mgr.remove_sequence(0, r)
    assert drain(mgr) == []  # no window stores it
    assert mgr.windows[8].tree.blocks() == []
    assert mgr.verify_queue_integrity()


def test_swa_sequence_that_takes_back_a_reused_block_is_not_stored() -> None:
    # the block it takes back came from the reuse tree: its last owner is another request
    mgr = vswa(swa_blocks=3)
    first = req(0, range(9))
    mgr.add_sequence(first)
    mgr.remove_sequence(0, first)
    h0, h1 = (b["block_hash"] for b in drain(mgr)[2]["data"]["blocks"])  # window 8's [0-3] [4-7]
    r = req(1, range(9))
    assert mgr.add_sequence(r) == 8
    add_tokens(mgr, r, range(9, 14))
    assert mgr.get_cache_block_ids(1, 8) == [[0, 1, 2, 0]]
    assert mgr.windows[8].valid_store_for_reuse[1] is False
    # taking block 0 back took it, and block 1 below it, out of window 8's tree
    removed = [(e["window_size"], e["data"]["block_hashes"]) for e in drain(mgr)]
    assert removed == [(8, [h1, h0])]
    assert mgr.store_blocks_for_reuse(1, r, pin_blocks=True) == [0, 1, 3, 4]
    stored = [(e["window_size"], e["data"]["type"], len(e["data"]["blocks"])) for e in drain(mgr)]
    assert stored == [(32, "stored", 2)]  # window 32 held its first two blocks already
    mgr.remove_sequence(1, r)
    assert mgr.windows[8].tree.blocks() == []
    assert mgr.verify_queue_integrity()
