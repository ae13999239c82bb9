"""Liveness: each followed worker's heartbeat key, read every ``liveness_interval_s``.

A worker whose heartbeat (``kvmesh:{<worker>}:alive``) appears is synchronised (from its
snapshot: ``events.consumer.resync``); one whose heartbeat expired leaves the index
(``remove_worker``) until it beats again, unless a Redis restart holds it
(``events.consumer.registry``). ``EventConsumer.check_liveness_soon`` asks for this check at
the next round instead of when due (a router that saw a heartbeat vanish).

The heartbeat says ``"<epoch> <last event id>"``: a worker whose reported id the consumer has
not applied within ``stale_after_s`` (2 s) is marked ``WorkerState.stale =
"behind_heartbeat"`` (logged once, cleared when it has), and if nothing at all was applied for
it meanwhile (its stream position is wedged, e.g. past an entry with the largest possible id)
it is resynchronised, which repositions it.
"""

from __future__ import annotations

import logging
import time

from redis.asyncio import Redis

from events import keys
from events.consumer.config import ConsumerConfig
from events.consumer.registry import Registry
from events.consumer.resync import Resyncer
from events.consumer.state import NO_DEADLINE, Counters, WorkerState
from events.index import PrefixIndex

__all__ = ["Liveness", "parse_heartbeat"]

logger = logging.getLogger(__name__)


def parse_heartbeat(value: bytes | str) -> tuple[int, int] | None:
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


class Liveness:
    """Reads the heartbeats of the registry's workers; see the module docstring."""

    def __init__(
        self,
        redis: Redis,
        index: PrefixIndex,
        config: ConsumerConfig,
        counters: Counters,
        registry: Registry,
        resync: Resyncer,
    ) -> None:
        self._redis = redis
        self._index = index
        self._config = config
        self._counters = counters
        self._registry = registry
        self._resync = resync

    async def check(self) -> None:
        """Read every followed worker's heartbeat; start, expire or flag workers by it."""
        states = list(self._registry.workers.values())
        if not states:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for state in states:
                pipe.get(keys.alive_key(state.worker))
            beats = await pipe.execute()
        gone = [s for s, beat in zip(states, beats, strict=True) if beat is None and s.alive]
        held = await self._registry.held(gone) if gone else set()
        now = time.monotonic()
        counters = self._counters
        for state, beat in zip(states, beats, strict=True):
            exists = beat is not None
            if state.worker in held:
                continue  # Redis lost its heartbeat in a restart: kept while it writes it again
            if exists:
                reported = parse_heartbeat(beat)
                if reported is not None:
                    state.reported_epoch, state.reported_seq = reported
            if exists and not state.alive:
                state.alive = True
                state.synced = False
                state.retry_at = now
                state.retry_delay = 0.0
                counters.num_syncs += 1
            elif not exists and state.alive:
                logger.info("consumer: worker %s stopped beating; dropped", state.worker)
                state.alive = False
                state.synced = False
                state.retry_at = NO_DEADLINE
                self._index.remove_worker(state.worker)
                counters.num_expired += 1
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
        if now - state.behind_since < self._config.stale_after_s:
            return
        if state.stale is None:
            state.stale = "behind_heartbeat"
            self._counters.num_stale_reports += 1
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
            self._resync.schedule(state, "behind_heartbeat")
