"""EventBatcher on its own (no Redis): which events land in which entry, the block and byte
limits, dropping and the dropped count."""

from __future__ import annotations

from collections.abc import Sequence

from cache import (
    CreatedData,
    EventDiff,
    KVCacheEvent,
    RemovedData,
    StoredBlock,
    StoredData,
    UpdatedData,
)
from events.batching import EventBatcher, Fields, event_weight
from events.envelope import Envelope, decode_envelope

WINDOW = 64
BIG = [2**64 - 1 - i for i in range(20)]  # 9 bytes each in msgpack


def removed(event_id: int, num_hashes: int = 1) -> KVCacheEvent:
    """A removal weighing ``num_hashes`` blocks."""
    return KVCacheEvent(event_id, RemovedData(list(range(1, num_hashes + 1))), WINDOW)


def wide(event_id: int, num_hashes: int = 10) -> KVCacheEvent:
    """A removal of large hashes: 96 bytes encoded with 10 of them, 186 with 20."""
    return KVCacheEvent(event_id, RemovedData(BIG[:num_hashes]), WINDOW)


def ids(events: Sequence[KVCacheEvent]) -> list[int]:
    return [event.event_id for event in events]


def decoded(entries: list[Fields]) -> list[Envelope]:
    """The envelopes, read back as Redis hands them out (every value a string)."""
    return [
        decode_envelope({k: v if isinstance(v, bytes) else str(v) for k, v in fields.items()})
        for fields in entries
    ]


def test_event_weight_counts_blocks_and_one_per_other_event() -> None:
    stored = StoredData(None, [StoredBlock(h, ()) for h in (1, 2, 3)])
    events = [
        KVCacheEvent(0, CreatedData([4, 0]), WINDOW),
        KVCacheEvent(1, stored, WINDOW),
        KVCacheEvent(2, StoredData(None, []), WINDOW),
        KVCacheEvent(3, RemovedData([7, 8]), WINDOW),
        KVCacheEvent(4, RemovedData([]), WINDOW),
        KVCacheEvent(5, UpdatedData(7, cache_level=EventDiff(0, 1)), WINDOW),
    ]
    assert [event_weight([e]) for e in events] == [1, 3, 1, 2, 1, 1]
    assert event_weight(events) == 9


def test_batches_share_an_entry_up_to_max_entry_blocks() -> None:
    batcher = EventBatcher("w0", max_entry_blocks=4)
    batches = [[removed(0)], [removed(1, 2)], [removed(2)], [removed(3, 3)], [removed(4)]]
    for ts_us, batch in enumerate(batches, start=100):
        assert batcher.add(batch, ts_us=ts_us) == 0
    assert (batcher.buffered_blocks, batcher.num_batches, batcher.num_events) == (8, 5, 5)
    assert batcher.is_full
    assert batcher.first_event_id() == 0
    entries = batcher.take_entries()
    assert [(ids(e.events), e.ts_us, e.weight, e.dropped) for e in entries] == [
        ([0, 1, 2], 100, 4, 0),
        ([3, 4], 103, 4, 0),
    ]
    assert (batcher.buffered_blocks, batcher.num_batches, batcher.is_empty) == (0, 0, True)
    assert not batcher.is_full
    assert batcher.first_event_id() is None


def test_a_batch_heavier_than_an_entry_gets_one_to_itself() -> None:
    batcher = EventBatcher("w0", max_entry_blocks=4)
    batcher.add([removed(0)], ts_us=1)
    batcher.add([removed(1, 9)], ts_us=2)
    batcher.add([removed(2)], ts_us=3)
    entries = batcher.take_entries()
    assert [(ids(e.events), e.weight) for e in entries] == [([0], 1), ([1], 9), ([2], 1)]


def test_a_batch_after_a_loss_starts_an_entry_that_says_so() -> None:
    batcher = EventBatcher("w0")
    batcher.add([removed(0)], ts_us=1)
    batcher.add([removed(3)], ts_us=2, dropped=2)
    batcher.add([removed(4)], ts_us=3)
    batcher.add_dropped(5)  # nothing after it yet: it waits for the next batch
    assert batcher.carry_dropped == 5
    assert not batcher.is_empty
    batcher.add([removed(10)], ts_us=4)
    assert batcher.carry_dropped == 0
    entries = batcher.take_entries()
    assert [(ids(e.events), e.dropped) for e in entries] == [([0], 0), ([3, 4], 2), ([10], 5)]
    assert batcher.num_dropped == 0  # losses upstream are not the batcher's


def test_past_max_buffer_blocks_the_oldest_batches_are_dropped() -> None:
    batcher = EventBatcher("w0", max_buffer_blocks=5)
    assert batcher.add([removed(0, 2)], ts_us=1) == 0
    assert batcher.add([removed(1, 2)], ts_us=2, dropped=3) == 0
    # 6 blocks > 5: the oldest batch goes (1 event); the next one also carried a loss of 3,
    # but it stays, so only that one event is newly lost.
    assert batcher.add([removed(2, 2)], ts_us=3) == 1
    assert (batcher.buffered_blocks, batcher.num_dropped) == (4, 1)
    assert [(ids(b.events), b.dropped) for b in batcher.batches()] == [([1], 4), ([2], 0)]
    # 8 blocks: both older batches go, the first with the loss of 4 it carried.
    assert batcher.add([removed(3, 4)], ts_us=4) == 6
    assert (batcher.buffered_blocks, batcher.num_dropped) == (4, 3)
    entries = batcher.take_entries()
    # Event 3's entry reports every loss before it: 3 upstream, and events 0, 1 and 2.
    assert [(ids(e.events), e.dropped) for e in entries] == [([3], 6)]


def test_a_batch_over_the_whole_bound_is_dropped_at_once_and_carried() -> None:
    batcher = EventBatcher("w0", max_buffer_blocks=3)
    assert batcher.add([removed(0, 2), removed(1, 2)], ts_us=1, dropped=1) == 3
    assert (batcher.buffered_blocks, batcher.num_batches, batcher.carry_dropped) == (0, 0, 3)
    assert batcher.num_dropped == 2
    assert not batcher.is_empty
    assert batcher.take_entries() == []
    assert batcher.take_carry() == 3
    assert batcher.is_empty


def test_put_back_restores_order_and_moves_the_carry_to_the_front() -> None:
    batcher = EventBatcher("w0", max_entry_blocks=2)
    for event_id in range(4):
        batcher.add([removed(event_id)], ts_us=event_id)
    entries = batcher.take_entries()
    carry = batcher.take_carry()
    assert carry == 0
    batcher.add([removed(4)], ts_us=4)  # published while the write was in flight
    batcher.add_dropped(2)
    assert batcher.put_back(entries, carry=1) == 0
    assert [(ids(b.events), b.dropped, b.ts_us) for b in batcher.batches()] == [
        ([0, 1], 3, 0),
        ([2, 3], 0, 2),
        ([4], 0, 4),
    ]
    assert (batcher.buffered_blocks, batcher.carry_dropped) == (5, 0)


def test_put_back_over_the_bound_drops_the_oldest() -> None:
    batcher = EventBatcher("w0", max_entry_blocks=2, max_buffer_blocks=3)
    for event_id in range(2):
        batcher.add([removed(event_id)], ts_us=event_id)
    entries = batcher.take_entries()
    batcher.add([removed(2)], ts_us=2)
    batcher.add([removed(3)], ts_us=3)
    assert batcher.put_back(entries, carry=0) == 2
    assert [(ids(b.events), b.dropped) for b in batcher.batches()] == [([2], 2), ([3], 0)]
    assert (batcher.buffered_blocks, batcher.num_dropped) == (2, 2)


def test_clear_forgets_batches_and_losses() -> None:
    batcher = EventBatcher("w0")
    batcher.add([removed(0)], ts_us=1)
    batcher.add_dropped(4)
    batcher.clear()
    assert (batcher.buffered_blocks, batcher.num_batches, batcher.carry_dropped) == (0, 0, 0)
    assert batcher.is_empty


def test_encode_splits_an_entry_in_halves_while_over_max_entry_bytes() -> None:
    # 200 bytes of data per entry: two of these events (191 bytes), not three (286).
    batcher = EventBatcher("w0", max_entry_bytes=256 + 200)
    batcher.add([wide(i) for i in range(5)], ts_us=7, dropped=1)
    encoded = batcher.encode(batcher.take_entries(), 9)
    envelopes = decoded(encoded.fields)
    assert [ids(e.events()) for e in envelopes] == [[0, 1], [2], [3, 4]]
    assert [(e.epoch, e.dropped, e.ts_us, e.worker) for e in envelopes] == [
        (9, 1, 7, "w0"),  # the loss before the entry is said once, by its first piece
        (9, 0, 7, "w0"),
        (9, 0, 7, "w0"),
    ]
    assert all(len(e.data) <= 200 for e in envelopes)
    assert (encoded.num_oversized, batcher.num_dropped) == (0, 0)


def test_an_event_alone_over_max_entry_bytes_is_dropped_and_said() -> None:
    batcher = EventBatcher("w0", max_entry_bytes=256 + 100)
    batcher.add([wide(0), wide(1, 20), wide(2)], ts_us=1)
    encoded = batcher.encode(batcher.take_entries(), 3, next_seq=3)
    envelopes = decoded(encoded.fields)
    assert [(ids(e.events()), e.dropped) for e in envelopes] == [([0], 0), ([2], 1)]
    assert (encoded.num_oversized, batcher.num_dropped) == (1, 1)


def test_a_loss_with_nothing_after_it_becomes_a_marker() -> None:
    batcher = EventBatcher("w0", max_entry_bytes=256 + 100)
    batcher.add([wide(0), wide(1, 20)], ts_us=1)
    encoded = batcher.encode(batcher.take_entries(), 3, carry=2, next_seq=2)
    envelopes = decoded(encoded.fields)
    assert [(e.seq_first, e.seq_last, e.dropped, e.is_marker) for e in envelopes] == [
        (0, 0, 0, False),
        (2, 1, 3, True),  # the oversized event and the 2 carried
    ]
    assert encoded.num_oversized == 1
    # A carried loss alone is a marker too.
    alone = decoded(EventBatcher("w0").encode([], 3, carry=4, next_seq=10).fields)
    assert [(e.seq_first, e.seq_last, e.dropped, e.is_marker) for e in alone] == [(10, 9, 4, True)]
    assert EventBatcher("w0").encode([], 3).fields == []


def test_json_entries_carry_the_trtllm_shapes() -> None:
    batcher = EventBatcher("w0", fmt="json")
    batcher.add([removed(0, 2)], ts_us=1)
    (envelope,) = decoded(batcher.encode(batcher.take_entries(), 1).fields)
    assert envelope.fmt == "json"
    assert envelope.data == b'[{"event_id":0,"data":{"type":"removed","block_hashes":[1,2]},' \
        b'"window_size":64}]'  # fmt: skip
