"""Edge cases found in review: each pins down the seed's behaviour or the no-trace promise."""

from __future__ import annotations

import pytest

from cache import LlmRequest, OutOfBlocksError, UnknownBlockError
from tests.cache.factories import add_tokens, drain, ids, make_manager, req


def test_dummy_requests_reuse_but_are_not_stored() -> None:
    mgr = make_manager(8, events=64)
    a = req(1, range(9))
    mgr.add_sequence(a)
    mgr.remove_sequence(1, a)
    dummy = req(2, range(9), is_dummy=True)
    assert mgr.add_sequence(dummy) == 8
    assert ids(mgr, 2) == [0, 1, 3]
    drain(mgr)
    mgr.remove_sequence(2, req(2, range(50, 59), is_dummy=True))
    assert drain(mgr) == []


def test_find_new_context_block_with_extra_ids() -> None:
    mgr = make_manager(8)
    a = req(1, range(9), extra_ids=[0] * 9)
    mgr.add_sequence(a)
    mgr.remove_sequence(1, a)
    probe = req(2, range(9), extra_ids=[0] * 9)
    assert mgr.find_new_context_block(list(range(8)), probe) is None


def test_failed_replace_shared_block_changes_nothing() -> None:
    mgr = make_manager(4, max_beam_width=2, enable_block_reuse=False)
    mgr.add_sequence(req(1, range(8), beam_width=2))  # two shared blocks
    mgr.add_sequence(req(2, range(8)))  # the other two
    before = (mgr.get_cache_block_ids(1), mgr.get_num_free_blocks())
    with pytest.raises(OutOfBlocksError, match="needs 2 blocks to give each beam its own block 0"):
        mgr.replace_shared_block(1, 0)
    assert (mgr.get_cache_block_ids(1), mgr.get_num_free_blocks()) == before
    mgr.remove_sequence(1)
    assert mgr.get_num_free_blocks() == 2
    assert mgr.verify_queue_integrity()


def test_only_pinned_blocks_can_be_unpinned() -> None:
    mgr = make_manager(4)
    a = req(1, range(9))
    mgr.add_sequence(a)
    with pytest.raises(UnknownBlockError, match=r"block 0 is not pinned \(0 pin"):
        mgr.unpin_blocks_by_id([0])
    mgr.pin_blocks(1)
    mgr.unpin_blocks_by_id([0])
    with pytest.raises(UnknownBlockError, match="block 0 is not pinned"):
        mgr.unpin_blocks_by_id([0])
    mgr.remove_sequence(1, a)
    mgr.unpin_blocks_by_id([1, 2])
    assert mgr.get_num_free_blocks() == 4
    assert mgr.verify_queue_integrity()


def test_a_request_owns_its_tokens() -> None:
    prompt = list(range(9))
    a, b = LlmRequest(1, prompt), LlmRequest(2, prompt)
    a.add_new_token(100)
    assert (len(prompt), b.num_tokens, a.num_tokens) == (9, 9, 10)


def test_add_token_past_the_window_is_refused_without_a_trace() -> None:
    mgr = make_manager(8, max_sequence_length=8)
    r = req(1, range(8))
    mgr.add_sequence(r)
    add_tokens(mgr, r, range(8, 11))  # 11 tokens: the window holds up to 8 + 4 - 1
    with pytest.raises(ValueError, match="12 tokens exceed what window 8 holds"):
        mgr.add_token(1)
    assert mgr.get_num_tokens(1) == 11
    assert ids(mgr, 1) == [0, 1, 2]


def test_store_new_block_stores_each_new_block_once() -> None:
    mgr = make_manager(16, events=256)
    r = req(1, range(5))
    mgr.add_sequence(r)
    drain(mgr)
    stored: list[list[int]] = []
    for t in range(5, 17):
        add_tokens(mgr, r, [t])
        mgr.store_new_block(r)
        for event in drain(mgr):
            assert event["data"]["type"] == "stored"
            stored.append([len(b["tokens"]) for b in event["data"]["blocks"]])
    # at 9, 13 and 17 tokens a block is complete: the first store also stores the block before
    assert stored == [[4, 4], [4], [4]]
    tree = mgr.windows[1024].tree_blocks()
    assert sorted(b.block_id for b in tree) == [0, 1, 2, 3]
