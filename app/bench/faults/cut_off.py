"""Scenario ``publisher_cut_off``: a publisher cut off from Redis until its buffer
overflows."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis.asyncio as aioredis

from app.bench.faults.harness import POLL_S, READY_TIMEOUT_S, SETTLE_TIMEOUT_S, TOKENS_PER_BLOCK
from app.bench.faults.redis_restart import observer_settings
from app.bench.faults.synthetic import snapshot_of, synthetic_events, synthetic_tree
from app.core.embedded_redis import EmbeddedRedis
from app.router.runtime import RouterRuntime
from cache import KVCacheEvent
from events import keys
from events.envelope import Envelope, decode_envelope
from events.publisher import EventPublisher, PublisherConfig

# -- a publisher cut off from Redis until its buffer overflows ---------------------------------


async def _cut_off(url: str, num_blocks: int, buffer_blocks: int, cut_at: float) -> dict[str, Any]:
    admin: Any = aioredis.Redis.from_url(url)
    user, password = "kvmesh-cut-off", "cut-off-secret"
    await admin.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "&*", "+@all")
    cut_url = url.replace("redis://", f"redis://{user}:{password}@")
    events = {w: synthetic_events(i, num_blocks) for i, w in enumerate(("w0", "w1"))}
    published: dict[str, list[KVCacheEvent]] = {"w0": [], "w1": []}
    options: dict[str, Any] = {"linger_s": 0, "heartbeat_ttl_s": 30.0}
    cut = EventPublisher(
        cut_url,
        "w0",
        PublisherConfig(max_buffer_blocks=buffer_blocks, **options),
        snapshot_source=snapshot_of(published["w0"]),
        registry_entry={"url": "http://w0.invalid:8000", "tokens_per_block": TOKENS_PER_BLOCK},
    )
    honest = EventPublisher(
        url,
        "w1",
        PublisherConfig(**options),
        snapshot_source=snapshot_of(published["w1"]),
        registry_entry={"url": "http://w1.invalid:8000", "tokens_per_block": TOKENS_PER_BLOCK},
    )
    split = int(len(events["w0"]) * cut_at)

    async def feed(publisher: EventPublisher, chosen: list[KVCacheEvent]) -> None:
        for event in chosen:
            published[publisher.worker_id].append(event)
            publisher.publish([event])
            await asyncio.sleep(0.001)

    observer = await RouterRuntime.start(observer_settings(url))
    try:
        async with cut, honest:
            for publisher in (cut, honest):
                await feed(publisher, events[publisher.worker_id][:split])
                await publisher.flush(READY_TIMEOUT_S)
            wait_s = 0.0
            while observer.consumer.last_seq("w0") != split - 1 or (
                observer.consumer.last_seq("w1") != split - 1
            ):
                await asyncio.sleep(POLL_S)
                wait_s += POLL_S
                if wait_s > READY_TIMEOUT_S:
                    raise TimeoutError("the observer did not catch up before the cut")
            await admin.execute_command("ACL", "SETUSER", user, "off")
            await admin.execute_command("CLIENT", "KILL", "USER", user)
            cut_at_s = time.monotonic()
            await asyncio.gather(
                feed(cut, events["w0"][split:]), feed(honest, events["w1"][split:])
            )
            dropped = cut.num_dropped
            await admin.execute_command("ACL", "SETUSER", user, "on")
            reconnected = time.monotonic()
            trees = {w: synthetic_tree(i, num_blocks) for i, w in enumerate(("w0", "w1"))}
            index = observer.index
            while not all(
                observer.consumer.last_seq(w) == len(events[w]) - 1
                and index.worker_blocks(w) == tree
                for w, tree in trees.items()
            ):
                if time.monotonic() - reconnected > SETTLE_TIMEOUT_S:
                    break
                await asyncio.sleep(POLL_S)
            recovered = time.monotonic()
            exact = {w: index.worker_blocks(w) == tree for w, tree in trees.items()}
            stats = observer.consumer.stats()
            entries = await admin.xrange(keys.events_key("w0"))
            cut_stats = cut.stats()
    finally:
        await observer.aclose()
        await admin.execute_command("ACL", "DELUSER", user)
        await admin.aclose()
    envelopes: list[Envelope] = [decode_envelope(fields) for _, fields in entries]
    return {
        "blocks_per_worker": num_blocks,
        "buffer_blocks": buffer_blocks,
        "cut_off_s": round(reconnected - cut_at_s, 3),
        "dropped_events": dropped,
        "dropped_in_stream": sum(e.dropped for e in envelopes),
        "publisher_snapshots": cut_stats["snapshots"],
        "resync_reasons": stats["resync_reasons"],
        "malformed": stats["malformed"],
        "expired": stats["expired"],
        "recovered_s": round(recovered - reconnected, 3),
        "index_exact": exact,
    }


def publisher_cut_off(
    *, num_blocks: int = 4_096, buffer_blocks: int = 512, cut_at: float = 0.5
) -> dict[str, Any]:
    """See the module docstring. ``cut_at``: the share of the blocks published before."""
    with EmbeddedRedis() as server:
        return asyncio.run(_cut_off(server.url, num_blocks, buffer_blocks, cut_at))
