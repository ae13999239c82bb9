"""Which workers the consumer follows (``Registry``), and how a Redis restart holds them.

Every ``registry_interval_s`` the loop reads the registry (``kvmesh:workers``): a new worker
is followed (a ``WorkerState``, synchronised once its heartbeat is seen), an unregistered one
forgotten (``remove_worker``). A registry entry that is not a worker id and a JSON object is
counted and logged once per name and value, and skipped.

Before each registry or heartbeat read the loop compares Redis's ``run_id`` (every primary's,
on a Redis Cluster) with the last one seen (``check_run_id``, also awaited by a router before
it believes that something it knew is gone from Redis). A new one is a restart that lost every
stream: every synchronised worker is resynchronised.

A Redis restart without persistence loses the registry and every heartbeat too, not only the
streams, and the workers write them again only at their next heartbeat (within a second). So a
worker that the registry or its heartbeat stops naming is forgotten or expired only after
``run_id`` is checked again (``held``), and a restart *holds* every followed worker for its
heartbeat TTL (``WorkerState.held_until``; ``restart_hold_s`` when its entry does not say):
kept alive and followed, not forgotten, while the TTL runs, whether the registry or its
heartbeat comes back first (on a Redis Cluster they live on different primaries, and one may
restart alone); a worker that died with the server expires when it is over. Routers keep
routing to them meanwhile instead of finding no worker.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from typing import Any

from redis.asyncio import Redis, RedisCluster

from events import keys
from events.consumer.config import ConsumerConfig
from events.consumer.resync import Resyncer
from events.consumer.state import Counters, WorkerState
from events.index import PrefixIndex

__all__ = ["Registry"]

logger = logging.getLogger(__name__)


class Registry:
    """The followed workers (``workers``, ``by_key``) and Redis's ``run_id``; see the module
    docstring."""

    def __init__(
        self,
        redis: Redis,
        index: PrefixIndex,
        config: ConsumerConfig,
        counters: Counters,
        resync: Resyncer,
        *,
        cluster: bool,
    ) -> None:
        self._redis = redis
        self._index = index
        self._config = config
        self._counters = counters
        self._resync = resync
        self._cluster = cluster
        self.workers: dict[str, WorkerState] = {}  # followed workers, by id
        self.by_key: dict[bytes, WorkerState] = {}  # the same, by stream key
        self.run_id_due = True  # check run_id at the next round (at start, after an error)
        self._run_id: str | None = None
        self._bad_entries: dict[bytes, bytes] = {}  # logged already: name -> value

    # -- Redis restarts ------------------------------------------------------------------------

    async def check_run_id(self) -> None:
        """Compare Redis's ``run_id`` with the last one seen: a new one is a restart (every
        worker resynchronised and held)."""
        if self._cluster:
            # Every primary's: one of them restarting empty loses its workers' streams.
            infos = await self._redis.info("server", target_nodes=RedisCluster.PRIMARIES)
            run_id = ",".join(sorted(str(i.get("run_id", "")) for i in infos.values()))
        else:
            info = await self._redis.info("server")
            run_id = str(info.get("run_id", ""))
        if self._run_id is not None and run_id != self._run_id:
            self._counters.num_redis_restarts += 1
            logger.warning(
                "consumer: Redis restarted (new run_id); resynchronising every worker, each "
                "held for its heartbeat TTL while it registers again"
            )
            now = time.monotonic()
            for state in self.workers.values():
                if state.synced:
                    self._resync.schedule(state, "redis_restart")
                if state.alive:
                    state.held_until = now + self._hold_s(state)
                    self._counters.num_held += 1
        self._run_id = run_id
        self.run_id_due = False

    def _hold_s(self, state: WorkerState) -> float:
        """How long a restart holds ``state``: its heartbeat TTL (it beats again well within)."""
        ttl = state.info.get("heartbeat_ttl_s")
        if isinstance(ttl, int | float) and not isinstance(ttl, bool) and 0 < ttl <= 3_600:
            return float(ttl)
        return self._config.restart_hold_s

    async def held(self, states: Iterable[WorkerState]) -> set[str]:
        """Of ``states`` (about to be forgotten or expired), the ones a restart holds.

        ``run_id`` is checked again first: the registry or the heartbeats just read may come
        from a server that restarted after this round's check."""
        await self.check_run_id()
        now = time.monotonic()
        return {state.worker for state in states if state.held_until > now}

    # -- the registry --------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Read the registry: follow new workers, forget unregistered ones (unless held)."""
        raw: dict[bytes, bytes] = await self._redis.hgetall(keys.WORKERS_KEY)  # type: ignore[assignment]
        registered: dict[str, dict[str, Any]] = {}
        for name, value in raw.items():
            try:
                worker_id = keys.validate_worker_id(name.decode())
                info = json.loads(value)
                if not isinstance(info, dict):
                    raise ValueError("registry entry is not an object")
            except ValueError as exc:
                # An InvalidWorkerIdError, or json's: bad UTF-8, bad JSON, a too long integer.
                # Logged and counted once per name and value: the registry is read every
                # half second, and a forged entry would otherwise fill the log.
                if self._bad_entries.get(name) != value:
                    self._bad_entries[name] = value
                    self._counters.num_bad_registry_entries += 1
                    logger.warning("consumer: bad registry entry %r: %s", name[:80], exc)
                continue
            registered[worker_id] = info
        missing = [s for w, s in self.workers.items() if w not in registered]
        held = await self.held(missing) if missing else set()
        for gone in missing:
            if gone.worker not in held:
                self._forget(gone.worker)
        for worker_id, info in registered.items():
            state = self.workers.get(worker_id)
            if state is None:
                key = keys.events_key(worker_id).encode()
                state = WorkerState(worker_id, key)
                self.workers[worker_id] = state
                self.by_key[key] = state
            state.info = info

    def _forget(self, worker_id: str) -> None:
        state = self.workers.pop(worker_id)
        del self.by_key[state.key]
        self._index.remove_worker(worker_id)
