"""Scenario ``redis_restart``: Redis killed under load, restarted empty; every request
answered, the indexes exact again."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from typing import Any

import httpx

from app.bench.faults.client import drive, make_prompts, statuses, summarize
from app.bench.faults.harness import (
    POLL_S,
    READY_TIMEOUT_S,
    SEED,
    SETTLE_TIMEOUT_S,
    Cluster,
    cluster,
    counts_of,
    worker_tree,
)
from app.core.embedded_redis import EmbeddedRedis
from app.router.runtime import RouterRuntime
from app.router.settings import RouterSettings

# -- Redis killed and restarted (empty) under load ---------------------------------------------


async def indexes_exact(
    observer: RouterRuntime, router_url: str, worker_urls: dict[str, str]
) -> tuple[bool, dict[str, dict[str, int]]]:
    """Observer's index == every worker's tree; the routing router's counts == the trees'."""
    async with httpx.AsyncClient(timeout=10.0) as client:
        trees = {w: await worker_tree(client, url) for w, url in worker_urls.items()}
        counts = (await client.get(f"{router_url}/index/stats")).json()["index"]["per_worker"]
    index = observer.index
    exact = all(
        w in index.workers() and index.worker_blocks(w) == tree for w, tree in trees.items()
    ) and all(counts.get(w) == counts_of(tree) for w, tree in trees.items())
    return exact, {w: counts_of(tree) for w, tree in trees.items()}


def observer_settings(redis_url: str) -> RouterSettings:
    values: dict[str, Any] = {"sync_interval_s": 0.02, "load_interval_s": 0.05}
    return RouterSettings(redis_url=redis_url, **values)


async def _redis_restart(
    server: EmbeddedRedis,
    c: Cluster,
    prompts: list[list[int]],
    *,
    rate: float,
    restart_at: float,
    outage_s: float,
    stream_share: float,
    max_tokens: int,
) -> dict[str, Any]:
    observer = await RouterRuntime.start(observer_settings(server.url))
    try:
        workers = set(c.workers)

        async def observer_synced() -> None:
            while any(observer.consumer.last_seq(w) is None for w in workers):
                await asyncio.sleep(POLL_S)

        await asyncio.wait_for(observer_synced(), READY_TIMEOUT_S)
        load = asyncio.create_task(
            drive(
                c.router_url, prompts, rate=rate, stream_share=stream_share, max_tokens=max_tokens
            )
        )
        await asyncio.sleep(len(prompts) / rate * restart_at)
        killed = time.monotonic()
        server.kill()  # a crash, no persistence: streams, snapshots, registry, heartbeats gone
        await asyncio.sleep(outage_s)
        await asyncio.to_thread(server.start)
        restarted = time.monotonic()
        # Each worker's first /ready once Redis answers again: 200, not a dead pooled connection.
        async with httpx.AsyncClient(timeout=5.0) as client:
            ready_after_restart = {
                w: (await client.get(f"{url}/ready")).status_code
                for w, url in sorted(c.worker_urls.items())
            }

        async def recovered() -> None:
            async with httpx.AsyncClient(base_url=c.router_url, timeout=2.0) as client:
                while True:
                    with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                        ready = (await client.get("/ready")).status_code == 200
                        states = (await client.get("/workers")).json()["workers"]
                        up = {w["worker"] for w in states if w["state"] == "up" and w["synced"]}
                        synced = all(observer.consumer.last_seq(w) is not None for w in workers)
                        if ready and up == workers and synced:
                            return
                    await asyncio.sleep(POLL_S)

        await asyncio.wait_for(recovered(), SETTLE_TIMEOUT_S)
        recovered_at = time.monotonic()
        outcomes = await load
        load_end = time.monotonic()
        exact = False
        counts: dict[str, dict[str, int]] = {}
        while time.monotonic() - load_end < SETTLE_TIMEOUT_S:
            exact, counts = await indexes_exact(observer, c.router_url, c.worker_urls)
            if exact:
                break
            await asyncio.sleep(0.1)
        settled = time.monotonic()
        observer_stats = observer.consumer.stats()
    finally:
        await observer.aclose()
    async with httpx.AsyncClient(timeout=5.0) as client:
        publisher = {
            w: (await client.get(f"{url}/stats")).json()["events"]
            for w, url in c.worker_urls.items()
        }
        router_stats = (await client.get(f"{c.router_url}/index/stats")).json()["consumer"]
    outage = [o for o in outcomes if o.due < recovered_at and o.ended > killed]
    return {
        "outage_s": round(restarted - killed, 3),
        "recovered_s": round(recovered_at - restarted, 3),
        "settled_after_load_s": round(settled - load_end, 3),
        "index_exact": exact,
        "blocks": counts,
        "outage_requests": len(outage),
        "outage_completed": sum(o.kind == "completed" for o in outage),
        "outage_rejected": sum(o.kind == "rejected" for o in outage),
        "outage_failed": sum(o.kind == "failed" for o in outage),
        "statuses": statuses(outcomes),
        "worker_ready_after_restart": ready_after_restart,
        "publisher_dropped": sum(p["dropped"] for p in publisher.values()),
        "publisher_errors": sum(p["errors"] for p in publisher.values()),
        "publisher_snapshots": sum(p["snapshots"] for p in publisher.values()),
        "observer_redis_restarts": observer_stats["redis_restarts"],
        "observer_resyncs": observer_stats["resyncs"],
        "observer_resync_reasons": observer_stats["resync_reasons"],
        "observer_malformed": observer_stats["malformed"],
        "router_redis_restarts": router_stats["redis_restarts"],
        "router_resyncs": router_stats["resyncs"],
        **summarize(outcomes),
    }


def redis_restart_under_load(
    *,
    num_workers: int = 3,
    num_requests: int = 300,
    rate: float = 50.0,
    restart_at: float = 0.3,
    outage_s: float = 0.5,
    stream_share: float = 0.25,
    max_tokens: int = 8,
    heartbeat_ttl_s: float = 2.0,
) -> dict[str, Any]:
    """See the module docstring. ``restart_at``: fraction of the run before the kill."""
    prompts = make_prompts(num_requests, SEED + 1)
    with (
        EmbeddedRedis() as server,
        tempfile.TemporaryFile() as log,
        cluster(server.url, num_workers, log, heartbeat_ttl_s=heartbeat_ttl_s) as c,
    ):
        result = asyncio.run(
            _redis_restart(
                server,
                c,
                prompts,
                rate=rate,
                restart_at=restart_at,
                outage_s=outage_s,
                stream_share=stream_share,
                max_tokens=max_tokens,
            )
        )
    return {"workers": num_workers, "rate": rate, "heartbeat_ttl_s": heartbeat_ttl_s, **result}
