"""Resynchronisation: a worker's part of the index rebuilt from its snapshot (``Resyncer``).

A worker is resynchronised when what the consumer applied cannot be followed by what its
stream holds (a newer epoch, a gap, a loss the snapshot does not cover; ``events.consumer.apply``
says which), when Redis restarted (``events.consumer.registry``), or when its heartbeat says it
is ahead of a stream position that does not move (``events.consumer.liveness``). Those parts
``schedule`` it; the loop then calls ``resync`` for the worker, which forgets the worker
(``remove_worker``), loads its snapshot and replays it into the index in slices of
``step_budget_s``, the worker marked not synchronised meanwhile, and positions it at the
snapshot's ``stream_id`` with ``last_seq`` at its event id (the entries after it skip what the
snapshot covers).

A gap right after a resynchronisation, before anything was applied, means the snapshot is
older than what the stream still holds (trimmed): the consumer asks the worker for a fresh one
(``kvmesh:{<worker>}:snapshot:request``, answered at the worker's next flush or heartbeat) and
loads again after ``resync_delay_s``, doubling up to ``resync_delay_max_s``. A missing or bad
snapshot is retried the same way.

The entry that made a resynchronisation is remembered (a ``Suspect``): when it stops the
consumer again, the snapshot did not get past it, and the same snapshot is not replayed again
-- the consumer waits for a fresh one, which starts after the entry. The entry is then checked
against that snapshot: one from a later epoch, or with ids past the snapshot's, was never the
worker's (a forged marker) and is counted as malformed and logged once. So a hostile entry
costs one resynchronisation, never a loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Final

from redis.asyncio import Redis

from cache import KVCacheEvent
from events import keys
from events.consumer.config import ConsumerConfig
from events.consumer.state import NO_DEADLINE, Counters, Suspect, WorkerState, entry_key
from events.envelope import Envelope
from events.errors import EnvelopeError, EventsError, SnapshotError
from events.index import PrefixIndex
from events.snapshot import Snapshot, decode_snapshot_lazily

__all__ = ["Resyncer"]

logger = logging.getLogger(__name__)

_SNAPSHOT_REQUEST_TTL_MS: Final = 10_000


class Resyncer:
    """Schedules resynchronisations and runs them; see the module docstring."""

    def __init__(
        self,
        redis: Redis,
        index: PrefixIndex,
        config: ConsumerConfig,
        counters: Counters,
    ) -> None:
        self._redis = redis
        self._index = index
        self._config = config
        self._counters = counters

    # -- scheduling ----------------------------------------------------------------------------

    def schedule(self, state: WorkerState, reason: str, *, stale: bool = False) -> None:
        """Mark ``state`` for a resynchronisation; ``stale``: its snapshot is too old, so ask
        the worker for a new one and wait (with backoff) before loading again."""
        self._counters.num_resyncs += 1
        self._counters.resync_reasons[reason] += 1
        state.synced = False
        if stale:
            self.retry_later(state)
        else:
            state.retry_delay = 0.0
            state.retry_at = time.monotonic()

    def resync_at(
        self, state: WorkerState, entry_id: bytes, envelope: Envelope, reason: str
    ) -> None:
        """``envelope`` (at ``entry_id``) cannot follow what was applied: resynchronise.

        The entry is remembered. If the last resynchronisation was made by this same entry,
        the snapshot did not get past it: a fresh one is asked for (one taken after the entry
        was written starts after it). Once a snapshot that starts after it is loaded, the entry
        is checked against it (``_check_suspect``).
        """
        again = state.suspect is not None and state.suspect.entry_id == entry_id
        state.suspect = Suspect(
            entry_id,
            entry_key(entry_id),
            envelope.epoch,
            envelope.seq_first,
            envelope.seq_last,
            reason,
        )
        self.schedule(state, reason, stale=again or not state.applied_since_resync)

    def retry_later(self, state: WorkerState) -> None:
        """Ask the worker for a new snapshot now; load it after a delay that doubles."""
        state.synced = False
        state.request_snapshot = True
        state.retry_delay = min(
            max(state.retry_delay * 2, self._config.resync_delay_s),
            self._config.resync_delay_max_s,
        )
        state.retry_at = time.monotonic()

    # -- loading a snapshot --------------------------------------------------------------------

    async def resync(self, state: WorkerState) -> None:
        """Ask for a snapshot if one is due, else load the worker's snapshot and replay it."""
        worker_id = state.worker
        counters = self._counters
        if state.request_snapshot:
            # Ask for a fresh snapshot, and give the worker time to answer before loading.
            await self._redis.set(
                keys.snapshot_request_key(worker_id), b"1", px=_SNAPSHOT_REQUEST_TTL_MS
            )
            state.request_snapshot = False
            counters.num_snapshot_requests += 1
            state.retry_at = time.monotonic() + max(state.retry_delay, self._config.resync_delay_s)
            return
        raw = await self._redis.get(keys.snapshot_key(worker_id))
        self._index.remove_worker(worker_id)
        if not isinstance(raw, bytes):
            self.retry_later(state)
            return
        try:
            snapshot, events = decode_snapshot_lazily(raw)
            if snapshot.worker != worker_id:
                raise SnapshotError(f"snapshot of {snapshot.worker!r} under {worker_id!r}")
        except SnapshotError as exc:
            logger.warning("consumer: bad snapshot for %s: %s", worker_id, exc)
            counters.num_malformed += 1
            self.retry_later(state)
            return
        identity = (snapshot.epoch, snapshot.event_id, snapshot.stream_id)
        suspect = state.suspect
        if (
            suspect is not None
            and identity == state.loaded_snapshot
            and entry_key(snapshot.stream_id) < suspect.position
        ):
            # The snapshot loaded last time, which ends before the entry that stopped the
            # consumer: replaying it again would stop at that entry again. Wait for a new one.
            self.retry_later(state)
            return
        try:
            await self._replay(worker_id, events)
        except EventsError as exc:  # an event that does not decode, or one the index refuses
            logger.warning("consumer: bad snapshot for %s: %s", worker_id, exc)
            counters.num_malformed += 1
            self._index.remove_worker(worker_id)
            self.retry_later(state)
            return
        state.loaded_snapshot = identity
        self._check_suspect(state, snapshot)
        state.synced = True
        state.epoch = snapshot.epoch
        state.last_seq = state.snapshot_seq = snapshot.event_id
        state.pos = snapshot.stream_id
        state.applied_since_resync = 0
        state.retry_at = NO_DEADLINE
        counters.num_snapshot_loads += 1

    async def _replay(self, worker_id: str, events: Iterable[KVCacheEvent]) -> None:
        """Decode and apply a snapshot's events, giving the event loop back every
        ``step_budget_s`` (decoding 100k blocks takes about 0.3 s, applying them 0.1 s).

        The worker is not synchronised meanwhile (readers see it as resynchronising), and only
        the consumer's task writes the index, so nothing else changes the worker's part in
        between.
        """
        apply_event = self._index.apply_event
        clock = time.perf_counter
        budget_s = self._config.step_budget_s
        deadline = clock() + budget_s
        for event in events:
            apply_event(worker_id, event)
            if clock() >= deadline:
                self._counters.num_yields += 1
                await asyncio.sleep(0)
                deadline = clock() + budget_s

    def _check_suspect(self, state: WorkerState, snapshot: Snapshot) -> None:
        """The entry that made the resynchronisation, seen from a snapshot taken after it.

        That snapshot reflects every event the worker had then, in its epoch. An entry from a
        later epoch, or with event ids past the snapshot's, was never the worker's: it is
        counted as malformed and logged (once). An honest entry is behind the snapshot.
        """
        suspect = state.suspect
        if suspect is None or entry_key(snapshot.stream_id) < suspect.position:
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
        self._counters.count_malformed(state, suspect.entry_id, error)
