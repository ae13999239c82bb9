"""Synthetic stored blocks and the publisher process of the ``router_restart`` and
``publisher_cut_off`` scenarios, and reading a router's index exactly."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import subprocess
import time
from collections.abc import Iterator
from multiprocessing.synchronize import Event as EventType
from typing import IO, Any

import httpx
import numpy as np

from app.bench.faults.harness import (
    CHAIN_BLOCKS,
    HOST,
    POLL_S,
    READY_TIMEOUT_S,
    SEED,
    TOKENS_PER_BLOCK,
    index_counts,
    wait_ready,
    wait_until,
)
from app.bench.faults.redis_restart import observer_settings
from app.bench.worker import kvmesh_process
from app.core.net import free_port
from app.router.runtime import RouterRuntime
from cache import KVCacheEvent, StoredBlock, StoredData
from events.publisher import EventPublisher
from events.snapshot import Snapshot

# -- synthetic stored blocks (router restart, publisher cut off) -------------------------------


def synthetic_events(worker_index: int, num_blocks: int) -> list[KVCacheEvent]:
    """``num_blocks`` stored blocks in chains of ``CHAIN_BLOCKS`` from the root, one event per
    chain, every fourth chain on the host tier; seeded by the worker's index."""
    rng = np.random.default_rng(SEED * 1_000 + worker_index)
    hashes: list[int] = rng.integers(0, 2**63, size=num_blocks, dtype=np.int64).tolist()
    events: list[KVCacheEvent] = []
    for k, start in enumerate(range(0, num_blocks, CHAIN_BLOCKS)):
        level = 1 if k % 4 == 3 else 0
        chain = hashes[start : start + CHAIN_BLOCKS]
        blocks = [StoredBlock(h, (), cache_level=level) for h in chain]
        events.append(KVCacheEvent(len(events), StoredData(None, blocks), 4_096))
    return events


def synthetic_tree(worker_index: int, num_blocks: int) -> dict[int, int]:
    """What ``synthetic_events`` stores: hash -> tier."""
    rng = np.random.default_rng(SEED * 1_000 + worker_index)
    hashes: list[int] = rng.integers(0, 2**63, size=num_blocks, dtype=np.int64).tolist()
    return {h: 1 if (i // CHAIN_BLOCKS) % 4 == 3 else 0 for i, h in enumerate(hashes)}


def snapshot_of(published: list[KVCacheEvent]) -> Any:
    # What the worker holds is what it published (stored blocks only, nothing evicted).
    def take() -> Snapshot:
        return Snapshot(list(published), published[-1].event_id if published else -1)

    return take


def publisher_main(
    redis_url: str,
    num_workers: int,
    num_blocks: int,
    ready: EventType,
    snapshot: EventType,
    snapshotted: EventType,
    stop: EventType,
) -> None:
    """Child process: publish every worker's blocks, heartbeat; snapshot when asked; stop."""
    parent_pid = os.getppid()

    async def main() -> None:
        published: dict[str, list[KVCacheEvent]] = {f"w{i}": [] for i in range(num_workers)}
        publishers = [
            EventPublisher(
                redis_url,
                worker,
                snapshot_source=snapshot_of(mine),
                registry_entry={
                    "url": f"http://{worker}.invalid:8000",
                    "tokens_per_block": TOKENS_PER_BLOCK,
                    "capacity": [2 * num_blocks, 0],
                },
                load_source=lambda: {"active_sequences": 0, "waiting_requests": 0},
            )
            for worker, mine in published.items()
        ]

        def wait(event: EventType) -> bool:
            while not event.wait(0.5):
                if stop.is_set() or os.getppid() != parent_pid:
                    return False
            return True

        try:
            for i, publisher in enumerate(publishers):
                await publisher.start()
                mine = published[publisher.worker_id]
                for event in synthetic_events(i, num_blocks):
                    mine.append(event)
                    publisher.publish([event])
                await asyncio.sleep(0)
            await asyncio.gather(*(p.flush(READY_TIMEOUT_S) for p in publishers))
            ready.set()
            if await asyncio.to_thread(wait, snapshot):
                for publisher in publishers:
                    publisher.request_snapshot()
                await asyncio.gather(*(p.flush(READY_TIMEOUT_S) for p in publishers))
                snapshotted.set()
                await asyncio.to_thread(wait, stop)
        finally:
            await asyncio.gather(*(p.aclose() for p in publishers), return_exceptions=True)

    asyncio.run(main())


@contextlib.contextmanager
def router_ready_with(
    redis_url: str, log: IO[bytes], expected: dict[str, dict[str, int]]
) -> Iterator[tuple[subprocess.Popen[bytes], str, float]]:
    """``kvmesh router``; yields once it is ready with every worker's blocks per tier, with
    its URL and the seconds that took from the process' start."""
    port = free_port()
    url = f"http://{HOST}:{port}"
    flags = ["router", "--host", HOST, "--port", str(port), "--redis-url", redis_url]
    start = time.monotonic()
    with kvmesh_process(flags, log) as proc:
        wait_ready(url, proc, log)
        wait_until(lambda: index_counts(url) == expected, READY_TIMEOUT_S, "router index")
        yield proc, url, time.monotonic() - start


def wait_event(event: EventType, proc: multiprocessing.process.BaseProcess, what: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not event.wait(0.1):
        if not proc.is_alive():
            raise RuntimeError(f"{what}: the publishers' process exited with {proc.exitcode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not done within {READY_TIMEOUT_S} s")


def consumer_figures(router_url: str) -> dict[str, int]:
    consumer = httpx.get(f"{router_url}/index/stats", timeout=10.0).json()["consumer"]
    return {k: consumer[k] for k in ("snapshot_loads", "entries", "skipped_entries", "resyncs")}


async def observer_exact(redis_url: str, trees: dict[str, dict[int, int]]) -> dict[str, Any]:
    start = time.monotonic()
    observer = await RouterRuntime.start(observer_settings(redis_url))
    try:
        while not (
            observer.readiness()["ready"]
            and all(observer.consumer.last_seq(w) is not None for w in trees)
        ):
            if time.monotonic() - start > READY_TIMEOUT_S:
                raise TimeoutError(f"the observer was not ready: {observer.readiness()}")
            await asyncio.sleep(POLL_S)
        ready_s = time.monotonic() - start
        index = observer.index
        exact = all(index.worker_blocks(w) == tree for w, tree in trees.items())
        return {"observer_ready_s": round(ready_s, 3), "index_exact": exact}
    finally:
        await observer.aclose()
