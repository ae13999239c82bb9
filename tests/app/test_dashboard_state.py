"""``DashboardState``: rates per second, the sampled feed and its resumption, decisions, the
prefix map, all from real events on a fake clock."""

from __future__ import annotations

from app.dashboard.state import DashboardState, hex_hash
from app.router.policies import Cost, Decision
from cache import (
    EventDiff,
    KVCacheEvent,
    RemovedData,
    StoredBlock,
    StoredData,
    UpdatedData,
    block_hashes_for_tokens,
)
from events.envelope import Envelope
from events.index import PrefixIndex

WINDOW = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def stored(event_id: int, hashes: list[int], parent: int | None = None) -> KVCacheEvent:
    blocks = [StoredBlock(h, (1, 2)) for h in hashes]
    return KVCacheEvent(event_id, StoredData(parent, blocks), WINDOW)


def envelope(worker: str, events: list[KVCacheEvent]) -> Envelope:
    first, last = events[0].event_id, events[-1].event_id
    return Envelope(worker, 1, first, last, 0, "msgpack", b"")


def feed(state: DashboardState, worker: str, events: list[KVCacheEvent]) -> None:
    state.on_entry(worker, envelope(worker, events), events, 0)


def test_rates_count_blocks_per_second_and_type() -> None:
    clock = Clock()
    state = DashboardState(clock=clock, window_s=5)
    feed(state, "w0", [stored(1, [1, 2, 3]), stored(2, [4], parent=3)])
    clock.now += 1
    feed(state, "w0", [KVCacheEvent(3, RemovedData([4, 3]), WINDOW)])
    feed(state, "w1", [KVCacheEvent(1, UpdatedData(9, EventDiff(0, 1)), WINDOW)])
    clock.now += 2
    rates = state.rates(["w0", "w1", "w2"])
    assert rates["end"] == 1_003
    assert rates["series"]["w0"] == {
        "stored": [0, 4, 0, 0, 0],
        "removed": [0, 0, 2, 0, 0],
        "updated": [0, 0, 0, 0, 0],
    }
    assert rates["series"]["w1"]["updated"] == [0, 0, 1, 0, 0]
    assert rates["series"]["w2"]["stored"] == [0] * 5


def test_the_feed_is_sampled_per_interval_and_resumes_by_id() -> None:
    clock = Clock()
    state = DashboardState(clock=clock, feed_per_interval=3, feed_size=5, interval_s=0.25)
    feed(state, "w0", [stored(i, [100 + i]) for i in range(1, 6)])  # 3 kept, 2 skipped
    assert state.num_skipped == 2
    items, newest = state.feed_since(None)
    assert [(i["id"], i["hashes"]) for i in items] == [
        (1, [hex_hash(101)]),
        (2, [hex_hash(102)]),
        (3, [hex_hash(103)]),
    ]
    assert newest == 3
    clock.now += 0.25  # a new interval: a new budget
    feed(
        state,
        "w1",
        [
            KVCacheEvent(1, UpdatedData(7, EventDiff(0, 1)), WINDOW),
            KVCacheEvent(2, RemovedData([7, 8, 9, 10]), WINDOW),
        ],
    )
    items, newest = state.feed_since(3)
    assert [(i["id"], i["type"], i["blocks"], i["tier"]) for i in items] == [
        (4, "updated", 1, "0\u21921"),
        (5, "removed", 4, None),
    ]
    assert items[1]["hashes"] == [hex_hash(7), hex_hash(8), hex_hash(9)]
    assert state.feed_since(5) == ([], 5)
    clock.now += 0.25
    feed(state, "w0", [stored(9, [200]), stored(10, [201], parent=200)])
    # The ring holds ids 3..7 now: a client at 4 gets 5..7; one at 1 (fallen out) the newest.
    assert [i["id"] for i in state.feed_since(4)[0]] == [5, 6, 7]
    assert [i["id"] for i in state.feed_since(1, fresh=2)[0]] == [6, 7]
    assert state.feed_since(6)[0][0]["parent"] == hex_hash(200)


def test_decisions_and_the_prefix_map() -> None:
    clock = Clock()
    state = DashboardState(clock=clock, max_prefixes=2, prefix_blocks=4)
    index = PrefixIndex()
    system = block_hashes_for_tokens(list(range(96)), 16)  # 6 blocks
    other = block_hashes_for_tokens(list(range(500, 532)), 16)  # 2 blocks
    index.apply_event("w0", stored(1, system))
    index.apply_event("w1", stored(1, system[:2]))
    # Before any request: the most stored roots.
    feed(state, "w0", [stored(1, system)])
    feed(state, "w1", [stored(1, system[:2])])
    feed(state, "w1", [stored(2, other)])
    assert state.prefixes(index, ["w0", "w1"]) == {
        "by": "stored",
        "workers": ["w0", "w1"],
        "rows": [
            {"prefix": hex_hash(system[0]), "count": 2, "blocks": 4, "held": {"w0": 4, "w1": 2}},
            {"prefix": hex_hash(other[0]), "count": 1, "blocks": 2, "held": {"w0": 0, "w1": 0}},
        ],
    }
    decision = Decision(
        worker="w0",
        policy="kv_aware",
        expected_cached_tokens=80,
        costs=(Cost("w0", 16.0, 80, 16.0, 0.0, True), Cost("w1", 64.0, 32, 64.0, 0.0, True)),
        fresh=True,
    )
    for i in range(3):
        state.on_decision(f"r{i}", "completion", decision, 96, system)
    state.on_decision("q", "route", decision, 32, other)
    assert [d["request_id"] for d in state.decisions() or []] == ["r0", "r1", "r2", "q"]
    assert (state.decisions() or [])[0] == {
        "id": 1,
        "t": 1_000.0,
        "request_id": "r0",
        "kind": "completion",
        "policy": "kv_aware",
        "worker": "w0",
        "num_tokens": 96,
        "expected_cached_tokens": 80,
        "fresh": True,
        "costs": {"w0": 16.0, "w1": 64.0},
    }
    prefixes = state.prefixes(index, ["w0", "w1"])
    assert prefixes["by"] == "requests"
    assert [(r["prefix"], r["count"]) for r in prefixes["rows"]] == [
        (hex_hash(system[0]), 3),
        (hex_hash(other[0]), 1),
    ]
    assert DashboardState(record_decisions=False).decisions() is None

    # Requests are counted in batches between reads (what waits stays bounded) and in full
    # at each read; a prefix keeps its longest chain, within prefix_blocks (4 here).
    for i in range(130):
        state.on_decision(f"s{i}", "route", decision, 96, system if i % 2 else system[:3])
    assert len(state._pending) == 130 % 64
    rows = state.prefixes(index, ["w0", "w1"])["rows"]
    assert [(r["prefix"], r["count"], r["blocks"]) for r in rows] == [
        (hex_hash(system[0]), 133, 4),
        (hex_hash(other[0]), 1, 2),
    ]
    assert state._pending == []
    longer = block_hashes_for_tokens(list(range(700, 796)), 16)  # 6 blocks
    blocks = []
    for length in (2, 3, 6, 1):  # the kept chain grows to the longest seen, capped at 4
        for i in range(70):  # past a batch: counted before the read, and at it
            state.on_decision(f"l{length}-{i}", "route", decision, 96, longer[:length])
        rows = state.prefixes(index, ["w0", "w1"])["rows"]
        blocks.append(next(r["blocks"] for r in rows if r["prefix"] == hex_hash(longer[0])))
    assert blocks == [2, 3, 4, 4]


def test_decisions_ring_builds_each_row_once() -> None:
    state = DashboardState(clock=Clock(), decisions_size=2)
    decision = Decision(
        worker="w1",
        policy="kv_aware",
        expected_cached_tokens=0,
        costs=(Cost("w1", 2.0, 0, 2.0, 0.0, True),),
        fresh=False,
    )
    for i in range(3):
        state.on_decision(f"r{i}", "route", decision, 16, [])
    first = state.decisions() or []
    assert [(d["id"], d["request_id"], d["fresh"]) for d in first] == [
        (2, "r1", False),
        (3, "r2", False),
    ]
    state.on_decision("r3", "route", decision, 16, [])
    second = state.decisions() or []
    assert [d["id"] for d in second] == [3, 4]
    assert second[0] is first[1]  # the row of decision 3, built when first read
