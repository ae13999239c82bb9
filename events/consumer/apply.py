"""Applying stream entries to the index (``Applier``), and counting the ones it refuses.

Per worker the consumer keeps the epoch, the last event id applied (``last_seq``), the id of
the snapshot it started from and its position in the stream. For each entry, in stream order:

* malformed or larger than ``max_entry_bytes``: counted (``malformed``, ``oversized``), logged
  once, skipped (after an oversized one the freed heap is handed back with glibc's
  ``malloc_trim``: Redis cannot tell an entry's size before sending it);
* an older epoch: a leftover of an earlier start, skipped (``stale_entries``);
* ``seq_last <= last_seq``: already applied, or covered by the snapshot, skipped;
* a newer epoch, ``seq_first > last_seq + 1`` (a gap: events lost, or entries trimmed away by
  ``MAXLEN`` before they were read), or ``dropped > 0`` not covered by the snapshot:
  **resynchronise** (``events.consumer.resync``);
* else apply its events with ids above ``last_seq``; an event the index refuses (a cache level
  it does not know) makes the entry malformed: skipped whole if nothing of it was applied yet,
  else the worker is resynchronised. The ``on_entry`` hook (an ``EntryHook``) then sees it.

Entries are applied one at a time until ``step_budget_s`` has passed (the loop then gives the
event loop back), with the cyclic garbage collector paused meanwhile unless ``pause_gc`` is
off: decoding makes many short-lived objects. The index is consistent between entries, so its
readers see a whole entry or none.
"""

from __future__ import annotations

import ctypes
import gc
import time
from collections.abc import Callable, Iterable
from typing import Final

from cache import KVCacheEvent, RemovedData, StoredData
from events.consumer.config import ConsumerConfig
from events.consumer.resync import Resyncer
from events.consumer.state import Counters, WorkerState, entry_key, entry_ms
from events.envelope import Envelope, decode_envelope
from events.errors import EnvelopeError, EventsError, OversizedEntryError
from events.index import PrefixIndex

__all__ = ["Applier", "EntryHook"]

# Called after each applied entry: (worker, envelope, the events applied, their block count).
EntryHook = Callable[[str, Envelope, list[KVCacheEvent], int], None]


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


class Applier:
    """Applies one worker's entries to the index; see the module docstring."""

    def __init__(
        self,
        index: PrefixIndex,
        config: ConsumerConfig,
        counters: Counters,
        resync: Resyncer,
        on_entry: EntryHook | None,
    ) -> None:
        self._index = index
        self._config = config
        self._counters = counters
        self._resync = resync
        self.on_entry = on_entry
        self.oversized_read = False  # an oversized entry was read since release_memory()

    def apply(
        self, state: WorkerState, entries: list[tuple[bytes, dict[bytes, bytes]]], start: int
    ) -> int:
        """Apply ``entries[start:]`` until ``step_budget_s`` has passed; the next index."""
        # Decoding makes thousands of short-lived objects per entry, all freed by reference
        # counting: the cyclic collector's passes meanwhile are pure cost (about a fifth of
        # the time). Nothing awaits in between, so nothing else runs while it is paused.
        pause_gc = self._config.pause_gc and gc.isenabled()
        if pause_gc:
            gc.disable()
        try:
            deadline = time.perf_counter() + self._config.step_budget_s
            end = start
            while end < len(entries) and state.synced:
                entry_id, fields = entries[end]
                self._apply_entry(state, entry_id, fields)
                end += 1
                if end < len(entries) and time.perf_counter() >= deadline:
                    self._counters.num_yields += 1
                    break
            return end if state.synced else len(entries)
        finally:
            if pause_gc:
                gc.enable()

    def release_memory(self) -> None:
        """After a read that held an oversized entry (dropped by now): Python freed it, but
        glibc keeps the freed heap; hand it back."""
        self.oversized_read = False
        if _malloc_trim is not None:
            _malloc_trim(0)
            self._counters.num_memory_releases += 1

    def _apply_entry(self, state: WorkerState, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        """Apply one entry of ``state``'s stream, skip it, or resynchronise the worker."""
        counters = self._counters
        resync = self._resync
        worker_id = state.worker
        try:
            envelope = decode_envelope(fields, max_entry_bytes=self._config.max_entry_bytes)
            if envelope.worker != worker_id:
                raise EnvelopeError(f"worker: {envelope.worker!r} in the stream of {worker_id!r}")
        except EnvelopeError as exc:
            state.pos = entry_id
            oversized = isinstance(exc, OversizedEntryError)
            self.oversized_read |= oversized
            counters.count_malformed(state, entry_id, exc, oversized=oversized)
            return
        if envelope.epoch != state.epoch:
            if envelope.epoch < state.epoch:
                state.pos = entry_id
                counters.num_stale_entries += 1
                return
            resync.resync_at(state, entry_id, envelope, "epoch")
            return
        if envelope.seq_last <= state.last_seq:
            state.pos = entry_id
            counters.num_skipped_entries += 1
            return
        # Events were lost before this entry, and no snapshot we loaded covers them.
        if envelope.dropped and envelope.seq_first - 1 > state.snapshot_seq:
            resync.resync_at(state, entry_id, envelope, "dropped")
            return
        if envelope.seq_first > state.last_seq + 1:
            resync.resync_at(state, entry_id, envelope, "gap")
            return
        state.pos = entry_id
        try:
            events = envelope.events()
        except EnvelopeError as exc:
            counters.count_malformed(state, entry_id, exc)
            return
        last = state.last_seq
        if events and events[0].event_id <= last:
            events = [event for event in events if event.event_id > last]
        apply_event = self._index.apply_event
        num_applied = 0
        try:
            for event in events:
                apply_event(worker_id, event)
                num_applied += 1
        except EventsError as exc:
            # The index refused an event (InvalidEventError), before changing anything.
            counters.count_malformed(state, entry_id, EnvelopeError(f"data: refused: {exc}"))
            if not num_applied:
                # Nothing of the entry reached the index: skipped whole, like an entry
                # that does not decode (last_seq stays, so an honest entry with the same
                # ids is still applied).
                return
            # Part of it did: what the index holds for this worker is now incomplete.
            resync.schedule(state, "bad_event", stale=True)
            return
        blocks = _block_count(events)
        state.last_seq = envelope.seq_last
        state.applied_since_resync += 1
        state.retry_delay = 0.0
        state.entries += 1
        state.events += len(events)
        state.blocks += blocks
        counters.num_entries += 1
        counters.num_events += len(events)
        counters.num_blocks += blocks
        counters.apply_lag_ms = max(time.time() * 1000 - entry_ms(entry_id), 0.0)
        if state.suspect is not None and entry_key(entry_id) > state.suspect.position:
            state.suspect = None  # got past it
        if self.on_entry is not None:
            self.on_entry(worker_id, envelope, events, blocks)
