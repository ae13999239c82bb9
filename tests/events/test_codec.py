from __future__ import annotations

import datetime
import enum
import uuid
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cache import (
    CreatedData,
    EventDiff,
    KVCacheEvent,
    KVCacheManager,
    LlmRequest,
    RemovedData,
    StoredBlock,
    StoredData,
    UpdatedData,
)
from events.codec import (
    TYPE_CREATED,
    TYPE_REMOVED,
    TYPE_STORED,
    TYPE_UPDATED,
    EventCodecError,
    decode_events,
    encode_events,
)


class _Plain(enum.Enum):
    A = 1


class _Level(enum.IntEnum):
    HOST = 1


MAX_U64 = 2**64 - 1
BIG = 2**63  # the first hash that does not fit a signed 64-bit integer


def sample_events() -> list[KVCacheEvent]:
    """One event of every type, hashes at and above 2**63, every optional field both ways."""
    return [
        KVCacheEvent(0, CreatedData([16384, 0]), 4096),
        KVCacheEvent(
            1,
            StoredData(
                None,
                [
                    StoredBlock(MAX_U64, tuple(range(16))),
                    StoredBlock(
                        BIG,
                        (31999, 0, 7, 2**32 - 1),
                        extra_ids=(0, 5, 0, 9),
                        cache_level=1,
                        priority=90,
                        mm_keys=((b"\xab" * 32, 3), ("not-a-digest", 0)),
                        cache_salt="salt",
                        lora_id=7,
                    ),
                ],
            ),
            4096,
        ),
        KVCacheEvent(2, StoredData(BIG + 12345, [StoredBlock(BIG + 1, (1, 2, 3))]), 4096),
        KVCacheEvent(3, RemovedData([BIG, MAX_U64, 0, 2**63 - 1]), 4096),
        KVCacheEvent(4, UpdatedData(MAX_U64, EventDiff(0, 1), EventDiff(35, 80)), 4096),
        KVCacheEvent(5, UpdatedData(BIG + 2, None, EventDiff(80, 35)), 512),
        KVCacheEvent(6, UpdatedData(BIG + 3, EventDiff(1, 0), None), 512),
        KVCacheEvent(7, RemovedData([BIG + 4]), 4096, attention_dp_rank=3),
    ]


def test_round_trip_of_every_event_type() -> None:
    events = sample_events()
    decoded = decode_events(encode_events(events))
    assert [e.to_dict() for e in decoded] == [e.to_dict() for e in events]
    # to_dict() omits lora_id; the dataclasses compare every field.
    assert decoded == events
    assert {e.type for e in decoded} == {"created", "stored", "removed", "updated"}


def test_round_trip_keeps_types_the_manager_uses() -> None:
    stored = decode_events(encode_events(sample_events()))[1].data
    assert isinstance(stored, StoredData)
    block = stored.blocks[1]
    assert type(block.tokens) is tuple
    assert type(block.extra_ids) is tuple
    assert block.mm_keys == ((b"\xab" * 32, 3), ("not-a-digest", 0))
    assert type(block.mm_keys[0][0]) is bytes
    assert type(block.mm_keys[1][0]) is str
    removed = decode_events(encode_events(sample_events()))[3].data
    assert isinstance(removed, RemovedData)
    assert type(removed.block_hashes) is list


def test_empty_batch() -> None:
    assert decode_events(encode_events([])) == []


def test_layout_is_the_documented_one() -> None:
    raw = msgpack.unpackb(encode_events(sample_events()), use_list=True)
    assert raw[0] == [0, 4096, TYPE_CREATED, [16384, 0]]
    assert raw[1][:4] == [1, 4096, TYPE_STORED, None]
    assert raw[1][4][0] == [MAX_U64, list(range(16)), None, 0, 35, [], None, None]
    assert raw[3] == [3, 4096, TYPE_REMOVED, [BIG, MAX_U64, 0, 2**63 - 1]]
    assert raw[4] == [4, 4096, TYPE_UPDATED, MAX_U64, [0, 1], [35, 80]]
    assert raw[7] == [7, 4096, TYPE_REMOVED, [BIG + 4], 3]


def test_round_trip_of_a_real_managers_events() -> None:
    mgr = KVCacheManager(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        tokens_per_block=4,
        blocks_per_window={64: (8, 0)},
        max_attention_window=[64],
        max_sequence_length=64,
        event_buffer_max_size=1000,
        allocate_pools=False,
    )
    events: list[KVCacheEvent] = []
    for rid in range(6):  # 6 x 4 blocks on 8 blocks: stores, then evictions
        request = LlmRequest(rid, [rid * 100 + t for t in range(16)])
        mgr.add_sequence(request)
        mgr.remove_sequence(rid, request)
        events += mgr.take_events()
    assert {e.type for e in events} >= {"created", "stored", "removed"}
    decoded = decode_events(encode_events(events))
    assert [e.to_dict() for e in decoded] == [e.to_dict() for e in events]


hashes = st.integers(min_value=0, max_value=MAX_U64)
small = st.integers(min_value=0, max_value=2**31 - 1)


@st.composite
def stored_blocks(draw: st.DrawFn) -> StoredBlock:
    tokens = tuple(draw(st.lists(st.integers(0, 2**32 - 1), max_size=8)))
    extra = draw(st.none() | st.just(tuple(draw(small) for _ in tokens)))
    mm = draw(st.lists(st.tuples(st.binary(max_size=32) | st.text(max_size=8), small), max_size=2))
    return StoredBlock(
        draw(hashes),
        tokens,
        extra,
        draw(st.integers(0, 1)),
        draw(st.integers(0, 100)),
        tuple(mm),
        draw(st.none() | st.text(max_size=8)),
        draw(st.none() | small),
    )


diffs = st.none() | st.builds(EventDiff, small, small)
event_data = st.one_of(
    st.builds(CreatedData, st.lists(small, max_size=3)),
    st.builds(StoredData, st.none() | hashes, st.lists(stored_blocks(), max_size=4)),
    st.builds(RemovedData, st.lists(hashes, max_size=6)),
    st.builds(UpdatedData, hashes, diffs, diffs),
)
kv_events = st.builds(KVCacheEvent, small, event_data, small, st.none() | small)


@given(st.lists(kv_events, max_size=6))
def test_round_trip_property(events: list[KVCacheEvent]) -> None:
    assert decode_events(encode_events(events)) == events


def _as_arrays(event: KVCacheEvent) -> list[Any]:
    """The documented layout, written out again (lists, as msgpack's own packb is given them)."""
    data = event.data
    head: list[Any] = [event.event_id, event.window_size]
    if isinstance(data, CreatedData):
        out = [*head, TYPE_CREATED, list(data.num_blocks_per_cache_level)]
    elif isinstance(data, StoredData):
        blocks = [
            [
                b.block_hash,
                list(b.tokens),
                None if b.extra_ids is None else list(b.extra_ids),
                b.cache_level,
                b.priority,
                [list(key) for key in b.mm_keys],
                b.cache_salt,
                b.lora_id,
            ]
            for b in data.blocks
        ]
        out = [*head, TYPE_STORED, data.parent_hash, blocks]
    elif isinstance(data, RemovedData):
        out = [*head, TYPE_REMOVED, list(data.block_hashes)]
    else:
        assert isinstance(data, UpdatedData)
        diffs = [
            None if d is None else [d.old_value, d.new_value]
            for d in (data.cache_level, data.priority)
        ]
        out = [*head, TYPE_UPDATED, data.block_hash, *diffs]
    return out if event.attention_dp_rank is None else [*out, event.attention_dp_rank]


@given(st.lists(kv_events, max_size=6))
def test_the_bytes_are_msgpacks_own(events: list[KVCacheEvent]) -> None:
    """The encoder (ormsgpack) writes byte for byte what msgpack's packb(use_bin_type=True)
    writes for the documented layout: the wire format does not depend on the packer."""
    expected = msgpack.packb([_as_arrays(e) for e in events], use_bin_type=True)
    assert encode_events(events) == expected


def test_the_documented_sample_is_msgpacks_own() -> None:
    events = sample_events()
    expected = msgpack.packb([_as_arrays(e) for e in events], use_bin_type=True)
    assert encode_events(events) == expected


# -- malformed input ---------------------------------------------------------------------------


def pack(obj: Any) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


GOOD_BLOCK = [BIG, [1, 2, 3, 4], None, 0, 35, [], None, None]


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "not a msgpack document"),
        (b"\xc1", "not a msgpack document"),
        (b"\x00\xff garbage \x13\x37" * 3, "not a msgpack document"),
        (pack([]) + b"\x01", "not a msgpack document"),  # trailing bytes
        (pack({"a": 1}), "expected an array of events, got map"),
        (pack(7), "expected an array of events, got int"),
        (pack([7]), "event 0: an event must be an array, got int"),
        (pack([[1, 2]]), "at least 3 elements"),
        (pack([[1, 4096, 9, []]]), "unknown event type code 9"),
        (pack([[1, 4096, -1, []]]), "unknown event type code -1"),
        (pack([[1, 4096, "stored", []]]), "type code must be an integer, got str"),
        (pack([["1", 4096, TYPE_REMOVED, []]]), "event_id must be an integer, got str"),
        (pack([[1, 4096.0, TYPE_REMOVED, []]]), "window_size must be an integer, got float"),
        (pack([[1, 4096, TYPE_REMOVED]]), "must have 4 or 5 elements, got 3"),
        (pack([[1, 4096, TYPE_REMOVED, [], None, None]]), "must have 4 or 5 elements, got 6"),
        (pack([[1, 4096, TYPE_REMOVED, [], "rank"]]), "attention_dp_rank must be an integer"),
        (pack([[1, 4096, TYPE_REMOVED, 5]]), "block_hashes must be an array, got int"),
        (pack([[1, 4096, TYPE_REMOVED, [1, "2"]]]), "block_hashes must be an array of integers"),
        (pack([[1, 4096, TYPE_REMOVED, [True]]]), "block_hashes must be an array of integers"),
        (pack([[1, 4096, TYPE_REMOVED, [-1]]]), "unsigned 64-bit"),
        (pack([[1, 4096, TYPE_CREATED, None]]), "num_blocks_per_cache_level must be an array"),
        (pack([[1, 4096, TYPE_UPDATED, BIG, [1], None]]), "cache_level diff must have 2"),
        (pack([[1, 4096, TYPE_UPDATED, BIG, None, 3]]), "priority diff must be an array"),
        (pack([[1, 4096, TYPE_UPDATED, -5, None, None]]), "block_hash -5 is not an unsigned"),
        (pack([[1, 4096, TYPE_STORED, "p", [GOOD_BLOCK]]]), "parent_hash must be an integer"),
        (pack([[1, 4096, TYPE_STORED, None, {}]]), "blocks must be an array, got map"),
        (pack([[1, 4096, TYPE_STORED, None, [[BIG]]]]), "block 0: a stored block must have 8"),
        (pack([[1, 4096, TYPE_STORED, None, [GOOD_BLOCK, 3]]]), "block 1: a stored block must"),
        (
            pack([[1, 4096, TYPE_STORED, None, [[b"h", *GOOD_BLOCK[1:]]]]]),
            "block_hash must be an integer, got bytes",
        ),
        # plain blocks (the columns' fast path) with one that is not: the per-block checks say
        (
            pack([[1, 4096, TYPE_STORED, None, [GOOD_BLOCK, [-1, *GOOD_BLOCK[1:]]]]]),
            "block 1: block_hash -1 is not an unsigned 64-bit integer",
        ),
        (
            pack(
                [
                    [
                        1,
                        4096,
                        TYPE_STORED,
                        None,
                        [GOOD_BLOCK, [*GOOD_BLOCK[:3], True, 35, [], None, None]],
                    ]
                ]
            ),
            "block 1: cache_level must be an integer, got bool",
        ),
        (
            pack([[1, 4096, TYPE_STORED, None, [GOOD_BLOCK, [*GOOD_BLOCK[:5], [], None, "x"]]]]),
            "block 1: lora_id must be an integer, got str",
        ),
        (
            pack([[1, 4096, TYPE_STORED, None, [[BIG, "1234", *GOOD_BLOCK[2:]]]]]),
            "tokens must be an array, got str",
        ),
        (
            pack([[1, 4096, TYPE_STORED, None, [GOOD_BLOCK, [BIG, [1, "x"], *GOOD_BLOCK[2:]]]]]),
            "tokens must be integers, found str",
        ),
        (
            pack([[1, 4096, TYPE_STORED, None, [[BIG, [1, 2.5], *GOOD_BLOCK[2:]]]]]),
            "tokens must be integers, found float",
        ),
        (
            pack([[1, 4096, TYPE_STORED, None, [[BIG, [1, 2], [0], *GOOD_BLOCK[3:]]]]]),
            "extra_ids has 1 entries for 2 tokens",
        ),
        (
            pack([[1, 4096, TYPE_STORED, None, [[*GOOD_BLOCK[:5], [[b"x"]], None, None]]]]),
            "an mm key must have 2 elements",
        ),
        (
            pack([[1, 4096, TYPE_STORED, None, [[*GOOD_BLOCK[:5], [[3, 0]], None, None]]]]),
            "an mm key hash must be bin or str, got int",
        ),
        (
            pack([[1, 4096, TYPE_STORED, None, [[*GOOD_BLOCK[:6], 5, None]]]]),
            "cache_salt must be a str or nil, got int",
        ),
        (
            pack([[1, 4096, TYPE_STORED, None, [[*GOOD_BLOCK[:7], "lora"]]]]),
            "lora_id must be an integer, got str",
        ),
    ],
)
def test_malformed_input_raises_value_error(data: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        decode_events(data)


def test_errors_say_which_event() -> None:
    good = [0, 4096, TYPE_REMOVED, [BIG]]
    with pytest.raises(EventCodecError, match=r"event 2 \(removed, id 0\)"):
        decode_events(pack([good, good, [0, 4096, TYPE_REMOVED, ["x"]]]))


def test_the_documented_good_block_decodes() -> None:
    # The malformed cases above differ from this valid event in one place each.
    [event] = decode_events(pack([[1, 4096, TYPE_STORED, None, [GOOD_BLOCK]]]))
    assert event.data == StoredData(None, [StoredBlock(BIG, (1, 2, 3, 4))])


def test_every_truncation_of_a_valid_batch_raises_value_error() -> None:
    data = encode_events(sample_events())
    for end in range(len(data)):
        with pytest.raises(ValueError):
            decode_events(data[:end])


def test_non_bytes_input_raises_value_error() -> None:
    with pytest.raises(ValueError, match="expected bytes, got str"):
        decode_events("not bytes")  # type: ignore[arg-type]


@given(st.binary(max_size=64))
def test_arbitrary_bytes_decode_or_raise_value_error(data: bytes) -> None:
    try:
        events = decode_events(data)
    except ValueError:
        return
    assert all(isinstance(e, KVCacheEvent) for e in events)


def test_encoding_a_hash_beyond_uint64_raises_value_error() -> None:
    event = KVCacheEvent(0, RemovedData([2**64]), 4096)
    with pytest.raises(ValueError, match="cannot encode"):
        encode_events([event])


@pytest.mark.parametrize(
    "token",
    [
        EventDiff(1, 2),  # a dataclass
        datetime.datetime(2026, 1, 1),
        uuid.UUID(int=7),
        1.5j,
        -(2**63) - 1,
        _Plain.A,
    ],
)
def test_encoding_what_msgpack_refuses_raises_value_error(token: Any) -> None:
    event = KVCacheEvent(0, StoredData(None, [StoredBlock(1, (1, token))]), 4096)
    with pytest.raises(ValueError, match="cannot encode KV cache events"):
        encode_events([event])


def test_an_int_enum_is_packed_as_its_int_as_msgpack_packs_it() -> None:
    event = KVCacheEvent(0, StoredData(None, [StoredBlock(1, (1, _Level.HOST))]), 4096)
    assert encode_events([event]) == encode_events(
        [KVCacheEvent(0, StoredData(None, [StoredBlock(1, (1, 1))]), 4096)]
    )
    assert encode_events([event]) == msgpack.packb([_as_arrays(event)], use_bin_type=True)
