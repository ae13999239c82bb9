"""The consumer at its exact boundaries: a gap of one event id, a heartbeat met exactly.

A real Redis, entries and snapshots written directly (``make_envelope``, ``encode_snapshot``)
or by a real publisher, and exact counters and index contents.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import pytest
import redis.asyncio as aioredis

from cache import KVCacheEvent, StoredBlock, StoredData
from events import keys
from events.consumer import ConsumerConfig, EventConsumer
from events.envelope import make_envelope
from events.snapshot import Snapshot, encode_snapshot
from tests.events.support import Workload, assert_index_exact, drive, make_consumer, make_publisher
from tests.support.wait import eventually

WINDOW = 64
EPOCH = 7


def _stored(event_id: int, parent: int | None, hashes: list[int]) -> KVCacheEvent:
    blocks = [StoredBlock(h, ()) for h in hashes]
    return KVCacheEvent(event_id, StoredData(parent, blocks), WINDOW)


async def _put_snapshot(client: Any, snapshot: Snapshot) -> None:
    await client.set(keys.snapshot_key(snapshot.worker), encode_snapshot(snapshot))


async def _step_until(consumer: EventConsumer, condition: Any, max_steps: int = 100) -> None:
    """Run the consumer's rounds by hand (no task: nothing runs between two of them)."""
    for _ in range(max_steps):
        if condition():
            return
        await consumer.step()
    raise AssertionError(f"condition still false after {max_steps} consumer steps")


async def test_a_gap_of_exactly_one_event_id_resynchronises(clean_redis_url: str) -> None:
    """Event 1 is lost: the entry holding event 2 (seq_first = last_seq + 2) cannot follow
    event 0. The consumer resynchronises once, from a snapshot that holds all three blocks,
    instead of applying event 2 on top of a chain that lacks event 1's block."""
    client: Any = aioredis.Redis.from_url(clean_redis_url)
    consumer = make_consumer(clean_redis_url)  # not started: the test runs its steps
    try:
        await client.hset(keys.WORKERS_KEY, "w0", json.dumps({"worker": "w0", "epoch": EPOCH}))
        await client.set(keys.alive_key("w0"), f"{EPOCH} -1", px=30_000)
        await _put_snapshot(client, Snapshot([], -1, EPOCH, "0-0", "w0"))
        await _step_until(consumer, lambda: consumer.last_seq("w0") == -1)
        assert consumer.index.workers() == []  # synchronised on an empty snapshot

        stream = keys.events_key("w0")
        await client.xadd(stream, make_envelope("w0", EPOCH, [_stored(0, None, [101])]).fields())
        # Event 1 (block 102 under 101) never reaches the stream.
        last_id = await client.xadd(
            stream, make_envelope("w0", EPOCH, [_stored(2, 102, [103])]).fields()
        )
        # The worker's snapshot after event 2, as it would write it when asked.
        after = Snapshot([_stored(2, None, [101, 102, 103])], 2, EPOCH, last_id.decode(), "w0")
        await _put_snapshot(client, after)

        await _step_until(consumer, lambda: consumer.last_seq("w0") == 2)
        stats = consumer.stats()
        state = consumer.workers()["w0"]
    finally:
        await consumer.aclose()
        await client.aclose()
    assert stats["resync_reasons"] == {"gap": 1}
    assert (stats["resyncs"], stats["snapshot_loads"], stats["snapshot_requests"]) == (1, 2, 0)
    assert (stats["entries"], stats["malformed"], stats["errors"]) == (1, 0, 0)
    position = (state.epoch, state.last_seq, state.snapshot_seq, state.pos)
    assert position == (EPOCH, 2, 2, last_id.decode())
    # Exactly the snapshot's content: 101 -> 102 -> 103, all on the GPU tier.
    assert consumer.index.worker_blocks("w0") == {101: 0, 102: 0, 103: 0}
    assert {h: consumer.index.parent_of(h) for h in (101, 102, 103)} == {
        101: None,
        102: 101,
        103: 102,
    }


async def test_a_worker_caught_up_exactly_with_its_heartbeat_is_not_stale(
    clean_redis_url: str,
) -> None:
    """The consumer applied (epoch, last_seq) == the heartbeat's (epoch, seq): the worker is
    not behind, so no timer runs for it (``behind_target`` stays None) and, idle for well over
    ``stale_after_s``, it is never reported ``behind_heartbeat``."""
    stale_after_s = 0.15
    workload = Workload(seed=870)
    client: Any = aioredis.Redis.from_url(clean_redis_url)
    publisher = make_publisher(clean_redis_url, "w0", workload)
    workers = {"w0": (workload, publisher)}
    try:
        async with (
            publisher,
            make_consumer(clean_redis_url, stale_after_s=stale_after_s) as consumer,
        ):
            await drive(workload, publisher, 20)
            await assert_index_exact(consumer, workers)
            state = consumer.workers()["w0"]
            last = publisher.last_seq
            assert last == workload.mgr.last_event_id > 0
            # The heartbeat, and the consumer's reading of it, say exactly what was applied.
            beat = f"{publisher.epoch} {last}".encode()
            await eventually(
                lambda: (state.reported_epoch, state.reported_seq) == (publisher.epoch, last)
            )
            assert await client.get(keys.alive_key("w0")) == beat
            assert (state.epoch, state.last_seq) == (publisher.epoch, last)
            checked = consumer._next_liveness_at
            idle_from = time.monotonic()
            # Idle: several liveness checks, over three times stale_after_s.
            await asyncio.sleep(3 * stale_after_s + 0.05)
            assert consumer._next_liveness_at > checked  # the heartbeat was checked again
            assert time.monotonic() - idle_from > stale_after_s
            assert await client.get(keys.alive_key("w0")) == beat  # still idle
            assert (state.epoch, state.last_seq) == (publisher.epoch, last)
            stats = consumer.stats()
            stale, behind_target = state.stale, state.behind_target
    finally:
        await client.aclose()
    assert stale is None
    assert (stats["stale_reports"], stats["stale_workers"], stats["resyncs"]) == (0, 0, 0)
    assert behind_target is None


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"block_ms": 0}, "block_ms must be positive, got 0"),
        ({"count": -1}, "count must be positive, got -1"),
        ({"max_entry_bytes": 0}, "max_entry_bytes must be positive"),
        ({"backoff_initial_s": 0.0}, "backoff_initial_s must be positive"),
        ({"registry_interval_s": -0.1}, "registry_interval_s must be >= 0"),
        ({"liveness_interval_s": float("nan")}, "liveness_interval_s must be >= 0"),
        ({"resync_delay_s": -1.0}, "resync_delay_s must be >= 0"),
        ({"step_budget_s": -0.001}, "step_budget_s must be >= 0"),
        ({"read_interval_s": -0.001}, "read_interval_s must be >= 0"),
        ({"stale_after_s": -1.0}, "stale_after_s must be >= 0"),
        ({"restart_hold_s": -1.0}, "restart_hold_s must be >= 0"),
        ({"resync_delay_s": 2.0}, "resync_delay_max_s must be >= resync_delay_s"),
        ({"backoff_max_s": 0.01}, "backoff_max_s must be >= backoff_initial_s"),
    ],
)
def test_consumer_config_refuses_a_setting_out_of_range(
    settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        ConsumerConfig(**settings)


async def test_a_consumer_without_a_config_takes_the_defaults() -> None:
    consumer = EventConsumer("redis://127.0.0.1:1/0")
    try:
        assert consumer.config == ConsumerConfig()
        assert (consumer.config.block_ms, consumer.config.step_budget_s) == (100, 0.010)
        assert ConsumerConfig(step_budget_s=0.0).step_budget_s == 0.0  # one entry per slice
    finally:
        await consumer.aclose()
