"""``EventConsumer``: the consumer's one task, its lifecycle, its reads and what it reports.

The task (``run``, started by ``start``) repeats ``step``, each round retried with backoff
after an error (``events.redis_io.Backoff``; a Redis error makes the next round check
``run_id`` first). A round:

1. when due (``registry_interval_s``, ``liveness_interval_s``, or after an error): Redis's
   ``run_id``, then the registry, then the heartbeats (``Registry``, ``Liveness``);
2. the resynchronisations that are due (``Resyncer.resync``);
3. one blocking ``XREAD`` over the streams of every synchronised worker (``block_ms``, at most
   ``count`` entries per stream; on a Redis Cluster one per stream, at once), sent no sooner
   than ``read_interval_s`` after the last, and the entries it returns applied (``Applier``),
   the event loop given back whenever ``step_budget_s`` has passed, so that a router sharing
   the loop never waits longer than that plus one entry.

This task is the index's only writer: the parts it calls are plain objects that start no task.
The queries (``workers``, ``last_seq``, ``stats``, ``lag``) only read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from types import TracebackType
from typing import Any

from redis.asyncio import Redis

from events.consumer.apply import Applier, EntryHook
from events.consumer.config import ConsumerConfig
from events.consumer.liveness import Liveness
from events.consumer.registry import Registry
from events.consumer.resync import Resyncer
from events.consumer.state import Counters, WorkerState, entry_ms
from events.index import PrefixIndex
from events.redis_io import Backoff, client_for, is_cluster, stop_tasks

__all__ = ["EventConsumer"]

logger = logging.getLogger(__name__)


class EventConsumer:
    """Reads every registered worker's stream into ``index``; see ``events.consumer``.

    ``redis``: a URL (the consumer owns and closes its client) or a client (left open).
    ``config``: every setting (``ConsumerConfig()`` by default). ``index``: the index to fill
    (a new ``PrefixIndex`` by default). ``on_entry``: called after each applied entry.
    """

    def __init__(
        self,
        redis: Redis | str,
        config: ConsumerConfig | None = None,
        *,
        index: PrefixIndex | None = None,
        on_entry: EntryHook | None = None,
    ) -> None:
        self.config = config = config if config is not None else ConsumerConfig()
        self._redis, self._owns_redis = client_for(
            redis, socket_timeout=config.block_ms / 1000 + 5.0
        )
        self._cluster = is_cluster(self._redis)
        self.index = index if index is not None else PrefixIndex()
        self.counters = Counters()
        # The parts, one concept each, sharing the index, the counters and the workers' states.
        # Only this consumer's task (run) calls the ones that write the index.
        self._resync = Resyncer(self._redis, self.index, config, self.counters)
        self._registry = Registry(
            self._redis, self.index, config, self.counters, self._resync, cluster=self._cluster
        )
        self._liveness = Liveness(
            self._redis, self.index, config, self.counters, self._registry, self._resync
        )
        self._applier = Applier(self.index, config, self.counters, self._resync, on_entry)

        self._next_registry_at = 0.0
        self._next_liveness_at = 0.0
        self.last_read_at = 0.0  # time.monotonic() when the last XREAD was sent
        self.num_reads = 0
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._backoff = Backoff(
            logger,
            "consumer",
            verb="read",
            doing="reading",
            initial_s=config.backoff_initial_s,
            max_s=config.backoff_max_s,
            # Reconnected: the run_id check decides whether everything must be resynchronised.
            on_redis_error=self._check_server_next,
        )

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> EventConsumer:
        if self._task is not None:
            raise RuntimeError("the consumer is already started")
        self._task = asyncio.create_task(self.run(), name="kvmesh-consumer")
        return self

    async def __aenter__(self) -> EventConsumer:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._stopping = True
        if self._task is not None:
            await stop_tasks([self._task])
            self._task = None
        if self._owns_redis:
            await self._redis.aclose()
            self._owns_redis = False

    async def run(self) -> None:
        """The consumer loop (``start()`` runs it as a task); returns when stopped."""
        while not self._stopping:
            await self._backoff.step(self.step)

    def _check_server_next(self) -> None:
        self._registry.run_id_due = True

    async def check_run_id(self) -> None:
        """Compare Redis's ``run_id`` with the last one seen: a new one is a restart (every
        worker resynchronised and held). The loop calls it; a router calls it too before it
        believes that something it knew is gone from Redis."""
        await self._registry.check_run_id()

    def check_liveness_soon(self) -> None:
        """Read the heartbeats at the next round instead of when due (a router that saw one
        vanish asks for it: the consumer decides whether the worker expired or is held)."""
        self._next_liveness_at = 0.0

    # -- the loop ------------------------------------------------------------------------------

    async def step(self) -> None:
        """One round: registry and liveness when due, resynchronisations, one XREAD."""
        now = time.monotonic()
        registry = self._registry
        # The run_id check comes first: after a restart it resynchronises (and holds) the
        # workers still followed, before a registry or heartbeats still missing expire them.
        if registry.run_id_due or now >= self._next_registry_at or now >= self._next_liveness_at:
            await registry.check_run_id()
        if now >= self._next_registry_at:
            await registry.refresh()
            self._next_registry_at = now + self.config.registry_interval_s
        if now >= self._next_liveness_at:
            await self._liveness.check()
            self._next_liveness_at = now + self.config.liveness_interval_s
        for state in list(registry.workers.values()):
            if state.alive and not state.synced and state.retry_at <= now:
                await self._resync.resync(state)
        streams: dict[bytes, bytes | str] = {
            state.key: state.pos for state in registry.workers.values() if state.synced
        }
        if not streams:
            deadline = min(
                [self._next_registry_at, self._next_liveness_at]
                + [s.retry_at for s in registry.workers.values() if s.alive and not s.synced]
            )
            block_s = self.config.block_ms / 1000
            await asyncio.sleep(min(max(deadline - time.monotonic(), 0.001), block_s))
            return
        wait = self.last_read_at + self.config.read_interval_s - time.monotonic()
        if wait > 0:  # gather what the workers flush meanwhile into one reply
            await asyncio.sleep(wait)
        self.last_read_at = time.monotonic()
        self.num_reads += 1
        reply = await self._read(streams)
        await self._apply_reply(reply)
        if self._applier.oversized_read:
            # An oversized entry was read (Redis cannot tell an entry's size before it sends
            # it) and refused: drop the reply that holds it before handing the heap back.
            reply.clear()
            self._applier.release_memory()

    async def _apply_reply(self, reply: list[Any]) -> None:
        for key, entries in reply:
            target = self._registry.by_key.get(key)
            start = 0
            while target is not None and target.synced and start < len(entries):
                start = self._applier.apply(target, entries, start)
                if start < len(entries):
                    # Over budget: let the rest of the event loop run, then carry on. The index
                    # is consistent between entries, so readers see a whole entry or none.
                    await asyncio.sleep(0)

    async def _read(self, streams: dict[bytes, bytes | str]) -> list[Any]:
        """One blocking XREAD; on a Redis Cluster one per stream, at once (each worker's stream
        has its own slot, and a command may not span slots)."""
        # redis-py (RESP2, bytes): [[stream key, [(entry id, {field: value}), ...]], ...]
        if not self._cluster:
            reply: list[Any] = await self._redis.xread(  # type: ignore[assignment]
                streams,  # type: ignore[arg-type]
                count=self.config.count,
                block=self.config.block_ms,
            )
            return reply
        replies = await asyncio.gather(*(self._read_one(key, pos) for key, pos in streams.items()))
        return [item for answer in replies if answer for item in answer]

    async def _read_one(self, key: bytes, pos: bytes | str) -> Any:
        # The command is made inside the task, not before it: a task cancelled before it starts
        # (the consumer closing) would otherwise leave redis-py's coroutine never awaited.
        block_ms = min(self.config.block_ms, 20)
        return await self._redis.xread({key: pos}, count=self.config.count, block=block_ms)

    # -- queries -------------------------------------------------------------------------------

    def workers(self) -> dict[str, WorkerState]:
        """Followed workers (registered), synchronised or not."""
        return dict(self._registry.workers)

    def last_seq(self, worker_id: str) -> int | None:
        """Last event id applied for ``worker_id``; None while it is not synchronised."""
        state = self._registry.workers.get(worker_id)
        if state is None or not state.synced:
            return None
        return state.last_seq

    def stats(self) -> dict[str, Any]:
        c = self.counters
        states = self._registry.workers.values()
        return {
            "workers": len(states),
            "synced_workers": sum(s.synced for s in states),
            "reads": self.num_reads,
            "entries": c.num_entries,
            "events": c.num_events,
            "blocks": c.num_blocks,
            "skipped_entries": c.num_skipped_entries,
            "stale_entries": c.num_stale_entries,
            "malformed": c.num_malformed,
            "oversized": c.num_oversized,
            "syncs": c.num_syncs,
            "resyncs": c.num_resyncs,
            "resync_reasons": dict(c.resync_reasons),
            "snapshot_loads": c.num_snapshot_loads,
            "snapshot_requests": c.num_snapshot_requests,
            "expired": c.num_expired,
            "errors": self.num_errors,
            "redis_restarts": c.num_redis_restarts,
            "held": c.num_held,
            "held_workers": sum(s.held_until > time.monotonic() for s in states),
            "apply_lag_ms": round(c.apply_lag_ms, 3),
            "yields": c.num_yields,
            "bad_registry_entries": c.num_bad_registry_entries,
            "stale_workers": sum(s.stale is not None for s in states),
            "stale_reports": c.num_stale_reports,
            "memory_releases": c.num_memory_releases,
        }

    async def lag(self, limit: int = 10_000) -> dict[str, dict[str, float]]:
        """Per synchronised worker: entries in its stream not read yet (at most ``limit``) and
        the age in ms of the oldest of them (0 when caught up)."""
        out: dict[str, dict[str, float]] = {}
        now_ms = time.time() * 1000
        for state in list(self._registry.workers.values()):
            if not state.synced:
                continue
            pos = state.pos.decode() if isinstance(state.pos, bytes) else state.pos
            pending: list[Any] = await self._redis.xrange(  # type: ignore[assignment]
                state.key, min=f"({pos}", max="+", count=limit
            )
            age = max(now_ms - entry_ms(pending[0][0]), 0.0) if pending else 0.0
            out[state.worker] = {"entries": len(pending), "ms": round(age, 3)}
        return out

    # -- counters (``self.counters``, counted by the parts), as they were always named ---------

    @property
    def num_errors(self) -> int:
        """Failed rounds (Redis errors and unexpected ones)."""
        return self._backoff.num_errors

    @property
    def num_entries(self) -> int:
        return self.counters.num_entries

    @property
    def num_events(self) -> int:
        return self.counters.num_events

    @property
    def num_blocks(self) -> int:
        return self.counters.num_blocks

    @property
    def num_skipped_entries(self) -> int:
        return self.counters.num_skipped_entries

    @property
    def num_stale_entries(self) -> int:
        return self.counters.num_stale_entries

    @property
    def num_malformed(self) -> int:
        return self.counters.num_malformed

    @property
    def num_oversized(self) -> int:
        return self.counters.num_oversized

    @property
    def num_syncs(self) -> int:
        return self.counters.num_syncs

    @property
    def num_resyncs(self) -> int:
        return self.counters.num_resyncs

    @property
    def resync_reasons(self) -> Counter[str]:
        return self.counters.resync_reasons

    @property
    def num_snapshot_loads(self) -> int:
        return self.counters.num_snapshot_loads

    @property
    def num_snapshot_requests(self) -> int:
        return self.counters.num_snapshot_requests

    @property
    def num_expired(self) -> int:
        return self.counters.num_expired

    @property
    def num_redis_restarts(self) -> int:
        return self.counters.num_redis_restarts

    @property
    def num_held(self) -> int:
        return self.counters.num_held

    @property
    def apply_lag_ms(self) -> float:
        return self.counters.apply_lag_ms

    @property
    def num_bad_registry_entries(self) -> int:
        return self.counters.num_bad_registry_entries

    @property
    def num_yields(self) -> int:
        return self.counters.num_yields

    @property
    def num_stale_reports(self) -> int:
        return self.counters.num_stale_reports

    @property
    def num_memory_releases(self) -> int:
        return self.counters.num_memory_releases
