"""What a publisher tells Redis about its worker besides the stream (``Heartbeat``): the
registry entry, the heartbeat key and the load hash, each kept by a task of its own.

Every ``heartbeat_interval_s`` one pipeline writes the registry entry (``kvmesh:workers``), the
heartbeat key (``SET ... PX heartbeat_ttl_s``, its value ``"<epoch> <last event id received>"``,
so that a consumer can tell it is behind), reads a consumer's request for a fresh snapshot and
checks that the snapshot still exists (a Redis restart without persistence loses it): either
makes the flusher write a new one. ``registered`` says whether the last heartbeat was written
(a worker whose Redis never answered is invisible to every router, and says so). Every
``load_interval_s`` the load task writes the load hash (with a TTL, so a dead worker's load
disappears). ``unregister`` removes the registry entry, the heartbeat key and the load hash (a
clean stop).

Both tasks log a failure and carry on; ``stop`` ends them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from redis.asyncio import Redis

from events import keys
from events.publisher.config import PublisherConfig
from events.publisher.flusher import Flusher
from events.redis_io import REDIS_ERRORS, raise_if_cancelled

__all__ = ["Heartbeat", "LoadSource"]

logger = logging.getLogger(__name__)

# The fields of a worker's load hash, read afresh at each write.
LoadSource = Callable[[], Mapping[str, int | float | str]]


class Heartbeat:
    """A worker's registry entry, heartbeat key and load hash; see the module docstring."""

    def __init__(
        self,
        redis: Redis,
        worker_id: str,
        config: PublisherConfig,
        flusher: Flusher,
        *,
        registry_entry: Mapping[str, Any] | None,
        load_source: LoadSource | None,
    ) -> None:
        self._redis = redis
        self._worker_id = worker_id
        self._config = config
        self._flusher = flusher  # its epoch and last event id; it writes the snapshots
        self.registry_entry: dict[str, Any] = dict(registry_entry or {})
        self.load_source = load_source
        self.started_at = time.time()
        self.registered = False  # the last heartbeat (registry entry + heartbeat key) was written
        self._stop = asyncio.Event()  # ends the heartbeat and load loops

    # -- heartbeat and registry ----------------------------------------------------------------

    def _registry_json(self) -> str:
        entry = dict(self.registry_entry)
        entry.update(
            worker=self._worker_id,
            epoch=self._flusher.epoch,
            started_at=self.started_at,
            fmt=self._config.fmt,
            heartbeat_ttl_s=self._config.heartbeat_ttl_s,
        )
        return json.dumps(entry, sort_keys=True)

    async def beat(self) -> None:
        """Write the registry entry and heartbeat key once; ask for a snapshot if one is due."""
        try:
            requested, has_snapshot = await self._write_heartbeat()
        except REDIS_ERRORS:
            self.registered = False
            raise
        if not self.registered:
            logger.info("publisher %s: registered in Redis", self._worker_id)
            self.registered = True
        if requested or not has_snapshot:
            if requested:
                logger.info("publisher %s: a consumer asked for a snapshot", self._worker_id)
            self._flusher.request_snapshot()

    async def _write_heartbeat(self) -> tuple[Any, Any]:
        """The registry entry and heartbeat key; (a consumer's snapshot request, whether our
        snapshot exists)."""
        worker_id = self._worker_id
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hset(keys.WORKERS_KEY, worker_id, self._registry_json())
            # "<epoch> <last event id received>": a consumer that has not applied that id
            # within its stale_after_s reports this worker stale (its index is behind).
            pipe.set(
                keys.alive_key(worker_id),
                f"{self._flusher.epoch} {self._flusher.last_seq}",
                px=int(self._config.heartbeat_ttl_s * 1000),
            )
            pipe.getdel(keys.snapshot_request_key(worker_id))
            pipe.exists(keys.snapshot_key(worker_id))
            _, _, requested, has_snapshot = await pipe.execute()
        return requested, has_snapshot

    async def unregister(self) -> None:
        """Remove the registry entry, the heartbeat key and the load hash (a clean stop)."""
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hdel(keys.WORKERS_KEY, self._worker_id)
                pipe.delete(keys.alive_key(self._worker_id), keys.load_key(self._worker_id))
                await pipe.execute()
        except REDIS_ERRORS as exc:
            logger.warning("publisher %s: could not unregister: %s", self._worker_id, exc)

    # -- load ----------------------------------------------------------------------------------

    async def write_load(self) -> None:
        """Write the load hash once (with its TTL)."""
        assert self.load_source is not None
        load = dict(self.load_source())
        key = keys.load_key(self._worker_id)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hset(key, mapping=load)  # type: ignore[arg-type]
            ttl_s = max(self._config.load_interval_s * 3, self._config.heartbeat_ttl_s)
            pipe.pexpire(key, int(ttl_s * 1000))
            await pipe.execute()

    # -- the tasks -----------------------------------------------------------------------------

    async def run_heartbeat(self) -> None:
        """The heartbeat task (the first beat is the publisher's start)."""
        interval_s = self._config.heartbeat_interval_s
        await self._every(interval_s, self.beat, "heartbeat", first=False)

    async def run_load(self) -> None:
        """The load task (needs a ``load_source``)."""
        await self._every(self._config.load_interval_s, self.write_load, "load update")

    def stop(self) -> None:
        """End both tasks at their next pause."""
        self._stop.set()

    async def _every(
        self,
        interval_s: float,
        action: Callable[[], Awaitable[None]],
        what: str,
        *,
        first: bool = True,
    ) -> None:
        """Run ``action`` every ``interval_s`` until ``stop``; log failures and carry on."""
        if not first:
            await self._pause(interval_s)
        while not self._stop.is_set():
            raise_if_cancelled()
            try:
                await action()
            except REDIS_ERRORS as exc:
                raise_if_cancelled()
                logger.debug("publisher %s: %s failed: %s", self._worker_id, what, exc)
            except Exception:
                raise_if_cancelled()
                logger.exception("publisher %s: %s error", self._worker_id, what)
            await self._pause(interval_s)

    async def _pause(self, seconds: float) -> None:
        """Sleep, or return early when stopped."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stop.wait()
