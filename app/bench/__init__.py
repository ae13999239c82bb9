"""Benchmarks run by ``kvmesh bench NAME``.

``BENCHMARKS`` maps a name to ``"module:function"``; the module is imported only when that
benchmark runs, so a heavy benchmark costs nothing to the rest of the CLI. A benchmark is a
``Callable[[argparse.Namespace], dict[str, Any]]``: it reads its options from the namespace
(``--quick`` asks for a small run, as in tests) and returns flat-ish, JSON-serialisable results.
To add one, write ``app/bench/<name>.py`` with a ``run(args)`` and add a line here.
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

    from app.redis_server import EmbeddedRedis

__all__ = ["BENCHMARKS", "Benchmark", "bench_redis", "load_benchmark", "receive"]

Benchmark = Callable[[argparse.Namespace], dict[str, Any]]

BENCHMARKS: dict[str, str] = {
    "events": "app.bench.events:run",
    "index": "app.bench.index:run",
    "manager": "app.bench.manager:run",
    "transfer": "app.bench.transfer:run",
    "redis": "app.bench.redis_rtt:run",
    "worker": "app.bench.worker:run",
    "router": "app.bench.router:run",
    "faults": "app.bench.faults:run",
    "ingest": "app.bench.ingest:run",
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
    from app.redis_server import EmbeddedRedis
    from app.settings import Settings

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
