"""``kvmesh ingest trtllm``: a TensorRT-LLM server's KV events, republished to the kvmesh stream.

TensorRT-LLM's ``trtllm-serve`` answers ``POST /kv_cache_events`` with a JSON list of the events
queued since the last call (a destructive read: one ingester per server). ``TrtllmIngest``
polls it, parses each event with ``KVCacheEvent.from_dict`` (skipping the ``{}`` / ``null`` its
serializer emits for a missing event) and hands them to an ``EventPublisher``, so routers
consume a real TensorRT-LLM worker exactly like one of ours. A non-empty answer is followed by
the next poll at once; an empty one by ``poll_interval_s`` (the server itself waits up to 2 s for
events before answering).

Each stream is a ``Republisher`` (``app.ingest.stream``): its publisher, and a ``PrefixIndex`` of
what the worker holds, fed with the same events, whose dump is the snapshot when consumers need
one -- after events were lost, at start, on request. Its answers are exact as long as no event
was lost upstream.

Event ids tell what happened upstream:

* an id at or below the last one, on a ``created`` event: the engine restarted (its ids start
  again at 0). The stream gets a new epoch; the local index starts empty; consumers resync;
* an id that jumps forward: TensorRT-LLM's bounded queue dropped events. They are reported as
  ``dropped`` (consumers reload the snapshot, which is the best knowledge there is);
* any other id at or below the last one: a duplicate, skipped.

Attention DP: events that carry ``attention_dp_rank`` have their own id sequence per rank, so
each rank gets its own stream, under the worker id ``<worker-id>-dp<rank>``.

The registry entry carries ``url`` (the TensorRT-LLM server), ``device: "trtllm"``,
``tokens_per_block`` (when given) and the capacity per level from the ``created`` events.

Errors (of ingest's one tree, ``app.ingest.errors``)::

    IngestError
    └── TrtllmIngestError   (also a RuntimeError) the endpoint answered something that is not a
                            list of events; ``run`` logs it and polls again after a back-off
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from typing import Any

import httpx
from redis.asyncio import Redis

from app.ingest.errors import TrtllmIngestError
from app.ingest.settings import TrtllmIngestSettings
from app.ingest.stream import Republisher, rank_worker_id, registry_entry
from cache import CreatedData, KVCacheEvent
from events import keys
from events.publisher import EventPublisher, PublisherConfig
from events.redis_io import client_for

__all__ = ["TrtllmIngest", "TrtllmIngestError", "run_trtllm_ingest"]

logger = logging.getLogger(__name__)

EVENTS_PATH = "/kv_cache_events"


class _Stream(Republisher):
    """One id sequence (a worker, or one attention-DP rank of it) republished as a worker. Its
    events keep their TensorRT-LLM ids, so the snapshot covers up to the last id seen."""

    __slots__ = ("capacity", "last_id")

    def __init__(
        self, redis: Redis, worker_id: str, config: PublisherConfig, entry: dict[str, Any]
    ) -> None:
        super().__init__(redis, worker_id, config, entry)
        self.last_id = -1
        self.capacity: dict[int, list[int]] = {}  # window -> blocks per level

    def last_event_id(self) -> int:
        return self.last_id

    def restart(self) -> None:
        self.last_id = -1
        self.capacity.clear()
        super().restart()


class TrtllmIngest:
    """Polls one TensorRT-LLM server and publishes its KV events; see the module docstring."""

    def __init__(
        self,
        url: str,
        worker_id: str,
        redis: Redis | str,
        *,
        tokens_per_block: int | None = None,
        model: str | None = None,
        poll_interval_s: float = 0.05,
        http_timeout_s: float = 10.0,
        backoff_max_s: float = 5.0,
        http_client: httpx.AsyncClient | None = None,
        **publisher_options: Any,
    ) -> None:
        self.worker_id = keys.validate_worker_id(worker_id)
        self.url = url.rstrip("/")
        self.tokens_per_block = tokens_per_block
        self.model = model
        self.poll_interval_s = poll_interval_s
        self.backoff_max_s = backoff_max_s
        self._redis, self._owns_redis = client_for(redis)
        self._http = http_client or httpx.AsyncClient(timeout=http_timeout_s)
        self._owns_http = http_client is None
        self._publisher_config = PublisherConfig(**publisher_options)
        self._streams: dict[int | None, _Stream] = {}
        self.num_polls = 0
        self.num_events = 0
        self.num_skipped = 0
        self.num_duplicates = 0
        self.num_dropped = 0
        self.num_restarts = 0
        self.num_errors = 0

    # -- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> TrtllmIngest:
        await self._stream(None)  # the worker's own stream exists from the start
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for stream in self._streams.values():
            await stream.publisher.aclose()
        if self._owns_http:
            await self._http.aclose()
        if self._owns_redis:
            await self._redis.aclose()

    async def _stream(self, rank: int | None) -> _Stream:
        stream = self._streams.get(rank)
        if stream is not None:
            return stream
        entry = registry_entry("trtllm", self.url, self.tokens_per_block, self.model)
        if rank is not None:
            entry["attention_dp_rank"] = rank
        worker_id = rank_worker_id(self.worker_id, rank)
        stream = _Stream(self._redis, worker_id, self._publisher_config, entry)
        self._streams[rank] = stream
        await stream.publisher.start()
        return stream

    def publishers(self) -> dict[str, EventPublisher]:
        return {s.worker_id: s.publisher for s in self._streams.values()}

    def local_blocks(self, worker_id: str | None = None) -> dict[int, int]:
        """What the ingester believes the worker (or one of its rank streams) holds."""
        target = worker_id or self.worker_id
        for stream in self._streams.values():
            if stream.worker_id == target:
                return stream.local_blocks()
        raise KeyError(target)

    def stats(self) -> dict[str, Any]:
        return {
            "polls": self.num_polls,
            "events": self.num_events,
            "skipped": self.num_skipped,
            "duplicates": self.num_duplicates,
            "dropped": self.num_dropped,
            "restarts": self.num_restarts,
            "errors": self.num_errors,
            "streams": {s.worker_id: s.last_id for s in self._streams.values()},
        }

    # -- polling -------------------------------------------------------------------------------

    async def fetch(self) -> list[Any]:
        """One destructive read of the server's queued events (raw JSON items)."""
        response = await self._http.post(self.url + EVENTS_PATH)
        response.raise_for_status()
        try:
            items = response.json()
        except ValueError as exc:
            raise TrtllmIngestError(f"{EVENTS_PATH} did not answer JSON: {exc}") from exc
        if items is None:
            return []
        if not isinstance(items, list):
            raise TrtllmIngestError(
                f"{EVENTS_PATH} answered a JSON {type(items).__name__}, not a list"
            )
        return items

    async def poll_once(self) -> int:
        """Fetch and publish one batch; returns the number of events published."""
        items = await self.fetch()
        self.num_polls += 1
        by_rank: dict[int | None, list[KVCacheEvent]] = {}
        for item in items:
            if not item:  # {} or null: a missing event, as TensorRT-LLM serialises it
                self.num_skipped += 1
                continue
            try:
                event = KVCacheEvent.from_dict(item)
            except (ValueError, AttributeError) as exc:
                self.num_skipped += 1
                logger.warning("ingest %s: skipped a malformed event: %s", self.worker_id, exc)
                continue
            by_rank.setdefault(event.attention_dp_rank, []).append(event)
        published = 0
        for rank, events in by_rank.items():
            published += self._publish(await self._stream(rank), events)
        return published

    def _publish(self, stream: _Stream, events: list[KVCacheEvent]) -> int:
        """Check ids, feed the local index and the publisher (synchronously: the snapshot source
        then always matches what was published)."""
        pending: list[KVCacheEvent] = []
        dropped = 0
        published = 0

        def flush() -> None:
            nonlocal pending, dropped, published
            if pending or dropped:
                stream.publisher.publish(pending, dropped=dropped)
                published += len(pending)
            pending, dropped = [], 0

        for event in events:
            event_id = event.event_id
            if event_id <= stream.last_id:
                if isinstance(event.data, CreatedData):
                    flush()
                    self._restart(stream)
                else:
                    self.num_duplicates += 1
                    continue
            elif event_id > stream.last_id + 1 and not (
                stream.last_id == -1 and isinstance(event.data, CreatedData)
            ):
                gap = event_id - stream.last_id - 1
                flush()
                dropped = gap
                self.num_dropped += gap
                logger.warning(
                    "ingest %s: %d events lost upstream before event %d",
                    stream.worker_id,
                    gap,
                    event_id,
                )
            try:
                stream.index.apply_event(stream.worker_id, event)
            except ValueError as exc:
                # Neither the local index nor any consumer can apply it: report it as lost.
                logger.warning("ingest %s: event %d refused: %s", stream.worker_id, event_id, exc)
                flush()
                dropped = 1
                self.num_dropped += 1
                stream.last_id = event_id
                continue
            if isinstance(event.data, CreatedData):
                stream.capacity[event.window_size] = list(event.data.num_blocks_per_cache_level)
                self._update_capacity(stream)
            pending.append(event)
            stream.last_id = event_id
            self.num_events += 1
        flush()
        return published

    def _restart(self, stream: _Stream) -> None:
        self.num_restarts += 1
        logger.info("ingest %s: the engine restarted (event ids start again)", stream.worker_id)
        stream.restart()

    def _update_capacity(self, stream: _Stream) -> None:
        levels = max(len(c) for c in stream.capacity.values())
        total = [sum(c[i] for c in stream.capacity.values() if i < len(c)) for i in range(levels)]
        stream.publisher.update_registry(
            capacity=total,
            windows={str(w): c for w, c in sorted(stream.capacity.items())},
        )

    async def run(self, *, max_polls: int | None = None) -> None:
        """Poll until cancelled (or ``max_polls`` polls); errors are logged and backed off."""
        backoff = self.poll_interval_s
        polls = 0
        while max_polls is None or polls < max_polls:
            polls += 1
            try:
                published = await self.poll_once()
            except (httpx.HTTPError, TrtllmIngestError) as exc:
                self.num_errors += 1
                logger.warning("ingest %s: polling %s failed: %s", self.worker_id, self.url, exc)
                backoff = min(max(backoff * 2, self.poll_interval_s), self.backoff_max_s)
                await asyncio.sleep(backoff * (0.5 + random.random()))
                continue
            backoff = self.poll_interval_s
            if not published:
                await asyncio.sleep(self.poll_interval_s)


async def run_trtllm_ingest(settings: TrtllmIngestSettings) -> dict[str, Any]:
    """What ``kvmesh ingest trtllm`` runs; returns the ingester's stats when it stops."""
    ingest = TrtllmIngest(
        settings.url,
        settings.worker_id,
        settings.redis_url,
        tokens_per_block=settings.tokens_per_block,
        model=settings.served_model_name,
        poll_interval_s=settings.poll_interval_s,
    )
    async with ingest:
        with contextlib.suppress(asyncio.CancelledError):
            await ingest.run(max_polls=settings.max_polls)
        for publisher in ingest.publishers().values():
            await publisher.flush(10)
        return ingest.stats()
