"""Scenario ``publishers``: 8 publishers at full speed into one consumer in its own process."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

from app.bench.events import Recording, record
from app.bench.faults.client import percentile
from app.bench.faults.harness import READY_TIMEOUT_S, SEED, rss_kib
from app.core.embedded_redis import EmbeddedRedis
from events.consumer import ConsumerConfig, EventConsumer
from events.envelope import Envelope
from events.publisher import EventPublisher

# -- 8 publishers at full speed into one consumer ----------------------------------------------


def _consumer_main(
    url: str, expected: dict[str, int], trees: dict[str, dict[int, int]], conn: Connection
) -> None:
    conn.send(asyncio.run(_consume(url, expected, trees, conn)))
    conn.close()


async def _consume(
    url: str, expected: dict[str, int], trees: dict[str, dict[int, int]], conn: Connection
) -> dict[str, Any]:
    lag_ms: list[float] = []
    done = asyncio.Event()
    remaining = set(expected)
    pid = os.getpid()
    rss = {"first": rss_kib(pid) or 0, "max": 0}

    def on_entry(worker_id: str, envelope: Envelope, events: Any, blocks: int) -> None:
        if envelope.ts_us:
            lag_ms.append(time.time() * 1e3 - envelope.ts_us / 1e3)
        if envelope.seq_last >= expected.get(worker_id, -2):
            remaining.discard(worker_id)
            if not remaining:
                done.set()

    async def sample() -> None:
        while True:
            rss["max"] = max(rss["max"], rss_kib(pid) or 0)
            await asyncio.sleep(0.05)

    consumer = EventConsumer(url, ConsumerConfig(registry_interval_s=0.1), on_entry=on_entry)
    sampler = asyncio.create_task(sample())
    try:
        async with consumer:
            while any(consumer.last_seq(w) is None for w in expected):
                await asyncio.sleep(0.005)
            rss["ready"] = rss_kib(pid) or 0
            conn.send("ready")
            start = time.monotonic()
            await asyncio.wait_for(done.wait(), READY_TIMEOUT_S * 2)
            seconds = time.monotonic() - start
            exact = all(consumer.index.worker_blocks(w) == trees[w] for w in expected)
            stats = consumer.stats()
    finally:
        sampler.cancel()
    return {"lag_ms": lag_ms, "rss": rss, "exact": exact, "stats": stats, "seconds": seconds}


async def _publish_all(url: str, recordings: list[Recording], conn: Connection) -> dict[str, Any]:
    publishers = [EventPublisher(url, rec.worker_id) for rec in recordings]
    for publisher in publishers:
        await publisher.start()
    while not conn.poll():
        await asyncio.sleep(0.005)
    if conn.recv() != "ready":
        raise RuntimeError("unexpected message from the consumer process")

    async def feed(publisher: EventPublisher, rec: Recording) -> None:
        for batch in rec.batches:
            publisher.publish(batch)
            await asyncio.sleep(0)

    start = time.monotonic()
    await asyncio.gather(*(feed(p, r) for p, r in zip(publishers, recordings, strict=True)))
    await asyncio.gather(*(p.flush(READY_TIMEOUT_S) for p in publishers))
    publish_s = time.monotonic() - start
    while not conn.poll():
        await asyncio.sleep(0.01)
    result: dict[str, Any] = conn.recv()
    result["publish_s"] = publish_s
    result["dropped"] = sum(p.num_dropped for p in publishers)
    for publisher in publishers:
        await publisher.aclose()
    return result


def publishers_into_consumer(
    *, num_publishers: int = 8, requests_per_worker: int = 150
) -> dict[str, Any]:
    """See the module docstring."""
    generate_start = time.monotonic()
    recordings = [
        record(f"p{i}", SEED + i, num_requests=requests_per_worker) for i in range(num_publishers)
    ]
    generate_s = time.monotonic() - generate_start
    expected = {rec.worker_id: rec.last_seq for rec in recordings}
    trees = {rec.worker_id: rec.tree for rec in recordings}
    context = multiprocessing.get_context("spawn")  # the consumer's RSS is its own, not ours
    with EmbeddedRedis() as server:
        parent_conn, child_conn = context.Pipe()
        child = context.Process(
            target=_consumer_main,
            args=(server.url, expected, trees, child_conn),
            name="kvmesh-bench-consumer",
            daemon=True,
        )
        child.start()
        try:
            gc.collect()
            result = asyncio.run(_publish_all(server.url, recordings, parent_conn))
        finally:
            child.join(30)
            if child.is_alive():
                child.kill()
                child.join()
    lag = result["lag_ms"]
    stats = result["stats"]
    block_events = sum(rec.block_events for rec in recordings)
    return {
        "publishers": num_publishers,
        "block_events": block_events,
        "events": sum(len(b) for rec in recordings for b in rec.batches),
        "entries": stats["entries"],
        "generate_s": round(generate_s, 2),
        "publish_s": round(result["publish_s"], 3),
        "consume_s": round(result["seconds"], 3),
        "block_events_per_s": round(block_events / result["seconds"]),
        "lag_p50_ms": round(statistics.median(lag), 2) if lag else 0.0,
        "lag_p99_ms": round(percentile(lag, 0.99), 2),
        "lag_max_ms": round(max(lag, default=0.0), 2),
        "consumer_rss_first_mib": round(result["rss"]["first"] / 1024, 1),
        "consumer_rss_ready_mib": round(result["rss"]["ready"] / 1024, 1),
        "consumer_rss_max_mib": round(result["rss"]["max"] / 1024, 1),
        "dropped": result["dropped"],
        "resyncs": stats["resyncs"],
        "malformed": stats["malformed"],
        "yields": stats["yields"],
        "index_exact": result["exact"],
    }
