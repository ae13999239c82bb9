"""The publisher's buffer and the one task that writes it out (``Flusher``): stream entries,
snapshots, trimming, and a new stream when the old one cannot take entries any more.

``add`` (the worker's ``publish``) never waits: it stamps the batch with the time it received
it and appends it to a bounded buffer (``events.batching.EventBatcher``). The flusher task
waits up to ``linger_s`` for more batches unless ``max_entry_blocks`` are already waiting, then
sends every entry it has in one pipeline of ``XADD ... MINID ~ <retain_s before its last
entry>``. The stream is trimmed by age, not by a count: a consumer that stalls for less than
``retain_s`` (60 s) finds every entry after its position (or after the snapshot it loads) still
there, so recovery cannot race trimming. ``maxlen`` (optional) caps the count on top of that,
to bound Redis's memory at high rates; when it trims within ``retain_s`` a warning says so once
(size it at least rate x retain_s). ``retain_s=None`` trims by ``maxlen`` alone. A consumer's
request for a fresh snapshot is read (``GETDEL``) in the same pipeline, so it is answered at
the next flush, not a heartbeat later. This task is the only writer of the stream and of the
snapshot, so their order is the order consumers see.

Loss and recovery. While Redis is away the task retries with exponential backoff (with jitter;
``events.redis_io.Backoff``) and batches keep accumulating; past ``max_buffer_blocks`` the
oldest batches are dropped. Whenever events were lost -- dropped here, or reported by the
caller as dropped by the manager's own bounded queue -- a fresh snapshot (``events.snapshot``)
is written before the next entry, and that entry carries ``dropped > 0`` (an entry with no
events, a *marker*, when nothing else is pending). Entries that a failed pipeline may or may
not have written are sent again: consumers skip what they already applied.

An entry with the largest possible id (``18446744073709551615-18446744073709551615``, added by
someone else) makes every later ``XADD`` fail for good: the flusher then deletes the stream and
carries on in a new epoch (``num_stream_resets``), snapshot first. Epochs are time-based
(``new_epoch``: microseconds << 12, plus 12 random bits), so a later start of the same worker
has a larger epoch; consumers rely on that to tell old entries from new ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Final

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from cache import KVCacheEvent
from events import keys
from events.batching import EventBatcher
from events.publisher.config import PublisherConfig
from events.redis_io import Backoff, raise_if_cancelled
from events.snapshot import Snapshot, SnapshotSource, encode_snapshot

__all__ = ["Flusher", "new_epoch"]

logger = logging.getLogger(__name__)

_MAX_U64: Final = 2**64 - 1
# What Redis answers an XADD to a stream whose last id is the largest possible.
_STREAM_EXHAUSTED: Final = "exhausted the last possible ID"


def new_epoch() -> int:
    """A fresh epoch: time-based, so that a later start gets a larger one."""
    return ((time.time_ns() // 1_000) << 12 | secrets.randbits(12)) & _MAX_U64


class Flusher:
    """One worker's buffered events and the task that writes them; see the module docstring."""

    def __init__(
        self,
        redis: Redis,
        worker_id: str,
        config: PublisherConfig,
        *,
        epoch: int,
        snapshot_source: SnapshotSource | None,
    ) -> None:
        self._redis = redis
        self._worker_id = worker_id
        self._config = config
        self._stream_key = keys.events_key(worker_id)
        self._snapshot_source = snapshot_source
        self.epoch = epoch
        self.batcher = EventBatcher(
            worker_id,
            fmt=config.fmt,
            max_entry_blocks=config.max_entry_blocks,
            max_entry_bytes=config.max_entry_bytes,
            max_buffer_blocks=config.max_buffer_blocks,
        )
        self.last_seq = -1  # highest event id received
        self.need_snapshot = True
        self._dropped_in_outage = 0  # events dropped since writing last worked
        self._last_stream_id = "0-0"
        self._inflight = False
        self._closing = False
        self._wakeup = asyncio.Event()
        self._full = asyncio.Event()
        self._drained = asyncio.Event()
        self.backoff = Backoff(
            logger,
            f"publisher {worker_id}",
            verb="write",
            doing="flushing",
            initial_s=config.backoff_initial_s,
            max_s=config.backoff_max_s,
            # Redis may have restarted and lost our snapshot: write a new one once back.
            on_redis_error=self._ask_for_snapshot,
        )

        self.num_entries = 0
        self.num_events = 0
        self.num_blocks = 0
        self._num_reported_dropped = 0  # by the caller (the manager's bounded queue)
        self.num_snapshots = 0
        self.num_stream_resets = 0  # streams deleted because no entry could be added any more
        self.num_capped_trims = 0  # flushes where maxlen trimmed what retain_s would keep

    @property
    def num_dropped(self) -> int:
        """Events lost: reported by the caller, dropped by the buffer, or oversized."""
        return self._num_reported_dropped + self.batcher.num_dropped

    # -- the buffer ----------------------------------------------------------------------------

    def add(self, events: Sequence[KVCacheEvent], *, dropped: int, ts_us: int | None) -> None:
        """Buffer a batch (``dropped``: events lost just before it; never waits)."""
        if dropped:
            self._num_reported_dropped += dropped
            self.need_snapshot = True
        if not events:
            if dropped:
                self.batcher.add_dropped(dropped)
                self.wake()
            return
        stamp = time.time_ns() // 1_000 if ts_us is None else ts_us
        self.last_seq = max(self.last_seq, events[-1].event_id)
        lost = self.batcher.add(events, ts_us=stamp, dropped=dropped)
        if lost:
            self._buffer_overflowed(lost)
        if self.batcher.is_full:
            self._full.set()
        self.wake()

    def restart(self, epoch: int) -> None:
        """The worker restarted: drop what is buffered, go on in ``epoch``, snapshot first."""
        self.epoch = epoch
        self.batcher.clear()
        self.last_seq = -1
        self.need_snapshot = True
        self._last_stream_id = "0-0"
        self.wake()

    def request_snapshot(self) -> None:
        self.need_snapshot = True
        self.wake()

    def wake(self) -> None:
        self._drained.clear()
        self._wakeup.set()

    def close(self) -> None:
        """Write what is left without lingering, then end the task."""
        self._closing = True
        self._wakeup.set()
        self._full.set()

    def _ask_for_snapshot(self) -> None:
        self.need_snapshot = True

    def _is_drained(self) -> bool:
        return self.batcher.is_empty and not self.need_snapshot and not self._inflight

    def _buffer_overflowed(self, lost: int) -> None:
        """The buffer dropped its oldest batches (``lost`` events, with the losses they
        carried): a snapshot must follow."""
        self.need_snapshot = True
        # One line per outage, not per batch: the count comes when writing works again.
        if not self._dropped_in_outage:
            logger.warning(
                "publisher %s: buffer full (%d blocks); dropping the oldest events until "
                "Redis takes writes again (consumers will resynchronise)",
                self._worker_id,
                self._config.max_buffer_blocks,
            )
        self._dropped_in_outage += lost

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until everything buffered so far (and any pending snapshot) is written."""
        self._full.set()
        self.wake()
        async with asyncio.timeout(timeout):
            while not self._is_drained():
                self._drained.clear()
                self.wake()
                await self._drained.wait()

    # -- writing -------------------------------------------------------------------------------

    def _take_snapshot(self) -> Snapshot:
        if self._snapshot_source is not None:
            return self._snapshot_source()
        # Without a source the publisher knows no state, only where the stream starts: an empty
        # snapshot just before the oldest event it still holds. That is exact before anything
        # was written or lost, and lets consumers follow the stream (inexactly) after.
        if self.num_entries or self.num_dropped:
            logger.warning(
                "publisher %s: a snapshot is needed but there is no snapshot source; "
                "consumers will follow the stream without the state before it",
                self._worker_id,
            )
        first = self.batcher.first_event_id()
        return Snapshot([], (self.last_seq + 1 if first is None else first) - 1)

    async def _stream_tail_id(self) -> str:
        """Id of the last entry of our stream ("0-0" when it is empty or gone)."""
        last = await self._redis.xrevrange(self._stream_key, "+", "-", count=1)
        if not last:
            return "0-0"
        entry_id = last[0][0]
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    async def flush_once(self) -> None:
        """One pipeline: the snapshot if one is due, then every buffered entry."""
        want_snapshot, self.need_snapshot = self.need_snapshot, False
        snapshot: Snapshot | None = None
        try:
            if want_snapshot:
                # Only this task writes the stream, so nothing lands between this read and the
                # snapshot; and nothing awaits between taking the snapshot and taking the
                # buffer, so every buffered event is covered by the snapshot.
                stream_id = await self._stream_tail_id()
                snapshot = replace(
                    self._take_snapshot(),
                    epoch=self.epoch,
                    stream_id=stream_id,
                    worker=self._worker_id,
                    ts_us=time.time_ns() // 1_000,
                )
        except BaseException:
            self.need_snapshot = True
            raise
        epoch = self.epoch
        entries = self.batcher.take_entries()
        carry = self.batcher.take_carry()
        # A loss with nothing after it yet is said by a marker, numbered as the next event.
        next_seq = self.last_seq + 1
        if snapshot is not None:
            next_seq = max(next_seq, snapshot.event_id + 1)
        encoded = self.batcher.encode(entries, epoch, carry=carry, next_seq=next_seq)
        if encoded.num_oversized:
            self.need_snapshot = True
        fields = encoded.fields
        if snapshot is None and not fields:
            return
        self._inflight = True
        minid = self._trim_minid()
        maxlen = self._config.maxlen
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                if snapshot is not None:
                    pipe.set(keys.snapshot_key(self._worker_id), encode_snapshot(snapshot))
                for entry_fields in fields:
                    pipe.xadd(
                        self._stream_key,
                        entry_fields,  # type: ignore[arg-type]
                        maxlen=maxlen if minid is None else None,
                        minid=minid,
                        approximate=True,
                    )
                if fields and minid is not None and maxlen is not None:
                    pipe.xtrim(self._stream_key, maxlen=maxlen, approximate=True)
                # A consumer's request for a fresh snapshot is answered at the next flush, not
                # only at the next heartbeat: the sooner it is written, the less of the stream
                # after it can be trimmed before the consumer reads it.
                pipe.getdel(keys.snapshot_request_key(self._worker_id))
                results = await pipe.execute()
        except BaseException:
            if snapshot is not None:
                self.need_snapshot = True
            if self.epoch == epoch:  # else a new epoch came meanwhile: these are history
                lost = self.batcher.put_back(entries, carry)
                if lost:
                    self._buffer_overflowed(lost)
            raise
        finally:
            self._inflight = False
        if snapshot is not None:
            self.num_snapshots += 1
        if results[-1]:
            logger.info("publisher %s: a consumer asked for a snapshot", self._worker_id)
            self.request_snapshot()
        if fields:
            if minid is not None and maxlen is not None:
                capped = results[-2]
                if capped and not self.num_capped_trims:
                    logger.warning(
                        "publisher %s: the stream reached maxlen (%d entries) within retain_s "
                        "(%.0f s): a consumer that falls further behind must resynchronise",
                        self._worker_id,
                        maxlen,
                        self._config.retain_s,
                    )
                self.num_capped_trims += bool(capped)
            last_id = results[len(fields) - 1 + (snapshot is not None)]
            self._last_stream_id = last_id.decode() if isinstance(last_id, bytes) else last_id
        self.num_entries += len(fields)
        for entry in entries:
            self.num_events += len(entry.events)
            self.num_blocks += entry.weight

    def _trim_minid(self) -> str | None:
        """``MINID`` for the next ``XADD``s: ``retain_s`` before our last entry, by the id
        Redis gave it (the server's clock, not ours); None: trim by ``maxlen`` alone."""
        retain_s = self._config.retain_s
        if retain_s is None:
            return None
        last_ms = int(self._last_stream_id.partition("-")[0])
        oldest_ms = last_ms - int(retain_s * 1000)
        return f"{oldest_ms}-0" if last_ms and oldest_ms > 0 else None

    async def _replace_stream(self, exc: ResponseError) -> None:
        """Our stream holds the largest possible entry id (``XADD`` of
        ``18446744073709551615-18446744073709551615``, by someone else): nothing can be added
        after it, ever. Delete the stream and carry on in a new epoch; the next flush writes a
        snapshot first, so consumers resynchronise onto the new stream."""
        logger.error(
            "publisher %s: the stream cannot take entries any more (%s); deleting it and "
            "starting epoch anew",
            self._worker_id,
            exc,
        )
        await self._redis.delete(self._stream_key)
        self.epoch = new_epoch()
        self._last_stream_id = "0-0"
        self.need_snapshot = True
        self.num_stream_resets += 1

    async def _flush_step(self) -> None:
        try:
            await self.flush_once()
        except ResponseError as exc:
            if _STREAM_EXHAUSTED not in str(exc):
                raise
            await self._replace_stream(exc)  # the next round writes the snapshot

    async def run(self) -> None:
        """The flusher task: flush when woken (after lingering), until closed and drained."""
        linger_s = self._config.linger_s
        while True:
            raise_if_cancelled()
            await self._wakeup.wait()
            if linger_s > 0 and not self._closing and not self._full.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(linger_s):
                        await self._full.wait()
            self._wakeup.clear()
            if not self._closing:
                self._full.clear()
            if not await self.backoff.step(self._flush_step):
                self._wakeup.set()
                continue
            if self._dropped_in_outage:
                logger.warning(
                    "publisher %s: %d events were dropped while Redis refused writes",
                    self._worker_id,
                    self._dropped_in_outage,
                )
                self._dropped_in_outage = 0
            if self._is_drained():
                self._drained.set()
                if self._closing:
                    return
            else:
                self._wakeup.set()
