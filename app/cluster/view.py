"""``ClusterView``: every worker as Redis tells it, kept current by two tasks on the event loop.

* the consumer (``events.consumer``): every registered worker's stream into the ``PrefixIndex``;
  it gives the loop back every ``step_budget_s`` so that requests never wait long behind it;
* the sync loop: every ``sync_interval_s`` it brings ``members`` in line with the consumer
  (registered, alive, synchronised); every ``load_interval_s`` it reads, in one pipeline, the
  operators' cordons (``app.cluster.fleet``) and each worker's load hash, heartbeat TTL and
  stream tail. After each round it calls the ``sync_hooks`` (the router copies the members into
  its ``RouterCore`` there).

For the index's lag the stream is asked for the first entry the consumer has not read (``XRANGE
(pos + COUNT 1``: nothing when it is up to date). ``XINFO STREAM``, read before for the
stream's last id, answers the whole first and last entries with it, and an event batch can be
100 KB: ten reads a second of 16 workers moved tens of MB and cost an idle router 7% of a core.

A worker whose heartbeat key is gone is not dropped here: the sync loop asks the consumer to
check at once, and the worker leaves when the consumer expires it (within about 0.2 s). The
consumer decides because Redis also loses every heartbeat when it restarts empty: the consumer
then holds each worker for its heartbeat TTL, and readers keep routing to them meanwhile.

Cordons read from Redis replace the last ones read, but a cordon that vanished is written back
when Redis has restarted since (it needs no persistence, and an empty restart must not put a
cordoned worker back in rotation); a read sent before this process's own cordon write is
skipped. While Redis does not answer, every member is stale (``redis_unreachable``) and readers
go on with what was last known.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from app.cluster.fleet import Cordon, CordonState, clear_cordon, parse_cordons, set_cordon
from app.cluster.members import Member, id_key, id_text, parse_load
from app.core.redis import RedisCredentialsError, check_credentials
from cache import KVCacheEvent
from events import keys
from events.consumer import ConsumerConfig, EntryHook, EventConsumer
from events.envelope import Envelope
from events.index import PrefixIndex
from events.redis_io import REDIS_ERRORS, raise_if_cancelled, redis_client

__all__ = ["ClusterView", "ViewConfig"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ViewConfig:
    """How often the view reads, and when it calls data stale (each service's settings)."""

    load_interval_s: float = 0.1
    sync_interval_s: float = 0.05
    max_lag_ms: float = 2_000.0
    step_budget_s: float = 0.010
    read_interval_s: float = 0.0  # the consumer's XREADs, at most this often (0: at once)

    def __post_init__(self) -> None:
        check_read_interval(self.read_interval_s, self.max_lag_ms)


def check_read_interval(read_interval_s: float, max_lag_ms: float) -> None:
    """Refuse reading the streams so seldom that a busy worker's entries wait unread for half
    of ``max_lag_ms``: the view would call workers stale between its own reads. (The settings
    and ``ViewConfig`` call it with the same seconds, so they agree to the last bit.)"""
    if read_interval_s > max_lag_ms / 2_000:
        raise ValueError(
            f"event_read_interval_ms: {read_interval_s * 1000:g} is more than half of "
            f"max_lag_ms ({max_lag_ms:g}); entries unread that long make a worker look stale"
        )


class ClusterView:
    """See the module docstring. ``name`` starts its log lines ("router", "dashboard")."""

    def __init__(self, redis: Redis, config: ViewConfig, *, name: str) -> None:
        self.redis = redis
        self.config = config
        self.name = name
        self.index = PrefixIndex()
        self.entry_hooks: list[EntryHook] = []  # every applied stream entry (the dashboard's)
        self.sync_hooks: list[Callable[[], None]] = []  # after every sync round
        self.consumer = EventConsumer(
            redis,
            ConsumerConfig(
                step_budget_s=config.step_budget_s, read_interval_s=config.read_interval_s
            ),
            index=self.index,
            on_entry=self._on_entry,
        )
        self.members: dict[str, Member] = {}
        self.cordons: dict[str, Cordon] = {}  # as last read from Redis
        self.num_bad_cordons = 0  # entries of the cordons hash that did not parse
        self._cordon_writes = 0  # our own writes (a read sent before one is old)
        self._cordon_restarts = 0  # the consumer's Redis restarts when the cordons were read
        self.redis_ok = False
        self.synced_once = False
        self.num_sync_errors = 0
        self._next_load_at = 0.0
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def connect(cls, redis_url: str, config: ViewConfig, *, name: str) -> ClusterView:
        """A view on its own client; a Redis that refuses the URL's credentials stops it here."""
        redis = redis_client(redis_url, socket_timeout=5.0)
        try:
            await check_credentials(redis, name)
        except RedisCredentialsError:
            await redis.aclose()
            raise
        return cls(redis, config, name=name)

    async def start(self) -> None:
        await self.consumer.start()
        self._task = asyncio.create_task(self._run_sync(), name=f"kvmesh-{self.name}-sync")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.consumer.aclose()
        await self.redis.aclose()

    def _on_entry(
        self, worker: str, envelope: Envelope, events: list[KVCacheEvent], blocks: int
    ) -> None:
        for hook in self.entry_hooks:
            hook(worker, envelope, events, blocks)

    # -- the sync loop -------------------------------------------------------------------------

    async def _run_sync(self) -> None:
        while True:
            try:
                await self.sync_once()
                self.redis_ok = True
            except REDIS_ERRORS as exc:
                self.num_sync_errors += 1
                if self.redis_ok:
                    logger.warning("%s: Redis read failed: %s", self.name, exc)
                self.redis_ok = False
                # Readers go on with the last index and loads, said to be stale.
                for member in self.members.values():
                    member.stale_reason = "redis_unreachable"
                self._call_hooks()
            except Exception:
                self.num_sync_errors += 1
                logger.exception("%s: sync error", self.name)
            # redis-py may swallow the cancellation of aclose() mid-command (or turn it into a
            # connection error): without this check the loop would never stop.
            raise_if_cancelled()
            await asyncio.sleep(self.config.sync_interval_s)

    async def sync_once(self) -> None:
        """Bring the members in line with the consumer (and, when due, read the loads)."""
        now = time.monotonic()
        self._follow()
        if now >= self._next_load_at:
            await self._read_loads()
            self._next_load_at = now + self.config.load_interval_s
            # Workers the consumer took up while Redis answered: routable now, their load read
            # at the next tick (a sync interval is 20-50 ms; a client may not wait for it).
            self._follow()
        self._judge()
        self.synced_once = True
        self._call_hooks()

    def _call_hooks(self) -> None:
        for hook in self.sync_hooks:
            hook()

    def _follow(self) -> None:
        """One member per alive worker the consumer follows; the others leave."""
        states = self.consumer.workers()
        for worker in list(self.members):
            state = states.get(worker)
            if state is None or not state.alive:
                del self.members[worker]
        for worker, state in states.items():
            if state.alive and worker not in self.members:
                self.members[worker] = Member(worker, state)

    def _judge(self) -> None:
        max_lag_ms = self.config.max_lag_ms
        for worker, member in self.members.items():
            member.cordon = self.cordons.get(worker)
            member.stale_reason = member.judge(max_lag_ms)

    async def _read_members(self, members: list[Member]) -> tuple[Any, list[list[Any]]]:
        """The cordons hash, and each member's [load hash, heartbeat PTTL, the id of the first
        stream entry the consumer has not read (None: it is up to date)]."""
        async with self.redis.pipeline(transaction=False) as pipe:
            # Always at least this: redis_ok (and /ready) is true only when Redis answers.
            pipe.hgetall(keys.CORDONS_KEY)
            for member in members:
                pipe.hgetall(keys.load_key(member.worker))
                pipe.pttl(keys.alive_key(member.worker))
                after = f"({id_text(member.follow.pos)}"
                pipe.xrange(member.follow.key, min=after, max="+", count=1)
            cordons_raw, *replies = await pipe.execute(raise_on_error=False)
        triples = zip(replies[::3], replies[1::3], replies[2::3], strict=True)
        return cordons_raw, [
            [load, pttl, unread[0][0] if isinstance(unread, list) and unread else None]
            for load, pttl, unread in triples
        ]

    async def _read_loads(self) -> None:
        members = list(self.members.values())
        writes = self._cordon_writes
        cordons_raw, replies = await self._read_members(members)
        if writes == self._cordon_writes:  # else this read predates our own write: skip it
            await self._set_cordons(cordons_raw)
        now_ms = time.time() * 1000
        for member, (load_raw, pttl, unread) in zip(members, replies, strict=True):
            ttl_s = member.info.get("heartbeat_ttl_s")
            member.heartbeat_ttl_s = float(ttl_s) if isinstance(ttl_s, int | float) else None
            if isinstance(pttl, int) and pttl >= 0 and member.heartbeat_ttl_s:
                member.heartbeat_age_s = max(member.heartbeat_ttl_s - pttl / 1000, 0.0)
            elif (
                isinstance(pttl, int)
                and pttl == -2
                and member.follow.held_until <= time.monotonic()
            ):
                # Expired, or lost by a Redis restart: the consumer tells which, now.
                self.consumer.check_liveness_soon()
                member.heartbeat_age_s = None
            load = parse_load(load_raw)
            member.has_load = bool(load)
            if load:
                member.load = load
            # The age of the oldest entry not read yet is the index's lag for that worker.
            member.lag_ms = max(now_ms - id_key(unread)[0], 0.0) if unread is not None else 0.0

    # -- cordons -------------------------------------------------------------------------------

    async def _set_cordons(self, raw: Any) -> None:
        if isinstance(raw, Exception):  # not a hash (WRONGTYPE): keep what was last read
            if not self.num_bad_cordons:
                logger.warning("%s: cannot read %s: %s", self.name, keys.CORDONS_KEY, raw)
            self.num_bad_cordons = 1
            return
        cordons, bad = parse_cordons(raw)
        if bad and bad != self.num_bad_cordons:
            logger.warning(
                "%s: %d malformed entries in %s skipped", self.name, bad, keys.CORDONS_KEY
            )
        self.num_bad_cordons = bad
        lost = {w: c for w, c in self.cordons.items() if w not in cordons}
        if lost:
            # Gone because someone lifted them, or because Redis restarted empty: then they
            # are written back. HSETNX: a newer word from another reader wins.
            await self.consumer.check_run_id()
            if self.consumer.num_redis_restarts != self._cordon_restarts:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for worker, cordon in lost.items():
                        pipe.hsetnx(keys.CORDONS_KEY, worker, json.dumps(cordon.as_dict()))
                    await pipe.execute()
                logger.warning(
                    "%s: Redis restarted; wrote back the cordons of %s",
                    self.name,
                    ", ".join(sorted(lost)),
                )
                cordons.update(lost)
        self._cordon_restarts = self.consumer.num_redis_restarts
        self.cordons = cordons

    async def cordon(self, worker: str, state: CordonState) -> Cordon:
        """Cordon (or drain) ``worker`` for every reader; applied here at once."""
        cordon = await set_cordon(self.redis, worker, state)
        self._apply_cordon(worker, cordon)
        return cordon

    async def uncordon(self, worker: str) -> None:
        await clear_cordon(self.redis, worker)
        self._apply_cordon(worker, None)

    def _apply_cordon(self, worker: str, cordon: Cordon | None) -> None:
        self._cordon_writes += 1
        if cordon is None:
            self.cordons.pop(worker, None)
        else:
            self.cordons[worker] = cordon
        self._judge()
        self._call_hooks()

    def cordon_report(self, worker: str, *, routed: int = 0) -> dict[str, Any] | None:
        """An operator's cordon as ``/workers`` shows it: for a drain, what is still in flight
        there (the worker's own count, and ``routed``: a router's) and whether it is done."""
        cordon = self.cordons.get(worker)
        if cordon is None:
            return None
        out = cordon.as_dict()
        if cordon.state == "draining":
            member = self.members.get(worker)
            running, waiting = member.in_flight() if member is not None else (0, 0)
            out["in_flight"] = {"running": running, "waiting": waiting, "this_router": routed}
            out["done"] = member is not None and running + waiting + routed == 0
        return out

    # -- reports -------------------------------------------------------------------------------

    def follows(self, worker: str) -> bool:
        """Whether ``worker`` is registered (alive or not) or cordoned: what an admin call may
        name."""
        return worker in self.consumer.workers() or worker in self.cordons

    def stream_reports(self) -> dict[str, dict[str, Any]]:
        """Per registered worker, by id: what ``/workers`` says of its stream, heartbeat and
        blocks."""
        per_worker = self.index.stats()["per_worker"]
        out: dict[str, dict[str, Any]] = {}
        for worker, state in sorted(self.consumer.workers().items()):
            member = self.members.get(worker)
            tiers = per_worker.get(worker, {"gpu": 0, "host": 0})
            out[worker] = {
                "model": state.info.get("model"),
                "approximate": bool(state.info.get("approximate")),
                "alive": state.alive,
                "synced": state.synced,
                "epoch": state.epoch,
                "last_seq": state.last_seq,
                "lag_ms": round(member.lag_ms, 3) if member is not None else 0.0,
                "heartbeat_age_s": member.heartbeat_age_s if member is not None else None,
                "blocks": {"gpu": tiers["gpu"], "host": tiers["host"]},
            }
        return out

    def workers_report(self) -> list[dict[str, Any]]:
        """``GET /workers`` as the view alone tells it (the standalone dashboard's; a router
        adds what it knows on top): every registered worker, ``gone`` once not alive."""
        out: list[dict[str, Any]] = []
        states = self.consumer.workers()
        for worker, stream in self.stream_reports().items():
            member = self.members.get(worker)
            entry: dict[str, Any] = {
                "worker": worker,
                "url": member.url if member is not None else states[worker].info.get("url"),
                "state": member.state if member is not None else "gone",
                "stale_reason": member.stale_reason if member is not None else None,
                "capacity_blocks": member.capacity_blocks if member is not None else 0,
                "load": dict(member.load) if member is not None else {},
                **stream,
                "cordon": self.cordon_report(worker),
            }
            out.append(entry)
        return out

    def catching_up(self) -> list[str]:
        """Alive workers whose snapshot is still being loaded."""
        return sorted(w for w, s in self.consumer.workers().items() if s.alive and not s.synced)

    def readiness(self, fresh: list[str], stale: dict[str, str]) -> dict[str, Any]:
        """``GET /ready``'s answer: ready when Redis answers, the workers are known, one of
        ``fresh`` (the reader's workers that are up with fresh data) exists, and every alive
        worker's stream has been caught up with (loaded from its snapshot)."""
        catching_up = self.catching_up()
        reasons: list[str] = []
        if not self.redis_ok:
            reasons.append("redis is not answering")
        if not self.synced_once:
            reasons.append("the worker registry has not been read yet")
        if not fresh:
            reasons.append("no worker is up with fresh data")
        if catching_up:
            reasons.append(f"catching up with {', '.join(catching_up)}")
        return {
            "ready": not reasons,
            "reasons": reasons,
            "workers_up": fresh,
            "stale": stale,
            "catching_up": catching_up,
        }
