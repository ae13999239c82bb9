"""``EventConsumer``: every worker's stream, read back into one ``PrefixIndex`` (asyncio).

One task does everything, in a loop, so the index has a single writer:

1. every ``registry_interval_s``: read the registry (``kvmesh:workers``) and follow new
   workers, forget unregistered ones; check Redis's ``run_id`` (a changed id is a restart
   that lost every stream: resynchronise every worker);
2. every ``liveness_interval_s``: read each worker's heartbeat key; a worker whose heartbeat
   expired leaves the index (``remove_worker``) until it beats again (``check_liveness_soon``
   asks for this check at the next round, e.g. when a router sees a heartbeat gone). The
   heartbeat says
   ``"<epoch> <last event id>"``: a worker whose reported id the consumer has not applied
   within ``stale_after_s`` (2 s) is marked ``WorkerState.stale = "behind_heartbeat"`` (logged
   once, cleared when it has), and if nothing at all was applied for it meanwhile (its stream
   position is wedged, e.g. past an entry with the largest possible id) it is resynchronised;
3. resynchronise the workers that need it (below); a snapshot is decoded and replayed in
   slices of ``step_budget_s`` too, the worker marked not synchronised meanwhile;
4. one blocking ``XREAD`` over the streams of every synchronised worker (``block_ms``, at most
   ``count`` entries per stream), and apply what it returns (with the cyclic garbage collector
   paused while it does, unless ``pause_gc=False``: decoding makes many short-lived objects),
   giving the event loop back whenever ``step_budget_s`` (10 ms) has passed, so that a router
   sharing the loop never waits longer than that plus one entry.

Per worker it keeps the epoch, the last event id applied (``last_seq``), the id of the snapshot
it started from and its position in the stream. For each entry, in stream order:

* malformed or larger than ``max_entry_bytes``: counted (``malformed``, ``oversized``), logged
  once, skipped (after an oversized one the freed heap is handed back with glibc's
  ``malloc_trim``: Redis cannot tell an entry's size before sending it);
* an older epoch: a leftover of an earlier start, skipped (``stale_entries``);
* ``seq_last <= last_seq``: already applied, or covered by the snapshot, skipped;
* a newer epoch, ``seq_first > last_seq + 1`` (a gap: events lost, or entries trimmed away by
  ``MAXLEN`` before they were read), or ``dropped > 0`` not covered by the snapshot:
  **resynchronise** -- forget the worker (``remove_worker``), load and replay its snapshot,
  and read the stream again after the snapshot's ``stream_id``, skipping the events the
  snapshot covers (an entry straddling its event id is applied from the next id on);
* else apply its events with ids above ``last_seq``; an event the index refuses (a cache level
  it does not know) makes the entry malformed: skipped whole if nothing of it was applied yet,
  else the worker is resynchronised.

A Redis restart without persistence loses the registry and every heartbeat too, not only the
streams, and the workers write them again only at their next heartbeat (within a second). So a
worker that the registry or its heartbeat stops naming is forgotten or expired only after
``run_id`` is checked again, and a restart *holds* every followed worker for its heartbeat TTL
(``WorkerState.held_until``; ``restart_hold_s`` when its entry does not say): kept alive and
followed, not forgotten, while the TTL runs, whether the registry or its heartbeat comes back
first (on a Redis Cluster they live on different primaries, and one may restart alone); a
worker that died with the server expires when it is over. Routers keep routing to them
meanwhile instead of finding no worker.

A gap right after a resynchronisation, before anything was applied, means the snapshot is
older than what the stream still holds (trimmed): the consumer asks the worker for a fresh one
(``kvmesh:{<worker>}:snapshot:request``, answered at the worker's next flush or heartbeat) and
tries again with backoff. The entry that made a resynchronisation is remembered: when it stops
the consumer again, the snapshot did not get past it, and the same snapshot is not replayed
again -- the consumer waits for a fresh one, which starts after the entry. The entry is then
checked against that snapshot: one from a later epoch, or with ids past the snapshot's, was
never the worker's (a forged marker) and is counted as malformed and logged once. So a hostile
entry costs one resynchronisation, never a loop.

Errors: whatever a stream entry or a snapshot holds is caught as ``events.errors.EventsError``
(an ``EnvelopeError``, a ``SnapshotError``, an ``InvalidEventError`` from the index), counted
and skipped. Connection errors: log, back off, retry (``events.redis_io.Backoff``); on
reconnection the ``run_id`` check decides whether everything must be resynchronised.

Stats: ``stats()`` (counters, and ``apply_lag_ms``: age of the last entry applied, by its stream
id's timestamp) and ``await lag()`` (per worker: entries not read yet, and the age of the oldest).
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final

from redis.asyncio import Redis, RedisCluster

from cache import KVCacheEvent, RemovedData, StoredData
from events import keys
from events.envelope import DEFAULT_MAX_ENTRY_BYTES, Envelope, decode_envelope
from events.errors import EnvelopeError, EventsError, OversizedEntryError, SnapshotError
from events.index import PrefixIndex
from events.redis_io import Backoff, client_for, is_cluster, stop_tasks
from events.snapshot import Snapshot, decode_snapshot_lazily

__all__ = ["EntryHook", "EventConsumer", "WorkerState"]

logger = logging.getLogger(__name__)

_SNAPSHOT_REQUEST_TTL_MS: Final = 10_000
_NO_DEADLINE: Final = float("inf")

# Called after each applied entry: (worker, envelope, the events applied, their block count).
EntryHook = Callable[[str, Envelope, list[KVCacheEvent], int], None]


def _entry_ms(entry_id: bytes | str) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.partition("-")[0])


def _entry_key(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _parse_heartbeat(value: bytes | str) -> tuple[int, int] | None:
    """``(epoch, last event id)`` from a heartbeat's value (``b"<epoch> <seq>"``); None when it
    does not say (an older publisher writes the epoch alone) or cannot be read."""
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    parts = text.split()
    if len(parts) != 2:
        return None
    try:
        return int(parts[0]), int(parts[1])
    except ValueError:
        return None


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None elsewhere): hands freed heap memory back to the OS."""
    try:
        function = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    trim: Callable[[int], int] = function
    return trim


_malloc_trim: Final = _load_malloc_trim()


def _block_count(events: Iterable[KVCacheEvent]) -> int:
    total = 0
    for event in events:
        data = event.data
        if type(data) is StoredData:
            total += len(data.blocks)
        elif type(data) is RemovedData:
            total += len(data.block_hashes)
    return total


@dataclass(frozen=True, slots=True)
class _Suspect:
    """An entry that made the consumer resynchronise: checked against the next snapshot."""

    entry_id: bytes
    position: tuple[int, int]
    epoch: int
    seq_first: int
    seq_last: int
    reason: str


@dataclass(slots=True)
class WorkerState:
    """What the consumer knows about one worker's stream."""

    worker: str
    key: bytes
    info: dict[str, Any] = field(default_factory=dict)
    alive: bool = False
    synced: bool = False
    epoch: int = -1
    last_seq: int = -1
    snapshot_seq: int = -1
    pos: bytes | str = "0-0"
    retry_at: float = _NO_DEADLINE
    retry_delay: float = 0.0
    request_snapshot: bool = False
    applied_since_resync: int = 0
    bad_high_water: tuple[int, int] = (-1, -1)  # last malformed entry counted
    # Why the index for this worker cannot be trusted although it is synchronised (None: it
    # can): "behind_heartbeat" -- the worker's heartbeat reported an event id that this
    # consumer has not applied within ``stale_after_s``. Cleared once it has.
    stale: str | None = None
    # The worker's own word, from its heartbeat: its epoch and the last event id it has.
    reported_epoch: int = -1
    reported_seq: int = -1
    # An event id the heartbeat reported that is not applied yet, since when (monotonic), and
    # the last_seq at that moment (to tell a consumer that lags from one that is frozen).
    behind_target: tuple[int, int] | None = None
    behind_since: float = 0.0
    behind_from_seq: int = -1
    # After a Redis restart (monotonic): until then the worker is kept, though the registry or
    # its heartbeat does not name it, while it writes them again (0: not held).
    held_until: float = 0.0
    # The entry that made the last resynchronisation, and the snapshot loaded before it.
    suspect: _Suspect | None = None
    loaded_snapshot: tuple[int, int, str] | None = None
    entries: int = 0
    events: int = 0
    blocks: int = 0


class EventConsumer:
    """Reads every registered worker's stream into ``index``; see the module docstring."""

    def __init__(
        self,
        redis: Redis | str,
        *,
        index: PrefixIndex | None = None,
        block_ms: int = 100,
        count: int = 256,
        registry_interval_s: float = 0.5,
        liveness_interval_s: float = 0.5,
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
        resync_delay_s: float = 0.02,
        resync_delay_max_s: float = 1.0,
        backoff_initial_s: float = 0.02,
        backoff_max_s: float = 2.0,
        on_entry: EntryHook | None = None,
        pause_gc: bool = True,
        step_budget_s: float = 0.010,
        stale_after_s: float = 2.0,
        restart_hold_s: float = 5.0,
    ) -> None:
        if block_ms <= 0 or count <= 0 or max_entry_bytes <= 0:
            raise ValueError("block_ms, count and max_entry_bytes must be positive")
        self._redis, self._owns_redis = client_for(redis, socket_timeout=block_ms / 1000 + 5.0)
        self._cluster = is_cluster(self._redis)
        self.index = index if index is not None else PrefixIndex()
        self.block_ms = block_ms
        self.count = count
        self.registry_interval_s = registry_interval_s
        self.liveness_interval_s = liveness_interval_s
        self.max_entry_bytes = max_entry_bytes
        self.resync_delay_s = resync_delay_s
        self.resync_delay_max_s = resync_delay_max_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.on_entry = on_entry
        self.pause_gc = pause_gc
        self.step_budget_s = step_budget_s
        self.stale_after_s = stale_after_s
        self.restart_hold_s = restart_hold_s

        self._workers: dict[str, WorkerState] = {}
        self._by_key: dict[bytes, WorkerState] = {}
        self._run_id: str | None = None
        self._check_server = True
        self._next_registry_at = 0.0
        self._next_liveness_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._backoff = Backoff(
            logger,
            "consumer",
            verb="read",
            doing="reading",
            initial_s=backoff_initial_s,
            max_s=backoff_max_s,
            # Reconnected: the run_id check decides whether everything must be resynchronised.
            on_redis_error=self._check_server_next,
        )

        self.num_entries = 0
        self.num_events = 0
        self.num_blocks = 0
        self.num_skipped_entries = 0
        self.num_stale_entries = 0
        self.num_malformed = 0
        self.num_oversized = 0
        self.num_syncs = 0
        self.num_resyncs = 0
        self.resync_reasons: Counter[str] = Counter()
        self.num_snapshot_loads = 0
        self.num_snapshot_requests = 0
        self.num_expired = 0
        self.num_redis_restarts = 0
        self.num_held = 0  # workers held through a Redis restart (WorkerState.held_until)
        self.apply_lag_ms = 0.0
        self.num_bad_registry_entries = 0
        self._bad_registry: dict[bytes, bytes] = {}
        self.num_yields = 0  # times a batch or a snapshot was split to give the loop back
        self.num_stale_reports = 0  # workers found behind their heartbeat (WorkerState.stale)
        self.num_memory_releases = 0  # malloc_trim calls after an oversized entry was read
        self._release_memory_pending = False

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
        self._check_server = True

    def check_liveness_soon(self) -> None:
        """Read the heartbeats at the next round instead of when due (a router that saw one
        vanish asks for it: the consumer decides whether the worker expired or is held)."""
        self._next_liveness_at = 0.0

    @property
    def num_errors(self) -> int:
        """Failed rounds (Redis errors and unexpected ones)."""
        return self._backoff.num_errors

    # -- queries -------------------------------------------------------------------------------

    def workers(self) -> dict[str, WorkerState]:
        """Followed workers (registered), synchronised or not."""
        return dict(self._workers)

    def last_seq(self, worker_id: str) -> int | None:
        """Last event id applied for ``worker_id``; None while it is not synchronised."""
        state = self._workers.get(worker_id)
        if state is None or not state.synced:
            return None
        return state.last_seq

    def stats(self) -> dict[str, Any]:
        return {
            "workers": len(self._workers),
            "synced_workers": sum(s.synced for s in self._workers.values()),
            "entries": self.num_entries,
            "events": self.num_events,
            "blocks": self.num_blocks,
            "skipped_entries": self.num_skipped_entries,
            "stale_entries": self.num_stale_entries,
            "malformed": self.num_malformed,
            "oversized": self.num_oversized,
            "syncs": self.num_syncs,
            "resyncs": self.num_resyncs,
            "resync_reasons": dict(self.resync_reasons),
            "snapshot_loads": self.num_snapshot_loads,
            "snapshot_requests": self.num_snapshot_requests,
            "expired": self.num_expired,
            "errors": self.num_errors,
            "redis_restarts": self.num_redis_restarts,
            "held": self.num_held,
            "held_workers": sum(s.held_until > time.monotonic() for s in self._workers.values()),
            "apply_lag_ms": round(self.apply_lag_ms, 3),
            "yields": self.num_yields,
            "bad_registry_entries": self.num_bad_registry_entries,
            "stale_workers": sum(s.stale is not None for s in self._workers.values()),
            "stale_reports": self.num_stale_reports,
            "memory_releases": self.num_memory_releases,
        }

    async def lag(self, limit: int = 10_000) -> dict[str, dict[str, float]]:
        """Per synchronised worker: entries in its stream not read yet (at most ``limit``) and
        the age in ms of the oldest of them (0 when caught up)."""
        out: dict[str, dict[str, float]] = {}
        now_ms = time.time() * 1000
        for state in list(self._workers.values()):
            if not state.synced:
                continue
            pos = state.pos.decode() if isinstance(state.pos, bytes) else state.pos
            pending: list[Any] = await self._redis.xrange(  # type: ignore[assignment]
                state.key, min=f"({pos}", max="+", count=limit
            )
            age = max(now_ms - _entry_ms(pending[0][0]), 0.0) if pending else 0.0
            out[state.worker] = {"entries": len(pending), "ms": round(age, 3)}
        return out

    # -- the loop ------------------------------------------------------------------------------

    async def step(self) -> None:
        """One round: registry and liveness when due, resynchronisations, one XREAD."""
        now = time.monotonic()
        # The run_id check comes first: after a restart it resynchronises (and holds) the
        # workers still followed, before a registry or heartbeats still missing expire them.
        if self._check_server or now >= self._next_registry_at or now >= self._next_liveness_at:
            await self.check_run_id()
        if now >= self._next_registry_at:
            await self._refresh_registry()
            self._next_registry_at = now + self.registry_interval_s
        if now >= self._next_liveness_at:
            await self._check_liveness()
            self._next_liveness_at = now + self.liveness_interval_s
        for state in list(self._workers.values()):
            if state.alive and not state.synced and state.retry_at <= now:
                await self._resync(state)
        streams: dict[bytes, bytes | str] = {
            state.key: state.pos for state in self._workers.values() if state.synced
        }
        if not streams:
            deadline = min(
                [self._next_registry_at, self._next_liveness_at]
                + [s.retry_at for s in self._workers.values() if s.alive and not s.synced]
            )
            await asyncio.sleep(min(max(deadline - time.monotonic(), 0.001), self.block_ms / 1000))
            return
        reply = await self._read(streams)
        await self._apply_reply(reply)
        if self._release_memory_pending:
            # An oversized entry was read (Redis cannot tell an entry's size before it sends
            # it) and refused. Python frees it, but glibc keeps the freed heap: hand it back.
            reply.clear()
            self._release_memory_pending = False
            if _malloc_trim is not None:
                _malloc_trim(0)
                self.num_memory_releases += 1

    async def _apply_reply(self, reply: list[Any]) -> None:
        for key, entries in reply:
            target = self._by_key.get(key)
            start = 0
            while target is not None and target.synced and start < len(entries):
                start = self._apply_for(target, entries, start)
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
                count=self.count,
                block=self.block_ms,
            )
            return reply
        replies = await asyncio.gather(*(self._read_one(key, pos) for key, pos in streams.items()))
        return [item for answer in replies if answer for item in answer]

    async def _read_one(self, key: bytes, pos: bytes | str) -> Any:
        # The command is made inside the task, not before it: a task cancelled before it starts
        # (the consumer closing) would otherwise leave redis-py's coroutine never awaited.
        return await self._redis.xread({key: pos}, count=self.count, block=min(self.block_ms, 20))

    def _apply_for(
        self, state: WorkerState, entries: list[tuple[bytes, dict[bytes, bytes]]], start: int
    ) -> int:
        """Apply ``entries[start:]`` until ``step_budget_s`` has passed; the next index."""
        # Decoding makes thousands of short-lived objects per entry, all freed by reference
        # counting: the cyclic collector's passes meanwhile are pure cost (about a fifth of
        # the time). Nothing awaits in between, so nothing else runs while it is paused.
        pause_gc = self.pause_gc and gc.isenabled()
        if pause_gc:
            gc.disable()
        try:
            deadline = time.perf_counter() + self.step_budget_s
            end = start
            while end < len(entries) and state.synced:
                self._apply_entries(state, entries[end : end + 1])
                end += 1
                if end < len(entries) and time.perf_counter() >= deadline:
                    self.num_yields += 1
                    break
            return end if state.synced else len(entries)
        finally:
            if pause_gc:
                gc.enable()

    async def check_run_id(self) -> None:
        """Compare Redis's ``run_id`` with the last one seen: a new one is a restart (every
        worker resynchronised and held). The loop calls it; a router calls it too before it
        believes that something it knew is gone from Redis."""
        if self._cluster:
            # Every primary's: one of them restarting empty loses its workers' streams.
            infos = await self._redis.info("server", target_nodes=RedisCluster.PRIMARIES)
            run_id = ",".join(sorted(str(i.get("run_id", "")) for i in infos.values()))
        else:
            info = await self._redis.info("server")
            run_id = str(info.get("run_id", ""))
        if self._run_id is not None and run_id != self._run_id:
            self.num_redis_restarts += 1
            logger.warning(
                "consumer: Redis restarted (new run_id); resynchronising every worker, each "
                "held for its heartbeat TTL while it registers again"
            )
            now = time.monotonic()
            for state in self._workers.values():
                if state.synced:
                    self._schedule_resync(state, "redis_restart")
                if state.alive:
                    state.held_until = now + self._hold_s(state)
                    self.num_held += 1
        self._run_id = run_id
        self._check_server = False

    def _hold_s(self, state: WorkerState) -> float:
        """How long a restart holds ``state``: its heartbeat TTL (it beats again well within)."""
        ttl = state.info.get("heartbeat_ttl_s")
        if isinstance(ttl, int | float) and not isinstance(ttl, bool) and 0 < ttl <= 3_600:
            return float(ttl)
        return self.restart_hold_s

    async def _held(self, states: Iterable[WorkerState]) -> set[str]:
        """Of ``states`` (about to be forgotten or expired), the ones a restart holds.

        ``run_id`` is checked again first: the registry or the heartbeats just read may come
        from a server that restarted after this round's check."""
        await self.check_run_id()
        now = time.monotonic()
        return {state.worker for state in states if state.held_until > now}

    async def _refresh_registry(self) -> None:
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
                if self._bad_registry.get(name) != value:
                    self._bad_registry[name] = value
                    self.num_bad_registry_entries += 1
                    logger.warning("consumer: bad registry entry %r: %s", name[:80], exc)
                continue
            registered[worker_id] = info
        missing = [s for w, s in self._workers.items() if w not in registered]
        held = await self._held(missing) if missing else set()
        for gone in missing:
            if gone.worker not in held:
                self._forget(gone.worker)
        for worker_id, info in registered.items():
            state = self._workers.get(worker_id)
            if state is None:
                key = keys.events_key(worker_id).encode()
                state = WorkerState(worker_id, key)
                self._workers[worker_id] = state
                self._by_key[key] = state
            state.info = info

    def _forget(self, worker_id: str) -> None:
        state = self._workers.pop(worker_id)
        del self._by_key[state.key]
        self.index.remove_worker(worker_id)

    async def _check_liveness(self) -> None:
        states = list(self._workers.values())
        if not states:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for state in states:
                pipe.get(keys.alive_key(state.worker))
            beats = await pipe.execute()
        gone = [s for s, beat in zip(states, beats, strict=True) if beat is None and s.alive]
        held = await self._held(gone) if gone else set()
        now = time.monotonic()
        for state, beat in zip(states, beats, strict=True):
            exists = beat is not None
            if state.worker in held:
                continue  # Redis lost its heartbeat in a restart: kept while it writes it again
            if exists:
                reported = _parse_heartbeat(beat)
                if reported is not None:
                    state.reported_epoch, state.reported_seq = reported
            if exists and not state.alive:
                state.alive = True
                state.synced = False
                state.retry_at = now
                state.retry_delay = 0.0
                self.num_syncs += 1
            elif not exists and state.alive:
                logger.info("consumer: worker %s stopped beating; dropped", state.worker)
                state.alive = False
                state.synced = False
                state.retry_at = _NO_DEADLINE
                self.index.remove_worker(state.worker)
                self.num_expired += 1
            if state.alive and state.synced and state.reported_epoch >= 0:
                self._check_behind(state, now)

    def _check_behind(self, state: WorkerState, now: float) -> None:
        """Compare what the consumer applied with what the worker's heartbeat says it has.

        A worker whose reported (epoch, event id) is not reached within ``stale_after_s`` is
        marked stale (``WorkerState.stale``), logged once; if the consumer has applied nothing
        for it meanwhile (its position is wedged, e.g. past an entry with the largest stream id)
        it also resynchronises from the snapshot, which repositions it.
        """
        applied = (state.epoch, state.last_seq)
        if state.behind_target is not None and applied >= state.behind_target:
            state.behind_target = None
        if state.behind_target is None:
            if applied < (state.reported_epoch, state.reported_seq):
                state.behind_target = (state.reported_epoch, state.reported_seq)
                state.behind_since = now
                state.behind_from_seq = state.last_seq
            if state.stale is not None:
                logger.info("consumer: worker %s caught up with its heartbeat", state.worker)
                state.stale = None
            return
        if now - state.behind_since < self.stale_after_s:
            return
        if state.stale is None:
            state.stale = "behind_heartbeat"
            self.num_stale_reports += 1
            epoch, seq = state.behind_target
            logger.warning(
                "consumer: worker %s is stale: its heartbeat reported event %d of epoch %d "
                "%.1f s ago; applied: event %d of epoch %d",
                state.worker,
                seq,
                epoch,
                now - state.behind_since,
                state.last_seq,
                state.epoch,
            )
        if state.last_seq == state.behind_from_seq:
            # Nothing applied at all: the stream is not moving for us. Start over from the
            # snapshot (and its stream id); the timer restarts after it.
            state.behind_target = None
            self._schedule_resync(state, "behind_heartbeat")

    # -- resynchronisation ---------------------------------------------------------------------

    def _schedule_resync(self, state: WorkerState, reason: str, *, stale: bool = False) -> None:
        """Mark ``state`` for a resynchronisation; ``stale``: its snapshot is too old, so ask
        the worker for a new one and wait (with backoff) before loading again."""
        self.num_resyncs += 1
        self.resync_reasons[reason] += 1
        state.synced = False
        if stale:
            self._retry_later(state)
        else:
            state.retry_delay = 0.0
            state.retry_at = time.monotonic()

    def _resync_at(
        self, state: WorkerState, entry_id: bytes, envelope: Envelope, reason: str
    ) -> None:
        """``envelope`` (at ``entry_id``) cannot follow what was applied: resynchronise.

        The entry is remembered. If the last resynchronisation was made by this same entry,
        the snapshot did not get past it: a fresh one is asked for (one taken after the entry
        was written starts after it). Once a snapshot that starts after it is loaded, the entry
        is checked against it (``_check_suspect``).
        """
        again = state.suspect is not None and state.suspect.entry_id == entry_id
        state.suspect = _Suspect(
            entry_id,
            _entry_key(entry_id),
            envelope.epoch,
            envelope.seq_first,
            envelope.seq_last,
            reason,
        )
        self._schedule_resync(state, reason, stale=again or not state.applied_since_resync)

    def _check_suspect(self, state: WorkerState, snapshot: Snapshot) -> None:
        """The entry that made the resynchronisation, seen from a snapshot taken after it.

        That snapshot reflects every event the worker had then, in its epoch. An entry from a
        later epoch, or with event ids past the snapshot's, was never the worker's: it is
        counted as malformed and logged (once). An honest entry is behind the snapshot.
        """
        suspect = state.suspect
        if suspect is None or _entry_key(snapshot.stream_id) < suspect.position:
            return
        state.suspect = None
        if suspect.epoch > snapshot.epoch:
            why = f"epoch {suspect.epoch} is later than the worker's ({snapshot.epoch})"
        elif suspect.epoch == snapshot.epoch and suspect.seq_last > snapshot.event_id:
            why = (
                f"seq_first..seq_last {suspect.seq_first}..{suspect.seq_last} is past the "
                f"worker's last event {snapshot.event_id}"
            )
        else:
            return
        error = EnvelopeError(f"{why} (caused a resynchronisation: {suspect.reason})")
        self._count_malformed(state, suspect.entry_id, error)

    def _retry_later(self, state: WorkerState) -> None:
        """Ask the worker for a new snapshot now; load it after a delay that doubles."""
        state.synced = False
        state.request_snapshot = True
        state.retry_delay = min(
            max(state.retry_delay * 2, self.resync_delay_s), self.resync_delay_max_s
        )
        state.retry_at = time.monotonic()

    async def _resync(self, state: WorkerState) -> None:
        worker_id = state.worker
        if state.request_snapshot:
            # Ask for a fresh snapshot, and give the worker time to answer before loading.
            await self._redis.set(
                keys.snapshot_request_key(worker_id), b"1", px=_SNAPSHOT_REQUEST_TTL_MS
            )
            state.request_snapshot = False
            self.num_snapshot_requests += 1
            state.retry_at = time.monotonic() + max(state.retry_delay, self.resync_delay_s)
            return
        raw = await self._redis.get(keys.snapshot_key(worker_id))
        self.index.remove_worker(worker_id)
        if not isinstance(raw, bytes):
            self._retry_later(state)
            return
        try:
            snapshot, events = decode_snapshot_lazily(raw)
            if snapshot.worker != worker_id:
                raise SnapshotError(f"snapshot of {snapshot.worker!r} under {worker_id!r}")
        except SnapshotError as exc:
            logger.warning("consumer: bad snapshot for %s: %s", worker_id, exc)
            self.num_malformed += 1
            self._retry_later(state)
            return
        identity = (snapshot.epoch, snapshot.event_id, snapshot.stream_id)
        suspect = state.suspect
        if (
            suspect is not None
            and identity == state.loaded_snapshot
            and _entry_key(snapshot.stream_id) < suspect.position
        ):
            # The snapshot loaded last time, which ends before the entry that stopped the
            # consumer: replaying it again would stop at that entry again. Wait for a new one.
            self._retry_later(state)
            return
        try:
            await self._replay(worker_id, events)
        except EventsError as exc:  # an event that does not decode, or one the index refuses
            logger.warning("consumer: bad snapshot for %s: %s", worker_id, exc)
            self.num_malformed += 1
            self.index.remove_worker(worker_id)
            self._retry_later(state)
            return
        state.loaded_snapshot = identity
        self._check_suspect(state, snapshot)
        state.synced = True
        state.epoch = snapshot.epoch
        state.last_seq = state.snapshot_seq = snapshot.event_id
        state.pos = snapshot.stream_id
        state.applied_since_resync = 0
        state.retry_at = _NO_DEADLINE
        self.num_snapshot_loads += 1

    async def _replay(self, worker_id: str, events: Iterable[KVCacheEvent]) -> None:
        """Decode and apply a snapshot's events, giving the event loop back every
        ``step_budget_s`` (decoding 100k blocks takes about 0.3 s, applying them 0.1 s).

        The worker is not synchronised meanwhile (readers see it as resynchronising), and only
        this task writes the index, so nothing else changes the worker's part in between.
        """
        apply_event = self.index.apply_event
        clock = time.perf_counter
        deadline = clock() + self.step_budget_s
        for event in events:
            apply_event(worker_id, event)
            if clock() >= deadline:
                self.num_yields += 1
                await asyncio.sleep(0)
                deadline = clock() + self.step_budget_s

    # -- applying entries ----------------------------------------------------------------------

    def _count_malformed(
        self, state: WorkerState, entry_id: bytes, exc: EnvelopeError, *, oversized: bool = False
    ) -> None:
        """Count a bad entry once, even when a resynchronisation makes it read again."""
        position = _entry_key(entry_id)
        if position <= state.bad_high_water:
            return
        state.bad_high_water = position
        self.num_malformed += 1
        if oversized:
            self.num_oversized += 1
        # str(exc): a record holding the exception would hold its frames, and the entry.
        logger.warning("consumer: skipped entry %r of %s: %s", entry_id, state.worker, str(exc))

    def _apply_entries(
        self, state: WorkerState, entries: list[tuple[bytes, dict[bytes, bytes]]]
    ) -> None:
        index = self.index
        worker_id = state.worker
        for entry_id, fields in entries:
            try:
                envelope = decode_envelope(fields, max_entry_bytes=self.max_entry_bytes)
                if envelope.worker != worker_id:
                    raise EnvelopeError(
                        f"worker: {envelope.worker!r} in the stream of {worker_id!r}"
                    )
            except EnvelopeError as exc:
                state.pos = entry_id
                oversized = isinstance(exc, OversizedEntryError)
                self._release_memory_pending |= oversized
                self._count_malformed(state, entry_id, exc, oversized=oversized)
                continue
            if envelope.epoch != state.epoch:
                if envelope.epoch < state.epoch:
                    state.pos = entry_id
                    self.num_stale_entries += 1
                    continue
                self._resync_at(state, entry_id, envelope, "epoch")
                return
            if envelope.seq_last <= state.last_seq:
                state.pos = entry_id
                self.num_skipped_entries += 1
                continue
            # Events were lost before this entry, and no snapshot we loaded covers them.
            if envelope.dropped and envelope.seq_first - 1 > state.snapshot_seq:
                self._resync_at(state, entry_id, envelope, "dropped")
                return
            if envelope.seq_first > state.last_seq + 1:
                self._resync_at(state, entry_id, envelope, "gap")
                return
            state.pos = entry_id
            try:
                events = envelope.events()
            except EnvelopeError as exc:
                self._count_malformed(state, entry_id, exc)
                continue
            last = state.last_seq
            if events and events[0].event_id <= last:
                events = [event for event in events if event.event_id > last]
            num_applied = 0
            try:
                for event in events:
                    index.apply_event(worker_id, event)
                    num_applied += 1
            except EventsError as exc:
                # The index refused an event (InvalidEventError), before changing anything.
                self._count_malformed(state, entry_id, EnvelopeError(f"data: refused: {exc}"))
                if not num_applied:
                    # Nothing of the entry reached the index: skipped whole, like an entry
                    # that does not decode (last_seq stays, so an honest entry with the same
                    # ids is still applied).
                    continue
                # Part of it did: what the index holds for this worker is now incomplete.
                self._schedule_resync(state, "bad_event", stale=True)
                return
            blocks = _block_count(events)
            state.last_seq = envelope.seq_last
            state.applied_since_resync += 1
            state.retry_delay = 0.0
            state.entries += 1
            state.events += len(events)
            state.blocks += blocks
            self.num_entries += 1
            self.num_events += len(events)
            self.num_blocks += blocks
            self.apply_lag_ms = max(time.time() * 1000 - _entry_ms(entry_id), 0.0)
            if state.suspect is not None and _entry_key(entry_id) > state.suspect.position:
                state.suspect = None  # got past it
            if self.on_entry is not None:
                self.on_entry(worker_id, envelope, events, blocks)
