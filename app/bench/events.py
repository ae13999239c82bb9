"""``kvmesh bench events``: KV events from 4 publishers through Redis into one consumer's index.

The transport is measured, not the managers: the event batches are *pre-generated*. Four real
``KVCacheManager`` instances (16 tokens a block, 4,096 primary + 1,024 secondary blocks, events
on) each run the workload of ``kvmesh bench manager`` -- requests of 4,096 tokens whose first
2,048 are one of 10 shared prefixes, 8 live at once, each removed with store-for-reuse -- and
every ``take_events()`` after an ``add_sequence`` or a removal is kept as one batch. That gives
the mix a worker publishes: stored events of up to 256 blocks with their tokens, removals,
offload/onboard updates. Not timed.

Then, for each of three phases, with fresh worker ids and fresh managers:

* the consumer runs in its own process (``multiprocessing``, fork): an ``EventConsumer`` with a
  ``PrefixIndex``, following the four workers through the registry;
* the main process runs four ``EventPublisher`` (default settings: 2 ms linger, entries of up to
  4,096 blocks, pipelined ``XADD MAXLEN ~ 10000``) in one asyncio loop, replaying the batches
  with ``publish()``, which stamps each batch with the time it received it;
* Redis is a private embedded ``redis-server`` (or ``$REDIS_URL``) -- a third process.

Phase 1, throughput: the batches are published as fast as the loop allows.
``block_events_per_s`` = stored blocks + removed hashes applied in the consumer's index, divided
by the time from the first ``publish()`` to the last entry applied.

Phase 1b, the same without the host tier (``block_events_per_s_gpu_only``): the evictions of a
request are then one ``removed`` event, instead of an ``updated`` (offload) event and a one-hash
``removed`` event per evicted block, so the consumer decodes about a hundredth of the events for
the same number of block events. Decoding is most of the consumer's time, per event.

Phase 2, latency: the publishers are paced to 10,000 block events/s in all (2,500 each, each
batch published when its share of the schedule is due); for every stream entry the consumer
applies, one sample: the time from the ``publish()`` of the oldest batch in the entry to the
moment the entry's events are in the index (so a sample is the worst latency of the batches in
its entry). ``latency_p50_ms``, ``latency_p99_ms``.

Phase 3, reads: paced as phase 2 but ten times faster (100,000 block events/s, the stream of a
fleet serving a few hundred 4k-token requests a second), twice: the consumer reading as soon as
anything is there, then at most every 5 ms (``read_interval_s``: a router's and a dashboard's
``--event-read-interval-ms 5``). ``reads_per_s_*``: XREADs a second; ``reads_cpu_s_*``:
the consumer's CPU seconds; ``reads_latency_p50_ms_*``/``..._p99_ms_*`` as in phase 2.

Every phase ends by checking that the consumer's index equals each manager's final reuse tree,
block by block and tier by tier (``index_exact``); the run fails otherwise, or if anything was
dropped or resynchronised on the way.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing
import secrets
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from app.bench import bench_redis, receive
from cache import KVCacheEvent, KVCacheManager, LlmRequest, RemovedData, StoredData
from events.consumer import ConsumerConfig, EventConsumer
from events.envelope import Envelope
from events.publisher import EventPublisher

SEED = 5  # issue #5
NUM_WORKERS = 4
TOKENS_PER_REQUEST = 4_096
PREFIX_TOKENS = 2_048
NUM_PREFIXES = 10
VOCAB_SIZE = 32_000
TOKENS_PER_BLOCK = 16
PRIMARY_BLOCKS = 4_096
SECONDARY_BLOCKS = 1_024
MAX_LIVE = 8

THROUGHPUT_REQUESTS = 600  # per worker: about 150,000 block events each
THROUGHPUT_REQUESTS_QUICK = 40
LATENCY_RATE = 10_000  # block events per second, all publishers together
LATENCY_SECONDS = 8.0
LATENCY_SECONDS_QUICK = 1.0
READS_RATE = 100_000
READS_SECONDS = 3.0
READS_SECONDS_QUICK = 0.5
READ_INTERVALS_S = (0.0, 0.005)
TIMEOUT_S = 120.0


@dataclass(slots=True)
class Recording:
    """One worker's pre-generated event batches, and what its manager holds at the end."""

    worker_id: str
    batches: list[list[KVCacheEvent]]
    block_counts: list[int]  # stored blocks + removed hashes, per batch
    last_seq: int
    tree: dict[int, int]  # hash -> tier, at the end

    @property
    def block_events(self) -> int:
        return sum(self.block_counts)


def _block_count(events: Sequence[KVCacheEvent]) -> int:
    total = 0
    for event in events:
        if isinstance(event.data, StoredData):
            total += len(event.data.blocks)
        elif isinstance(event.data, RemovedData):
            total += len(event.data.block_hashes)
    return total


def _make_manager(secondary_blocks: int) -> KVCacheManager:
    return KVCacheManager(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        tokens_per_block=TOKENS_PER_BLOCK,
        blocks_per_window={TOKENS_PER_REQUEST: (PRIMARY_BLOCKS, secondary_blocks)},
        max_num_sequences=MAX_LIVE,
        max_attention_window=[TOKENS_PER_REQUEST],
        max_sequence_length=TOKENS_PER_REQUEST,
        event_buffer_max_size=10_000_000,
        allocate_pools=False,
        report_leaf_takeover=True,
    )


def record(
    worker_id: str,
    seed: int,
    *,
    min_block_events: int = 0,
    num_requests: int = 0,
    secondary_blocks: int = SECONDARY_BLOCKS,
) -> Recording:
    """Run the workload on a fresh manager until both limits are reached; keep the batches."""
    rng = np.random.default_rng(seed)
    prefixes: list[list[int]] = rng.integers(
        0, VOCAB_SIZE, size=(NUM_PREFIXES, PREFIX_TOKENS)
    ).tolist()
    mgr = _make_manager(secondary_blocks)
    batches: list[list[KVCacheEvent]] = []
    counts: list[int] = []
    total = 0

    def take() -> None:
        nonlocal total
        events = mgr.take_events()
        if events:
            batches.append(events)
            counts.append(_block_count(events))
            total += counts[-1]

    take()  # `created`
    live: deque[tuple[int, LlmRequest]] = deque()
    rid = 0
    while rid < num_requests or total < min_block_events:
        if len(live) == MAX_LIVE:
            old_rid, old_request = live.popleft()
            mgr.remove_sequence(old_rid, old_request)
            take()
        suffix: list[int] = rng.integers(
            0, VOCAB_SIZE, size=TOKENS_PER_REQUEST - PREFIX_TOKENS
        ).tolist()
        request = LlmRequest(rid, prefixes[int(rng.integers(NUM_PREFIXES))] + suffix)
        mgr.add_sequence(request)
        live.append((rid, request))
        take()
        rid += 1
    if mgr.num_dropped_events:
        raise RuntimeError(f"the manager dropped {mgr.num_dropped_events} events")
    tree = {b.hash: 0 if b.is_primary else 1 for w in mgr.window_sizes for b in mgr.tree_blocks(w)}
    return Recording(worker_id, batches, counts, mgr.last_event_id, tree)


# -- the consumer process --------------------------------------------------------------------


def _consumer_process(
    url: str,
    expected: dict[str, int],
    trees: dict[str, dict[int, int]],
    conn: Connection,
    read_interval_s: float,
) -> None:
    result = asyncio.run(_consume(url, expected, trees, conn, read_interval_s))
    conn.send(result)
    conn.close()


async def _consume(
    url: str,
    expected: dict[str, int],
    trees: dict[str, dict[int, int]],
    conn: Connection,
    read_interval_s: float,
) -> dict[str, Any]:
    latencies_ms: list[float] = []
    last_apply = 0.0
    done = asyncio.Event()
    remaining = set(expected)

    def on_entry(
        worker_id: str, envelope: Envelope, events: list[KVCacheEvent], blocks: int
    ) -> None:
        nonlocal last_apply
        now = time.time()
        last_apply = now
        if envelope.ts_us:
            latencies_ms.append(now * 1e3 - envelope.ts_us / 1e3)
        if envelope.seq_last >= expected.get(worker_id, -2):
            remaining.discard(worker_id)
            if not remaining:
                done.set()

    config = ConsumerConfig(registry_interval_s=0.1, read_interval_s=read_interval_s)
    consumer = EventConsumer(url, config, on_entry=on_entry)
    async with consumer:
        while any(consumer.last_seq(w) is None for w in expected):
            await asyncio.sleep(0.005)
        conn.send("ready")
        cpu_start = time.process_time()
        reads_start = consumer.num_reads
        await asyncio.wait_for(done.wait(), TIMEOUT_S)
        cpu_s = time.process_time() - cpu_start
        reads = consumer.num_reads - reads_start
        exact = all(
            consumer.index.worker_blocks(w) == trees[w]
            if w in consumer.index.workers()
            else not trees[w]
            for w in expected
        )
        stats = consumer.stats()
    return {
        "last_apply": last_apply,
        "latencies_ms": latencies_ms,
        "exact": exact,
        "stats": stats,
        "cpu_s": cpu_s,
        "reads": reads,
    }


# -- the publishing side ---------------------------------------------------------------------


async def _publish(
    url: str, recordings: list[Recording], conn: Connection, rate: float | None
) -> dict[str, Any]:
    publishers = [EventPublisher(url, rec.worker_id) for rec in recordings]
    for publisher in publishers:
        await publisher.start()
    if await receive(conn, TIMEOUT_S, "consumer") != "ready":
        raise RuntimeError("unexpected message from the consumer process")
    per_publisher = rate / len(recordings) if rate else None

    async def feed(publisher: EventPublisher, rec: Recording, t0: float) -> None:
        sent = 0
        for batch, blocks in zip(rec.batches, rec.block_counts, strict=True):
            if per_publisher is not None:
                delay = t0 + sent / per_publisher - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            publisher.publish(batch)
            sent += blocks
            if per_publisher is None:
                await asyncio.sleep(0)

    wall_start = time.time()
    cpu_start = time.process_time()
    t0 = time.monotonic()
    await asyncio.gather(*(feed(p, r, t0) for p, r in zip(publishers, recordings, strict=True)))
    for publisher in publishers:
        await publisher.flush(TIMEOUT_S)
    publish_seconds = time.monotonic() - t0
    cpu_s = time.process_time() - cpu_start
    result = await receive(conn, TIMEOUT_S, "consumer")
    stats = [p.stats() for p in publishers]
    for publisher in publishers:
        await publisher.aclose()
    assert isinstance(result, dict)
    result["wall_start"] = wall_start
    result["publish_seconds"] = publish_seconds
    result["publisher_cpu_s"] = cpu_s
    result["publisher_stats"] = stats
    return result


def _phase(
    url: str, recordings: list[Recording], rate: float | None, read_interval_s: float = 0.0
) -> dict[str, Any]:
    # The forked consumer inherits the recordings: freezing them keeps its garbage collector
    # from walking (and copying, page by page) millions of objects it never uses.
    gc.collect()
    gc.freeze()
    context = multiprocessing.get_context("fork")
    parent_conn, child_conn = context.Pipe()
    expected = {rec.worker_id: rec.last_seq for rec in recordings}
    trees = {rec.worker_id: rec.tree for rec in recordings}
    process = context.Process(
        target=_consumer_process,
        args=(url, expected, trees, child_conn, read_interval_s),
        daemon=True,
    )
    process.start()
    try:
        result = asyncio.run(_publish(url, recordings, parent_conn, rate))
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()
        gc.unfreeze()
    stats = result["stats"]
    dropped = sum(s["dropped"] for s in result["publisher_stats"])
    if not result["exact"] or dropped or stats["resyncs"] or stats["malformed"]:
        raise RuntimeError(
            f"the consumer's index is not exact (exact={result['exact']}, dropped={dropped}, "
            f"resyncs={stats['resyncs']}, malformed={stats['malformed']})"
        )
    blocks = sum(rec.block_events for rec in recordings)
    if stats["blocks"] != blocks:
        raise RuntimeError(f"the consumer applied {stats['blocks']} block events of {blocks}")
    result["blocks"] = blocks
    result["seconds"] = result["last_apply"] - result["wall_start"]
    return result


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(url: str, *, quick: bool, embedded: bool) -> dict[str, Any]:
    run_id = secrets.token_hex(3)  # fresh worker ids: a shared Redis may hold older ones
    throughput_requests = THROUGHPUT_REQUESTS_QUICK if quick else THROUGHPUT_REQUESTS
    latency_seconds = LATENCY_SECONDS_QUICK if quick else LATENCY_SECONDS
    generate_start = time.perf_counter()
    bulk = [
        record(f"bench-{run_id}-t{i}", SEED + i, num_requests=throughput_requests)
        for i in range(NUM_WORKERS)
    ]
    # The same workload without a host tier: evictions then come as one `removed` event per
    # request instead of an `updated` (offload) plus a `removed` per block.
    gpu_only = [
        record(
            f"bench-{run_id}-g{i}",
            SEED + i,
            num_requests=throughput_requests,
            secondary_blocks=0,
        )
        for i in range(NUM_WORKERS)
    ]
    paced = [
        record(
            f"bench-{run_id}-l{i}",
            SEED + 100 + i,
            min_block_events=int(LATENCY_RATE / NUM_WORKERS * latency_seconds),
        )
        for i in range(NUM_WORKERS)
    ]
    reads_seconds = READS_SECONDS_QUICK if quick else READS_SECONDS
    fast = {
        interval: [
            record(
                f"bench-{run_id}-r{interval * 1e3:g}-{i}",
                SEED + 200 + i,
                min_block_events=int(READS_RATE / NUM_WORKERS * reads_seconds),
            )
            for i in range(NUM_WORKERS)
        ]
        for interval in READ_INTERVALS_S
    }
    generate_seconds = time.perf_counter() - generate_start

    throughput = _phase(url, bulk, None)
    throughput_gpu_only = _phase(url, gpu_only, None)
    latency = _phase(url, paced, LATENCY_RATE)
    samples = latency["latencies_ms"]
    reads: dict[str, Any] = {"reads_rate_block_events_per_s": READS_RATE}
    for interval, recordings in fast.items():
        result = _phase(url, recordings, READS_RATE, interval)
        name = f"{interval * 1e3:g}ms"
        seconds = result["seconds"]
        reads[f"reads_per_s_{name}"] = round(result["reads"] / seconds)
        reads[f"reads_cpu_s_{name}"] = round(result["cpu_s"], 3)
        reads[f"reads_entries_{name}"] = result["stats"]["entries"]
        reads[f"reads_latency_p50_ms_{name}"] = round(statistics.median(result["latencies_ms"]), 3)
        reads[f"reads_latency_p99_ms_{name}"] = round(_percentile(result["latencies_ms"], 0.99), 3)
    return {
        "workers": NUM_WORKERS,
        "embedded_redis": embedded,
        "events_source": "pre-generated batches from real KVCacheManager workloads",
        "block_events_per_s": round(throughput["blocks"] / throughput["seconds"]),
        "throughput_block_events": throughput["blocks"],
        "throughput_batches": sum(len(rec.batches) for rec in bulk),
        "throughput_entries": throughput["stats"]["entries"],
        "throughput_seconds": round(throughput["seconds"], 3),
        "throughput_consumer_cpu_s": round(throughput["cpu_s"], 3),
        "throughput_publisher_cpu_s": round(throughput["publisher_cpu_s"], 3),
        "throughput_events": sum(len(b) for rec in bulk for b in rec.batches),
        "block_events_per_s_gpu_only": round(
            throughput_gpu_only["blocks"] / throughput_gpu_only["seconds"]
        ),
        "gpu_only_block_events": throughput_gpu_only["blocks"],
        "gpu_only_events": sum(len(b) for rec in gpu_only for b in rec.batches),
        "gpu_only_consumer_cpu_s": round(throughput_gpu_only["cpu_s"], 3),
        "gpu_only_publisher_cpu_s": round(throughput_gpu_only["publisher_cpu_s"], 3),
        "latency_rate_block_events_per_s": LATENCY_RATE,
        "latency_achieved_block_events_per_s": round(latency["blocks"] / latency["seconds"]),
        "latency_samples": len(samples),
        "latency_p50_ms": round(statistics.median(samples), 3),
        "latency_p99_ms": round(_percentile(samples, 0.99), 3),
        "latency_max_ms": round(max(samples), 3),
        **reads,
        "index_exact": True,
        "generate_seconds": round(generate_seconds, 2),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    with bench_redis() as (url, server):
        return measure(url, quick=args.quick, embedded=server is not None)
