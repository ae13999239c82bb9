"""One error tree for events/ (``events.errors``): every refusal of bad data is an
``EventsError`` (and still a ``ValueError``), and the consumer catches that root."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import redis.asyncio as aioredis

import events
from cache import (
    EventDiff,
    KVCacheEvent,
    RemovedData,
    StoredBlock,
    StoredData,
    UpdatedData,
)
from events import codec, envelope, errors, keys, snapshot
from events.codec import decode_events, encode_events
from events.envelope import decode_envelope, make_envelope
from events.errors import (
    EnvelopeError,
    EventCodecError,
    EventsError,
    InvalidEventError,
    InvalidWorkerIdError,
    OversizedEntryError,
    SnapshotError,
)
from events.index import PrefixIndex
from events.snapshot import Snapshot, decode_snapshot, encode_snapshot
from tests.events.support import make_consumer

WINDOW = 16


def test_the_tree() -> None:
    assert {cls: cls.__mro__[1:-3] for cls in errors.__dict__.values() if _is_error(cls)} == {
        EventsError: (),
        EventCodecError: (EventsError, ValueError),
        EnvelopeError: (EventsError, ValueError),
        OversizedEntryError: (EnvelopeError, EventsError, ValueError),
        SnapshotError: (EventsError, ValueError),
        InvalidEventError: (EventsError, ValueError),
        InvalidWorkerIdError: (EventsError, ValueError),
    }


def _is_error(value: object) -> bool:
    return isinstance(value, type) and issubclass(value, Exception)


def test_the_errors_are_the_same_classes_where_they_were_raised_before() -> None:
    assert codec.EventCodecError is EventCodecError
    assert envelope.EnvelopeError is EnvelopeError
    assert envelope.OversizedEntryError is OversizedEntryError
    assert snapshot.SnapshotError is SnapshotError
    assert events.EventsError is EventsError


def _stored(*hashes: int, level: int = 0, parent: int | None = None) -> KVCacheEvent:
    blocks = [StoredBlock(h, (), cache_level=level) for h in hashes]
    return KVCacheEvent(0, StoredData(parent, blocks), WINDOW)


@pytest.mark.parametrize(
    ("raise_it", "error", "message"),
    [
        (lambda: decode_events(b"\xc1"), EventCodecError, "not a msgpack document"),
        (lambda: decode_events(msgpack.packb([[0, 16, 9, 0]])), EventCodecError, "type code 9"),
        (lambda: decode_envelope({}), EnvelopeError, "^v: missing$"),
        (
            lambda: decode_envelope({b"data": b"x" * 100}, max_entry_bytes=10),
            OversizedEntryError,
            "^data: entry of 104 bytes is larger than 10$",
        ),
        (
            lambda: (
                make_envelope("w0", 1, [], next_seq=0)
                .__class__("w0", 1, 0, 0, 0, "msgpack", b"\xc1")
                .events()
            ),
            EnvelopeError,
            "^data: malformed KV event batch",
        ),
        (lambda: decode_snapshot(b"\xc1"), SnapshotError, "not a msgpack document"),
        (lambda: keys.validate_worker_id("w{1}"), InvalidWorkerIdError, "braces"),
        (lambda: keys.events_key(""), InvalidWorkerIdError, "must not be empty"),
        (
            lambda: keys.worker_from_events_key("kvmesh:workers"),
            InvalidWorkerIdError,
            "not a kvmesh events stream key",
        ),
    ],
    ids=[
        "codec-bytes",
        "codec-type",
        "envelope",
        "oversized",
        "envelope-data",
        "snapshot",
        "worker-id",
        "key",
        "events-key",
    ],
)
def test_each_module_raises_its_error(
    raise_it: Callable[[], object], error: type[EventsError], message: str
) -> None:
    with pytest.raises(error, match=message) as caught:
        raise_it()
    assert isinstance(caught.value, EventsError)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (_stored(1, 2, 1), "^stored event: a block hash appears twice in one chain$"),
        (_stored(1, 2, parent=2), "^stored event: block 2 is its own ancestor$"),
        (_stored(1, parent=-1), "^stored event: bad parent_hash -1$"),
        (_stored(1, 2**64), r"^stored event: block hash 18446744073709551616 is outside"),
        (_stored(1, level=7), "^stored event: cache_level must be 0 or 1, got 7$"),
        (
            KVCacheEvent(0, RemovedData("12"), WINDOW),  # type: ignore[arg-type]
            "^removed event: block_hashes must be a list, got str$",
        ),
        (
            KVCacheEvent(0, UpdatedData(1, cache_level=EventDiff(0, 5)), WINDOW),
            "^updated event: cache_level must become 0 or 1, got 5$",
        ),
        (KVCacheEvent(0, "stored", WINDOW), "^unknown event data str$"),  # type: ignore[arg-type]
        (42, "^not a KV cache event: int$"),
        ({"event_id": 1, "window_size": 16}, "^malformed TensorRT-LLM event"),
    ],
)
def test_every_refusal_of_the_index_is_an_invalid_event_error(event: Any, message: str) -> None:
    index = PrefixIndex()
    index.apply_event("w0", _stored(10, 11))
    with pytest.raises(InvalidEventError, match=message):
        index.apply_event("w0", event)
    assert index.worker_blocks("w0") == {10: 0, 11: 0}


def _bad_data_snapshot() -> bytes:
    """A snapshot whose header is fine and whose one event does not decode."""
    header = Snapshot([], 0, epoch=1, worker="w0")
    raw = msgpack.unpackb(encode_snapshot(header))
    raw["data"] = b"\x91\xc1"  # an array of one event, and a byte msgpack never uses
    packed: bytes = msgpack.packb(raw, use_bin_type=True)
    return packed


@pytest.mark.parametrize(
    ("make_raw", "message"),
    [
        (
            lambda: encode_snapshot(Snapshot([_stored(5, level=7)], 0, epoch=1, worker="w0")),
            "consumer: bad snapshot for w0: stored event: cache_level must be 0 or 1, got 7",
        ),
        (
            _bad_data_snapshot,
            "consumer: bad snapshot for w0: malformed snapshot: data: malformed KV event batch: "
            "event 0: not msgpack (FormatError: ",
        ),
    ],
    ids=["refused-by-the-index", "event-does-not-decode"],
)
async def test_the_consumer_counts_a_snapshot_it_cannot_replay_and_asks_for_another(
    clean_redis_url: str,
    caplog: pytest.LogCaptureFixture,
    make_raw: Callable[[], bytes],
    message: str,
) -> None:
    caplog.set_level(logging.INFO, logger="events")
    client: Any = aioredis.Redis.from_url(clean_redis_url)
    consumer = make_consumer(clean_redis_url)  # not started: the test runs its steps
    try:
        await client.hset(keys.WORKERS_KEY, "w0", '{"url": "http://w0:8001"}')
        await client.set(keys.alive_key("w0"), "1 0")
        await client.set(keys.snapshot_key("w0"), make_raw())
        await consumer.step()  # registry and heartbeat: w0 is to be synchronised
        await consumer.step()  # its snapshot is loaded, and refused
        assert consumer.num_malformed == 1
        assert consumer.stats()["errors"] == 0
        assert consumer.last_seq("w0") is None  # not synchronised
        assert consumer.index.workers() == []
        await consumer.step()  # the retry asks the worker for a fresh snapshot first
        assert await client.get(keys.snapshot_request_key("w0")) == b"1"
        assert (consumer.num_malformed, consumer.num_snapshot_requests) == (1, 1)
    finally:
        await consumer.aclose()
        await client.aclose()
    warnings = [r.getMessage() for r in caplog.records if "bad snapshot" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].startswith(message)


def test_a_stored_event_that_the_codec_writes_is_one_the_index_may_refuse() -> None:
    """The codec checks shapes, the index meaning: a cache level of 7 passes the first."""
    (event,) = decode_events(encode_events([_stored(5, level=7)]))
    with pytest.raises(InvalidEventError, match="cache_level must be 0 or 1, got 7"):
        PrefixIndex().apply_event("w0", event)
