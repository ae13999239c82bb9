"""``kvmesh bench redis``: round-trip latency and pipelined XADD throughput against Redis.

Uses ``REDIS_URL`` when set, else a private embedded redis-server. It measures the transport
the event stream will use, so later event-publisher numbers have a baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from app.core.embedded_redis import EmbeddedRedis
from app.core.settings import Settings

_STREAM_KEY = "kvmesh:bench:stream"


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = Settings()
    num_pings = 200 if args.quick else 5_000
    num_entries = 1_000 if args.quick else 50_000
    if settings.redis_url is not None:
        return asyncio.run(_measure(settings.redis_url, num_pings, num_entries, embedded=False))
    with EmbeddedRedis() as server:
        return asyncio.run(_measure(server.url, num_pings, num_entries, embedded=True))


async def _measure(url: str, num_pings: int, num_entries: int, *, embedded: bool) -> dict[str, Any]:
    client = aioredis.Redis.from_url(url)
    try:
        latencies_us: list[float] = []
        for _ in range(num_pings):
            start = time.perf_counter()
            await client.ping()
            latencies_us.append((time.perf_counter() - start) * 1e6)
        latencies_us.sort()

        await client.delete(_STREAM_KEY)
        payload: dict[FieldT, EncodableT] = {"v": b"1", "data": b"x" * 256}
        batch = 500
        start = time.perf_counter()
        for first in range(0, num_entries, batch):
            async with client.pipeline(transaction=False) as pipe:
                for _ in range(min(batch, num_entries - first)):
                    pipe.xadd(_STREAM_KEY, payload, maxlen=10_000, approximate=True)
                await pipe.execute()
        xadd_s = time.perf_counter() - start
        await client.delete(_STREAM_KEY)
    finally:
        await client.aclose()
    return {
        "embedded": embedded,
        "ping_count": num_pings,
        "ping_p50_us": round(statistics.median(latencies_us), 1),
        "ping_p99_us": round(latencies_us[int(0.99 * (len(latencies_us) - 1))], 1),
        "xadd_count": num_entries,
        "xadd_per_s": round(num_entries / xadd_s),
    }
