"""EventPublisher against a real Redis, read back with plain Redis commands (no consumer)."""

from __future__ import annotations

import dataclasses
import json
from itertools import pairwise
from typing import Any

import pytest
import redis.asyncio as aioredis

from cache import KVCacheEvent, RemovedData
from events import keys
from events.envelope import Envelope, decode_envelope
from events.publisher import EventPublisher, PublisherConfig
from events.snapshot import Snapshot, decode_snapshot
from tests.events.support import Workload, drive, last_event_id, make_publisher


async def read_stream(url: str, worker_id: str) -> list[Envelope]:
    client: Any = aioredis.Redis.from_url(url)
    try:
        entries = await client.xrange(keys.events_key(worker_id))
    finally:
        await client.aclose()
    return [decode_envelope(fields) for _, fields in entries]


async def read_snapshot(url: str, worker_id: str) -> Snapshot:
    client: Any = aioredis.Redis.from_url(url)
    try:
        raw = await client.get(keys.snapshot_key(worker_id))
    finally:
        await client.aclose()
    assert isinstance(raw, bytes)
    return decode_snapshot(raw)


def removed(event_id: int, num_hashes: int = 1) -> KVCacheEvent:
    return KVCacheEvent(event_id, RemovedData(list(range(1, num_hashes + 1))), 64)


async def test_start_writes_snapshot_registry_heartbeat_and_load(clean_redis_url: str) -> None:
    workload = Workload(seed=1)
    for _ in range(50):
        workload.step()
    publisher = make_publisher(clean_redis_url, "w0", workload)
    client: Any = aioredis.Redis.from_url(clean_redis_url)
    try:
        async with publisher:
            snapshot = await read_snapshot(clean_redis_url, "w0")
            assert (snapshot.worker, snapshot.epoch, snapshot.stream_id) == (
                "w0",
                publisher.epoch,
                "0-0",
            )
            assert snapshot.event_id == last_event_id(workload)
            entry = json.loads(await client.hget(keys.WORKERS_KEY, "w0"))
            assert entry == {
                "worker": "w0",
                "url": "http://w0:8001",
                "device": "cpu",
                "capacity": [48, 16],
                "windows": {"1024": [48, 16]},
                "tokens_per_block": 4,
                "epoch": publisher.epoch,
                "started_at": entry["started_at"],
                "fmt": "msgpack",
                "heartbeat_ttl_s": 1.0,
            }
            assert await client.get(keys.alive_key("w0")) == f"{publisher.epoch} -1".encode()
            assert 0 < await client.pttl(keys.alive_key("w0")) <= 1000
            await publisher._heartbeat.write_load()
            load = await client.hgetall(keys.load_key("w0"))
            free = workload.mgr.get_num_free_blocks()
            assert load == {
                b"active_sequences": str(len(workload.mgr.sequences)).encode(),
                b"waiting_requests": str(len(workload.live)).encode(),
                b"free_blocks_0": str(free).encode(),
                b"used_blocks_0": str(48 - free).encode(),
                b"free_blocks_1": load[b"free_blocks_1"],
                b"used_blocks_1": load[b"used_blocks_1"],
            }
            assert int(load[b"free_blocks_1"]) + int(load[b"used_blocks_1"]) == 16
        # aclose() unregisters: registry entry, heartbeat and load are gone.
        assert await client.hget(keys.WORKERS_KEY, "w0") is None
        assert await client.exists(keys.alive_key("w0"), keys.load_key("w0")) == 0
        assert await client.exists(keys.snapshot_key("w0")) == 1
    finally:
        await client.aclose()


async def test_batches_become_entries_with_consecutive_seqs(clean_redis_url: str) -> None:
    publisher = EventPublisher(
        clean_redis_url, "w0", PublisherConfig(linger_s=0.05, max_entry_blocks=10)
    )
    async with publisher:
        # 30 one-block batches at once: the flusher waits for no linger once 10 blocks wait,
        # and cuts entries at 10 blocks.
        for event_id in range(30):
            publisher.publish([removed(event_id)])
        await publisher.flush(5)
        publisher.publish([removed(30, num_hashes=25)])  # larger than an entry: alone
        publisher.publish([removed(31)])
        await publisher.flush(5)
    envelopes = await read_stream(clean_redis_url, "w0")
    assert [(e.seq_first, e.seq_last) for e in envelopes] == [
        (0, 9),
        (10, 19),
        (20, 29),
        (30, 30),
        (31, 31),
    ]
    assert all(e.dropped == 0 and e.epoch == publisher.epoch for e in envelopes)
    assert [ev.event_id for e in envelopes for ev in e.events()] == list(range(32))
    assert publisher.stats()["entries"] == 5
    assert publisher.stats()["blocks"] == 30 + 25 + 1


async def test_close_flushes_what_is_buffered(clean_redis_url: str) -> None:
    publisher = EventPublisher(
        clean_redis_url, "w0", PublisherConfig(linger_s=10.0, max_entry_blocks=1000)
    )
    await publisher.start()
    for event_id in range(5):
        publisher.publish([removed(event_id)])
    await publisher.aclose()  # does not wait for the 10 s linger
    envelopes = await read_stream(clean_redis_url, "w0")
    assert [(e.seq_first, e.seq_last) for e in envelopes] == [(0, 4)]
    with pytest.raises(RuntimeError, match="closed"):
        publisher.publish([removed(5)])


async def test_entries_are_trimmed_to_about_maxlen(clean_redis_url: str) -> None:
    publisher = EventPublisher(
        clean_redis_url, "w0", PublisherConfig(linger_s=0, maxlen=10, max_entry_blocks=1)
    )
    async with publisher:
        for event_id in range(600):
            publisher.publish([removed(event_id)])
            if event_id % 50 == 49:
                await publisher.flush(5)
    envelopes = await read_stream(clean_redis_url, "w0")
    # MAXLEN ~ trims whole radix-tree nodes (100 entries each), so a little over 10 stay.
    assert 10 <= len(envelopes) <= 200
    assert envelopes[-1].seq_last == 599


async def test_an_event_too_large_for_any_entry_is_dropped_openly(clean_redis_url: str) -> None:
    workload = Workload(seed=2)
    publisher = make_publisher(clean_redis_url, "w0", workload, max_entry_bytes=300, linger_s=0)
    async with publisher:
        await publisher.flush(5)
        publisher.publish([removed(1)])
        publisher.publish([removed(2, num_hashes=100)])  # about 900 bytes encoded
        publisher.publish([removed(3)])
        await publisher.flush(5)
    envelopes = await read_stream(clean_redis_url, "w0")
    assert [(e.seq_first, e.seq_last, e.dropped) for e in envelopes] == [
        (1, 1, 0),
        (3, 3, 1),
    ]
    assert publisher.num_dropped == 1
    assert publisher.num_snapshots == 2  # at start, and after the drop


async def test_dropped_from_the_manager_starts_a_new_entry_after_a_snapshot(
    clean_redis_url: str,
) -> None:
    workload = Workload(seed=3, event_buffer=8)  # the manager's own queue overflows
    publisher = make_publisher(clean_redis_url, "w0", workload, linger_s=0.2)
    async with publisher:
        await publisher.flush(5)
        for _ in range(40):
            workload.step()
        assert workload.mgr.num_dropped_events > 0
        publisher.publish_from(workload.mgr)
        await publisher.flush(5)
        snapshot = await read_snapshot(clean_redis_url, "w0")
    envelopes = await read_stream(clean_redis_url, "w0")
    assert len(envelopes) == 1
    assert envelopes[0].dropped == workload.mgr.num_dropped_events
    assert snapshot.event_id == last_event_id(workload) >= envelopes[0].seq_last
    assert publisher.num_snapshots == 2


async def test_drop_with_nothing_after_it_writes_a_marker(clean_redis_url: str) -> None:
    workload = Workload(seed=4)
    publisher = make_publisher(clean_redis_url, "w0", workload, linger_s=0)
    async with publisher:
        await publisher.flush(5)
        for _ in range(20):
            workload.step()
        workload.mgr.take_events()  # lost, as far as the publisher knows
        publisher.publish([], dropped=7)
        await publisher.flush(5)
    envelopes = await read_stream(clean_redis_url, "w0")
    next_id = last_event_id(workload) + 1
    assert [(e.seq_first, e.seq_last, e.dropped, e.is_marker) for e in envelopes] == [
        (next_id, next_id - 1, 7, True)
    ]
    assert (await read_snapshot(clean_redis_url, "w0")).event_id == next_id - 1


async def test_publisher_checks_its_arguments(clean_redis_url: str) -> None:
    with pytest.raises(ValueError, match="braces"):
        EventPublisher(clean_redis_url, "w{1}")
    with pytest.raises(ValueError, match="fmt"):
        PublisherConfig(fmt="xml")
    with pytest.raises(ValueError, match="maxlen must be positive"):
        PublisherConfig(maxlen=0)
    with pytest.raises(ValueError, match="heartbeat_ttl_s"):
        PublisherConfig(heartbeat_interval_s=2, heartbeat_ttl_s=1)
    publisher = EventPublisher(clean_redis_url, "w1")
    with pytest.raises(ValueError, match="dropped"):
        publisher.publish([], dropped=-1)
    await publisher.aclose()


async def test_start_survives_a_redis_that_is_not_there() -> None:
    config = PublisherConfig(backoff_max_s=0.05, close_timeout_s=0.1)
    publisher = EventPublisher("redis://127.0.0.1:1/0", "w0", config)
    async with publisher:
        publisher.publish([removed(0)])
    assert publisher.num_errors >= 1
    assert publisher.buffered_blocks == 1


async def test_drive_helper_runs_a_workload(clean_redis_url: str) -> None:
    workload = Workload(seed=5)
    async with make_publisher(clean_redis_url, "w0", workload) as publisher:
        await drive(workload, publisher, 20)
        await publisher.flush(5)
        assert publisher.last_seq == last_event_id(workload)
    envelopes = await read_stream(clean_redis_url, "w0")
    assert envelopes[-1].seq_last == last_event_id(workload)


async def test_entries_over_max_entry_bytes_are_split(clean_redis_url: str) -> None:
    publisher = EventPublisher(
        clean_redis_url, "w0", PublisherConfig(max_entry_bytes=600, linger_s=0)
    )
    async with publisher:
        big = [2**64 - 1 - i for i in range(20)]  # 9 bytes each in msgpack: ~190 per event
        publisher.publish([KVCacheEvent(i, RemovedData(big), 64) for i in range(12)])
        await publisher.flush(5)
    envelopes = await read_stream(clean_redis_url, "w0")
    assert len(envelopes) > 1
    assert all(len(e.data) + 256 <= 600 for e in envelopes)
    assert [ev.event_id for e in envelopes for ev in e.events()] == list(range(12))
    assert all(e.seq_first == prev.seq_last + 1 for prev, e in pairwise(envelopes))
    assert publisher.num_dropped == 0


def test_publisher_config_defaults_are_what_a_worker_uses() -> None:
    config = PublisherConfig()
    assert dataclasses.asdict(config) == {
        "fmt": "msgpack",
        "maxlen": 10_000,
        "retain_s": 60.0,
        "max_entry_blocks": 4_096,
        "max_entry_bytes": 8 * 1024 * 1024,
        "linger_s": 0.002,
        "max_buffer_blocks": 1_000_000,
        "heartbeat_interval_s": 1.0,
        "heartbeat_ttl_s": 5.0,
        "load_interval_s": 1.0,
        "backoff_initial_s": 0.02,
        "backoff_max_s": 2.0,
        "close_timeout_s": 5.0,
        "close_timeout_failing_s": 1.0,
        "unregister_on_close": True,
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.linger_s = 0  # type: ignore[misc]
    assert PublisherConfig(maxlen=None, retain_s=None).maxlen is None  # None: no cap, no age
    with pytest.raises(ValueError, match="retain_s must be positive, got 0"):
        PublisherConfig(retain_s=0)
