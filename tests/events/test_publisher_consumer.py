"""Publishers on real managers -> a real Redis -> one consumer's PrefixIndex, end to end.

Every test ends with the same check (``assert_index_exact``): once the consumer has applied
every event id, its index holds, worker by worker and tier by tier, exactly the blocks in each
manager's reuse tree.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
from typing import Any

import pytest
import redis.asyncio as aioredis

from app.core.embedded_redis import EmbeddedRedis
from cache import KVCacheEvent, RemovedData
from events import keys
from events.envelope import decode_envelope, make_envelope
from events.publisher import EventPublisher, PublisherConfig
from tests.events.support import (
    Workload,
    assert_index_exact,
    drive,
    index_blocks,
    last_event_id,
    make_consumer,
    make_publisher,
)
from tests.support.wait import eventually


async def test_four_workers_publishing_concurrently(clean_redis_url: str) -> None:
    workloads = [Workload(seed=100 + i) for i in range(4)]
    # w3 publishes TensorRT-LLM's JSON shapes, the others msgpack: one consumer reads both.
    publishers = [
        make_publisher(clean_redis_url, f"w{i}", w, fmt="json" if i == 3 else "msgpack")
        for i, w in enumerate(workloads)
    ]
    workers = {p.worker_id: (w, p) for w, p in zip(workloads, publishers, strict=True)}
    async with make_consumer(clean_redis_url) as consumer:
        for publisher in publishers:
            await publisher.start()
        await asyncio.gather(*(drive(w, p, 250, pause_s=0.0005) for w, p in workers.values()))
        await assert_index_exact(consumer, workers)
        stats = consumer.stats()
        for publisher in publishers:
            await publisher.aclose()
    # Both tiers are exercised, and nothing went wrong on the way.
    assert any(1 in w.blocks().values() for w in workloads)
    assert stats["workers"] == stats["synced_workers"] == 4
    assert (stats["resyncs"], stats["malformed"], stats["errors"]) == (0, 0, 0)
    assert stats["syncs"] == stats["snapshot_loads"] == 4
    # Every event after the start-up snapshots (which cover each manager's `created`, id 0).
    assert stats["events"] == sum(last_event_id(w) for w in workloads)
    assert stats["blocks"] > 1_000
    assert consumer.workers()["w2"].info["url"] == "http://w2:8001"


async def test_redis_killed_and_restarted_mid_run(embedded_redis: EmbeddedRedis) -> None:
    url = embedded_redis.url
    workloads = [Workload(seed=200 + i) for i in range(4)]
    publishers = [make_publisher(url, f"w{i}", w) for i, w in enumerate(workloads)]
    workers = {p.worker_id: (w, p) for w, p in zip(workloads, publishers, strict=True)}
    async with make_consumer(url) as consumer:
        for publisher in publishers:
            await publisher.start()
        await eventually(lambda: consumer.stats()["synced_workers"] == 4)
        running = asyncio.gather(*(drive(w, p, 300, pause_s=0.002) for w, p in workers.values()))
        await asyncio.sleep(0.2)
        embedded_redis.kill()  # a crash: no persistence, the streams and snapshots are gone
        await asyncio.sleep(0.3)
        embedded_redis.start()
        await running
        await assert_index_exact(consumer, workers)
        stats = consumer.stats()
        for publisher in publishers:
            await publisher.aclose()
    assert stats["redis_restarts"] == 1
    assert stats["resync_reasons"]["redis_restart"] == 4
    assert stats["resyncs"] >= 4
    assert all(p.num_errors > 0 and p.num_snapshots >= 2 for p in publishers)
    assert stats["synced_workers"] == 4


async def test_a_late_consumer_rebuilds_from_snapshot_and_stream(clean_redis_url: str) -> None:
    workload = Workload(seed=300)
    async with make_publisher(clean_redis_url, "w0", workload) as publisher:
        await drive(workload, publisher, 100)
        await publisher.flush(5)
        async with make_consumer(clean_redis_url) as consumer:
            await assert_index_exact(consumer, {"w0": (workload, publisher)})
            await drive(workload, publisher, 50)
            await assert_index_exact(consumer, {"w0": (workload, publisher)})
            stats = consumer.stats()
            lag = await consumer.lag()
    assert (stats["syncs"], stats["snapshot_loads"], stats["resyncs"]) == (1, 1, 0)
    assert lag == {"w0": {"entries": 0, "ms": 0.0}}


async def test_a_late_consumer_after_the_stream_was_trimmed(clean_redis_url: str) -> None:
    workload = Workload(seed=301)
    # One entry per publish, and a stream that keeps only about the last 10 of them.
    publisher = make_publisher(clean_redis_url, "w0", workload, maxlen=10, linger_s=0)
    async with publisher:
        for _ in range(6):
            await drive(workload, publisher, 50)
            await publisher.flush(5)
        client: Any = aioredis.Redis.from_url(clean_redis_url)
        try:
            length = await client.xlen(keys.events_key("w0"))
        finally:
            await client.aclose()
        assert length < publisher.num_entries  # the start of the stream is gone
        async with make_consumer(clean_redis_url) as consumer:
            # The start-up snapshot is older than the stream: the consumer sees the gap, asks
            # for a fresh snapshot, and the worker writes one at its next heartbeat.
            await assert_index_exact(consumer, {"w0": (workload, publisher)})
            await drive(workload, publisher, 30)
            await assert_index_exact(consumer, {"w0": (workload, publisher)})
            stats = consumer.stats()
    assert stats["resync_reasons"]["gap"] >= 1
    assert stats["snapshot_requests"] >= 1
    assert stats["snapshot_loads"] >= 2
    assert publisher.num_snapshots >= 2


async def test_malformed_and_oversized_entries_are_counted_and_skipped(
    clean_redis_url: str,
) -> None:
    workload = Workload(seed=400)
    client: Any = aioredis.Redis.from_url(clean_redis_url)
    stream = keys.events_key("w0")
    publisher = make_publisher(clean_redis_url, "w0", workload, max_entry_blocks=64)
    try:
        async with publisher, make_consumer(clean_redis_url, max_entry_bytes=4096) as consumer:
            await drive(workload, publisher, 30)
            await assert_index_exact(consumer, {"w0": (workload, publisher)})
            next_id = publisher.last_seq + 1
            good = make_envelope("w0", publisher.epoch, [], next_seq=next_id).fields()
            bad: list[dict[str, Any]] = [
                {"hello": "world"},  # no envelope fields at all
                {**good, "v": 2},  # a format from the future
                # a valid header claiming the next id, with data that is not msgpack
                {**good, "seq_first": next_id, "seq_last": next_id, "data": b"\xc1\xc1"},
                # an entry over the consumer's max_entry_bytes
                {**good, "data": b"\x90" + b"\x00" * 5000},
                {**good, "worker": "w9"},  # another worker's entry in this stream
            ]
            for fields in bad:
                await client.xadd(stream, fields)
            await drive(workload, publisher, 30)
            await assert_index_exact(consumer, {"w0": (workload, publisher)})
            stats = consumer.stats()
    finally:
        await client.aclose()
    assert (stats["malformed"], stats["oversized"], stats["resyncs"]) == (5, 1, 0)


async def test_a_worker_whose_heartbeat_stops_leaves_the_index(clean_redis_url: str) -> None:
    workloads = [Workload(seed=500), Workload(seed=501)]
    survivor = make_publisher(clean_redis_url, "w0", workloads[0])
    # w1 "crashes": closing without unregistering is the same as dying, for Redis.
    crasher = make_publisher(
        clean_redis_url, "w1", workloads[1], unregister_on_close=False, heartbeat_ttl_s=0.3
    )
    async with make_consumer(clean_redis_url) as consumer:
        await survivor.start()
        await crasher.start()
        await drive(workloads[0], survivor, 30)
        await drive(workloads[1], crasher, 30)
        both = {"w0": (workloads[0], survivor), "w1": (workloads[1], crasher)}
        await assert_index_exact(consumer, both)
        assert index_blocks(consumer.index, "w1")
        await crasher.aclose()
        await eventually(lambda: consumer.stats()["expired"] == 1, timeout_s=5)
        assert consumer.index.workers() == ["w0"]
        assert consumer.last_seq("w1") is None
        await drive(workloads[0], survivor, 10)
        await assert_index_exact(consumer, {"w0": both["w0"]})
        # A worker that closes cleanly unregisters, and is forgotten at once.
        await survivor.aclose()
        await eventually(lambda: "w0" not in consumer.workers(), timeout_s=5)
        assert consumer.index.workers() == []
        assert consumer.stats()["expired"] == 1


async def test_a_restarted_worker_starts_a_new_epoch(clean_redis_url: str) -> None:
    first = Workload(seed=600)
    async with make_consumer(clean_redis_url) as consumer:
        async with make_publisher(clean_redis_url, "w0", first, unregister_on_close=False) as old:
            await drive(first, old, 40)
            await assert_index_exact(consumer, {"w0": (first, old)})
        # Same worker id, a new manager (empty cache), a new publisher: a new epoch.
        second = Workload(seed=601)
        async with make_publisher(clean_redis_url, "w0", second) as new:
            assert new.epoch > old.epoch
            await drive(second, new, 40)
            await assert_index_exact(consumer, {"w0": (second, new)})
            stats = consumer.stats()
    assert stats["resync_reasons"].get("epoch", 0) + stats["syncs"] >= 2


async def test_drop_path_snapshot_and_resync_while_redis_refuses_the_worker(
    clean_redis_url: str,
) -> None:
    # The worker's Redis user is switched off for a while: its writes fail, Redis keeps its
    # data, and the other clients (the consumer) carry on. A tiny buffer overflows meanwhile.
    admin: Any = aioredis.Redis.from_url(clean_redis_url)
    await admin.execute_command("ACL", "SETUSER", "worker", "on", ">secret", "~*", "&*", "+@all")
    worker_url = clean_redis_url.replace("redis://", "redis://worker:secret@")
    workload = Workload(seed=700)
    publisher = make_publisher(
        worker_url, "w0", workload, max_buffer_blocks=40, heartbeat_ttl_s=30.0, linger_s=0
    )
    try:
        async with publisher, make_consumer(clean_redis_url) as consumer:
            await drive(workload, publisher, 30)
            await assert_index_exact(consumer, {"w0": (workload, publisher)})
            snapshots_before = publisher.num_snapshots
            await admin.execute_command("ACL", "SETUSER", "worker", "off")
            await admin.execute_command("CLIENT", "KILL", "USER", "worker")
            await drive(workload, publisher, 100, pause_s=0.001)
            assert publisher.num_dropped > 0
            await admin.execute_command("ACL", "SETUSER", "worker", "on")
            await assert_index_exact(consumer, {"w0": (workload, publisher)})
            stats = consumer.stats()
            entries = await admin.xrange(keys.events_key("w0"))
    finally:
        await admin.execute_command("ACL", "DELUSER", "worker")
        await admin.aclose()
    envelopes = [decode_envelope(fields) for _, fields in entries]
    assert sum(e.dropped for e in envelopes) == publisher.num_dropped
    assert publisher.num_snapshots > snapshots_before
    assert stats["resync_reasons"]["dropped"] == 1
    assert stats["expired"] == 0


async def test_lag_counts_unread_entries(clean_redis_url: str) -> None:
    publisher = EventPublisher(
        clean_redis_url, "w0", PublisherConfig(linger_s=0, max_entry_blocks=1)
    )
    consumer = make_consumer(clean_redis_url)  # not started: the test runs its steps
    try:
        async with publisher:
            while consumer.last_seq("w0") != -1:
                await consumer.step()
            assert await consumer.lag() == {"w0": {"entries": 0, "ms": 0.0}}
            for event_id in range(5):
                publisher.publish([KVCacheEvent(event_id, RemovedData([7]), 64)])
            await publisher.flush(5)
            lag = await consumer.lag()
            assert lag["w0"]["entries"] == 5
            assert lag["w0"]["ms"] >= 0
            while consumer.last_seq("w0") != 4:
                await consumer.step()
            assert (await consumer.lag())["w0"]["entries"] == 0
    finally:
        await consumer.aclose()


@pytest.mark.parametrize("interval_s", [0.0, 0.3])
async def test_reads_are_at_most_one_per_read_interval(
    clean_redis_url: str, interval_s: float
) -> None:
    """An entry that arrives right after a read waits for the next read, no sooner than
    ``read_interval_s`` after the last: what comes meanwhile arrives in one reply."""
    publisher = EventPublisher(clean_redis_url, "w0", PublisherConfig(linger_s=0))
    consumer = make_consumer(clean_redis_url, read_interval_s=interval_s)  # stepped here
    try:
        async with publisher:
            while consumer.last_seq("w0") != -1:
                await consumer.step()
            reads = consumer.stats()["reads"]
            times = []
            for event_id in range(3):
                publisher.publish([KVCacheEvent(event_id, RemovedData([7]), 64)])
                await publisher.flush(5)
                await consumer.step()  # one read each: the entry is there
                times.append(consumer.last_read_at)
                assert consumer.last_seq("w0") == event_id
            assert consumer.stats()["reads"] == reads + 3
            gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
            if interval_s:
                assert min(gaps) >= interval_s
            else:
                assert max(gaps) < 0.3  # no wait, where the other case waits at least 0.3 s
    finally:
        await consumer.aclose()


async def test_the_consumer_gives_the_event_loop_back_between_entries(
    clean_redis_url: str,
) -> None:
    """A backlog is applied in slices of ``step_budget_s`` (here 0: one entry per slice), with
    the event loop free in between, and the index is whole between entries."""
    workload = Workload(seed=310)
    async with make_publisher(clean_redis_url, "w0", workload) as publisher:
        await publisher.flush(5)
        consumer = make_consumer(clean_redis_url, step_budget_s=0.0, count=1_000)
        try:
            while consumer.last_seq("w0") is None:
                await consumer.step()
            client = aioredis.Redis.from_url(clean_redis_url)
            length_before = await client.xlen(keys.events_key("w0"))
            for _ in range(20):  # one stream entry per flush (none when a step made no event)
                await drive(workload, publisher, 1)
                await publisher.flush(5)
            new_entries = await client.xlen(keys.events_key("w0")) - length_before
            await client.aclose()
            entries_before = consumer.num_entries
            turns = 0
            stop = asyncio.Event()

            async def ticker() -> None:
                nonlocal turns
                while not stop.is_set():
                    turns += 1
                    await asyncio.sleep(0)

            task = asyncio.create_task(ticker())
            await asyncio.sleep(0)
            await consumer.step()
            stop.set()
            await task
            applied = consumer.num_entries - entries_before
            assert applied == new_entries > 10
            assert consumer.num_yields == applied - 1
            assert turns >= applied - 1
            assert consumer.last_seq("w0") == last_event_id(workload)
            assert index_blocks(consumer.index, "w0") == workload.blocks()
        finally:
            await consumer.aclose()


async def test_a_per_stream_read_cancelled_before_it_starts_leaves_no_command_unawaited(
    clean_redis_url: str,
) -> None:
    """On a Redis Cluster the consumer reads each stream with its own XREAD, gathered. Cancelled
    before those reads start (the consumer closing), no redis-py command coroutine may be left
    never awaited (redis-py 8 wraps XREAD's in a second coroutine that would never await it; the
    warnings are errors here, and once failed the cluster test at random)."""
    consumer = make_consumer(clean_redis_url)
    consumer._cluster = True  # the per-stream path; a single node answers it the same
    streams: dict[bytes, bytes | str] = {keys.events_key(f"w{i}").encode(): b"0" for i in range(6)}
    try:
        read = asyncio.create_task(consumer._read(streams))
        await asyncio.sleep(0)  # the read has made its per-stream tasks, none has run yet
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read
        gc.collect()  # an unawaited coroutine warns when it is collected
        assert await consumer._read(streams) == []  # the path itself works
    finally:
        await consumer.aclose()


async def _watch_alive(consumer: Any, workers: set[str], missing: list[float]) -> None:
    """Every few ms: note when a followed worker is not alive in the consumer's view."""
    loop = asyncio.get_running_loop()
    while True:
        states = consumer.workers()
        if any(w not in states or not states[w].alive for w in workers):
            missing.append(loop.time())
        await asyncio.sleep(0.002)


@pytest.mark.parametrize("heartbeats_first", [False, True], ids=["both_gone", "heartbeats_first"])
async def test_a_redis_restart_holds_every_worker_until_it_registers_again(
    embedded_redis: EmbeddedRedis, heartbeats_first: bool
) -> None:
    """Redis restarts empty: the registry and the heartbeats are gone until each worker's next
    heartbeat (up to 1.5 s here). The consumer must keep following every worker through
    that, never report one gone, and rebuild the index from the new snapshots. Also when the
    heartbeats come back before the registry (on a Redis Cluster they live on other primaries,
    and only the registry's may restart)."""
    url = embedded_redis.url
    workloads = [Workload(seed=210 + i) for i in range(2)]
    # A heartbeat every 1.5 s: the registry stays empty for up to 1.5 s after the restart,
    # while the consumer reads it every 50 ms (and holds each worker for its 2 s TTL).
    publishers = [
        make_publisher(url, f"w{i}", w, heartbeat_interval_s=1.5, heartbeat_ttl_s=2.0)
        for i, w in enumerate(workloads)
    ]
    workers = {p.worker_id: (w, p) for w, p in zip(workloads, publishers, strict=True)}
    async with make_consumer(url) as consumer:
        for publisher in publishers:
            await publisher.start()
        await asyncio.gather(*(drive(w, p, 20) for w, p in workers.values()))
        await assert_index_exact(consumer, workers)
        missing: list[float] = []
        watch = asyncio.create_task(_watch_alive(consumer, set(workers), missing))
        try:
            embedded_redis.kill()
            await asyncio.sleep(0.2)
            embedded_redis.start()
            if heartbeats_first:
                client: Any = aioredis.Redis.from_url(url)
                try:
                    for publisher in publishers:
                        beat = f"{publisher.epoch} {publisher.last_seq}"
                        await client.set(keys.alive_key(publisher.worker_id), beat, px=2_000)
                finally:
                    await client.aclose()
            await eventually(lambda: all(p.registered for p in publishers))
            await eventually(lambda: consumer.stats()["held_workers"] == 0)
            await asyncio.gather(*(drive(w, p, 20) for w, p in workers.values()))
            await assert_index_exact(consumer, workers)
        finally:
            watch.cancel()
        stats = consumer.stats()
        for publisher in publishers:
            await publisher.aclose()
    assert missing == []
    assert stats["redis_restarts"] == 1
    assert (stats["held"], stats["expired"], stats["workers"]) == (2, 0, 2)
    assert stats["resync_reasons"]["redis_restart"] == 2


async def test_a_worker_that_dies_with_redis_expires_when_its_hold_is_over(
    embedded_redis: EmbeddedRedis,
) -> None:
    """Held through a restart for its heartbeat TTL, no longer: a worker that never registers
    again leaves the consumer then, while one that does stays."""
    url = embedded_redis.url
    ttl_s = 1.0
    survivor, victim = Workload(seed=220), Workload(seed=221)
    live = make_publisher(url, "w0", survivor, heartbeat_ttl_s=ttl_s)
    dead = make_publisher(
        url, "w1", victim, heartbeat_ttl_s=ttl_s, unregister_on_close=False, close_timeout_s=0.1
    )
    async with make_consumer(url) as consumer, live:
        await dead.start()
        await eventually(lambda: consumer.stats()["synced_workers"] == 2)
        embedded_redis.kill()
        await dead.aclose()  # dies with the server: nothing of it will come back
        embedded_redis.start()
        restarted = asyncio.get_running_loop().time()
        await eventually(lambda: consumer.stats()["held"] == 2)
        await eventually(lambda: "w1" not in consumer.workers(), timeout_s=ttl_s + 3.0)
        gone_after_s = asyncio.get_running_loop().time() - restarted
        await assert_index_exact(consumer, {"w0": (survivor, live)})
        stats = consumer.stats()
    # Held for its TTL from the moment the consumer saw the restart, then forgotten (the
    # registry no longer names it) and out of the index.
    assert ttl_s * 0.9 <= gone_after_s <= ttl_s + 1.5
    assert stats["workers"] == 1
    assert "w1" not in consumer.index.workers()
