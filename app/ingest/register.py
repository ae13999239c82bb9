"""``kvmesh register``: an OpenAI-compatible server that publishes no KV events (llama.cpp, TGI,
an older vLLM, any such endpoint) as a kvmesh worker that routers place requests on by what they
sent it.

The registry entry says ``approximate: true``, with the server's URL, model, block size and
capacity; an ``EventPublisher`` with no events keeps it alive (the heartbeat) and answers
consumers' snapshot requests with an empty snapshot, so the routers follow it as any worker.
Each router then keeps, for that worker, the block hashes of the prompts it sent there (for
``--approx-ttl-s``, at most the entry's capacity), and matches prompts against them as it
matches an exact worker's index (Dynamo's ``--no-kv-events`` and llm-d's approximate scorer work
the same way). The process runs until stopped; a clean stop unregisters the worker.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from app.ingest.settings import RegisterSettings
from app.ingest.stream import registry_entry
from events.publisher import EventPublisher, PublisherConfig

__all__ = ["approximate_entry", "run_register"]

logger = logging.getLogger(__name__)


def approximate_entry(settings: RegisterSettings) -> dict[str, Any]:
    """The registry entry of a worker without KV events."""
    entry = registry_entry(
        settings.source, settings.url.rstrip("/"), settings.block_size, settings.served_model_name
    )
    entry.update(approximate=True, capacity=[settings.capacity_blocks, 0])
    return entry


async def run_register(
    settings: RegisterSettings, stop: asyncio.Event | None = None
) -> dict[str, Any]:
    """Register the server and keep it registered until ``stop`` is set (or the task is
    cancelled, as Ctrl-C does); what was registered."""
    entry = approximate_entry(settings)
    publisher = EventPublisher(
        settings.redis_url, settings.worker_id, PublisherConfig(), registry_entry=entry
    )
    await publisher.start()
    logger.info(
        "register %s: %s (model %s) registered, routed approximately",
        settings.worker_id,
        entry["url"],
        settings.served_model_name or "any",
    )
    try:
        await (stop or asyncio.Event()).wait()
    finally:
        await publisher.aclose()
    return {"worker_id": settings.worker_id, **entry}
