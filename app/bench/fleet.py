"""The fleet ``kvmesh bench router`` routes to: 16 workers that are only publishers.

``worker_loads``: the load each worker reports (seeded, fixed for the run). ``publishers``: a
child process running one ``EventPublisher`` per worker, which registers the worker (URL, 16
tokens per block, capacity, heartbeat), publishes its load and every event of the bench's
stream (renumbered per worker from 0, as each worker's manager numbers its own:
``events_per_worker``), and stays alive, heartbeating, until the bench ends. The URLs are never
contacted: ``/route`` only decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import replace
from multiprocessing.synchronize import Event as EventType

import numpy as np
import uvloop

from app.bench.index import NUM_WORKERS, SEED, TOKENS_PER_BLOCK
from cache import KVCacheEvent
from events.codec import decode_events
from events.publisher import EventPublisher
from events.redis_io import redis_client
from events.snapshot import Snapshot

__all__ = ["CAPACITY_BLOCKS", "events_per_worker", "publishers", "worker_loads", "worker_url"]

CAPACITY_BLOCKS = 65_536
PUBLISH_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 15.0


def worker_loads(seed: int = SEED + 2) -> dict[str, dict[str, int]]:
    """The load each worker reports, in the load hash's fields (seeded, fixed for the run)."""
    rng = np.random.default_rng(seed)
    loads: dict[str, dict[str, int]] = {}
    for i in range(NUM_WORKERS):
        used = int(rng.integers(4_096, 32_768))
        loads[f"worker-{i}"] = {
            "active_sequences": int(rng.integers(0, 33)),
            "waiting_requests": int(rng.integers(0, 5)),
            "free_blocks_0": CAPACITY_BLOCKS - used,
            "used_blocks_0": used,
            "free_blocks_1": 0,
            "used_blocks_1": 0,
        }
    return loads


def worker_url(worker: str) -> str:
    # Never contacted: /route only decides. The router marks a worker without a URL stale.
    return f"http://{worker}.invalid:8000"


def events_per_worker(stream: list[tuple[str, bytes]]) -> dict[str, list[KVCacheEvent]]:
    """The stream's events by worker, renumbered from 0 per worker (ids without gaps)."""
    out: dict[str, list[KVCacheEvent]] = defaultdict(list)
    for worker, blob in stream:
        mine = out[worker]
        for event in decode_events(blob):
            mine.append(replace(event, event_id=len(mine)))
    return dict(out)


def _publisher_main(
    redis_url: str,
    stream: list[tuple[str, bytes]],
    loads: dict[str, dict[str, int]],
    ready: EventType,
    stop: EventType,
) -> None:
    """Child process: 16 publishers that publish everything, then heartbeat until ``stop``."""
    parent_pid = os.getppid()
    events = events_per_worker(stream)
    uvloop.run(_run_publishers(redis_url, events, loads, ready, stop, parent_pid))


async def _run_publishers(
    redis_url: str,
    events: dict[str, list[KVCacheEvent]],
    loads: dict[str, dict[str, int]],
    ready: EventType,
    stop: EventType,
    parent_pid: int,
) -> None:
    redis = redis_client(redis_url)
    published: dict[str, list[KVCacheEvent]] = {worker: [] for worker in loads}

    def snapshot_of(worker: str) -> Callable[[], Snapshot]:
        # What the worker holds is what it published so far (no evictions in this workload).
        def take() -> Snapshot:
            mine = published[worker]
            return Snapshot(list(mine), mine[-1].event_id if mine else -1)

        return take

    publishers = [
        EventPublisher(
            redis,
            worker,
            snapshot_source=snapshot_of(worker),
            registry_entry={
                "url": worker_url(worker),
                "tokens_per_block": TOKENS_PER_BLOCK,
                "capacity": [CAPACITY_BLOCKS, 0],
            },
            load_source=load.copy,
        )
        for worker, load in loads.items()
    ]
    try:
        for publisher in publishers:
            await publisher.start()
        for publisher in publishers:
            worker = publisher.worker_id
            for event in events.get(worker, []):
                published[worker].append(event)
                publisher.publish([event])
            await asyncio.sleep(0)  # let the flushers start on what is buffered
        await asyncio.gather(*(p.flush(PUBLISH_TIMEOUT_S) for p in publishers))
        ready.set()
        await asyncio.to_thread(_wait_for_stop, stop, parent_pid)
    finally:
        await asyncio.gather(*(p.aclose() for p in publishers), return_exceptions=True)
        await redis.aclose()


def _wait_for_stop(stop: EventType, parent_pid: int) -> None:
    """Until the benchmark says stop, or dies without saying it (then this process goes too)."""
    while not stop.wait(1.0) and os.getppid() == parent_pid:
        pass


@contextlib.contextmanager
def publishers(
    redis_url: str, stream: list[tuple[str, bytes]], loads: dict[str, dict[str, int]]
) -> Iterator[multiprocessing.process.BaseProcess]:
    """The publishers' process, once everything is published; stopped (unregistering) at exit."""
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Event(), context.Event()
    proc = context.Process(
        target=_publisher_main,
        args=(redis_url, stream, loads, ready, stop),
        name="kvmesh-bench-publishers",
        daemon=True,
    )
    proc.start()
    try:
        deadline = time.monotonic() + PUBLISH_TIMEOUT_S
        while not ready.wait(0.1):
            if not proc.is_alive():
                raise RuntimeError(f"the publishers' process exited with {proc.exitcode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the events were not published within {PUBLISH_TIMEOUT_S} s")
        yield proc
    finally:
        stop.set()
        proc.join(STOP_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
