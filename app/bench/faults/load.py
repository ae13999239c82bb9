"""Scenario ``load``: R requests through one router to 4 workers, RSS sampled."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from typing import Any

from app.bench.faults.client import drive, make_prompts, metric, summarize
from app.bench.faults.harness import SEED, RssSampler, cluster
from app.core.embedded_redis import EmbeddedRedis

# -- load: R requests through a router to 4 workers --------------------------------------------


def load(
    *,
    num_workers: int = 4,
    num_requests: int = 5_000,
    rate: float = 100.0,
    stream_share: float = 0.2,
    max_tokens: int = 16,
) -> dict[str, Any]:
    """See the module docstring."""
    prompts = make_prompts(num_requests, SEED + 2, num_documents=64)
    with (
        EmbeddedRedis() as server,
        tempfile.TemporaryFile() as log,
        cluster(server.url, num_workers, log, num_gpu_blocks=1_024, num_host_blocks=256) as c,
    ):
        pids = {**c.pids(), "redis": server.pid, "client": os.getpid()}
        with RssSampler(pids) as rss:
            start = time.monotonic()
            outcomes = asyncio.run(
                drive(
                    c.router_url,
                    prompts,
                    rate=rate,
                    stream_share=stream_share,
                    max_tokens=max_tokens,
                )
            )
            seconds = time.monotonic() - start
        retries = metric(c.router_url, "kvmesh_router_retries_total")
    summary = summarize(outcomes)
    return {
        "workers": num_workers,
        "offered_rate": rate,
        "achieved_rate": round(len(outcomes) / seconds, 1),
        "stream_share": stream_share,
        "max_tokens": max_tokens,
        **summary,
        "router_retries": int(retries),
        "rss_first_mib": rss.first_mib(),
        "rss_max_mib": rss.max_mib(),
        "rss_samples": rss.num_samples,
    }
