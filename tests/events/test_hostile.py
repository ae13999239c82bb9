"""The event bus against hostile and faulty stream entries (issue 12, first block).

Real managers (``Workload``), a real Redis, and the truth taken from each manager's tree: each
test injects what was found to break the consumer or the publisher, and checks the exact
outcome (counters, log lines) and that the index equals the manager's tree, tier by tier.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from cache import KVCacheEvent, StoredBlock, StoredData
from events import keys
from events.consumer import EventConsumer
from events.envelope import make_envelope
from events.publisher import EventPublisher, PublisherConfig
from events.snapshot import Snapshot
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

WINDOW = 1024  # the workloads' attention window
MAX_ID = "18446744073709551615-18446744073709551615"


def _messages(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if needle in r.getMessage()]


def _jump_ahead(publisher: EventPublisher) -> dict[str, Any]:
    """A marker whose seq jumps 1000 ids ahead of the worker's."""
    return make_envelope("w0", publisher.epoch, [], next_seq=publisher.last_seq + 1001).fields()


def _epoch_max(publisher: EventPublisher) -> dict[str, Any]:
    """A marker at the right seq, from the last possible epoch."""
    return make_envelope("w0", 2**64 - 1, [], next_seq=publisher.last_seq + 1).fields()


@pytest.mark.parametrize(
    ("hostile", "why"),
    [
        (_jump_ahead, "seq_first..seq_last {next_1000}..{next_999} is past the worker's last "
         "event {last} (caused a resynchronisation: gap)"),
        (_epoch_max, "epoch 18446744073709551615 is later than the worker's ({epoch}) "
         "(caused a resynchronisation: epoch)"),
    ],
    ids=["seq_jumps_ahead", "epoch_2**64-1"],
)  # fmt: skip
async def test_a_marker_no_snapshot_gets_past_is_skipped_after_one_resync(
    clean_redis_url: str,
    caplog: pytest.LogCaptureFixture,
    hostile: Callable[[EventPublisher], dict[str, Any]],
    why: str,
) -> None:
    """Before: 600-800 resyncs in 15 s, the worker's part of the index wrong, nothing logged,
    and never healed for an idle worker."""
    caplog.set_level(logging.INFO, logger="events")
    workload = Workload(seed=800)
    client: Any = aioredis.Redis.from_url(clean_redis_url)
    publisher = make_publisher(clean_redis_url, "w0", workload)
    workers = {"w0": (workload, publisher)}
    try:
        async with publisher, make_consumer(clean_redis_url) as consumer:
            await drive(workload, publisher, 30)
            await assert_index_exact(consumer, workers)
            last = publisher.last_seq
            entry_id = await client.xadd(keys.events_key("w0"), hostile(publisher))
            # The worker stays idle: the consumer gets past the entry all the same.
            await eventually(lambda: consumer.num_malformed == 1 and bool(consumer.last_seq("w0")))
            assert index_blocks(consumer.index, "w0") == workload.blocks()
            await drive(workload, publisher, 30)
            await assert_index_exact(consumer, workers)
            await asyncio.sleep(0.3)  # time for a loop to show, if there were one
            stats = consumer.stats()
    finally:
        await client.aclose()
    assert (stats["resyncs"], stats["malformed"], stats["errors"]) == (1, 1, 0)
    assert stats["synced_workers"] == 1
    expected = why.format(
        next_1000=last + 1001, next_999=last + 1000, last=last, epoch=publisher.epoch
    )
    assert _messages(caplog, "skipped entry") == [
        f"consumer: skipped entry {entry_id!r} of w0: {expected}"
    ]


async def test_an_entry_with_the_largest_id_neither_stops_the_publisher_nor_freezes_the_index(
    clean_redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: the publisher's buffer grew for good (23,105 blocks in 15 s) while the consumer
    showed the worker in sync, its index frozen."""
    caplog.set_level(logging.INFO, logger="events")
    workload = Workload(seed=810)
    client: Any = aioredis.Redis.from_url(clean_redis_url)
    publisher = make_publisher(clean_redis_url, "w0", workload)
    workers = {"w0": (workload, publisher)}
    try:
        async with publisher, make_consumer(clean_redis_url, stale_after_s=0.3) as consumer:
            await drive(workload, publisher, 30)
            await assert_index_exact(consumer, workers)
            first_epoch = publisher.epoch
            await client.xadd(keys.events_key("w0"), {"hostile": "1"}, id=MAX_ID)
            state = consumer.workers()["w0"]
            await eventually(lambda: state.pos == MAX_ID.encode())  # XREAD sees nothing more
            await drive(workload, publisher, 30)
            # The heartbeat says the worker is ahead; the consumer applies nothing: stale.
            await eventually(lambda: state.stale == "behind_heartbeat")
            await assert_index_exact(consumer, workers)
            await eventually(lambda: state.stale is None)
            stats = consumer.stats()
    finally:
        await client.aclose()
    assert publisher.num_stream_resets == 1
    assert publisher.epoch != first_epoch
    assert publisher.buffered_blocks == 0
    assert stats["stale_reports"] == 1
    # Frozen at the largest id, the consumer never saw the new epoch's entries: the heartbeat
    # alone told it, and one resynchronisation moved it onto the new stream.
    assert stats["resync_reasons"] == {"behind_heartbeat": 1}
    assert stats["malformed"] == 1  # the hostile entry itself
    assert len(_messages(caplog, "the stream cannot take entries any more")) == 1
    assert len(_messages(caplog, "consumer: worker w0 is stale")) == 1


async def test_a_large_snapshot_is_replayed_without_holding_the_event_loop(
    clean_redis_url: str,
) -> None:
    """Before: a resync decoded and applied the whole snapshot in one step (100k blocks:
    about 0.45 s here; 8.4 s for a consumer 100k events behind on 2 cores)."""
    events: list[KVCacheEvent] = []
    for chain in range(20_000):  # 100,000 blocks in chains of 5
        blocks = [StoredBlock(1 + chain * 5 + i, (), cache_level=i % 2) for i in range(5)]
        events.append(KVCacheEvent(0, StoredData(None, blocks), WINDOW))
    publisher = EventPublisher(
        clean_redis_url,
        "w0",
        PublisherConfig(linger_s=0),
        snapshot_source=lambda: Snapshot(events, 0),
    )
    consumer = make_consumer(clean_redis_url)  # not started: the test runs its steps
    longest = 0.0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal longest
        before = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0)
            now = time.perf_counter()
            longest = max(longest, now - before)
            before = now

    try:
        async with publisher:
            task = asyncio.create_task(ticker())
            while consumer.last_seq("w0") is None:
                await consumer.step()
            stop.set()
            await task
    finally:
        await consumer.aclose()
    assert consumer.index.num_blocks("w0") == 100_000
    assert sorted(consumer.index.worker_blocks("w0").values()).count(1) == 40_000
    assert consumer.num_yields >= 10
    assert longest < 0.05  # step_budget_s is 10 ms; room for a loaded machine


async def test_a_slow_consumer_stalled_for_two_seconds_catches_up_without_resyncing(
    clean_redis_url: str,
) -> None:
    """A consumer at 6 ms an entry, stalled for 2 s, behind a stream trimmed by time.

    Before, with MAXLEN 50 (a count), it resynced 121-146 times in 15 s and its recovery
    raced the trimming (1.0 to 13.4 s, once not within 30 s). Trimmed by age (retain_s), the
    entries after its position are there when it comes back: no resync at all."""
    workload = Workload(seed=820)
    publisher = make_publisher(
        clean_redis_url, "w0", workload, maxlen=None, retain_s=30.0, linger_s=0
    )
    stall = threading.Event()
    stop = threading.Event()
    shared: dict[str, Any] = {}

    def slow(worker: str, envelope: Any, events: Any, blocks: int) -> None:
        time.sleep(0.006)
        if stall.is_set():
            stall.clear()
            time.sleep(2.0)

    def run_consumer() -> None:
        async def main() -> None:
            async with make_consumer(clean_redis_url, on_entry=slow) as consumer:
                shared["consumer"] = consumer
                while not stop.is_set():
                    await asyncio.sleep(0.01)

        asyncio.run(main())

    # Its own thread and event loop: the sleeps slow the consumer, not the publisher.
    thread = threading.Thread(target=run_consumer, name="slow-consumer")
    thread.start()
    try:
        async with publisher:
            await eventually(lambda: "consumer" in shared)
            consumer: EventConsumer = shared["consumer"]
            await eventually(lambda: consumer.last_seq("w0") is not None)
            await drive(workload, publisher, 100, steps_per_publish=2, pause_s=0.01)
            stall.set()
            await drive(workload, publisher, 200, steps_per_publish=2, pause_s=0.01)
            await publisher.flush(5)
            stopped = time.monotonic()
            await eventually(lambda: consumer.last_seq("w0") == last_event_id(workload), 20)
            caught_up_s = time.monotonic() - stopped
            # Read from this thread while the consumer, caught up, has nothing to apply.
            blocks = index_blocks(consumer.index, "w0")
            stats = consumer.stats()
            client: Any = aioredis.Redis.from_url(clean_redis_url)
            length = await client.xlen(keys.events_key("w0"))
            await client.aclose()
    finally:
        stop.set()
        thread.join(10)
    assert (stats["resyncs"], stats["snapshot_loads"], stats["malformed"]) == (0, 1, 0)
    assert blocks == workload.blocks()
    assert length == publisher.num_entries > 250  # nothing trimmed: MAXLEN 50 kept 50
    assert caught_up_s < 10


async def test_retain_s_trims_the_stream_by_age(clean_redis_url: str) -> None:
    workload = Workload(seed=821)
    client: Any = aioredis.Redis.from_url(clean_redis_url)
    stream = keys.events_key("w0")
    try:
        async with make_publisher(
            clean_redis_url, "w0", workload, maxlen=None, retain_s=0.2, linger_s=0
        ) as publisher:
            for _ in range(5):
                await drive(workload, publisher, 120, steps_per_publish=1)
                await publisher.flush(5)
                await asyncio.sleep(0.1)
            entries = await client.xrange(stream)
    finally:
        await client.aclose()
    first_ms = int(entries[0][0].split(b"-")[0])
    last_ms = int(entries[-1][0].split(b"-")[0])
    assert len(entries) < publisher.num_entries
    # Trimming is approximate (whole stream nodes of 100 entries): at most one node older.
    assert sum(int(e[0].split(b"-")[0]) < last_ms - 200 for e in entries) <= 100
    assert last_ms - first_ms < 2_000


async def test_an_event_the_index_refuses_is_skipped_without_resyncing(
    clean_redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: 8 resyncs before the entry was skipped."""
    caplog.set_level(logging.INFO, logger="events")
    workload = Workload(seed=830)
    client: Any = aioredis.Redis.from_url(clean_redis_url)
    publisher = make_publisher(clean_redis_url, "w0", workload)
    workers = {"w0": (workload, publisher)}
    try:
        async with publisher, make_consumer(clean_redis_url) as consumer:
            await drive(workload, publisher, 30)
            await assert_index_exact(consumer, workers)
            # Forged at the next id; the worker's own entry with that id comes after it.
            block = StoredBlock(12345, (), cache_level=7)
            event = KVCacheEvent(publisher.last_seq + 1, StoredData(None, [block]), WINDOW)
            forged = make_envelope("w0", publisher.epoch, [event]).fields()
            entry_id = await client.xadd(keys.events_key("w0"), forged)
            await drive(workload, publisher, 30)
            await assert_index_exact(consumer, workers)
            stats = consumer.stats()
    finally:
        await client.aclose()
    assert (stats["resyncs"], stats["malformed"], stats["errors"]) == (0, 1, 0)
    assert _messages(caplog, "skipped entry") == [
        f"consumer: skipped entry {entry_id!r} of w0: data: refused: "
        "stored event: cache_level must be 0 or 1, got 7"
    ]


async def test_json_with_infinity_or_deep_nesting_is_counted_as_malformed(
    clean_redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: OverflowError and RecursionError escaped the decoder (counted as errors)."""
    caplog.set_level(logging.INFO, logger="events")
    workload = Workload(seed=840)
    client: Any = aioredis.Redis.from_url(clean_redis_url)
    publisher = make_publisher(clean_redis_url, "w0", workload, fmt="json")
    workers = {"w0": (workload, publisher)}
    try:
        async with publisher, make_consumer(clean_redis_url) as consumer:
            await drive(workload, publisher, 30)
            await assert_index_exact(consumer, workers)
            next_id = publisher.last_seq + 1
            header = make_envelope("w0", publisher.epoch, [], fmt="json", next_seq=next_id)
            infinity = (
                b'[{"event_id": Infinity, "window_size": 1024,'
                b' "data": {"type": "removed", "block_hashes": [1]}}]'
            )
            deep = b"[" * 100_000 + b"]" * 100_000
            ids = []
            for data in (infinity, deep):
                fields = {**header.fields(), "seq_last": next_id, "data": data}
                ids.append(await client.xadd(keys.events_key("w0"), fields))
            await drive(workload, publisher, 30)
            await assert_index_exact(consumer, workers)
            stats = consumer.stats()
    finally:
        await client.aclose()
    assert (stats["malformed"], stats["errors"], stats["resyncs"]) == (2, 0, 0)
    assert _messages(caplog, "skipped entry") == [
        f"consumer: skipped entry {ids[0]!r} of w0: data: Infinity is not a valid value in an "
        "event",
        f"consumer: skipped entry {ids[1]!r} of w0: data: JSON nested too deeply",
    ]
    assert not _messages(caplog, "unexpected error")


def _rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc")
async def test_a_64_mib_entry_does_not_raise_the_consumers_rss_for_good(
    clean_redis_url: str, tmp_path: Any
) -> None:
    """Before: RSS 48 MB higher for good (glibc kept the freed heap)."""
    workload = Workload(seed=850)
    publisher = make_publisher(clean_redis_url, "w0", workload)
    workers = {"w0": (workload, publisher)}
    payload = tmp_path / "payload"
    payload.write_bytes(b"\x90" * (64 << 20))
    async with publisher, make_consumer(clean_redis_url) as consumer:
        await drive(workload, publisher, 30)
        await assert_index_exact(consumer, workers)
        # Written by redis-cli, so that only the consumer reads the 64 MiB in this process.
        ctypes.CDLL(None).malloc_trim(0)
        before = _rss_mib()
        with payload.open("rb") as stdin:
            subprocess.run(
                ["redis-cli", "-u", clean_redis_url, "-x", "XADD", keys.events_key("w0"), "*",
                 "data"],
                stdin=stdin,
                check=True,
                capture_output=True,
            )  # fmt: skip
        await eventually(lambda: consumer.num_oversized == 1)
        await drive(workload, publisher, 30)
        await assert_index_exact(consumer, workers)
        after = _rss_mib()
        stats = consumer.stats()
    assert (stats["oversized"], stats["malformed"], stats["resyncs"]) == (1, 1, 0)
    assert stats["memory_releases"] == 1
    assert after - before < 16, (before, after)


async def test_forged_registry_entries_and_other_workers_entries_are_skipped(
    clean_redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A registry entry that is not a JSON object or names a bad worker id, a stream of a worker
    nobody registered, an entry in w0's stream claiming to be w1's, one repeating ids already
    applied, and one with negative ids: each counted or ignored, none applied, w0 exact."""
    caplog.set_level(logging.INFO, logger="events")
    workload = Workload(seed=850)
    client: Any = aioredis.Redis.from_url(clean_redis_url)
    publisher = make_publisher(clean_redis_url, "w0", workload)
    workers = {"w0": (workload, publisher)}
    try:
        async with publisher, make_consumer(clean_redis_url) as consumer:
            await drive(workload, publisher, 20)
            await assert_index_exact(consumer, workers)
            await client.hset(keys.WORKERS_KEY, "ghost", b"not json")
            await client.hset(keys.WORKERS_KEY, "list", b"[1, 2]")
            await client.hset(keys.WORKERS_KEY, "bad{id}", b"{}")
            # A stream for a worker that is not registered: never read.
            stray = KVCacheEvent(0, StoredData(None, [StoredBlock(777, (1,))]), WINDOW)
            await client.xadd(
                keys.events_key("nobody"), make_envelope("nobody", 1, [stray]).fields()
            )
            # In w0's stream: an entry signed as w1, one repeating applied ids.
            other = make_envelope("w1", publisher.epoch, [stray]).fields()
            wrong_worker = await client.xadd(keys.events_key("w0"), other)
            repeat = KVCacheEvent(0, StoredData(None, [StoredBlock(778, (1,))]), WINDOW)
            await client.xadd(
                keys.events_key("w0"), make_envelope("w0", publisher.epoch, [repeat]).fields()
            )
            negative = make_envelope("w0", publisher.epoch, [], next_seq=1).fields()
            negative["seq_first"] = "-5"
            negative_id = await client.xadd(keys.events_key("w0"), negative)
            await drive(workload, publisher, 20)
            await assert_index_exact(consumer, workers)
            await eventually(lambda: consumer.num_bad_registry_entries == 3)
            await asyncio.sleep(0.2)  # a few more registry reads: no more lines, no more counts
            stats = consumer.stats()
            followed = sorted(consumer.workers())
    finally:
        await client.aclose()
    assert followed == ["w0"]
    assert (stats["malformed"], stats["resyncs"], stats["errors"]) == (2, 0, 0)
    assert stats["skipped_entries"] >= 1  # the repeated ids
    assert 777 not in index_blocks(consumer.index, "w0")
    assert 778 not in index_blocks(consumer.index, "w0")
    skipped = _messages(caplog, "skipped entry")
    assert [m.split(":")[1].strip() for m in skipped] == [
        f"skipped entry {wrong_worker!r} of w0",
        f"skipped entry {negative_id!r} of w0",
    ]
    assert stats["bad_registry_entries"] == 3
    assert sorted(_messages(caplog, "bad registry entry")) == [
        "consumer: bad registry entry b'bad{id}': worker id 'bad{id}' must not contain braces "
        "(Redis hash tags)",
        "consumer: bad registry entry b'ghost': Expecting value: line 1 column 1 (char 0)",
        "consumer: bad registry entry b'list': registry entry is not an object",
    ]
