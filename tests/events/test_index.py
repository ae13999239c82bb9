"""PrefixIndex: leading-prefix matches per worker and tier, from our events and TensorRT-LLM's."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import events.index
import events.index.prefix
from cache import (
    CreatedData,
    EventDiff,
    KVCacheEvent,
    KVCacheManager,
    OutOfBlocksError,
    RemovedData,
    StoredBlock,
    StoredData,
    UpdatedData,
    block_hashes_for_tokens,
)
from cache.window import WindowBlockManager
from events.errors import InvalidEventError
from events.index import GPU_TIER, HOST_TIER, PrefixIndex
from tests.cache.factories import make_manager, req

WINDOW = 16
# Seven chained block hashes of one request (4 tokens a block); H[k] is block k.
H = block_hashes_for_tokens(list(range(28)), 4)
COLD = block_hashes_for_tokens([9, 9, 9, 9, 9, 9, 9, 9], 4)


def stored(
    parent: int | None, hashes: Sequence[int], level: int | Sequence[int] = 0
) -> KVCacheEvent:
    levels = [level] * len(hashes) if isinstance(level, int) else list(level)
    blocks = [StoredBlock(h, (), cache_level=lv) for h, lv in zip(hashes, levels, strict=True)]
    return KVCacheEvent(0, StoredData(parent, blocks), WINDOW)


def removed(hashes: Sequence[int]) -> KVCacheEvent:
    return KVCacheEvent(0, RemovedData(list(hashes)), WINDOW)


def moved(block_hash: int, old: int, new: int) -> KVCacheEvent:
    return KVCacheEvent(0, UpdatedData(block_hash, cache_level=EventDiff(old, new)), WINDOW)


def created() -> KVCacheEvent:
    return KVCacheEvent(0, CreatedData([8, 2]), WINDOW)


def three_workers(**kwargs: Any) -> PrefixIndex:
    """a holds blocks 0..2, b holds 0..5, c holds 0, 1, 3, 4 (block 2 evicted alone)."""
    index = PrefixIndex(**kwargs)
    index.apply_event("a", stored(None, H[:3]))
    index.apply_event("b", stored(None, H[:6]))
    index.apply_event("c", stored(None, H[:5]))
    index.apply_event("c", removed([H[2]]))
    return index


def test_public_names() -> None:
    assert events.index.__all__ == ["GPU_TIER", "HOST_TIER", "PrefixIndex"]
    assert (GPU_TIER, HOST_TIER) == (0, 1)


def test_leading_blocks_per_worker() -> None:
    index = three_workers()
    assert index.find_matches(H) == {"a": 3, "b": 6, "c": 2}
    assert index.find_matches(H[:2]) == {"a": 2, "b": 2, "c": 2}
    assert index.find_matches(H[:4]) == {"a": 3, "b": 4, "c": 2}
    # Only leading blocks count: after an unknown first block, nothing matches.
    assert index.find_matches([*COLD, *H]) == {}
    assert index.find_matches([]) == {}
    assert index.find_matches_by_tier(H) == {"a": (3, 3), "b": (6, 6), "c": (2, 2)}
    assert index.worker_blocks("c") == {H[0]: 0, H[1]: 0, H[3]: 0, H[4]: 0}
    assert index.workers() == ["a", "b", "c"]
    assert len(index) == 6
    assert index.approx_bytes() > 6 * 36  # at least the six hash keys


def test_monotone_variant_agrees_where_presence_is_monotone() -> None:
    exact, monotone = PrefixIndex(), PrefixIndex(assume_monotone=True)
    for index in (exact, monotone):
        index.apply_event("a", stored(None, H[:3]))
        index.apply_event("b", stored(None, H[:6]))
        index.apply_event("c", stored(None, H[:1]))
        index.apply_event("d", stored(None, H))
        index.apply_event("e", stored(None, COLD))
    for request in (H, H[:1], H[:3], H[:4], [*H, *COLD], COLD, [*COLD, *H], []):
        assert monotone.find_matches(request) == exact.find_matches(request)
    assert exact.find_matches(H) == {"a": 3, "b": 6, "c": 1, "d": 7}


def test_stored_below_an_unknown_parent() -> None:
    index = PrefixIndex()
    index.apply_event("a", stored(H[2], H[3:5]))  # the chain above was trimmed
    assert index.worker_blocks("a") == {H[3]: 0, H[4]: 0}
    assert index.parent_of(H[3]) == H[2]
    assert index.parent_of(H[4]) == H[3]
    assert index.find_matches(H) == {}
    assert index.find_matches(H[3:]) == {"a": 2}
    index.apply_event("a", stored(None, H[:3]))  # the chain above comes back
    assert index.find_matches(H) == {"a": 5}
    assert index.parent_of(H[0]) is None


def test_removed() -> None:
    index = three_workers()
    index.apply_event("b", removed([H[5], H[4]]))
    assert index.find_matches(H) == {"a": 3, "b": 4, "c": 2}
    assert index.num_blocks("b") == 4
    # H[4] is still held by c; H[5] by nobody, so it leaves the index.
    assert len(index) == 5
    with pytest.raises(KeyError):
        index.parent_of(H[5])
    assert index.parent_of(H[4]) == H[3]
    # Blocks the worker does not hold are skipped and counted.
    index.apply_event("a", removed([H[5], H[4], H[2]]))
    assert index.num_unknown_block_refs == 2
    assert index.find_matches(H) == {"a": 2, "b": 4, "c": 2}
    assert index.stats()["per_worker"]["a"] == {"blocks": 2, "gpu": 2, "host": 0}


def test_updated_moves_blocks_between_tiers() -> None:
    index = three_workers()
    index.apply_event("b", moved(H[1], 0, 1))
    index.apply_event("b", moved(H[4], 0, 1))
    index.apply_event("c", moved(H[0], 0, 1))
    assert index.find_matches(H) == {"a": 3, "b": 6, "c": 2}
    assert index.find_matches_by_tier(H) == {"a": (3, 3), "b": (6, 4), "c": (2, 1)}
    assert index.find_matches_by_tier(H[:3]) == {"a": (3, 3), "b": (3, 2), "c": (2, 1)}
    assert index.worker_blocks("b") == {H[0]: 0, H[1]: 1, H[2]: 0, H[3]: 0, H[4]: 1, H[5]: 0}
    assert index.stats()["per_worker"]["b"] == {"blocks": 6, "gpu": 4, "host": 2}
    # Onboard (host -> GPU); an update to the tier a block is already on changes nothing.
    index.apply_event("b", moved(H[1], 1, 0))
    index.apply_event("b", moved(H[0], 1, 0))
    assert index.find_matches_by_tier(H) == {"a": (3, 3), "b": (6, 5), "c": (2, 1)}
    # A priority change does not touch tiers; an update of a block not held is counted.
    priority = UpdatedData(H[4], priority=EventDiff(35, 80))
    index.apply_event("b", KVCacheEvent(0, priority, WINDOW))
    index.apply_event("a", moved(H[5], 0, 1))
    assert index.num_unknown_block_refs == 1
    assert index.find_matches_by_tier(H) == {"a": (3, 3), "b": (6, 5), "c": (2, 1)}
    assert index.stats() == {
        "workers": 3,
        "blocks": 6,
        "entries": 13,
        "gpu_entries": 11,
        "host_entries": 2,
        "per_worker": {
            "a": {"blocks": 3, "gpu": 3, "host": 0},
            "b": {"blocks": 6, "gpu": 5, "host": 1},
            "c": {"blocks": 4, "gpu": 3, "host": 1},
        },
    }


def test_stored_levels() -> None:
    index = PrefixIndex()
    index.apply_event("a", stored(None, H[:2], level=1))
    index.apply_event("a", stored(H[1], H[2:5], level=[0, 1, 0]))
    assert index.find_matches_by_tier(H) == {"a": (5, 2)}
    assert index.worker_blocks("a") == {H[0]: 1, H[1]: 1, H[2]: 0, H[3]: 1, H[4]: 0}
    # A store again (after a replay, say) sets the tier it names.
    index.apply_event("a", stored(None, H[:2]))
    index.apply_event("a", stored(H[2], H[3:5], level=1))
    assert index.worker_blocks("a") == {H[0]: 0, H[1]: 0, H[2]: 0, H[3]: 1, H[4]: 1}
    assert index.stats()["per_worker"]["a"] == {"blocks": 5, "gpu": 3, "host": 2}
    index.apply_event("b", stored(None, H[:3], level=[1, 1, 0]))
    assert index.find_matches_by_tier(H) == {"a": (5, 3), "b": (3, 1)}


def test_created_clears_the_worker_and_remove_worker_frees_its_slot() -> None:
    index = three_workers()
    index.apply_event("b", moved(H[0], 0, 1))
    index.apply_event("b", created())  # b restarted
    assert index.workers() == ["a", "b", "c"]
    assert index.num_blocks("b") == 0
    assert index.find_matches(H) == {"a": 3, "c": 2}
    assert index.stats()["per_worker"]["b"] == {"blocks": 0, "gpu": 0, "host": 0}
    assert index.remove_worker("a") is True
    assert index.remove_worker("a") is False
    assert index.workers() == ["b", "c"]
    assert index.find_matches(H) == {"c": 2}
    assert len(index) == 4  # c's blocks
    assert index.worker_blocks("a") == {}  # removed: it holds nothing
    index.apply_event("d", stored(None, H[:1]))  # takes a's slot, and none of its blocks
    assert index.workers() == ["d", "b", "c"]
    assert index.find_matches(H) == {"c": 2, "d": 1}
    assert index.worker_blocks("d") == {H[0]: 0}


def test_many_workers() -> None:
    """Past the initial slot capacity the host bits move up; nothing is lost."""
    index = PrefixIndex()
    for w in range(70):
        index.apply_event(f"w{w}", stored(None, H[: 1 + w % 7], level=w % 2))
        if w % 3 == 0:
            index.apply_event(f"w{w}", moved(H[0], w % 2, 1 - w % 2))
    expected: dict[str, tuple[int, int]] = {}
    for w in range(70):
        n = 1 + w % 7
        on_host = n if w % 2 else 0
        if w % 3 == 0:
            on_host += -1 if w % 2 else 1
        expected[f"w{w}"] = (n, n - on_host)
    assert index.find_matches_by_tier(H) == expected
    assert index.find_matches(H) == {w: n for w, (n, _) in expected.items()}
    assert index.parent_of(H[3]) == H[2]
    assert index.parent_of(H[0]) is None


# -- TensorRT-LLM JSON (TRTLLM_EVENTS.md section 4) -------------------------------------------

LORA = 42
H_0_3, H_4_7, H_8_9 = 12106754553835128565, 5617127532119243971, 7092498913842505426
R2 = [916751715089631, 16955605079875586289, 6725517949602612192]
R3 = [35232537392298, 18060640999673525243, 3499009167702446897]


def trt_block(h: int, tokens: Sequence[int]) -> dict[str, Any]:
    return {
        "type": "stored_block",
        "block_hash": h,
        "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens],
        "cache_level": 0,
        "priority": 35,
        "mm_keys": [],
        "cache_salt": None,
    }


def trt_stored(event_id: int, parent: int | None, blocks: list[dict[str, Any]]) -> dict[str, Any]:
    data = {"type": "stored", "parent_hash": parent, "blocks": blocks}
    return {"event_id": event_id, "data": data, "window_size": WINDOW}


def trt_updated(event_id: int, h: int, old: int, new: int) -> dict[str, Any]:
    diff = {"type": "event_diff", "new_value": new, "old_value": old}
    data = {"type": "updated", "block_hash": h, "cache_level": diff, "priority": None}
    return {"event_id": event_id, "data": data, "window_size": WINDOW}


def trt_stream() -> list[dict[str, Any] | None]:
    """Steps 0..5 of the worked stream, with the empty dicts and None a serializer may emit."""
    r2, r3 = [1, 1, *range(2, 12)], [2, 1, *range(2, 12)]
    return [
        {
            "event_id": 0,
            "data": {"type": "created", "num_blocks_per_cache_level": [8, 2]},
            "window_size": WINDOW,
        },
        trt_stored(1, None, [trt_block(H_0_3, range(4)), trt_block(H_4_7, range(4, 8))]),
        {},
        trt_stored(2, H_4_7, [trt_block(H_8_9, [8, 9])]),
        trt_updated(3, H_8_9, 0, 1),
        trt_updated(4, H_4_7, 0, 1),
        None,
        trt_updated(5, H_0_3, 0, 1),
        {"event_id": 6, "data": {"type": "removed", "block_hashes": [H_8_9]}, "window_size": 16},
        trt_stored(7, None, [trt_block(h, r2[4 * k : 4 * k + 4]) for k, h in enumerate(R2)]),
        trt_stored(8, None, [trt_block(h, r3[4 * k : 4 * k + 4]) for k, h in enumerate(R3)]),
    ]


def test_tensorrt_llm_json_stream() -> None:
    # The router's own hashes of these prompts are the ones in the events.
    lora_chain = block_hashes_for_tokens(list(range(10)), 4, lora_task_id=LORA)
    assert lora_chain == [H_0_3, H_4_7]
    assert block_hashes_for_tokens([1, 1, *range(2, 12)], 4) == R2
    assert block_hashes_for_tokens([2, 1, *range(2, 12)], 4) == R3
    assert max(R2) >= 2**63 and H_0_3 >= 2**63

    index = PrefixIndex()
    index.apply_events("trt-0", trt_stream())
    assert index.worker_blocks("trt-0") == {
        H_0_3: 1,
        H_4_7: 1,
        **dict.fromkeys(R2, 0),
        **dict.fromkeys(R3, 0),
    }
    assert index.find_matches_by_tier(lora_chain) == {"trt-0": (2, 0)}
    assert index.find_matches_by_tier(R2) == {"trt-0": (3, 3)}
    assert index.find_matches(R3[:2]) == {"trt-0": 2}
    assert index.find_matches(block_hashes_for_tokens(list(range(10)), 4)) == {}  # no LoRA
    assert index.parent_of(R2[2]) == R2[1]
    # Step 6: onboard H_0_3.
    index.apply_event("trt-0", trt_updated(9, H_0_3, 1, 0))
    assert index.find_matches_by_tier(lora_chain) == {"trt-0": (2, 1)}
    # A restart (a new `created` at event id 0) drops everything the worker held.
    index.apply_event("trt-0", trt_stream()[0])
    assert index.find_matches(R2) == {}
    assert len(index) == 0


def test_hashes_as_decimal_strings_in_json() -> None:
    """TRTLLM_EVENTS.md advises keeping big hashes as decimal strings end to end."""
    event = trt_stored(1, None, [trt_block(H_0_3, range(4))])
    event["data"]["blocks"][0]["block_hash"] = str(H_0_3)
    index = PrefixIndex()
    index.apply_event("w", event)
    assert index.find_matches([H_0_3]) == {"w": 1}


# -- malformed input ---------------------------------------------------------------------------


def _bad_stored(**changes: Any) -> KVCacheEvent:
    block = StoredBlock(H[0], ())
    for name, value in changes.items():
        object.__setattr__(block, name, value)
    return KVCacheEvent(0, StoredData(None, [block]), WINDOW)


def _json(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    event = trt_stored(1, None, [trt_block(H[0], range(4))])
    change(event)
    return event


MALFORMED: list[tuple[object, str]] = [
    (_bad_stored(block_hash="17"), "not an int"),
    (_bad_stored(block_hash=1.5), "not an int"),
    (_bad_stored(block_hash=-1), "outside 0..2\\*\\*64-1"),
    (_bad_stored(block_hash=2**64), "outside 0..2\\*\\*64-1"),
    (_bad_stored(cache_level=2), "cache_level must be 0 or 1"),
    (_bad_stored(cache_level=-1), "cache_level must be 0 or 1"),
    (stored(None, [H[0], H[1], H[0]]), "appears twice"),
    (stored(H[1], [H[0], H[1]]), "its own ancestor"),
    (stored(-5, [H[0]]), "bad parent_hash"),
    (KVCacheEvent(0, StoredData(None, (StoredBlock(H[0], ()),)), WINDOW), "list"),  # type: ignore[arg-type]
    (KVCacheEvent(0, RemovedData([H[0], "x"]), WINDOW), "not an int"),  # type: ignore[list-item]
    (KVCacheEvent(0, RemovedData(H[0]), WINDOW), "must be a list"),  # type: ignore[arg-type]
    (moved(H[0], 0, 2), "cache_level must become 0 or 1"),
    (KVCacheEvent(0, UpdatedData(-3, None, None), WINDOW), "outside"),
    (KVCacheEvent(0, "stored", WINDOW), "unknown event data str"),  # type: ignore[arg-type]
    (42, "not a KV cache event: int"),
    ("stored", "not a KV cache event: str"),
    ({"event_id": 1, "window_size": 16}, "TensorRT-LLM event.*data"),
    (_json(lambda e: e["data"].update(type="evicted")), "unknown event type 'evicted'"),
    (_json(lambda e: e["data"]["blocks"][0].update(block_hash="0x12")), "invalid literal"),
    (_json(lambda e: e["data"]["blocks"][0].update(block_hash=-7)), "outside"),
    (_json(lambda e: e["data"].update(blocks=None)), "TensorRT-LLM event"),
    (_json(lambda e: e["data"]["blocks"][0].update(cache_level=3)), "cache_level"),
]


@pytest.mark.parametrize(("event", "message"), MALFORMED)
def test_malformed_events_raise_and_change_nothing(event: Any, message: str) -> None:
    index = three_workers()
    index.apply_event("b", moved(H[1], 0, 1))
    before = (index.stats(), {w: index.worker_blocks(w) for w in index.workers()})
    with pytest.raises(ValueError, match=message):
        index.apply_event("b", event)
    with pytest.raises(ValueError, match=message):
        index.apply_event("new", event)
    assert (index.stats(), {w: index.worker_blocks(w) for w in index.workers()}) == before
    assert index.find_matches_by_tier(H) == {"a": (3, 3), "b": (6, 5), "c": (2, 2)}


def test_a_repeated_hash_in_a_new_chain_is_rolled_back() -> None:
    index = PrefixIndex()
    index.apply_event("a", stored(None, H[:2]))
    with pytest.raises(ValueError, match="appears twice"):
        index.apply_event("a", stored(H[1], [H[2], H[3], H[2]]))  # all new to the index
    assert len(index) == 2
    assert index.stats()["per_worker"]["a"] == {"blocks": 2, "gpu": 2, "host": 0}


def test_empty_and_missing_events_are_skipped() -> None:
    index = PrefixIndex()
    index.apply_events("a", [{}, None, stored(None, [])])
    assert index.stats()["blocks"] == 0
    assert index.find_matches(H) == {}


# -- dump and replay -----------------------------------------------------------------------------


def replay(index: PrefixIndex, *, check_shape: bool = True) -> PrefixIndex:
    fresh = PrefixIndex()
    for worker in index.workers():
        dumped = index.dump_events(worker)
        if check_shape:
            check_dump_shape(index, worker, dumped)
        fresh.apply_event(worker, created())
        fresh.apply_events(worker, copy.deepcopy(dumped))
    return fresh


def check_dump_shape(index: PrefixIndex, worker: str, dumped: list[KVCacheEvent]) -> None:
    """Stored events only, ids 0.., each a chain, parents stored before their children."""
    held = index.worker_blocks(worker)
    seen: set[int] = set()
    assert [e.event_id for e in dumped] == list(range(len(dumped)))
    for event in dumped:
        assert isinstance(event.data, StoredData)
        parent = event.data.parent_hash
        assert parent is None or parent not in held or parent in seen
        for block in event.data.blocks:
            assert index.parent_of(block.block_hash) == parent
            assert block.cache_level == held[block.block_hash]
            seen.add(block.block_hash)
            parent = block.block_hash
    assert seen == held.keys()


def assert_same_state(a: PrefixIndex, b: PrefixIndex, requests: list[list[int]]) -> None:
    assert a.stats() == b.stats()
    assert sorted(a.workers()) == sorted(b.workers())
    for worker in a.workers():
        blocks = a.worker_blocks(worker)
        assert b.worker_blocks(worker) == blocks
        assert {h: b.parent_of(h) for h in blocks} == {h: a.parent_of(h) for h in blocks}
    for request in requests:
        assert b.find_matches(request) == a.find_matches(request)
        assert b.find_matches_by_tier(request) == a.find_matches_by_tier(request)


def test_dump_events_round_trip() -> None:
    index = three_workers()
    branch = block_hashes_for_tokens([0, 1, 2, 3, 4, 5, 6, 7, 7, 7, 7, 7, 8, 8, 8, 8], 4)
    assert branch[:2] == H[:2]
    index.apply_event("b", stored(H[1], branch[2:]))  # a branch off b's chain at block 1
    index.apply_event("b", moved(H[3], 0, 1))
    index.apply_event("b", moved(branch[3], 0, 1))
    index.apply_event("d", stored(H[4], H[5:7], level=[1, 0]))  # below a parent d lacks
    index.apply_event("e", stored(None, COLD))
    index.apply_event("e", created())  # e holds nothing: its dump is empty
    dumped_b = index.dump_events("b")
    assert [
        (e.data.parent_hash, [(blk.block_hash, blk.cache_level) for blk in e.data.blocks])
        for e in dumped_b
        if isinstance(e.data, StoredData)
    ] == [
        (None, [(H[0], 0), (H[1], 0), (H[2], 0), (H[3], 1), (H[4], 0), (H[5], 0)]),
        (H[1], [(branch[2], 0), (branch[3], 1)]),
    ]
    assert {e.window_size for e in dumped_b} == {WINDOW}
    assert index.dump_events("e") == []
    assert [e.window_size for e in index.dump_events("d", window_size=4096)] == [4096]
    requests = [H, branch, COLD, H[:3], [*H[:2], *branch[2:]], H[4:], H[5:]]
    assert_same_state(index, replay(index), requests)


def test_dump_survives_a_parent_cycle() -> None:
    """Only a broken stream links blocks in a cycle; the dump still rebuilds the state."""
    index = PrefixIndex()
    index.apply_event("a", stored(H[1], [H[0]]))
    index.apply_event("a", stored(H[0], [H[1]]))
    index.apply_event("a", stored(H[1], [H[2]]))
    assert len(index.dump_events("a")) == 3
    assert_same_state(index, replay(index, check_shape=False), [H])


# -- against the block manager -----------------------------------------------------------------

TPB = 4
PREFIXES = ((1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9, 9, 9), (5, 5, 5, 5), ())
ALPHABET = (1, 2, 3, 9)


def prompts(*, whole_blocks: bool) -> st.SearchStrategy[list[int]]:
    """Prompts over shared prefixes; with `whole_blocks`, len % TPB == 1, so that what a
    release stores (all tokens but the last) is whole blocks only."""
    lengths = st.sampled_from([1, 5, 9]) if whole_blocks else st.integers(1, 10)
    tails = lengths.flatmap(lambda n: st.lists(st.sampled_from(ALPHABET), min_size=n, max_size=n))
    return st.builds(lambda prefix, tail: [*prefix, *tail], st.sampled_from(PREFIXES), tails)


def operations(*, whole_blocks: bool) -> st.SearchStrategy[list[tuple[Any, ...]]]:
    return st.lists(
        st.one_of(
            st.tuples(st.just("add"), prompts(whole_blocks=whole_blocks)),
            st.tuples(st.just("remove"), st.integers(0, 3), st.booleans()),
        ),
        min_size=5,
        max_size=40,
    )


def tree_blocks(wm: WindowBlockManager) -> dict[int, int]:
    return {b.hash: 0 if b.is_primary else 1 for b in wm.tree_blocks()}


def tree_match(wm: WindowBlockManager, hashes: list[int]) -> int:
    """Leading blocks of `hashes` present in the manager's reuse tree (walked from the root)."""
    node, n = wm.tree.root, 0
    for h in hashes:
        child = node.next_blocks.get(h)
        if child is None:
            break
        node, n = child, n + 1
    return n


def run_ops(
    mgr: KVCacheManager, ops: list[tuple[Any, ...]], step: Callable[[list[KVCacheEvent]], None]
) -> list[list[int]]:
    """Apply `ops` to `mgr`; after each, hand its events to `step`. Returns the prompts.

    An add that finds no room first removes the oldest live request (storing its blocks),
    so that the pools churn: eviction, offload to the host tier, onboarding.
    """
    live: list[tuple[int, Any]] = []
    seen: list[list[int]] = []
    for rid, op in enumerate(ops):
        if op[0] == "add":
            for _ in range(2):
                request = req(rid, op[1])
                try:
                    mgr.add_sequence(request)
                except OutOfBlocksError:
                    if not live:
                        break
                    old_rid, old_request = live.pop(0)
                    mgr.remove_sequence(old_rid, old_request)
                else:
                    live.append((rid, request))
                    seen.append(op[1])
                    break
        elif live:
            old_rid, old_request = live.pop(op[1] % len(live))
            mgr.remove_sequence(old_rid, old_request if op[2] else None)
        step(mgr.take_events())
    return seen


@settings(max_examples=100)
@given(operations(whole_blocks=True))
def test_index_mirrors_the_block_manager(ops: list[tuple[Any, ...]]) -> None:
    """Random traffic through a real manager with a host tier: after every step the index
    holds exactly the reuse tree's blocks, each on its tier, and matches as the tree does.

    Partial blocks never reach the tree here: by default (as in the seed) the manager hands a
    free partial leaf to a request that extends it without a `removed` event (TRTLLM_EVENTS.md
    section 3, rule 3), which no consumer can see; `test_index_follows_partial_reuse` turns
    the report of such take-overs on.
    """
    mgr = make_manager(8, 4, tokens_per_block=TPB, events=100_000, enable_partial_reuse=False)
    exact, monotone = PrefixIndex(), PrefixIndex(assume_monotone=True)
    probes: list[list[int]] = [[*p, 1] for p in PREFIXES]

    def step(batch: list[KVCacheEvent]) -> None:
        for event in batch:
            worker = f"w{event.window_size}"
            exact.apply_event(worker, event)
            monotone.apply_event(worker, event)
        for window, wm in mgr.windows.items():
            worker = f"w{window}"
            expected = tree_blocks(wm)
            assert exact.worker_blocks(worker) == expected
            assert monotone.worker_blocks(worker) == expected
            host = sum(expected.values())
            assert exact.stats()["per_worker"][worker] == {
                "blocks": len(expected),
                "gpu": len(expected) - host,
                "host": host,
            }
            for tokens in probes[-8:]:
                hashes = block_hashes_for_tokens(tokens, TPB)
                n = tree_match(wm, hashes)
                want = {worker: n} if n else {}
                assert exact.find_matches(hashes) == want
                assert monotone.find_matches(hashes) == want
                on_host = sum(expected[h] for h in hashes[:n])
                assert exact.find_matches_by_tier(hashes) == (
                    {worker: (n, n - on_host)} if n else {}
                )

    probes += run_ops(mgr, ops, step)
    assert_same_state(exact, replay(exact), probes)


@settings(max_examples=100)
@given(operations(whole_blocks=False))
def test_index_follows_partial_reuse(ops: list[tuple[Any, ...]]) -> None:
    """Partial blocks and partial reuse, with the manager reporting the leaves it takes over
    (`report_leaf_takeover`): the index still holds exactly the tree, and matches as it does.
    It also equals a plain replay of the events, hash by hash."""
    mgr = make_manager(8, 4, tokens_per_block=TPB, events=100_000, report_leaf_takeover=True)
    wm = mgr.windows[1024]
    index = PrefixIndex()
    model: dict[int, int] = {}  # hash -> tier, by the book
    probes: list[list[int]] = [[*p, 1] for p in PREFIXES]

    def step(batch: list[KVCacheEvent]) -> None:
        for event in batch:
            index.apply_event("w", event)
            data = event.data
            if isinstance(data, StoredData):
                model.update((b.block_hash, b.cache_level) for b in data.blocks)
            elif isinstance(data, RemovedData):
                for h in data.block_hashes:
                    del model[h]
            elif (
                isinstance(data, UpdatedData)
                and data.cache_level is not None
                and data.block_hash in model  # not an onboard of a leaf just taken over
            ):
                model[data.block_hash] = data.cache_level.new_value
        assert index.worker_blocks("w") == model == tree_blocks(wm)
        for tokens in probes[-8:]:
            hashes = block_hashes_for_tokens(tokens, TPB)
            n = tree_match(wm, hashes)
            assert index.find_matches(hashes) == ({"w": n} if n else {})

    probes += run_ops(mgr, ops, step)
    assert_same_state(index, replay(index), probes)


# -- the compiled table against the pure-Python one ------------------------------------------

POOL = block_hashes_for_tokens(list(range(600)), 2)  # 300 chained hashes to draw chains from
needs_numba = pytest.mark.skipif(
    not PrefixIndex().compiled, reason="no numba (or KVMESH_NO_NUMBA): only the Python table"
)


@pytest.mark.skipif(
    importlib.util.find_spec("numba") is None or bool(os.environ.get("KVMESH_NO_NUMBA")),
    reason="no numba (or KVMESH_NO_NUMBA): the Python table is the expected one",
)
def test_compiled_table_is_in_use_where_numba_is_installed() -> None:
    """With numba installed, a compiled table that fails its self-test falls back to the dict
    silently (a warning), and the comparisons above skip: this fails instead."""
    from events.index.array_table import ArrayTable

    assert events.index.prefix._compiled_table_works()
    index = PrefixIndex()
    assert index.compiled
    assert isinstance(index._table, ArrayTable)


def random_op(rng: random.Random, num_workers: int) -> tuple[str, KVCacheEvent | None]:
    """An event of a random worker: mostly stores (mixed tiers, repeated hashes, the parent in
    the chain), removals (some of blocks not held), tier moves, priority changes, restarts;
    None means "forget the worker"."""
    worker = f"w{rng.randrange(num_workers)}"
    kind = rng.random()
    if kind < 0.45:
        start = rng.randrange(len(POOL))
        chain = [POOL[(start + k) % len(POOL)] for k in range(rng.randrange(1, 40))]
        if rng.random() < 0.05:
            chain.append(rng.choice(chain))  # refused: a hash twice
        parent = None if rng.random() < 0.3 else rng.choice(POOL)
        r = rng.random()
        level: int | list[int] = (
            0 if r < 0.4 else 1 if r < 0.6 else [rng.randrange(2) for _ in chain]
        )
        return worker, stored(parent, chain, level)
    if kind < 0.7:
        return worker, removed(rng.sample(POOL, rng.randrange(0, 30)))
    if kind < 0.85:
        return worker, moved(rng.choice(POOL), 0, rng.randrange(2))
    if kind < 0.9:
        priority = UpdatedData(rng.choice(POOL), priority=EventDiff(35, 80))
        return worker, KVCacheEvent(0, priority, WINDOW)
    if kind < 0.95:
        return worker, created()
    return worker, None


def assert_identical(a: PrefixIndex, b: PrefixIndex, requests: list[list[int]]) -> None:
    """Same answers to every question, orders included (workers, blocks, dumped events)."""
    assert a.stats() == b.stats()
    assert a.workers() == b.workers()
    assert len(a) == len(b)
    assert a.num_unknown_block_refs == b.num_unknown_block_refs
    for worker in a.workers():
        blocks = a.worker_blocks(worker)
        assert list(b.worker_blocks(worker).items()) == list(blocks.items())
        assert {h: b.parent_of(h) for h in blocks} == {h: a.parent_of(h) for h in blocks}
        assert a.num_blocks(worker) == b.num_blocks(worker)
        assert a.dump_events(worker) == b.dump_events(worker)
    for request in requests:
        expected = a.find_matches(request)
        assert list(b.find_matches(request).items()) == list(expected.items())
        assert b.find_matches(np.array(request, dtype=np.uint64)) == expected
        assert b.find_matches_by_tier(request) == a.find_matches_by_tier(request)


@needs_numba
@pytest.mark.parametrize("num_workers", [3, 40])
@pytest.mark.parametrize("seed", range(4))
def test_compiled_table_equals_the_python_table(seed: int, num_workers: int) -> None:
    """Random streams (past 32 workers a second word of bits; past 192 hashes the table grows;
    removals shift rows back) give the same state, matches and errors in both tables."""
    rng = random.Random(seed)
    compiled = PrefixIndex(compiled=True)
    python = PrefixIndex(compiled=False)
    exact = (compiled, python)
    monotone = (
        PrefixIndex(compiled=True, assume_monotone=True),
        PrefixIndex(compiled=False, assume_monotone=True),
    )
    assert compiled.compiled and not python.compiled
    requests = [POOL[k : k + rng.randrange(1, 60)] for k in range(0, 300, 7)]
    requests += [[*POOL[:5], 12345], [], [2**64 - 1, *POOL[:3]]]
    peak = most = 0
    for step in range(400):
        worker, event = random_op(rng, num_workers)
        outcomes: list[bool | str | None] = []
        for index in (*exact, *monotone):
            if event is None:
                outcomes.append(index.remove_worker(worker))
                continue
            try:
                index.apply_event(worker, event)
                outcomes.append(None)
            except InvalidEventError as exc:
                outcomes.append(str(exc))
        assert len(set(outcomes)) == 1, outcomes
        peak = max(peak, len(compiled))
        most = max(most, len(compiled.workers()))
        if step % 40 == 39:
            assert_identical(python, compiled, requests)
            assert_identical(monotone[1], monotone[0], requests)
    assert_identical(python, compiled, requests)
    assert peak > 192  # the first table's fill limit: it grew
    assert most > min(32, num_workers - 1)  # with 40, a second word of worker bits


@needs_numba
@settings(max_examples=60)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=60))
def test_compiled_table_equals_the_python_table_on_short_streams(seeds: list[int]) -> None:
    compiled, python = PrefixIndex(compiled=True), PrefixIndex(compiled=False)
    for seed in seeds:
        worker, event = random_op(random.Random(seed), 5)
        for index in (compiled, python):
            if event is None:
                index.remove_worker(worker)
            else:
                with contextlib.suppress(InvalidEventError):
                    index.apply_event(worker, event)
    assert_identical(python, compiled, [POOL[:40], POOL[100:140], POOL[5:9]])


def test_find_matches_takes_lists_and_arrays_and_ignores_what_is_not_a_hash() -> None:
    for compiled in {PrefixIndex().compiled, False}:
        index = three_workers(compiled=compiled)
        assert index.find_matches(np.array(H, dtype=np.uint64)) == {"a": 3, "b": 6, "c": 2}
        # Nothing is held under a value that is not a 64-bit hash: the match ends there.
        assert index.find_matches([*H[:2], -1, *H[2:]]) == {"a": 2, "b": 2, "c": 2}
        assert index.find_matches([*H[:3], "x", *H[3:]]) == {"a": 3, "b": 3, "c": 2}  # type: ignore[list-item]
        assert index.find_matches([2**64, *H]) == {}
        with pytest.raises(KeyError):
            index.parent_of(2**64)
        with pytest.raises(KeyError):
            index.parent_of(COLD[0])


def test_a_broken_compiled_table_falls_back_to_the_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise RuntimeError("no LLVM here")

    monkeypatch.setattr(events.index.prefix, "_self_test", broken)
    events.index.prefix._compiled_table_works.cache_clear()
    try:
        index = three_workers()
        assert not index.compiled
        assert index.find_matches(H) == {"a": 3, "b": 6, "c": 2}
        with pytest.raises(RuntimeError, match="needs numba"):
            PrefixIndex(compiled=True)
    finally:
        events.index.prefix._compiled_table_works.cache_clear()


def test_an_unknown_worker_holds_nothing() -> None:
    """What the index does not know holds no block and rebuilds from no event (callers need
    not check ``workers()`` first)."""
    index = PrefixIndex()
    assert (index.worker_blocks("nobody"), index.dump_events("nobody")) == ({}, [])
    assert index.workers() == []  # asking made no entry
