"""Scenario ``kill_worker``: ``kill -9`` of one worker under load through a router."""

from __future__ import annotations

import asyncio
import signal
import tempfile
import threading
import time
from typing import Any

from app.bench.faults.client import drive, make_prompts, metric, summarize
from app.bench.faults.harness import (
    SEED,
    cluster,
    index_counts,
    routable,
    wait_until,
    worker_states,
)
from app.core.embedded_redis import EmbeddedRedis

# -- kill -9 of a worker under load ------------------------------------------------------------


def kill_worker_under_load(
    *,
    num_workers: int = 3,
    num_requests: int = 300,
    rate: float = 50.0,
    kill_at: float = 0.4,
    heartbeat_ttl_s: float = 2.0,
    stream_share: float = 0.5,
    max_tokens: int = 32,
    step_ms: float = 5.0,
) -> dict[str, Any]:
    """See the module docstring. ``kill_at``: the fraction of the run after which to kill."""
    victim = "w0"
    prompts = make_prompts(num_requests, SEED)
    with (
        EmbeddedRedis() as server,
        tempfile.TemporaryFile() as log,
        cluster(
            server.url, num_workers, log, heartbeat_ttl_s=heartbeat_ttl_s, step_ms=step_ms
        ) as c,
    ):
        assert c.router is not None
        marks: dict[str, float] = {}
        errors: list[BaseException] = []

        def inject() -> None:
            try:
                kill_and_watch()
            except BaseException as exc:  # re-raised in the main thread
                errors.append(exc)

        def kill_and_watch() -> None:
            time.sleep(num_requests / rate * kill_at)
            blocks_before = index_counts(c.router_url).get(victim, {}).get("blocks", 0)
            marks["blocks_before"] = blocks_before
            c.workers[victim].send_signal(signal.SIGKILL)
            marks["killed"] = time.monotonic()
            c.workers[victim].wait()
            wait_until(lambda: victim not in routable(c.router_url), 30.0, "marked stale")
            marks["stale"] = time.monotonic()
            wait_until(
                lambda: worker_states(c.router_url).get(victim, "gone") == "gone",
                30.0,
                "out of rotation",
            )
            marks["gone"] = time.monotonic()
            wait_until(lambda: victim not in index_counts(c.router_url), 30.0, "out of index")
            marks["unindexed"] = time.monotonic()

        injector = threading.Thread(target=inject, name="kvmesh-kill")
        injector.start()
        outcomes = asyncio.run(
            drive(
                c.router_url,
                prompts,
                rate=rate,
                stream_share=stream_share,
                max_tokens=max_tokens,
            )
        )
        injector.join()
        if errors:
            raise errors[0]
        retries = metric(c.router_url, "kvmesh_router_retries_total")
        survivors = set(c.workers) - {victim}
        left = routable(c.router_url)
    killed = marks["killed"]
    in_flight = [o for o in outcomes if o.due < killed < o.ended]
    after = [o for o in outcomes if o.due > marks["gone"]]
    return {
        "workers": num_workers,
        "rate": rate,
        "heartbeat_ttl_s": heartbeat_ttl_s,
        "victim_blocks_before": int(marks["blocks_before"]),
        "stale_after_s": round(marks["stale"] - killed, 3),
        "gone_after_s": round(marks["gone"] - killed, 3),
        "unindexed_after_s": round(marks["unindexed"] - killed, 3),
        "in_flight_at_kill": len(in_flight),
        "in_flight_completed": sum(o.kind == "completed" for o in in_flight),
        "in_flight_failed": sum(o.kind == "failed" for o in in_flight),
        "in_flight_failed_streams": sum(o.kind == "failed" and o.stream for o in in_flight),
        "router_retries": int(retries),
        "sent_to_victim_after_gone": sum(o.worker == victim for o in after),
        "routable_at_end": sorted(left),
        "survivors": sorted(survivors),
        **summarize(outcomes),
    }
