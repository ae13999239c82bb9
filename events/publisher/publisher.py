"""``EventPublisher``: its lifecycle, the worker's side (``publish``, never waiting) and stats.

It builds its two parts and runs their tasks: the ``Flusher`` (the buffer, and the one task
that writes the stream and the snapshot) and the ``Heartbeat`` (the registry entry, the
heartbeat key, the load hash). Start: a snapshot, then the registry entry and heartbeat (when
Redis answers; else the tasks retry in the background), then the tasks. ``aclose()`` flushes
what is buffered (waiting at most ``close_timeout_s``; at most one more attempt, a second at
most, while Redis is not answering: a shutdown does not wait on a Redis that is down), stops
the tasks, then removes the registry entry and the heartbeat key.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Protocol

from redis.asyncio import Redis

from cache import KVCacheEvent
from events import keys
from events.publisher.config import PublisherConfig
from events.publisher.flusher import Flusher, new_epoch
from events.publisher.heartbeat import Heartbeat, LoadSource
from events.redis_io import REDIS_ERRORS, client_for, stop_tasks
from events.snapshot import SnapshotSource

__all__ = ["EventPublisher", "EventSource"]

logger = logging.getLogger(__name__)


class EventSource(Protocol):
    """What ``publish_from`` needs of a manager (``KVCacheManager`` is one)."""

    def take_events(self) -> list[KVCacheEvent]: ...

    @property
    def num_dropped_events(self) -> int: ...


class EventPublisher:
    """Publishes one worker's KV events to ``kvmesh:{<worker>}:events``; see ``events.publisher``.

    ``redis``: a URL (the publisher owns and closes its client) or a client (left open).
    ``snapshot_source`` makes the worker's snapshot (without one, the publisher can only say
    where the stream starts); ``registry_entry`` is the worker's registry fields;
    ``load_source`` (optional) the fields of its load hash; ``epoch``: by default a new one.
    """

    def __init__(
        self,
        redis: Redis | str,
        worker_id: str,
        config: PublisherConfig | None = None,
        *,
        snapshot_source: SnapshotSource | None = None,
        registry_entry: Mapping[str, Any] | None = None,
        load_source: LoadSource | None = None,
        epoch: int | None = None,
    ) -> None:
        self.worker_id = keys.validate_worker_id(worker_id)
        self.config = config = config if config is not None else PublisherConfig()
        self._redis, self._owns_redis = client_for(redis)
        self._flusher = Flusher(
            self._redis,
            self.worker_id,
            config,
            epoch=new_epoch() if epoch is None else epoch,
            snapshot_source=snapshot_source,
        )
        self._heartbeat = Heartbeat(
            self._redis,
            self.worker_id,
            config,
            self._flusher,
            registry_entry=registry_entry,
            load_source=load_source,
        )
        self._source_dropped_seen = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._flusher_task: asyncio.Task[None] | None = None
        self._closed = False

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> EventPublisher:
        """Write the first snapshot and the registry entry (if Redis answers), start the tasks."""
        if self._tasks:
            raise RuntimeError("the publisher is already started")
        try:
            await self._flusher.flush_once()
            await self._heartbeat.beat()
        except REDIS_ERRORS as exc:
            logger.warning(
                "publisher %s: Redis is not answering at start (%s); retrying in the background",
                self.worker_id,
                exc,
            )
        self._flusher_task = asyncio.create_task(
            self._flusher.run(), name=f"kvmesh-pub-{self.worker_id}"
        )
        self._tasks.append(self._flusher_task)
        self._tasks.append(
            asyncio.create_task(self._heartbeat.run_heartbeat(), name="kvmesh-heartbeat")
        )
        if self._heartbeat.load_source is not None:
            self._tasks.append(asyncio.create_task(self._heartbeat.run_load(), name="kvmesh-load"))
        self._flusher.wake()
        return self

    async def __aenter__(self) -> EventPublisher:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Flush what is buffered (at most ``close_timeout_s``), unregister, stop the tasks."""
        if self._closed:
            return
        self._closed = True
        self._flusher.close()
        timeout_s = self.close_timeout_s
        if self._flusher_task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._flusher_task), timeout_s)
            except TimeoutError:
                logger.warning(
                    "publisher %s: closing with %d buffered events%s not written",
                    self.worker_id,
                    self._flusher.batcher.num_events,
                    " and a snapshot" if self._flusher.need_snapshot else "",
                )
                self._flusher_task.cancel()
        self._heartbeat.stop()
        await stop_tasks(self._tasks, grace_s=timeout_s)
        if self.config.unregister_on_close:
            await self._heartbeat.unregister()
        if self._owns_redis:
            await self._redis.aclose()

    # -- the worker's side ---------------------------------------------------------------------

    def publish(
        self, events: Sequence[KVCacheEvent], *, dropped: int = 0, ts_us: int | None = None
    ) -> None:
        """Queue a batch (never waits; call it on the event loop's thread). ``dropped``: events
        lost just before it, upstream. The batch is kept as it is, not copied."""
        if self._closed:
            raise RuntimeError("the publisher is closed")
        if dropped < 0:
            raise ValueError(f"dropped must be >= 0, got {dropped}")
        self._flusher.add(events, dropped=dropped, ts_us=ts_us)

    def publish_from(self, source: EventSource) -> int:
        """``publish(source.take_events())`` with the events the source dropped since last time."""
        events = source.take_events()
        total = source.num_dropped_events
        dropped, self._source_dropped_seen = total - self._source_dropped_seen, total
        self.publish(events, dropped=max(dropped, 0))
        return len(events)

    def new_epoch(self, epoch: int | None = None) -> int:
        """The worker restarted: drop what is buffered, start a new epoch, snapshot again."""
        epoch = new_epoch() if epoch is None else epoch
        self._flusher.restart(epoch)
        self._source_dropped_seen = 0
        self._heartbeat.started_at = time.time()
        return epoch

    def update_registry(self, **fields: Any) -> None:
        """Change registry fields; written with the next heartbeat."""
        self._heartbeat.registry_entry.update(fields)

    def request_snapshot(self) -> None:
        self._flusher.request_snapshot()

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until everything published so far (and any pending snapshot) is written."""
        await self._flusher.flush(timeout)

    # -- state and stats -----------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The current epoch (new at every start, and after a stream reset)."""
        return self._flusher.epoch

    @property
    def last_seq(self) -> int:
        """Highest event id received so far (-1 before the first)."""
        return self._flusher.last_seq

    @property
    def registered(self) -> bool:
        """The last heartbeat (registry entry + heartbeat key) was written."""
        return self._heartbeat.registered

    @property
    def close_timeout_s(self) -> float:
        """How long a shutdown waits for the buffer: ``close_timeout_s``, or while Redis is not
        answering (the last write failed, or the heartbeat) one more attempt at most."""
        if self._flusher.backoff.failing or not self.registered:
            return min(self.config.close_timeout_s, self.config.close_timeout_failing_s)
        return self.config.close_timeout_s

    @property
    def buffered_blocks(self) -> int:
        return self._flusher.batcher.buffered_blocks

    @property
    def num_entries(self) -> int:
        return self._flusher.num_entries

    @property
    def num_events(self) -> int:
        return self._flusher.num_events

    @property
    def num_blocks(self) -> int:
        return self._flusher.num_blocks

    @property
    def num_snapshots(self) -> int:
        return self._flusher.num_snapshots

    @property
    def num_stream_resets(self) -> int:
        """Streams deleted because no entry could be added any more."""
        return self._flusher.num_stream_resets

    @property
    def num_capped_trims(self) -> int:
        """Flushes where ``maxlen`` trimmed what ``retain_s`` would keep."""
        return self._flusher.num_capped_trims

    @property
    def num_dropped(self) -> int:
        """Events lost: reported by the caller, dropped by the buffer, or oversized."""
        return self._flusher.num_dropped

    @property
    def num_errors(self) -> int:
        """Failed flushes (Redis errors and unexpected ones)."""
        return self._flusher.backoff.num_errors

    def stats(self) -> dict[str, Any]:
        batcher = self._flusher.batcher
        return {
            "worker": self.worker_id,
            "epoch": self.epoch,
            "entries": self.num_entries,
            "events": self.num_events,
            "blocks": self.num_blocks,
            "dropped": self.num_dropped,
            "snapshots": self.num_snapshots,
            "errors": self.num_errors,
            "stream_resets": self.num_stream_resets,
            "capped_trims": self.num_capped_trims,
            "buffered_blocks": batcher.buffered_blocks,
            "buffered_batches": batcher.num_batches,
        }
