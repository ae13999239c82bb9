"""Reuse namespaces (LoRA, cache salt, extra ids, multimodal), find_new_context_block, and
retention priorities and durations through the manager."""

from __future__ import annotations

from cache import BlockKey, MultimodalItem, RetentionConfig, TokenRangeRetention
from tests.cache.factories import add_tokens, ids, make_manager, req


def prepop_after(first: dict[str, object], second: dict[str, object]) -> int:
    mgr = make_manager(16)
    a = req(0, range(9), **first)
    mgr.add_sequence(a)
    mgr.remove_sequence(0, a)
    return mgr.add_sequence(req(1, range(9), **second))


def test_lora_task_ids_are_namespaces() -> None:
    assert prepop_after({"lora_task_id": 1}, {"lora_task_id": 1}) == 8
    assert prepop_after({"lora_task_id": 1}, {"lora_task_id": 2}) == 0
    assert prepop_after({}, {"lora_task_id": 0}) == 0  # None and 0 differ
    assert prepop_after({}, {}) == 8


def test_cache_salt_isolates_tenants() -> None:
    assert prepop_after({"cache_salt_id": 7}, {"cache_salt_id": 7}) == 8
    assert prepop_after({"cache_salt_id": 7}, {"cache_salt_id": 8}) == 0
    assert prepop_after({"cache_salt_id": 7}, {}) == 0


def test_extra_ids_are_part_of_the_key() -> None:
    extra = [0, 0, 5, 0, 0, 0, 0, 0, 0]
    assert prepop_after({"extra_ids": extra}, {"extra_ids": extra}) == 8
    # a differing extra id at token 2: the first block matches its first two tokens only
    other = [0, 0, 6, 0, 0, 0, 0, 0, 0]
    assert prepop_after({"extra_ids": extra}, {"extra_ids": other}) == 2
    assert prepop_after({"extra_ids": extra}, {"extra_ids": [0] * 9}) == 2
    # with and without extra ids the keys differ (the flag is hashed), but partial matching
    # compares tokens and extra ids only, as the seed's partialMatch: the first block is
    # copied as a 4-token partial match
    assert prepop_after({"extra_ids": [0] * 9}, {}) == 4


def test_multimodal_content_hashes_are_part_of_the_key() -> None:
    image_a = MultimodalItem(bytes([1] * 32), start=4, length=4)
    image_b = MultimodalItem(bytes([2] * 32), start=4, length=4)
    assert prepop_after({"multimodal": [image_a]}, {"multimodal": [image_a]}) == 8
    # the first block holds no image tokens, so it is shared; the second is not
    assert prepop_after({"multimodal": [image_a]}, {"multimodal": [image_b]}) == 4


def test_find_new_context_block() -> None:
    mgr = make_manager(16)
    a = req(0, range(13))
    mgr.add_sequence(a)
    mgr.remove_sequence(0, a)  # stores [0-3], [4-7], [8-11]
    probe = req(1, range(20))
    key = mgr.find_new_context_block(list(range(20)), probe)
    assert key == BlockKey(tokens=range(16))  # everything up to the first uncached block
    assert mgr.find_new_context_block(list(range(12)), probe) is None


def test_decode_blocks_take_the_decode_priority() -> None:
    mgr = make_manager(16)
    config = RetentionConfig(ranges=[TokenRangeRetention(0, 4, 90)], decode_priority=60)
    r = req(0, range(6), retention=config)
    mgr.add_sequence(r)
    first, second = ids(mgr, 0)
    assert mgr.get_priority_by_block_id(first) == 90
    assert mgr.get_priority_by_block_id(second) == 35  # a context block outside the range
    add_tokens(mgr, r, [6, 7, 8])  # 9 tokens: a decode block
    assert mgr.get_priority_by_block_id(ids(mgr, 0)[2]) == 60


def test_retention_durations_expire_on_refresh() -> None:
    now = [0.0]
    mgr = make_manager(4, clock=lambda: now[0])
    config = RetentionConfig(ranges=[TokenRangeRetention(0, None, 90, duration_s=10.0)])
    a = req(0, range(9), retention=config)
    mgr.add_sequence(a)
    mgr.remove_sequence(0, a)
    wm = mgr.windows[1024]
    # the free queue: block 3 (never used) at 35, then the cached blocks at 90
    assert wm.policy.free_order(0) == [3, 2, 1, 0]
    now[0] = 5.0
    mgr.refresh_blocks()
    assert [mgr.get_priority_by_block_id(b) for b in (0, 1)] == [90, 90]
    now[0] = 10.5
    mgr.refresh_blocks()
    assert [mgr.get_priority_by_block_id(b) for b in (0, 1, 2)] == [35, 35, 35]
    # demoted blocks go to the tail of the default queue, in expiry order
    assert wm.policy.free_order(0) == [3, 2, 1, 0]
    assert mgr.verify_queue_integrity()


def test_high_priority_blocks_outlive_default_ones() -> None:
    mgr = make_manager(4)
    keep = RetentionConfig(ranges=[TokenRangeRetention(0, None, 80)])
    a = req(0, range(5), retention=keep)  # blocks [0-3] (80) and the empty key (80)
    mgr.add_sequence(a)
    mgr.remove_sequence(0, a)
    b = req(1, range(100, 105))
    mgr.add_sequence(b)
    mgr.remove_sequence(1, b)
    # a third prompt needs two blocks: the default-priority ones go first
    c = req(2, range(200, 205))
    mgr.add_sequence(c)
    assert mgr.add_sequence(req(3, range(5))) == 4  # the priority-80 prefix survived
