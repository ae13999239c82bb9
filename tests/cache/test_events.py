"""Scenarios E1, E3, E9: which events the manager emits, with which fields, in which order."""

from __future__ import annotations

from typing import Any

import pytest

from cache import KVCacheEvent, RetentionConfig, TokenRangeRetention
from tests.cache.factories import add_tokens, drain, make_manager, req

LORA = 42
H_0_3 = 12106754553835128565  # [0,1,2,3], LoRA 42
H_4_7 = 5617127532119243971
H_8_9 = 7092498913842505426


def stored_block(h: int, tokens: list[int], priority: int = 35, level: int = 0) -> dict[str, Any]:
    return {
        "type": "stored_block",
        "block_hash": h,
        "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens],
        "cache_level": level,
        "priority": priority,
        "mm_keys": [],
        "cache_salt": None,
    }


def level_update(
    event_id: int, h: int, old: int, new: int, window_size: int = 16
) -> dict[str, Any]:
    return {
        "event_id": event_id,
        "data": {
            "type": "updated",
            "block_hash": h,
            "cache_level": {"type": "event_diff", "new_value": new, "old_value": old},
            "priority": None,
        },
        "window_size": window_size,
    }


def test_e1_event_stream() -> None:
    mgr = make_manager(8, 2, max_sequence_length=16, events=1024)
    # 1. created, once: draining is destructive
    assert drain(mgr) == [
        {
            "event_id": 0,
            "data": {"type": "created", "num_blocks_per_cache_level": [8, 2]},
            "window_size": 16,
        }
    ]
    assert drain(mgr) == []
    # 2. r0: two full blocks stored after prefill
    r0 = req(0, range(10), lora_task_id=LORA)
    mgr.add_sequence(r0)
    mgr.store_context_blocks(r0)
    assert drain(mgr) == [
        {
            "event_id": 1,
            "data": {
                "type": "stored",
                "parent_hash": None,
                "blocks": [stored_block(H_0_3, [0, 1, 2, 3]), stored_block(H_4_7, [4, 5, 6, 7])],
            },
            "window_size": 16,
        }
    ]
    # 3. one generated token, then release: the partial block [8, 9]
    add_tokens(mgr, r0, [10])
    mgr.remove_sequence(0, r0)
    assert drain(mgr) == [
        {
            "event_id": 2,
            "data": {
                "type": "stored",
                "parent_hash": H_4_7,
                "blocks": [stored_block(H_8_9, [8, 9])],
            },
            "window_size": 16,
        }
    ]
    # 4. a request that only reuses emits nothing
    r1 = req(1, range(9), lora_task_id=LORA)
    mgr.add_sequence(r1)
    mgr.store_context_blocks(r1)
    mgr.remove_sequence(1, r1)
    assert drain(mgr) == []
    # 5. two 13-token requests need 8 blocks: three cached blocks are offloaded and the 2-slot
    #    host pool overflows, dropping the first block offloaded
    r2 = req(2, [1, 1, *range(2, 13)])
    r3 = req(3, [2, 1, *range(2, 13)])
    mgr.add_sequence(r2)
    mgr.add_sequence(r3)
    assert drain(mgr) == [
        level_update(3, H_8_9, 0, 1),
        level_update(4, H_4_7, 0, 1),
        level_update(5, H_0_3, 0, 1),
        {"event_id": 6, "data": {"type": "removed", "block_hashes": [H_8_9]}, "window_size": 16},
    ]
    # 6. releasing them stores two 3-block chains
    mgr.remove_sequence(2, r2)
    mgr.remove_sequence(3, r3)
    events = drain(mgr)
    assert [(e["event_id"], e["data"]["parent_hash"]) for e in events] == [(7, None), (8, None)]
    assert [[b["block_hash"] for b in e["data"]["blocks"]] for e in events] == [
        [916751715089631, 16955605079875586289, 6725517949602612192],
        [35232537392298, 18060640999673525243, 3499009167702446897],
    ]
    # 7. r4 reuses [0-3] from the host pool: onboard, two offloads, one removal
    r4 = req(4, [0, 1, 2, 3, 1, 1, 1, 1, 0], lora_task_id=LORA)
    mgr.add_sequence(r4)
    assert drain(mgr) == [
        level_update(9, H_0_3, 1, 0),
        level_update(10, 6725517949602612192, 0, 1),
        {"event_id": 11, "data": {"type": "removed", "block_hashes": [H_4_7]}, "window_size": 16},
        level_update(12, 16955605079875586289, 0, 1),
    ]
    mgr.store_context_blocks(r4)
    events = drain(mgr)
    assert [e["data"]["type"] for e in events] == ["stored"]
    assert events[0]["event_id"] == 13
    assert events[0]["data"]["parent_hash"] == H_0_3
    assert mgr.verify_queue_integrity()


def test_e3_priority_updates() -> None:
    mgr = make_manager(8, 2, max_sequence_length=16, events=1024)
    high = RetentionConfig(ranges=[TokenRangeRetention(0, None, 50)], decode_priority=35)
    r0 = req(0, range(8), retention=high)
    mgr.add_sequence(r0)
    mgr.store_context_blocks(r0)
    mgr.remove_sequence(0, r0)
    events = drain(mgr)
    assert [e["data"]["type"] for e in events] == ["created", "stored", "stored"]
    assert events[1]["data"]["blocks"] == [stored_block(733356887393045, [0, 1, 2, 3], 50)]
    assert events[2]["data"]["parent_hash"] == 733356887393045
    assert events[2]["data"]["blocks"] == [stored_block(5186383150576877657, [4, 5, 6], 50)]
    # same tokens, no retention: the partial block is taken over, then stored again
    r1 = req(1, range(8))
    mgr.add_sequence(r1)
    mgr.store_context_blocks(r1)
    mgr.remove_sequence(1, r1)
    events = drain(mgr)
    assert [e["data"]["type"] for e in events] == ["stored"]
    assert events[0]["data"]["blocks"][0]["priority"] == 50
    # priority 10 for the same tokens: one update per matched block
    low = RetentionConfig(ranges=[TokenRangeRetention(0, None, 10)])
    r2 = req(2, range(8), retention=low)
    mgr.add_sequence(r2)
    assert drain(mgr) == [
        {
            "event_id": eid,
            "data": {
                "type": "updated",
                "block_hash": h,
                "cache_level": None,
                "priority": {"type": "event_diff", "new_value": 10, "old_value": 50},
            },
            "window_size": 16,
        }
        for eid, h in ((4, 733356887393045), (5, 5186383150576877657))
    ]
    assert mgr.get_priority_by_block_id(0) == 10


def test_e9_serialization_shape() -> None:
    mgr = make_manager(4, tokens_per_block=64, max_sequence_length=256, events=16)
    assert drain(mgr) == [
        {
            "event_id": 0,
            "data": {"type": "created", "num_blocks_per_cache_level": [4, 0]},
            "window_size": 256,
        }
    ]
    r = req(0, [1, 2, 3, 4, 5], max_new_tokens=1)
    mgr.add_sequence(r)
    mgr.remove_sequence(0, r)
    assert drain(mgr) == [
        {
            "event_id": 1,
            "data": {
                "type": "stored",
                "parent_hash": None,
                "blocks": [stored_block(924206229973855, [1, 2, 3, 4])],
            },
            "window_size": 256,
        }
    ]


def test_bounded_buffer_drops_the_oldest_and_counts() -> None:
    mgr = make_manager(8, events=1)
    r = req(0, range(10))
    mgr.add_sequence(r)
    mgr.store_context_blocks(r)
    mgr.flush_iteration_events()
    events = mgr.get_latest_events()
    assert [e.type for e in events] == ["stored"]  # the created event was dropped
    assert mgr.num_dropped_events == 1


def test_no_events_without_a_buffer() -> None:
    mgr = make_manager(8)
    r = req(0, range(10))
    mgr.add_sequence(r)
    mgr.remove_sequence(0, r)
    assert mgr.take_events() == []


def test_get_latest_events_waits_up_to_the_timeout() -> None:
    mgr = make_manager(8, events=8)
    mgr.take_events()
    assert mgr.get_latest_events(timeout=0.01) == []


def test_salt_and_multimodal_keys_appear_in_stored_blocks() -> None:
    from cache import MultimodalItem

    mgr = make_manager(8, events=8)
    item = MultimodalItem(bytes(range(32)), start=2, length=4)
    r = req(0, range(9), cache_salt_id=7, cache_salt="tenant-A", multimodal=[item])
    mgr.add_sequence(r)
    mgr.remove_sequence(0, r)
    blocks = drain(mgr)[-1]["data"]["blocks"]
    assert [b["cache_salt"] for b in blocks] == ["tenant-A", "tenant-A"]
    assert blocks[0]["mm_keys"] == [
        {"type": "mm_key", "hash": bytes(range(32)).hex(), "start_offset": 0}
    ]
    assert blocks[1]["mm_keys"] == [
        {"type": "mm_key", "hash": bytes(range(32)).hex(), "start_offset": 2}
    ]


@pytest.mark.parametrize(
    "bad",
    [
        {},
        {"event_id": 1, "data": {"type": "exploded"}, "window_size": 16},
        {"event_id": 1, "data": {"type": "removed"}, "window_size": 16},
    ],
)
def test_from_dict_rejects_malformed_events(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="event"):
        KVCacheEvent.from_dict(bad)


def test_to_dict_from_dict_round_trip() -> None:
    mgr = make_manager(8, 2, max_sequence_length=16, events=1024)
    for rid in range(6):
        r = req(rid, [rid % 2, *range(1, 12)])
        mgr.add_sequence(r)
        mgr.remove_sequence(rid, r)
    events = mgr.take_events()
    assert {e.type for e in events} >= {"created", "stored"}
    assert [KVCacheEvent.from_dict(e.to_dict()).to_dict() for e in events] == [
        e.to_dict() for e in events
    ]


def test_leaf_takeover_is_silent_unless_asked() -> None:
    for report in (False, True):
        mgr = make_manager(8, events=64, report_leaf_takeover=report)
        a = req(0, range(7))
        mgr.add_sequence(a)
        mgr.remove_sequence(0, a)  # stores [0-3] and the partial leaf [4, 5]
        leaf = drain(mgr)[-1]["data"]["blocks"][-1]["block_hash"]
        mgr.add_sequence(req(1, range(8)))  # takes the leaf over for partial reuse
        expected = [{"type": "removed", "block_hashes": [leaf]}] if report else []
        assert [e["data"] for e in drain(mgr)] == expected
