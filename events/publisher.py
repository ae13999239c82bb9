"""``EventPublisher``: one worker's KV events onto its Redis stream (asyncio).

How a worker uses it (the manager has a single writer, the worker's engine task)::

    async with EventPublisher(redis_url, "w3", snapshot_source=lambda: manager_snapshot(mgr),
                              registry_entry=manager_registry_entry(mgr, url=..., device=...),
                              load_source=lambda: manager_load(mgr, num_waiting=len(queue))
                              ) as publisher:
        ...                              # after each engine iteration:
        publisher.publish_from(mgr)      # = publish(mgr.take_events(), dropped=<new drops>)

The worker *pushes*: ``publish(events, dropped=n)`` is synchronous and never waits; it stamps
the batch with the time it received it and appends it to a bounded buffer. A background
flusher task turns the buffer into stream entries (``events.envelope``): it waits up to
``linger_s`` for more batches unless ``max_entry_blocks`` are already waiting, then sends every
entry it has in one pipeline of ``XADD ... MINID ~ <retain_s before its last entry>``. The
stream is trimmed by age, not by a count: a consumer that stalls for less than ``retain_s``
(60 s) finds every entry after its position (or after the snapshot it loads) still there, so
recovery cannot race trimming. ``maxlen`` (optional) caps the count on top of that, to bound
Redis's memory at high rates; when it trims within ``retain_s`` a warning says so once (size
it at least rate x retain_s). ``retain_s=None`` trims by ``maxlen`` alone (the old behaviour).
A consumer's request for a fresh snapshot is read (``GETDEL``) in the same pipeline, so it is
answered at the next flush, not a heartbeat later. The flusher is the only task
that writes the stream and the snapshot, so their order is the order consumers see.

Loss and recovery. While Redis is away the flusher retries with exponential backoff (with
jitter) and batches keep accumulating; past ``max_buffer_blocks`` the oldest batches are
dropped. Whenever events were lost -- dropped here, or reported by the caller as dropped by the
manager's own bounded queue -- the publisher writes a fresh snapshot (``events.snapshot``)
before the next entry, and that entry carries ``dropped > 0`` (an entry with no events, a
*marker*, when nothing else is pending). A consumer that sees it reloads the snapshot and
skips every event the snapshot covers. Entries that a failed pipeline may or may not have
written are sent again: consumers skip what they already applied (``seq_last <= last``).

Other keys, kept by a heartbeat task every ``heartbeat_interval_s``: the registry entry
(``kvmesh:workers``), the heartbeat key (``SET ... PX heartbeat_ttl_s``, its value
``"<epoch> <last event id received>"``, so that a consumer can tell it is behind), a check that
the snapshot still exists (a Redis restart without persistence loses it: then a new one is
written) and a consumer's request for a fresh snapshot. A load task writes the load hash every
``load_interval_s`` (with a TTL, so a dead worker's load disappears). Start: a snapshot, then
the registry entry and heartbeat. ``aclose()`` flushes what is buffered (waiting at most
``close_timeout_s``), then removes the registry entry and the heartbeat key.

An entry with the largest possible id (``18446744073709551615-18446744073709551615``, added by
someone else) makes every later ``XADD`` fail for good: the publisher then deletes its stream
and carries on in a new epoch (``num_stream_resets``), snapshot first.

Epochs are time-based (microseconds << 12, plus 12 random bits), so a later start of the same
worker has a larger epoch; consumers rely on that to tell old entries from new ones.

Background tasks log, back off and carry on; only ``aclose`` stops them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, Final, Protocol, cast

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from cache import KVCacheEvent, KVCacheManager, RemovedData, StoredData
from events import keys
from events.envelope import DEFAULT_MAX_ENTRY_BYTES, FMT_MSGPACK, FORMATS, make_envelope
from events.snapshot import Snapshot, SnapshotSource, encode_snapshot

__all__ = [
    "REDIS_ERRORS",
    "EventPublisher",
    "EventSource",
    "client_for",
    "is_cluster",
    "manager_load",
    "manager_registry_entry",
    "new_epoch",
    "raise_if_cancelled",
    "redis_client",
]

logger = logging.getLogger(__name__)

_MAX_U64: Final = 2**64 - 1
# What a lost connection, a refused connection or a timeout look like from redis-py.
REDIS_ERRORS: Final = (RedisError, OSError, TimeoutError)
# What Redis answers an XADD to a stream whose last id is the largest possible.
_STREAM_EXHAUSTED: Final = "exhausted the last possible ID"
# Room for the envelope's other fields next to ``data`` when sizing an entry.
_ENVELOPE_OVERHEAD: Final = 256


def raise_if_cancelled() -> None:
    """Re-raise a cancellation that a library turned into another error.

    redis-py may catch the ``CancelledError`` of a task cancelled mid-command and raise a
    connection error instead; a loop that logs and carries on would then never stop.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def new_epoch() -> int:
    """A fresh epoch: time-based, so that a later start gets a larger one."""
    return ((time.time_ns() // 1_000) << 12 | secrets.randbits(12)) & _MAX_U64


CLUSTER_SCHEMES: Final = ("redis+cluster://", "rediss+cluster://")


def redis_client(url: str, *, socket_timeout: float | None = 5.0) -> Redis:
    """An asyncio client that fails fast: kvmesh's loops do their own retrying and backoff.

    ``redis+cluster://host:port`` (or ``rediss+cluster://``) names a Redis Cluster by any of
    its nodes: the client is then a ``RedisCluster``, typed as ``Redis`` because it speaks the
    same commands; the few places that must differ ask ``is_cluster``. Every key of one worker
    carries its id as a hash tag, so its stream, snapshot, load and heartbeat share a slot."""
    connect_timeout = min(socket_timeout or 2.0, 2.0)
    if url.startswith(CLUSTER_SCHEMES):
        cluster = RedisCluster.from_url(  # it retries by itself when the topology changes
            url.replace("+cluster", "", 1),
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
        )
        return cast(Redis, cluster)
    client: Redis = Redis.from_url(
        url,
        socket_timeout=socket_timeout,
        socket_connect_timeout=connect_timeout,
        retry=Retry(NoBackoff(), 0),
    )
    return client


def is_cluster(client: Redis) -> bool:
    return isinstance(client, RedisCluster)


def client_for(redis: Redis | str, *, socket_timeout: float | None = 5.0) -> tuple[Redis, bool]:
    """A client for a URL, owned by the caller (who closes it), or the client given, not owned."""
    if isinstance(redis, str):
        return redis_client(redis, socket_timeout=socket_timeout), True
    return redis, False


class EventSource(Protocol):
    """What ``publish_from`` needs of a manager (``KVCacheManager`` is one)."""

    def take_events(self) -> list[KVCacheEvent]: ...

    @property
    def num_dropped_events(self) -> int: ...


def manager_registry_entry(
    mgr: KVCacheManager, *, url: str | None = None, device: str | None = None
) -> dict[str, Any]:
    """The registry fields a ``KVCacheManager`` can tell: capacity per level and per window."""
    windows = {}
    for size in mgr.window_sizes:
        cap = mgr.window_capacity(size)
        windows[str(size)] = [cap.primary, cap.secondary]
    total = mgr.window_capacity()
    return {
        "url": url,
        "device": device if device is not None else str(mgr.device),
        "tokens_per_block": mgr.tokens_per_block,
        "capacity": [total.primary, total.secondary],
        "windows": windows,
    }


def manager_load(mgr: KVCacheManager, *, num_waiting: int = 0) -> dict[str, int]:
    """Load fields of a ``KVCacheManager`` (summed over windows) for the load hash."""
    cap = mgr.window_capacity()
    return {
        "active_sequences": len(mgr.sequences),
        "waiting_requests": num_waiting,
        "free_blocks_0": cap.free_primary,
        "used_blocks_0": cap.primary - cap.free_primary,
        "free_blocks_1": cap.free_secondary,
        "used_blocks_1": cap.secondary - cap.free_secondary,
    }


def _weight(events: Sequence[KVCacheEvent]) -> int:
    """Blocks an event batch carries (stored blocks, removed hashes; 1 for other events)."""
    total = 0
    for event in events:
        data = event.data
        if type(data) is StoredData:
            total += len(data.blocks) or 1
        elif type(data) is RemovedData:
            total += len(data.block_hashes) or 1
        else:
            total += 1
    return total


@dataclass(slots=True)
class _Batch:
    events: Sequence[KVCacheEvent]
    ts_us: int
    weight: int
    # Events lost just before this batch (a new stream entry starts here when non-zero).
    dropped: int = 0


@dataclass(slots=True)
class _Entry:
    events: list[KVCacheEvent]
    ts_us: int
    dropped: int
    weight: int


class EventPublisher:
    """Publishes one worker's KV events to ``kvmesh:{<worker>}:events``; see the module doc."""

    def __init__(
        self,
        redis: Redis | str,
        worker_id: str,
        *,
        snapshot_source: SnapshotSource | None = None,
        registry_entry: Mapping[str, Any] | None = None,
        load_source: Callable[[], Mapping[str, int | float | str]] | None = None,
        epoch: int | None = None,
        fmt: str = FMT_MSGPACK,
        maxlen: int | None = 10_000,
        retain_s: float | None = 60.0,
        max_entry_blocks: int = 4_096,
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
        linger_s: float = 0.002,
        max_buffer_blocks: int = 1_000_000,
        heartbeat_interval_s: float = 1.0,
        heartbeat_ttl_s: float = 5.0,
        load_interval_s: float = 1.0,
        backoff_initial_s: float = 0.02,
        backoff_max_s: float = 2.0,
        close_timeout_s: float = 5.0,
        unregister_on_close: bool = True,
    ) -> None:
        self.worker_id = keys.validate_worker_id(worker_id)
        if fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
        for name, value in (
            ("maxlen", 1 if maxlen is None else maxlen),
            ("retain_s", 1 if retain_s is None else retain_s),
            ("max_entry_blocks", max_entry_blocks),
            ("max_entry_bytes", max_entry_bytes),
            ("max_buffer_blocks", max_buffer_blocks),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if heartbeat_ttl_s <= heartbeat_interval_s:
            raise ValueError("heartbeat_ttl_s must be longer than heartbeat_interval_s")
        self._redis, self._owns_redis = client_for(redis)
        self.epoch = new_epoch() if epoch is None else epoch
        self.fmt = fmt
        self.maxlen = maxlen
        self.retain_s = retain_s
        self.max_entry_blocks = max_entry_blocks
        self.max_entry_bytes = max_entry_bytes
        self.linger_s = linger_s
        self.max_buffer_blocks = max_buffer_blocks
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.load_interval_s = load_interval_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.close_timeout_s = close_timeout_s
        self.unregister_on_close = unregister_on_close
        self._snapshot_source = snapshot_source
        self._registry_entry: dict[str, Any] = dict(registry_entry or {})
        self._load_source = load_source
        self._stream_key = keys.events_key(worker_id)

        self._buffer: deque[_Batch] = deque()
        self._buffered_blocks = 0
        self._carry_dropped = 0  # lost events with no batch after them yet
        self._dropped_in_outage = 0  # events dropped since writing last worked
        self._last_seq = -1  # highest event id received
        self._source_dropped_seen = 0
        self._need_snapshot = True
        self._last_stream_id = "0-0"
        self._started_at = time.time()

        self._wakeup = asyncio.Event()
        self._full = asyncio.Event()
        self._drained = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._closing = False
        self._stop = asyncio.Event()  # ends the heartbeat and load loops
        self._closed = False
        self._failing = False
        self._inflight = False

        self.num_entries = 0
        self.num_events = 0
        self.num_blocks = 0
        self.num_dropped = 0  # events lost (buffer overflow, oversized, reported by the caller)
        self.num_snapshots = 0
        self.num_errors = 0
        self.num_stream_resets = 0  # streams deleted because no entry could be added any more
        self.num_capped_trims = 0  # flushes where maxlen trimmed what retain_s would keep

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> EventPublisher:
        """Write the first snapshot and the registry entry (if Redis answers), start the tasks."""
        if self._tasks:
            raise RuntimeError("the publisher is already started")
        try:
            await self._flush_once()
            await self._heartbeat_once()
        except REDIS_ERRORS as exc:
            logger.warning(
                "publisher %s: Redis is not answering at start (%s); retrying in the background",
                self.worker_id,
                exc,
            )
        self._flusher = asyncio.create_task(
            self._run_flusher(), name=f"kvmesh-pub-{self.worker_id}"
        )
        self._tasks.append(self._flusher)
        self._tasks.append(asyncio.create_task(self._run_heartbeat(), name="kvmesh-heartbeat"))
        if self._load_source is not None:
            self._tasks.append(asyncio.create_task(self._run_load(), name="kvmesh-load"))
        self._wakeup.set()
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
        self._closing = True
        self._wakeup.set()
        self._full.set()
        if self._flusher is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._flusher), self.close_timeout_s)
            except TimeoutError:
                logger.warning(
                    "publisher %s: closing with %d buffered events not written",
                    self.worker_id,
                    sum(len(b.events) for b in self._buffer),
                )
                self._flusher.cancel()
        self._stop.set()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=self.close_timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.unregister_on_close:
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    pipe.hdel(keys.WORKERS_KEY, self.worker_id)
                    pipe.delete(keys.alive_key(self.worker_id), keys.load_key(self.worker_id))
                    await pipe.execute()
            except REDIS_ERRORS as exc:
                logger.warning("publisher %s: could not unregister: %s", self.worker_id, exc)
        if self._owns_redis:
            await self._redis.aclose()

    # -- the worker's side ---------------------------------------------------------------------

    def publish(
        self, events: Sequence[KVCacheEvent], *, dropped: int = 0, ts_us: int | None = None
    ) -> None:
        """Queue a batch (never waits; call it on the event loop's thread). ``dropped``: events
        lost just before it, upstream. The batch is kept as it is, not copied."""
        if self._closing:
            raise RuntimeError("the publisher is closed")
        if dropped < 0:
            raise ValueError(f"dropped must be >= 0, got {dropped}")
        if dropped:
            self.num_dropped += dropped
            self._need_snapshot = True
        if not events:
            if dropped:
                self._carry_dropped += dropped
                self._wake()
            return
        stamp = time.time_ns() // 1_000 if ts_us is None else ts_us
        weight = _weight(events)
        self._last_seq = max(self._last_seq, events[-1].event_id)
        self._buffer.append(_Batch(events, stamp, weight, dropped + self._carry_dropped))
        self._carry_dropped = 0
        self._buffered_blocks += weight
        if self._buffered_blocks > self.max_buffer_blocks:
            self._drop_oldest()
        if self._buffered_blocks >= self.max_entry_blocks:
            self._full.set()
        self._wake()

    def publish_from(self, source: EventSource) -> int:
        """``publish(source.take_events())`` with the events the source dropped since last time."""
        events = source.take_events()
        total = source.num_dropped_events
        dropped, self._source_dropped_seen = total - self._source_dropped_seen, total
        self.publish(events, dropped=max(dropped, 0))
        return len(events)

    def new_epoch(self, epoch: int | None = None) -> int:
        """The worker restarted: drop what is buffered, start a new epoch, snapshot again."""
        self.epoch = new_epoch() if epoch is None else epoch
        self._buffer.clear()
        self._buffered_blocks = 0
        self._carry_dropped = 0
        self._last_seq = -1
        self._source_dropped_seen = 0
        self._need_snapshot = True
        self._last_stream_id = "0-0"
        self._started_at = time.time()
        self._wake()
        return self.epoch

    def update_registry(self, **fields: Any) -> None:
        """Change registry fields; written with the next heartbeat."""
        self._registry_entry.update(fields)

    def request_snapshot(self) -> None:
        self._need_snapshot = True
        self._wake()

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until everything published so far (and any pending snapshot) is written."""
        self._full.set()
        self._wake()
        async with asyncio.timeout(timeout):
            while not self._is_drained():
                self._drained.clear()
                self._wake()
                await self._drained.wait()

    @property
    def buffered_blocks(self) -> int:
        return self._buffered_blocks

    @property
    def last_seq(self) -> int:
        """Highest event id received so far (-1 before the first)."""
        return self._last_seq

    def stats(self) -> dict[str, Any]:
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
            "buffered_blocks": self._buffered_blocks,
            "buffered_batches": len(self._buffer),
        }

    # -- buffer --------------------------------------------------------------------------------

    def _wake(self) -> None:
        self._drained.clear()
        self._wakeup.set()

    def _is_drained(self) -> bool:
        return (
            not self._buffer
            and not self._carry_dropped
            and not self._need_snapshot
            and not self._inflight
        )

    def _drop_oldest(self) -> None:
        """Drop whole batches, oldest first, until the buffer is within its bound."""
        lost = 0
        while self._buffer and self._buffered_blocks > self.max_buffer_blocks:
            batch = self._buffer.popleft()
            self._buffered_blocks -= batch.weight
            lost += len(batch.events) + batch.dropped
            self.num_dropped += len(batch.events)
        if lost:
            self._need_snapshot = True
            if self._buffer:
                self._buffer[0].dropped += lost
            else:
                self._carry_dropped += lost
            # One line per outage, not per batch: the count comes when writing works again.
            if not self._dropped_in_outage:
                logger.warning(
                    "publisher %s: buffer full (%d blocks); dropping the oldest events until "
                    "Redis takes writes again (consumers will resynchronise)",
                    self.worker_id,
                    self.max_buffer_blocks,
                )
            self._dropped_in_outage += lost

    def _take_entries(self) -> list[_Entry]:
        """Pop every buffered batch, grouped into entries (new entry at a drop or when full)."""
        entries: list[_Entry] = []
        current: _Entry | None = None
        while self._buffer:
            batch = self._buffer.popleft()
            if (
                current is None
                or batch.dropped
                or current.weight + batch.weight > self.max_entry_blocks
            ):
                current = _Entry(list(batch.events), batch.ts_us, batch.dropped, batch.weight)
                entries.append(current)
            else:
                current.events.extend(batch.events)
                current.weight += batch.weight
        self._buffered_blocks = 0
        return entries

    def _put_back(self, entries: list[_Entry], carry: int) -> None:
        """A failed write: entries return to the front of the buffer, in order."""
        for entry in reversed(entries):
            self._buffer.appendleft(_Batch(entry.events, entry.ts_us, entry.weight, entry.dropped))
            self._buffered_blocks += entry.weight
        self._carry_dropped += carry
        if self._carry_dropped and self._buffer:
            self._buffer[0].dropped += self._carry_dropped
            self._carry_dropped = 0
        if self._buffered_blocks > self.max_buffer_blocks:
            self._drop_oldest()

    def _encode(
        self, events: list[KVCacheEvent], ts_us: int, dropped: int
    ) -> tuple[list[dict[str, bytes | str | int]], int]:
        """Envelope fields for ``events``, split in halves while over ``max_entry_bytes``.

        Returns the fields and the number of lost events to carry onto what follows: an event
        that alone is too large for any consumer is dropped openly (the next entry says so, and
        a snapshot follows) rather than written and refused everywhere.
        """
        envelope = make_envelope(
            self.worker_id, self.epoch, events, dropped=dropped, fmt=self.fmt, ts_us=ts_us
        )
        if len(envelope.data) + _ENVELOPE_OVERHEAD <= self.max_entry_bytes:
            return [envelope.fields()], 0
        if len(events) == 1:
            logger.error(
                "publisher %s: event %d is %d bytes encoded, over max_entry_bytes; dropped",
                self.worker_id,
                events[0].event_id,
                len(envelope.data),
            )
            self.num_dropped += 1
            self._need_snapshot = True
            return [], dropped + 1
        half = len(events) // 2
        first, lost = self._encode(events[:half], ts_us, dropped)
        second, lost = self._encode(events[half:], ts_us, lost)
        return first + second, lost

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
                self.worker_id,
            )
        first = self._buffer[0].events[0].event_id if self._buffer else self._last_seq + 1
        return Snapshot([], first - 1)

    async def _stream_tail_id(self) -> str:
        """Id of the last entry of our stream ("0-0" when it is empty or gone)."""
        last = await self._redis.xrevrange(self._stream_key, "+", "-", count=1)
        if not last:
            return "0-0"
        entry_id = last[0][0]
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    async def _flush_once(self) -> None:
        """One pipeline: the snapshot if one is due, then every buffered entry."""
        want_snapshot, self._need_snapshot = self._need_snapshot, False
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
                    worker=self.worker_id,
                    ts_us=time.time_ns() // 1_000,
                )
        except BaseException:
            self._need_snapshot = True
            raise
        epoch = self.epoch
        entries = self._take_entries()
        carry, self._carry_dropped = self._carry_dropped, 0
        fields: list[dict[str, bytes | str | int]] = []
        lost = 0
        for entry in entries:
            pieces, lost = self._encode(entry.events, entry.ts_us, entry.dropped + lost)
            fields.extend(pieces)
        if carry + lost:
            # Nothing after the loss yet: a marker says so, numbered as the next event will be.
            next_seq = self._last_seq + 1
            if snapshot is not None:
                next_seq = max(next_seq, snapshot.event_id + 1)
            marker = make_envelope(
                self.worker_id, self.epoch, [], dropped=carry + lost, fmt=self.fmt,
                next_seq=next_seq,
            )  # fmt: skip
            fields.append(marker.fields())
        if snapshot is None and not fields:
            return
        self._inflight = True
        minid = self._trim_minid()
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                if snapshot is not None:
                    pipe.set(keys.snapshot_key(self.worker_id), encode_snapshot(snapshot))
                for entry_fields in fields:
                    pipe.xadd(
                        self._stream_key,
                        entry_fields,  # type: ignore[arg-type]
                        maxlen=self.maxlen if minid is None else None,
                        minid=minid,
                        approximate=True,
                    )
                if fields and minid is not None and self.maxlen is not None:
                    pipe.xtrim(self._stream_key, maxlen=self.maxlen, approximate=True)
                # A consumer's request for a fresh snapshot is answered at the next flush, not
                # only at the next heartbeat: the sooner it is written, the less of the stream
                # after it can be trimmed before the consumer reads it.
                pipe.getdel(keys.snapshot_request_key(self.worker_id))
                results = await pipe.execute()
        except BaseException:
            if snapshot is not None:
                self._need_snapshot = True
            if self.epoch == epoch:  # else new_epoch() came meanwhile: these are history
                self._put_back(entries, carry)
            raise
        finally:
            self._inflight = False
        if snapshot is not None:
            self.num_snapshots += 1
        if results[-1]:
            logger.info("publisher %s: a consumer asked for a snapshot", self.worker_id)
            self.request_snapshot()
        if fields:
            if minid is not None and self.maxlen is not None:
                capped = results[-2]
                if capped and not self.num_capped_trims:
                    logger.warning(
                        "publisher %s: the stream reached maxlen (%d entries) within retain_s "
                        "(%.0f s): a consumer that falls further behind must resynchronise",
                        self.worker_id,
                        self.maxlen,
                        self.retain_s,
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
        if self.retain_s is None:
            return None
        last_ms = int(self._last_stream_id.partition("-")[0])
        oldest_ms = last_ms - int(self.retain_s * 1000)
        return f"{oldest_ms}-0" if last_ms and oldest_ms > 0 else None

    async def _replace_stream(self, exc: ResponseError) -> None:
        """Our stream holds the largest possible entry id (``XADD`` of
        ``18446744073709551615-18446744073709551615``, by someone else): nothing can be added
        after it, ever. Delete the stream and carry on in a new epoch; the next flush writes a
        snapshot first, so consumers resynchronise onto the new stream."""
        logger.error(
            "publisher %s: the stream cannot take entries any more (%s); deleting it and "
            "starting epoch anew",
            self.worker_id,
            exc,
        )
        await self._redis.delete(self._stream_key)
        self.epoch = new_epoch()
        self._last_stream_id = "0-0"
        self._need_snapshot = True
        self.num_stream_resets += 1

    async def _run_flusher(self) -> None:
        backoff = self.backoff_initial_s
        while True:
            raise_if_cancelled()
            await self._wakeup.wait()
            if self.linger_s > 0 and not self._closing and not self._full.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.linger_s):
                        await self._full.wait()
            self._wakeup.clear()
            if not self._closing:
                self._full.clear()
            try:
                try:
                    await self._flush_once()
                except ResponseError as exc:
                    if _STREAM_EXHAUSTED not in str(exc):
                        raise
                    await self._replace_stream(exc)
                    self._wakeup.set()
                    continue
            except REDIS_ERRORS as exc:
                raise_if_cancelled()
                self.num_errors += 1
                # Redis may have restarted and lost our snapshot: write a new one once back.
                self._need_snapshot = True
                if not self._failing:
                    logger.warning("publisher %s: Redis write failed: %s", self.worker_id, exc)
                self._failing = True
                await asyncio.sleep(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, self.backoff_max_s)
                self._wakeup.set()
                continue
            except Exception:
                raise_if_cancelled()
                self.num_errors += 1
                logger.exception("publisher %s: unexpected error while flushing", self.worker_id)
                await asyncio.sleep(backoff)
                self._wakeup.set()
                continue
            if self._failing:
                logger.info("publisher %s: Redis writes succeed again", self.worker_id)
            if self._dropped_in_outage:
                logger.warning(
                    "publisher %s: %d events were dropped while Redis refused writes",
                    self.worker_id,
                    self._dropped_in_outage,
                )
                self._dropped_in_outage = 0
            self._failing = False
            backoff = self.backoff_initial_s
            if self._is_drained():
                self._drained.set()
                if self._closing:
                    return
            else:
                self._wakeup.set()

    # -- heartbeat, registry, load -------------------------------------------------------------

    def _registry_json(self) -> str:
        entry = dict(self._registry_entry)
        entry.update(
            worker=self.worker_id,
            epoch=self.epoch,
            started_at=self._started_at,
            fmt=self.fmt,
            heartbeat_ttl_s=self.heartbeat_ttl_s,
        )
        return json.dumps(entry, sort_keys=True)

    async def _heartbeat_once(self) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hset(keys.WORKERS_KEY, self.worker_id, self._registry_json())
            # "<epoch> <last event id received>": a consumer that has not applied that id
            # within its stale_after_s reports this worker stale (its index is behind).
            pipe.set(
                keys.alive_key(self.worker_id),
                f"{self.epoch} {self._last_seq}",
                px=int(self.heartbeat_ttl_s * 1000),
            )
            pipe.getdel(keys.snapshot_request_key(self.worker_id))
            pipe.exists(keys.snapshot_key(self.worker_id))
            _, _, requested, has_snapshot = await pipe.execute()
        if requested or not has_snapshot:
            if requested:
                logger.info("publisher %s: a consumer asked for a snapshot", self.worker_id)
            self.request_snapshot()

    async def _run_heartbeat(self) -> None:
        await self._every(self.heartbeat_interval_s, self._heartbeat_once, "heartbeat", first=False)

    async def _every(
        self,
        interval_s: float,
        action: Callable[[], Awaitable[None]],
        what: str,
        *,
        first: bool = True,
    ) -> None:
        """Run ``action`` every ``interval_s`` until ``aclose``; log failures and carry on."""
        if not first:
            await self._pause(interval_s)
        while not self._stop.is_set():
            raise_if_cancelled()
            try:
                await action()
            except REDIS_ERRORS as exc:
                raise_if_cancelled()
                logger.debug("publisher %s: %s failed: %s", self.worker_id, what, exc)
            except Exception:
                raise_if_cancelled()
                logger.exception("publisher %s: %s error", self.worker_id, what)
            await self._pause(interval_s)

    async def _pause(self, seconds: float) -> None:
        """Sleep, or return early when the publisher closes."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stop.wait()

    async def _load_once(self) -> None:
        assert self._load_source is not None
        load = dict(self._load_source())
        key = keys.load_key(self.worker_id)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hset(key, mapping=load)  # type: ignore[arg-type]
            pipe.pexpire(key, int(max(self.load_interval_s * 3, self.heartbeat_ttl_s) * 1000))
            await pipe.execute()

    async def _run_load(self) -> None:
        await self._every(self.load_interval_s, self._load_once, "load update")
