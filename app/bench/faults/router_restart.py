"""Scenario ``router_restart``: a router killed and restarted over W workers x B blocks."""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
import tempfile
import time
from typing import Any

from app.bench.faults.harness import counts_of, rss_kib
from app.bench.faults.synthetic import (
    consumer_figures,
    observer_exact,
    publisher_main,
    router_ready_with,
    synthetic_tree,
    wait_event,
)
from app.core.embedded_redis import EmbeddedRedis


def router_restart(*, num_workers: int = 8, num_blocks: int = 100_000) -> dict[str, Any]:
    """See the module docstring."""
    trees = {f"w{i}": synthetic_tree(i, num_blocks) for i in range(num_workers)}
    expected = {w: counts_of(tree) for w, tree in trees.items()}
    context = multiprocessing.get_context("spawn")
    ready, snapshot, snapshotted, stop = (context.Event() for _ in range(4))
    with EmbeddedRedis() as server, tempfile.TemporaryFile() as log:
        child = context.Process(
            target=publisher_main,
            args=(server.url, num_workers, num_blocks, ready, snapshot, snapshotted, stop),
            name="kvmesh-bench-publishers",
            daemon=True,
        )
        publish_start = time.monotonic()
        child.start()
        try:
            wait_event(ready, child, "publishing")
            publish_s = time.monotonic() - publish_start
            with router_ready_with(server.url, log, expected) as (proc, url, cold_s):
                cold = consumer_figures(url)
                snapshot.set()
                wait_event(snapshotted, child, "the snapshots")
                proc.send_signal(signal.SIGKILL)  # a crash: nothing flushed, nothing said
                proc.wait()
            with router_ready_with(server.url, log, expected) as (proc, url, restart_s):
                restart = consumer_figures(url)
                router_rss_mib = round((rss_kib(proc.pid) or 0) / 1024, 1)
            observer = asyncio.run(observer_exact(server.url, trees))
        finally:
            stop.set()
            child.join(30)
            if child.is_alive():
                child.kill()
                child.join()
    return {
        "workers": num_workers,
        "blocks_per_worker": num_blocks,
        "entries": sum(len(t) for t in trees.values()),
        "publish_s": round(publish_s, 2),
        "cold_start_ready_s": round(cold_s, 3),
        "cold_start_consumer": cold,
        "restart_ready_s": round(restart_s, 3),
        "restart_consumer": restart,
        "router_rss_mib": router_rss_mib,
        **observer,
    }
