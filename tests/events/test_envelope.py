"""The stream entry envelope, the Redis keys and the snapshot format."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import redis
from redis.crc import key_slot

from cache import (
    CreatedData,
    EventDiff,
    KVCacheBlock,
    KVCacheEvent,
    RemovedData,
    StoredBlock,
    StoredData,
    UpdatedData,
)
from events import keys
from events.envelope import (
    DEFAULT_MAX_ENTRY_BYTES,
    FMT_JSON,
    FMT_MSGPACK,
    Envelope,
    EnvelopeError,
    OversizedEntryError,
    decode_envelope,
    make_envelope,
)
from events.index import PrefixIndex
from events.snapshot import (
    Snapshot,
    SnapshotError,
    decode_snapshot,
    encode_snapshot,
    manager_snapshot,
)
from tests.events.support import Workload

MAX_U64 = 2**64 - 1
BIG = 2**63


def every_event_type() -> list[KVCacheEvent]:
    """Consecutive ids 10..16, every event type, hashes at and above 2**63."""
    return [
        KVCacheEvent(10, CreatedData([8, 2]), 16),
        KVCacheEvent(
            11,
            StoredData(
                None,
                [
                    StoredBlock(MAX_U64, (0, 1, 2, 3), cache_level=0, priority=35),
                    StoredBlock(
                        BIG,
                        (4, 5, 6, 7),
                        extra_ids=(0, 3, 0, 1),
                        cache_level=1,
                        priority=90,
                        mm_keys=((b"\x01" * 32, 42), ("sku-1234-a", 0)),
                        cache_salt="tenant-A",
                    ),
                ],
            ),
            16,
        ),
        KVCacheEvent(12, StoredData(BIG + 5, [StoredBlock(BIG + 6, (8, 9))]), 16),
        KVCacheEvent(13, RemovedData([BIG + 6, MAX_U64, 2**63 - 1]), 16),
        KVCacheEvent(14, UpdatedData(BIG, cache_level=EventDiff(0, 1)), 16),
        KVCacheEvent(15, UpdatedData(MAX_U64, priority=EventDiff(50, 10)), 16),
        KVCacheEvent(16, RemovedData([BIG]), 16, attention_dp_rank=1),
    ]


# -- envelope round trips ----------------------------------------------------------------------


def test_msgpack_round_trip_keeps_every_event_exactly() -> None:
    events = every_event_type()
    envelope = make_envelope("w0", MAX_U64, events, dropped=3, ts_us=1_700_000_000_000_000)
    back = decode_envelope(_as_redis_fields(envelope))
    assert back == envelope
    assert (back.v, back.worker, back.epoch, back.fmt) == (1, "w0", MAX_U64, FMT_MSGPACK)
    assert (back.seq_first, back.seq_last, back.dropped) == (10, 16, 3)
    assert back.ts_us == 1_700_000_000_000_000
    assert back.events() == events


def test_json_round_trip_keeps_trtllm_shapes_and_big_hashes() -> None:
    events = every_event_type()
    envelope = make_envelope("w0", 7, events, fmt=FMT_JSON)
    back = decode_envelope(_as_redis_fields(envelope))
    assert back.fmt == FMT_JSON
    assert [e.to_dict() for e in back.events()] == [e.to_dict() for e in events]
    # The hashes are JSON integers, not floats or strings.
    assert b'"block_hash":18446744073709551615' in back.data
    assert b'"block_hash":9223372036854775808' in back.data


def test_entry_round_trip_through_a_real_redis_stream(clean_redis_url: str) -> None:
    client: Any = redis.Redis.from_url(clean_redis_url)
    try:
        for fmt in (FMT_MSGPACK, FMT_JSON):
            envelope = make_envelope("w-1", 2**64 - 2, every_event_type(), fmt=fmt)
            client.xadd(keys.events_key("w-1"), envelope.fields())
        entries = client.xrange(keys.events_key("w-1"))
    finally:
        client.close()
    decoded = [decode_envelope(fields) for _, fields in entries]
    assert [e.fmt for e in decoded] == [FMT_MSGPACK, FMT_JSON]
    for envelope in decoded:
        assert envelope.epoch == 2**64 - 2
        assert [e.to_dict() for e in envelope.events()] == [e.to_dict() for e in every_event_type()]


def test_a_marker_carries_no_events() -> None:
    marker = make_envelope("w0", 1, [], dropped=5, next_seq=40)
    assert (marker.seq_first, marker.seq_last, marker.is_marker) == (40, 39, True)
    back = decode_envelope(_as_redis_fields(marker))
    assert back.events() == []
    assert back.dropped == 5
    with pytest.raises(ValueError, match="next_seq"):
        make_envelope("w0", 1, [])


def test_make_envelope_checks_its_arguments() -> None:
    events = every_event_type()
    with pytest.raises(ValueError, match="braces"):
        make_envelope("w{0}", 1, events)
    with pytest.raises(ValueError, match="fmt"):
        make_envelope("w0", 1, events, fmt="yaml")
    with pytest.raises(ValueError, match="epoch"):
        make_envelope("w0", 2**64, events)
    with pytest.raises(ValueError, match="dropped"):
        make_envelope("w0", 1, events, dropped=-1)


# -- malformed entries -------------------------------------------------------------------------


def _as_redis_fields(envelope: Envelope) -> dict[bytes, bytes]:
    """The fields as redis-py returns them from XRANGE/XREAD: bytes to bytes."""
    out: dict[bytes, bytes] = {}
    for name, value in envelope.fields().items():
        out[name.encode()] = value if isinstance(value, bytes) else str(value).encode()
    return out


def _good_fields() -> dict[bytes, bytes]:
    return _as_redis_fields(make_envelope("w0", 9, every_event_type()))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({b"v": None}, "^v: missing"),
        ({b"data": None}, "^data: missing"),
        ({b"seq_first": None}, "^seq_first: missing"),
        ({b"v": b"2"}, "^v: unsupported format version 2"),
        ({b"v": b"one"}, "^v: not an integer"),
        ({b"epoch": b"-1"}, "^epoch: -1 is out of range"),
        ({b"epoch": str(2**64).encode()}, "^epoch: .* is out of range"),
        ({b"dropped": b"x"}, "^dropped: not an integer"),
        ({b"worker": b"w{0}"}, "^worker: .*braces"),
        ({b"worker": b"\xff"}, "^worker: not UTF-8"),
        ({b"fmt": b"yaml"}, "^fmt: unknown format 'yaml'"),
        ({b"seq_first": b"20", b"seq_last": b"10"}, "^seq_last: 10 is before seq_first 20"),
    ],
)
def test_a_malformed_header_names_the_field(
    change: dict[bytes, bytes | None], message: str
) -> None:
    fields = _good_fields()
    for name, value in change.items():
        if value is None:
            del fields[name]
        else:
            fields[name] = value
    with pytest.raises(EnvelopeError, match=message):
        decode_envelope(fields)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({b"data": b"\xc1"}, "^data: malformed KV event batch: not a msgpack document"),
        ({b"data": msgpack.packb([[1, 2]])}, "^data: malformed KV event batch"),
        ({b"fmt": b"json", b"data": b"{"}, "^data: not a JSON document"),
        ({b"fmt": b"json", b"data": b"{}"}, "^data: expected a JSON list"),
        ({b"fmt": b"json", b"data": b'[{"event_id": 10}]'}, "^data: event 0: malformed"),
        ({b"seq_first": b"9"}, r"^data: event ids run 10\.\.16, but seq_first\.\.seq_last is 9"),
        ({b"seq_last": b"17"}, r"^data: event ids run 10\.\.16, but .* is 10\.\.17"),
        ({b"data": msgpack.packb([])}, r"^data: no events, but seq_first\.\.seq_last is 10\.\.16"),
    ],
)
def test_malformed_data_is_found_when_the_events_are_decoded(
    change: dict[bytes, bytes], message: str
) -> None:
    fields = _good_fields()
    fields.update(change)
    envelope = decode_envelope(fields)  # the header is fine
    with pytest.raises(EnvelopeError, match=message):
        envelope.events()


def test_event_ids_must_increase_inside_an_entry() -> None:
    events = every_event_type()
    events[3] = KVCacheEvent(12, RemovedData([1]), 16)  # 10 11 12 12 14 15 16
    with pytest.raises(EnvelopeError, match=r"^data: event ids do not increase strictly"):
        decode_envelope(_as_redis_fields(make_envelope("w0", 1, events))).events()


def test_an_oversized_entry_is_refused_before_anything_else() -> None:
    fields = _good_fields()
    size = sum(len(k) + len(v) for k, v in fields.items())
    assert decode_envelope(fields, max_entry_bytes=size).seq_last == 16
    with pytest.raises(OversizedEntryError, match=f"^data: entry of {size} bytes is larger than"):
        decode_envelope(fields, max_entry_bytes=size - 1)
    fields[b"v"] = b"99"  # not even looked at
    with pytest.raises(EnvelopeError, match="larger than"):
        decode_envelope(fields, max_entry_bytes=size - 1)
    assert DEFAULT_MAX_ENTRY_BYTES == 8 * 1024 * 1024


def test_decode_accepts_str_fields_and_ignores_unknown_ones() -> None:
    envelope = make_envelope("w0", 3, every_event_type(), fmt=FMT_JSON)
    fields: dict[str, Any] = {
        k: v if isinstance(v, bytes) else str(v) for k, v in envelope.fields().items()
    }
    fields["data"] = envelope.data.decode()
    fields["extra"] = "ignored"
    assert decode_envelope(fields) == envelope


# -- keys --------------------------------------------------------------------------------------


def test_keys_share_one_cluster_slot_per_worker() -> None:
    worker_keys = [
        keys.events_key("w3"),
        keys.snapshot_key("w3"),
        keys.snapshot_request_key("w3"),
        keys.load_key("w3"),
        keys.alive_key("w3"),
    ]
    assert worker_keys == [
        "kvmesh:{w3}:events",
        "kvmesh:{w3}:snapshot",
        "kvmesh:{w3}:snapshot:request",
        "kvmesh:{w3}:load",
        "kvmesh:{w3}:alive",
    ]
    assert len({key_slot(key.encode()) for key in worker_keys}) == 1
    assert keys.WORKERS_KEY == "kvmesh:workers"
    assert keys.worker_from_events_key(b"kvmesh:{gpu-7.node2}:events") == "gpu-7.node2"


@pytest.mark.parametrize(
    ("worker_id", "message"),
    [
        ("", "must not be empty"),
        ("w" * 129, "129 characters long; at most 128"),
        ("w{1", "braces"),
        ("w}1", "braces"),
        ("w 1", "whitespace"),
        ("w\n1", "whitespace"),
        (7, "must be a str"),
    ],
)
def test_bad_worker_ids_fail_before_any_io(worker_id: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        keys.events_key(worker_id)
    with pytest.raises(ValueError, match=message):
        keys.validate_worker_id(worker_id)


def test_worker_from_events_key_refuses_other_keys() -> None:
    for key in ("kvmesh:workers", "kvmesh:{w1}:load", "other:{w1}:events"):
        with pytest.raises(ValueError, match="not a kvmesh events stream key"):
            keys.worker_from_events_key(key)


# -- snapshots ---------------------------------------------------------------------------------


@pytest.fixture
def busy_workload() -> Iterator[Workload]:
    workload = Workload(seed=11)
    for _ in range(400):
        workload.step()
    yield workload


def test_manager_snapshot_replays_into_exactly_the_tree(busy_workload: Workload) -> None:
    mgr = busy_workload.mgr
    tree = busy_workload.blocks()
    assert 1 in tree.values() and 0 in tree.values()  # both tiers are in use
    snapshot = manager_snapshot(mgr)
    assert snapshot.event_id == mgr.take_events()[-1].event_id  # the newest event there is
    assert snapshot.num_blocks == len(tree)
    index = PrefixIndex()
    index.apply_events("w0", snapshot.events)
    assert index.worker_blocks("w0") == tree
    seen: set[int] = set()
    for event in snapshot.events:
        assert isinstance(event.data, StoredData)
        # Parents come first, and each event is one chain.
        assert event.data.parent_hash is None or event.data.parent_hash in seen
        seen.update(block.block_hash for block in event.data.blocks)
        assert all(block.tokens == () for block in event.data.blocks)


def test_manager_snapshot_with_tokens(busy_workload: Workload) -> None:
    mgr = busy_workload.mgr
    snapshot = manager_snapshot(mgr, with_tokens=True)
    blocks: dict[int, KVCacheBlock] = {
        b.hash: b for window in mgr.window_sizes for b in mgr.tree_blocks(window)
    }
    for event in snapshot.events:
        assert isinstance(event.data, StoredData)
        for stored in event.data.blocks:
            assert stored.tokens == blocks[stored.block_hash].key.tokens


def test_snapshot_flushes_the_iteration_first(busy_workload: Workload) -> None:
    mgr = busy_workload.mgr
    mgr.take_events()
    busy_workload.step()  # events now wait in the manager's current iteration
    snapshot = manager_snapshot(mgr)
    later = mgr.take_events()
    assert all(event.event_id <= snapshot.event_id for event in later)


def test_snapshot_encoding_round_trip() -> None:
    events = every_event_type()
    snapshot = Snapshot(events, 16, epoch=MAX_U64, stream_id="17-3", worker="w9", ts_us=5)
    back = decode_snapshot(encode_snapshot(snapshot))
    assert back == snapshot
    assert (back.epoch, back.event_id, back.stream_id, back.worker, back.ts_us) == (
        MAX_U64,
        16,
        "17-3",
        "w9",
        5,
    )
    empty = Snapshot([], -1, epoch=1, worker="w9")
    assert decode_snapshot(encode_snapshot(empty)) == empty


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\xc1", "not a msgpack document"),
        (msgpack.packb([1]), "expected a map"),
        (msgpack.packb({"v": 2}), "v: unsupported version 2"),
        (msgpack.packb({"v": 1, "epoch": 1}), "event_id: missing"),
        (
            msgpack.packb({"v": 1, "epoch": 1, "event_id": "3"}),
            "event_id: expected int, got str",
        ),
        (
            msgpack.packb({"v": 1, "epoch": 1, "event_id": 3, "data": b"\xc1"}),
            "data: malformed KV event batch",
        ),
    ],
)
def test_malformed_snapshots_are_refused(raw: bytes, message: str) -> None:
    with pytest.raises(SnapshotError, match=message):
        decode_snapshot(raw)


@pytest.mark.parametrize(
    "module_name",
    [
        "events.keys",
        "events.envelope",
        "events.snapshot",
        "events.errors",
        "events.batching",
        "events.redis_io",
        "events.publisher",
        "events.publisher.config",
        "events.publisher.publisher",
        "events.publisher.flusher",
        "events.publisher.heartbeat",
        "events.consumer",
        "events.consumer.config",
        "events.consumer.loop",
        "events.consumer.registry",
        "events.consumer.liveness",
        "events.consumer.resync",
        "events.consumer.apply",
        "events.consumer.state",
        "events.index",
        "events.index.prefix",
        "events.index.tables",
    ],
)
def test_export_lists_are_exact(module_name: str) -> None:
    module = importlib.import_module(module_name)
    defined = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(value) or inspect.isclass(value))
        and value.__module__ == module_name
    }
    assert defined <= set(module.__all__)
    assert all(hasattr(module, name) for name in module.__all__)
