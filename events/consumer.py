"""``EventConsumer``: every worker's stream, read back into one ``PrefixIndex`` (asyncio).

One task does everything, in a loop, so the index has a single writer:

1. every ``registry_interval_s``: read the registry (``kvmesh:workers``) and follow new
   workers, forget unregistered ones; check Redis's ``run_id`` (a changed id is a restart
   that lost every stream: resynchronise every worker);
2. every ``liveness_interval_s``: check each worker's heartbeat key; a worker whose heartbeat
   expired leaves the index (``remove_worker``) until it beats again;
3. resynchronise the workers that need it (below);
4. one blocking ``XREAD`` over the streams of every synchronised worker (``block_ms``, at most
   ``count`` entries per stream), and apply what it returns (with the cyclic garbage collector
   paused while it does, unless ``pause_gc=False``: decoding makes many short-lived objects),
   giving the event loop back whenever ``step_budget_s`` (10 ms) has passed, so that a router
   sharing the loop never waits longer than that plus one entry.

Per worker it keeps the epoch, the last event id applied (``last_seq``), the id of the snapshot
it started from and its position in the stream. For each entry, in stream order:

* malformed or larger than ``max_entry_bytes``: counted (``malformed``, ``oversized``), skipped;
* an older epoch: a leftover of an earlier start, skipped (``stale_entries``);
* ``seq_last <= last_seq``: already applied, or covered by the snapshot, skipped;
* a newer epoch, ``seq_first > last_seq + 1`` (a gap: events lost, or entries trimmed away by
  ``MAXLEN`` before they were read), or ``dropped > 0`` not covered by the snapshot:
  **resynchronise** -- forget the worker (``remove_worker``), load and replay its snapshot,
  and read the stream again after the snapshot's ``stream_id``, skipping the events the
  snapshot covers (an entry straddling its event id is applied from the next id on);
* else apply its events with ids above ``last_seq``.

A gap right after a resynchronisation, before anything was applied, means the snapshot is
older than what the stream still holds (trimmed): the consumer asks the worker for a fresh one
(``kvmesh:{<worker>}:snapshot:request``, answered at the worker's next heartbeat) and tries
again with backoff. Connection errors: log, back off, retry; on reconnection the ``run_id``
check decides whether everything must be resynchronised.

Stats: ``stats()`` (counters, and ``apply_lag_ms``: age of the last entry applied, by its stream
id's timestamp) and ``await lag()`` (per worker: entries not read yet, and the age of the oldest).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final

from redis.asyncio import Redis

from cache import KVCacheEvent, RemovedData, StoredData
from events import keys
from events.envelope import (
    DEFAULT_MAX_ENTRY_BYTES,
    Envelope,
    EnvelopeError,
    OversizedEntryError,
    decode_envelope,
)
from events.index import PrefixIndex
from events.publisher import REDIS_ERRORS, client_for, raise_if_cancelled
from events.snapshot import SnapshotError, decode_snapshot

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


def _block_count(events: Iterable[KVCacheEvent]) -> int:
    total = 0
    for event in events:
        data = event.data
        if type(data) is StoredData:
            total += len(data.blocks)
        elif type(data) is RemovedData:
            total += len(data.block_hashes)
    return total


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
    ) -> None:
        if block_ms <= 0 or count <= 0 or max_entry_bytes <= 0:
            raise ValueError("block_ms, count and max_entry_bytes must be positive")
        self._redis, self._owns_redis = client_for(redis, socket_timeout=block_ms / 1000 + 5.0)
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

        self._workers: dict[str, WorkerState] = {}
        self._by_key: dict[bytes, WorkerState] = {}
        self._run_id: str | None = None
        self._check_server = True
        self._next_registry_at = 0.0
        self._next_liveness_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._failing = False

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
        self.num_errors = 0
        self.num_redis_restarts = 0
        self.apply_lag_ms = 0.0
        self.num_yields = 0  # times a batch was split to give the event loop back

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
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._owns_redis:
            await self._redis.aclose()
            self._owns_redis = False

    async def run(self) -> None:
        """The consumer loop (``start()`` runs it as a task); returns when stopped."""
        backoff = self.backoff_initial_s
        while not self._stopping:
            try:
                await self.step()
            except REDIS_ERRORS as exc:
                raise_if_cancelled()
                self.num_errors += 1
                self._check_server = True
                if not self._failing:
                    logger.warning("consumer: Redis read failed: %s", exc)
                self._failing = True
                await asyncio.sleep(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, self.backoff_max_s)
                continue
            except Exception:
                raise_if_cancelled()
                self.num_errors += 1
                logger.exception("consumer: unexpected error")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)
                continue
            if self._failing:
                logger.info("consumer: Redis reads succeed again")
            self._failing = False
            backoff = self.backoff_initial_s

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
            "apply_lag_ms": round(self.apply_lag_ms, 3),
            "yields": self.num_yields,
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
        # The run_id check comes first: after a restart it resynchronises the workers still
        # followed, before a registry that is still empty makes the consumer forget them.
        if self._check_server or now >= self._next_registry_at:
            await self._check_run_id()
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
        # redis-py (RESP2, bytes): [[stream key, [(entry id, {field: value}), ...]], ...]
        reply: list[Any] = await self._redis.xread(  # type: ignore[assignment]
            streams,  # type: ignore[arg-type]
            count=self.count,
            block=self.block_ms,
        )
        for key, entries in reply:
            target = self._by_key.get(key)
            start = 0
            while target is not None and target.synced and start < len(entries):
                start = self._apply_for(target, entries, start)
                if start < len(entries):
                    # Over budget: let the rest of the event loop run, then carry on. The index
                    # is consistent between entries, so readers see a whole entry or none.
                    await asyncio.sleep(0)

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

    async def _check_run_id(self) -> None:
        info = await self._redis.info("server")
        run_id = str(info.get("run_id", ""))
        if self._run_id is not None and run_id != self._run_id:
            self.num_redis_restarts += 1
            logger.warning("consumer: Redis restarted (new run_id); resynchronising every worker")
            for state in self._workers.values():
                if state.synced:
                    self._schedule_resync(state, "redis_restart")
        self._run_id = run_id
        self._check_server = False

    async def _refresh_registry(self) -> None:
        raw: dict[bytes, bytes] = await self._redis.hgetall(keys.WORKERS_KEY)  # type: ignore[assignment]
        registered: dict[str, dict[str, Any]] = {}
        for name, value in raw.items():
            try:
                worker_id = keys.validate_worker_id(name.decode())
                info = json.loads(value)
                if not isinstance(info, dict):
                    raise ValueError("registry entry is not an object")
            except (ValueError, UnicodeDecodeError) as exc:
                logger.warning("consumer: bad registry entry %r: %s", name[:80], exc)
                continue
            registered[worker_id] = info
        for worker_id in list(self._workers):
            if worker_id not in registered:
                self._forget(worker_id)
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
                pipe.exists(keys.alive_key(state.worker))
            alive = await pipe.execute()
        now = time.monotonic()
        for state, exists in zip(states, alive, strict=True):
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
            snapshot = decode_snapshot(raw)
            if snapshot.worker != worker_id:
                raise SnapshotError(f"snapshot of {snapshot.worker!r} under {worker_id!r}")
            self.index.apply_events(worker_id, snapshot.events)
        except ValueError as exc:  # SnapshotError, or an event the index refuses
            logger.warning("consumer: bad snapshot for %s: %s", worker_id, exc)
            self.num_malformed += 1
            self.index.remove_worker(worker_id)
            self._retry_later(state)
            return
        state.synced = True
        state.epoch = snapshot.epoch
        state.last_seq = state.snapshot_seq = snapshot.event_id
        state.pos = snapshot.stream_id
        state.applied_since_resync = 0
        state.retry_at = _NO_DEADLINE
        self.num_snapshot_loads += 1

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
        logger.warning("consumer: skipped entry %r of %s: %s", entry_id, state.worker, exc)

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
                self._count_malformed(state, entry_id, exc, oversized=oversized)
                continue
            if envelope.epoch != state.epoch:
                if envelope.epoch < state.epoch:
                    state.pos = entry_id
                    self.num_stale_entries += 1
                    continue
                self._schedule_resync(state, "epoch", stale=not state.applied_since_resync)
                return
            if envelope.seq_last <= state.last_seq:
                state.pos = entry_id
                self.num_skipped_entries += 1
                continue
            # Events were lost before this entry, and no snapshot we loaded covers them.
            if envelope.dropped and envelope.seq_first - 1 > state.snapshot_seq:
                self._schedule_resync(state, "dropped", stale=not state.applied_since_resync)
                return
            if envelope.seq_first > state.last_seq + 1:
                self._schedule_resync(state, "gap", stale=not state.applied_since_resync)
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
            try:
                for event in events:
                    index.apply_event(worker_id, event)
            except ValueError as exc:
                # The index refused an event: what it holds for this worker is now incomplete.
                logger.warning("consumer: bad event from %s: %s", worker_id, exc)
                self.num_malformed += 1
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
            if self.on_entry is not None:
                self.on_entry(worker_id, envelope, events, blocks)
