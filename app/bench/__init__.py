"""Benchmarks run by ``kvmesh bench NAME``.

``BENCHMARKS`` maps a name to ``"module:function"``; the module is imported only when that
benchmark runs, so a heavy benchmark costs nothing to the rest of the CLI. A benchmark is a
``Callable[[argparse.Namespace], dict[str, Any]]``: it reads its options from the namespace
(``--quick`` asks for a small run, as in tests; ``--json`` is the CLI's) and returns flat-ish,
JSON-serialisable results. ``BENCHMARK_HELP`` is what ``kvmesh bench NAME --help`` says about
it, kept here for the same reason: building the parser imports no benchmark. To add one, write
``app/bench/<name>.py`` with a ``run(args)`` and add a line to both.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from app.core.embedded_redis import EmbeddedRedis

__all__ = [
    "BENCHMARKS",
    "BENCHMARK_HELP",
    "Benchmark",
    "bench_redis",
    "load_benchmark",
    "receive",
]

Benchmark = Callable[[argparse.Namespace], dict[str, Any]]

BENCHMARKS: dict[str, str] = {
    "events": "app.bench.events:run",
    "index": "app.bench.index:run",
    "manager": "app.bench.manager:run",
    "transfer": "app.bench.transfer:run",
    "redis": "app.bench.redis_rtt:run",
    "worker": "app.bench.worker:run",
    "router": "app.bench.router:run",
    "proxy": "app.bench.proxy:run",
    "faults": "app.bench.faults:run",
    "ingest": "app.bench.ingest:run",
}

# name -> (what it measures, what --quick runs instead); each module's docstring has the rest.
BENCHMARK_HELP: dict[str, tuple[str, str]] = {
    "events": (
        "KV events from 4 publishers through Redis into one consumer's index: throughput and "
        "latency",
        "40 requests' events per publisher instead of 600, 1 s of paced latency instead of 8",
    ),
    "index": (
        "the router's prefix index: applying events and matching prompts",
        "1,000 events and 200 requests instead of 20,000 and 2,000, one build instead of 5",
    ),
    "manager": (
        "block manager throughput: 4,096-token requests sharing 10 prefixes",
        "100 requests instead of 2,000",
    ),
    "transfer": (
        "offload and onboard bandwidth between the pools, against a plain torch copy",
        "32 blocks instead of 1,024",
    ),
    "redis": (
        "round-trip latency and pipelined XADD throughput against Redis ($REDIS_URL or a "
        "private one)",
        "200 pings and 1,000 entries instead of 5,000 and 50,000",
    ),
    "worker": (
        "one worker process over HTTP against its bare block manager",
        "100 requests from 16 clients instead of 2,000 from 64",
    ),
    "router": (
        "routing decisions, in process and through a real kvmesh router over HTTP",
        "1,000 events, 200 requests, 200 requests/s for 1 s instead of 20,000, 2,000, 1,000/s "
        "for 10 s",
    ),
    "proxy": (
        "what a kvmesh router adds to a proxied, non-streamed completion against calling the "
        "worker directly: latency and router CPU per request",
        "2 rounds of 10 requests each way instead of 10 of 100",
    ),
    "faults": (
        "kvmesh under faults and load, with real processes (docs/reliability.md)",
        "every scenario smaller: fewer workers, requests and blocks (QUICK in faults.py)",
    ),
    "ingest": (
        "vLLM KV events through kvmesh ingest vllm into the Redis stream",
        "40 scheduler steps instead of 1,500",
    ),
}


def load_benchmark(name: str) -> Benchmark:
    """Import and return the benchmark registered as ``name`` (KeyError if unknown)."""
    module_name, _, attr = BENCHMARKS[name].partition(":")
    module = importlib.import_module(module_name)
    bench: Benchmark = getattr(module, attr)
    return bench


@contextlib.contextmanager
def bench_redis() -> Iterator[tuple[str, EmbeddedRedis | None]]:
    """The Redis a benchmark runs against: $REDIS_URL / KVMESH_REDIS_URL when set (no server of
    ours: None), else a private embedded ``redis-server`` for the run (stopped after it)."""
    from app.core.embedded_redis import EmbeddedRedis
    from app.core.settings import Settings

    url = Settings().redis_url
    if url is not None:
        yield url, None
        return
    with EmbeddedRedis() as server:
        yield server.url, server


async def receive(conn: Connection, timeout_s: float, who: str) -> Any:
    """The next message from a benchmark's helper process, polled without blocking the event
    loop; TimeoutError naming `who` if none comes within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the {who} process did not answer")
        await asyncio.sleep(0.002)
    return conn.recv()
