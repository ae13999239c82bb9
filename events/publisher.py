"""``EventPublisher``: one worker's KV events onto its Redis stream (asyncio).

How a worker uses it (the manager has a single writer, the worker's engine task)::

    config = PublisherConfig(maxlen=20_000)          # every setting, with documented defaults
    async with EventPublisher(redis_url, "w3", config,
                              snapshot_source=lambda: manager_snapshot(mgr),
                              registry_entry=manager_registry_entry(mgr, url=..., device=...),
                              load_source=lambda: manager_load(mgr, num_waiting=len(queue))
                              ) as publisher:
        ...                              # after each engine iteration:
        publisher.publish_from(mgr)      # = publish(mgr.take_events(), dropped=<new drops>)

The worker *pushes*: ``publish(events, dropped=n)`` is synchronous and never waits; it stamps
the batch with the time it received it and appends it to a bounded buffer
(``events.batching.EventBatcher``). A background flusher task turns the buffer into stream
entries (``events.envelope``): it waits up to ``linger_s`` for more batches unless
``max_entry_blocks`` are already waiting, then sends every entry it has in one pipeline of
``XADD ... MINID ~ <retain_s before its last entry>``. The stream is trimmed by age, not by a
count: a consumer that stalls for less than ``retain_s`` (60 s) finds every entry after its
position (or after the snapshot it loads) still there, so recovery cannot race trimming.
``maxlen`` (optional) caps the count on top of that, to bound Redis's memory at high rates;
when it trims within ``retain_s`` a warning says so once (size it at least rate x retain_s).
``retain_s=None`` trims by ``maxlen`` alone (the old behaviour). A consumer's request for a
fresh snapshot is read (``GETDEL``) in the same pipeline, so it is answered at the next flush,
not a heartbeat later. The flusher is the only task that writes the stream and the snapshot,
so their order is the order consumers see.

Loss and recovery. While Redis is away the flusher retries with exponential backoff (with
jitter; ``events.redis_io.Backoff``) and batches keep accumulating; past
``max_buffer_blocks`` the oldest batches are dropped. Whenever events were lost -- dropped
here, or reported by the caller as dropped by the manager's own bounded queue -- the publisher
writes a fresh snapshot (``events.snapshot``) before the next entry, and that entry carries
``dropped > 0`` (an entry with no events, a *marker*, when nothing else is pending). A
consumer that sees it reloads the snapshot and skips every event the snapshot covers. Entries
that a failed pipeline may or may not have written are sent again: consumers skip what they
already applied (``seq_last <= last``).

Other keys, kept by a heartbeat task every ``heartbeat_interval_s``: the registry entry
(``kvmesh:workers``), the heartbeat key (``SET ... PX heartbeat_ttl_s``, its value
``"<epoch> <last event id received>"``, so that a consumer can tell it is behind), a check that
the snapshot still exists (a Redis restart without persistence loses it: then a new one is
written) and a consumer's request for a fresh snapshot. A load task writes the load hash every
``load_interval_s`` (with a TTL, so a dead worker's load disappears). Start: a snapshot, then
the registry entry and heartbeat; ``registered`` says whether the last heartbeat was written
(a worker whose Redis never answered is invisible to every router, and says so). ``aclose()``
flushes what is buffered (waiting at most ``close_timeout_s``; at most one more attempt, a
second at most, while Redis is not answering: a shutdown does not wait on a Redis that is
down), then removes the registry entry and the heartbeat key.

An entry with the largest possible id (``18446744073709551615-18446744073709551615``, added by
someone else) makes every later ``XADD`` fail for good: the publisher then deletes its stream
and carries on in a new epoch (``num_stream_resets``), snapshot first.

Epochs are time-based (microseconds << 12, plus 12 random bits), so a later start of the same
worker has a larger epoch; consumers rely on that to tell old entries from new ones.

Background tasks log, back off and carry on; only ``aclose`` stops them. Settings are one
``PublisherConfig``; a setting out of range raises ``ValueError`` when the config is made.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, Final, Protocol

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from cache import KVCacheEvent, KVCacheManager
from events import keys
from events.batching import EventBatcher
from events.envelope import DEFAULT_MAX_ENTRY_BYTES, FMT_MSGPACK, FORMATS
from events.redis_io import REDIS_ERRORS, Backoff, client_for, raise_if_cancelled, stop_tasks
from events.snapshot import Snapshot, SnapshotSource, encode_snapshot

__all__ = [
    "EventPublisher",
    "EventSource",
    "PublisherConfig",
    "manager_load",
    "manager_registry_entry",
    "new_epoch",
]

logger = logging.getLogger(__name__)

_MAX_U64: Final = 2**64 - 1
# What Redis answers an XADD to a stream whose last id is the largest possible.
_STREAM_EXHAUSTED: Final = "exhausted the last possible ID"


def new_epoch() -> int:
    """A fresh epoch: time-based, so that a later start gets a larger one."""
    return ((time.time_ns() // 1_000) << 12 | secrets.randbits(12)) & _MAX_U64


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


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    """How a publisher writes its stream; the defaults are what a worker uses.

    Sizes are in blocks (a stored event weighs its blocks, a removal its hashes, any other
    event 1) or bytes; times in seconds. Out-of-range values raise ``ValueError`` here.
    """

    fmt: str = FMT_MSGPACK  # the events inside an entry: "msgpack" (events.codec) or "json"
    maxlen: int | None = 10_000  # cap on the stream's entries (XTRIM MAXLEN ~); None: no cap
    retain_s: float | None = 60.0  # keep entries this long (XADD MINID ~); None: maxlen alone
    max_entry_blocks: int = 4_096  # an entry's blocks at most; this many waiting: no lingering
    max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES  # larger entries are split (consumer's cap)
    linger_s: float = 0.002  # wait this long for more batches before a flush
    max_buffer_blocks: int = 1_000_000  # buffered while Redis is away; past it the oldest go
    heartbeat_interval_s: float = 1.0  # registry entry and heartbeat key, this often
    heartbeat_ttl_s: float = 5.0  # the heartbeat key's TTL: longer than heartbeat_interval_s
    load_interval_s: float = 1.0  # the load hash (needs a load_source), this often
    backoff_initial_s: float = 0.02  # first delay after a failed write; doubles per failure
    backoff_max_s: float = 2.0  # ... up to this
    close_timeout_s: float = 5.0  # aclose() waits this long for the buffer to be written
    close_timeout_failing_s: float = 1.0  # ... or this long while Redis writes are failing
    unregister_on_close: bool = True  # aclose() removes the registry entry and heartbeat key

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}, got {self.fmt!r}")
        for name, value in (
            ("maxlen", 1 if self.maxlen is None else self.maxlen),
            ("retain_s", 1 if self.retain_s is None else self.retain_s),
            ("max_entry_blocks", self.max_entry_blocks),
            ("max_entry_bytes", self.max_entry_bytes),
            ("max_buffer_blocks", self.max_buffer_blocks),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.heartbeat_ttl_s <= self.heartbeat_interval_s:
            raise ValueError("heartbeat_ttl_s must be longer than heartbeat_interval_s")


class EventPublisher:
    """Publishes one worker's KV events to ``kvmesh:{<worker>}:events``; see the module doc.

    ``redis``: a URL (the publisher owns and closes its client) or a client (left open).
    ``snapshot_source`` makes the worker's snapshot (without one, the publisher can only say
    where the stream starts); ``registry_entry`` is the worker's registry fields;
    ``load_source`` (optional) the fields of its load hash; ``epoch``: by default a new one.
    """

    def __init__(
        self,
        redis: Redis | str,
        worker_id: str,
        config: PublisherConfig | None = None,
        *,
        snapshot_source: SnapshotSource | None = None,
        registry_entry: Mapping[str, Any] | None = None,
        load_source: Callable[[], Mapping[str, int | float | str]] | None = None,
        epoch: int | None = None,
    ) -> None:
        self.worker_id = keys.validate_worker_id(worker_id)
        self.config = config = config if config is not None else PublisherConfig()
        self._redis, self._owns_redis = client_for(redis)
        self.epoch = new_epoch() if epoch is None else epoch
        self._snapshot_source = snapshot_source
        self._registry_entry: dict[str, Any] = dict(registry_entry or {})
        self._load_source = load_source
        self._stream_key = keys.events_key(worker_id)

        self._batcher = EventBatcher(
            self.worker_id,
            fmt=config.fmt,
            max_entry_blocks=config.max_entry_blocks,
            max_entry_bytes=config.max_entry_bytes,
            max_buffer_blocks=config.max_buffer_blocks,
        )
        self._dropped_in_outage = 0  # events dropped since writing last worked
        self._last_seq = -1  # highest event id received
        self._source_dropped_seen = 0
        self._need_snapshot = True
        self._last_stream_id = "0-0"
        self._started_at = time.time()
        self._backoff = Backoff(
            logger,
            f"publisher {self.worker_id}",
            verb="write",
            doing="flushing",
            initial_s=config.backoff_initial_s,
            max_s=config.backoff_max_s,
            # Redis may have restarted and lost our snapshot: write a new one once back.
            on_redis_error=self._ask_for_snapshot,
        )

        self._wakeup = asyncio.Event()
        self._full = asyncio.Event()
        self._drained = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._closing = False
        self._stop = asyncio.Event()  # ends the heartbeat and load loops
        self._closed = False
        self._inflight = False
        self.registered = False  # the last heartbeat (registry entry + heartbeat key) was written

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
        return self._num_reported_dropped + self._batcher.num_dropped

    @property
    def num_errors(self) -> int:
        """Failed flushes (Redis errors and unexpected ones)."""
        return self._backoff.num_errors

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
        timeout_s = self.close_timeout_s
        if self._flusher is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._flusher), timeout_s)
            except TimeoutError:
                logger.warning(
                    "publisher %s: closing with %d buffered events%s not written",
                    self.worker_id,
                    self._batcher.num_events,
                    " and a snapshot" if self._need_snapshot else "",
                )
                self._flusher.cancel()
        self._stop.set()
        await stop_tasks(self._tasks, grace_s=timeout_s)
        if self.config.unregister_on_close:
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
            self._num_reported_dropped += dropped
            self._need_snapshot = True
        if not events:
            if dropped:
                self._batcher.add_dropped(dropped)
                self._wake()
            return
        stamp = time.time_ns() // 1_000 if ts_us is None else ts_us
        self._last_seq = max(self._last_seq, events[-1].event_id)
        lost = self._batcher.add(events, ts_us=stamp, dropped=dropped)
        if lost:
            self._buffer_overflowed(lost)
        if self._batcher.is_full:
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
        self._batcher.clear()
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
    def close_timeout_s(self) -> float:
        """How long a shutdown waits for the buffer: ``close_timeout_s``, or while Redis is not
        answering (the last write failed, or the heartbeat) one more attempt at most."""
        if self._backoff.failing or not self.registered:
            return min(self.config.close_timeout_s, self.config.close_timeout_failing_s)
        return self.config.close_timeout_s

    @property
    def buffered_blocks(self) -> int:
        return self._batcher.buffered_blocks

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
            "buffered_blocks": self._batcher.buffered_blocks,
            "buffered_batches": self._batcher.num_batches,
        }

    # -- buffer --------------------------------------------------------------------------------

    def _wake(self) -> None:
        self._drained.clear()
        self._wakeup.set()

    def _ask_for_snapshot(self) -> None:
        self._need_snapshot = True

    def _is_drained(self) -> bool:
        return self._batcher.is_empty and not self._need_snapshot and not self._inflight

    def _buffer_overflowed(self, lost: int) -> None:
        """The buffer dropped its oldest batches (``lost`` events, with the losses they
        carried): a snapshot must follow."""
        self._need_snapshot = True
        # One line per outage, not per batch: the count comes when writing works again.
        if not self._dropped_in_outage:
            logger.warning(
                "publisher %s: buffer full (%d blocks); dropping the oldest events until "
                "Redis takes writes again (consumers will resynchronise)",
                self.worker_id,
                self.config.max_buffer_blocks,
            )
        self._dropped_in_outage += lost

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
        first = self._batcher.first_event_id()
        return Snapshot([], (self._last_seq + 1 if first is None else first) - 1)

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
        entries = self._batcher.take_entries()
        carry = self._batcher.take_carry()
        # A loss with nothing after it yet is said by a marker, numbered as the next event.
        next_seq = self._last_seq + 1
        if snapshot is not None:
            next_seq = max(next_seq, snapshot.event_id + 1)
        encoded = self._batcher.encode(entries, epoch, carry=carry, next_seq=next_seq)
        if encoded.num_oversized:
            self._need_snapshot = True
        fields = encoded.fields
        if snapshot is None and not fields:
            return
        self._inflight = True
        minid = self._trim_minid()
        maxlen = self.config.maxlen
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                if snapshot is not None:
                    pipe.set(keys.snapshot_key(self.worker_id), encode_snapshot(snapshot))
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
                pipe.getdel(keys.snapshot_request_key(self.worker_id))
                results = await pipe.execute()
        except BaseException:
            if snapshot is not None:
                self._need_snapshot = True
            if self.epoch == epoch:  # else new_epoch() came meanwhile: these are history
                lost = self._batcher.put_back(entries, carry)
                if lost:
                    self._buffer_overflowed(lost)
            raise
        finally:
            self._inflight = False
        if snapshot is not None:
            self.num_snapshots += 1
        if results[-1]:
            logger.info("publisher %s: a consumer asked for a snapshot", self.worker_id)
            self.request_snapshot()
        if fields:
            if minid is not None and maxlen is not None:
                capped = results[-2]
                if capped and not self.num_capped_trims:
                    logger.warning(
                        "publisher %s: the stream reached maxlen (%d entries) within retain_s "
                        "(%.0f s): a consumer that falls further behind must resynchronise",
                        self.worker_id,
                        maxlen,
                        self.config.retain_s,
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
        retain_s = self.config.retain_s
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
            self.worker_id,
            exc,
        )
        await self._redis.delete(self._stream_key)
        self.epoch = new_epoch()
        self._last_stream_id = "0-0"
        self._need_snapshot = True
        self.num_stream_resets += 1

    async def _flush_step(self) -> None:
        try:
            await self._flush_once()
        except ResponseError as exc:
            if _STREAM_EXHAUSTED not in str(exc):
                raise
            await self._replace_stream(exc)  # the next round writes the snapshot

    async def _run_flusher(self) -> None:
        linger_s = self.config.linger_s
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
            if not await self._backoff.step(self._flush_step):
                self._wakeup.set()
                continue
            if self._dropped_in_outage:
                logger.warning(
                    "publisher %s: %d events were dropped while Redis refused writes",
                    self.worker_id,
                    self._dropped_in_outage,
                )
                self._dropped_in_outage = 0
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
            fmt=self.config.fmt,
            heartbeat_ttl_s=self.config.heartbeat_ttl_s,
        )
        return json.dumps(entry, sort_keys=True)

    async def _heartbeat_once(self) -> None:
        try:
            requested, has_snapshot = await self._write_heartbeat()
        except REDIS_ERRORS:
            self.registered = False
            raise
        if not self.registered:
            logger.info("publisher %s: registered in Redis", self.worker_id)
            self.registered = True
        if requested or not has_snapshot:
            if requested:
                logger.info("publisher %s: a consumer asked for a snapshot", self.worker_id)
            self.request_snapshot()

    async def _write_heartbeat(self) -> tuple[Any, Any]:
        """The registry entry and heartbeat key; (a consumer's snapshot request, whether our
        snapshot exists)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hset(keys.WORKERS_KEY, self.worker_id, self._registry_json())
            # "<epoch> <last event id received>": a consumer that has not applied that id
            # within its stale_after_s reports this worker stale (its index is behind).
            pipe.set(
                keys.alive_key(self.worker_id),
                f"{self.epoch} {self._last_seq}",
                px=int(self.config.heartbeat_ttl_s * 1000),
            )
            pipe.getdel(keys.snapshot_request_key(self.worker_id))
            pipe.exists(keys.snapshot_key(self.worker_id))
            _, _, requested, has_snapshot = await pipe.execute()
        return requested, has_snapshot

    async def _run_heartbeat(self) -> None:
        interval_s = self.config.heartbeat_interval_s
        await self._every(interval_s, self._heartbeat_once, "heartbeat", first=False)

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
            ttl_s = max(self.config.load_interval_s * 3, self.config.heartbeat_ttl_s)
            pipe.pexpire(key, int(ttl_s * 1000))
            await pipe.execute()

    async def _run_load(self) -> None:
        await self._every(self.config.load_interval_s, self._load_once, "load update")
