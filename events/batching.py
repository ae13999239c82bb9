"""``EventBatcher``: the publisher's bounded buffer, from the worker's batches to stream entries.

Synchronous and without I/O: the publisher owns the clock, Redis and the snapshot, and the
batcher is tested on its own.

In: ``add(events, ts_us=..., dropped=n)`` appends one batch as the worker handed it over (not
copied), stamped with the time it was received; ``dropped`` counts events lost just before it.
``add_dropped(n)`` records a loss with nothing after it yet: it rides on the next batch (or on
a marker, if the buffer is flushed first). The buffer is bounded in blocks (a stored event
weighs its blocks, a removal its hashes, any other event 1): past ``max_buffer_blocks``, whole
batches are dropped, oldest first, and the first batch left (or the carried loss) says how
many events went.

Out: ``take_entries()`` empties the buffer into entries, in order: consecutive batches share an
entry while it stays within ``max_entry_blocks``; a batch that follows a loss always starts
one, so that the loss is reported where it happened. ``encode()`` turns entries into envelope
fields, splitting an entry in halves while it is over ``max_entry_bytes``; a single event too
large for any consumer is dropped openly (counted, and carried onto what follows), and a loss
left with nothing after it becomes a *marker* (an entry with no events). A failed write gives
its entries back with ``put_back``, at the front, in order.

``num_dropped`` counts the events the batcher itself lost (overflow, oversized); the methods
that can lose events return how many, so that the publisher asks for a snapshot.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from cache import KVCacheEvent, RemovedData, StoredData
from events.envelope import DEFAULT_MAX_ENTRY_BYTES, FMT_MSGPACK, make_envelope

__all__ = ["Batch", "EncodedEntries", "Entry", "EventBatcher", "Fields", "event_weight"]

logger = logging.getLogger(__name__)

# Room for the envelope's other fields next to ``data`` when sizing an entry.
ENVELOPE_OVERHEAD: Final = 256

# One stream entry's fields, as ``XADD`` takes them.
Fields = dict[str, bytes | str | int]


def event_weight(events: Sequence[KVCacheEvent]) -> int:
    """Blocks an event batch carries (stored blocks, removed hashes; 1 for other events)."""
    total = 0
    for event in events:
        data = event.data
        if type(data) is StoredData:
            total += len(data.rows()) or 1  # not ``blocks``, which would make block objects
        elif type(data) is RemovedData:
            total += len(data.block_hashes) or 1
        else:
            total += 1
    return total


@dataclass(slots=True)
class Batch:
    """One ``add``: the events as the worker handed them over."""

    events: Sequence[KVCacheEvent]
    ts_us: int
    weight: int
    # Events lost just before this batch (a new stream entry starts here when non-zero).
    dropped: int = 0


@dataclass(slots=True)
class Entry:
    """Consecutive batches that go into one stream entry (before any split by bytes)."""

    events: list[KVCacheEvent]
    ts_us: int  # of its oldest batch
    dropped: int
    weight: int


@dataclass(frozen=True, slots=True)
class EncodedEntries:
    """What ``encode`` made: the fields of each stream entry, in order, and how many events
    were dropped because one alone was over ``max_entry_bytes``."""

    fields: list[Fields]
    num_oversized: int


class EventBatcher:
    """The publisher's buffer of one worker's event batches; see the module docstring."""

    __slots__ = (
        "_buffer",
        "buffered_blocks",
        "carry_dropped",
        "fmt",
        "max_buffer_blocks",
        "max_entry_blocks",
        "max_entry_bytes",
        "num_dropped",
        "worker_id",
    )

    def __init__(
        self,
        worker_id: str,
        *,
        fmt: str = FMT_MSGPACK,
        max_entry_blocks: int = 4_096,
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
        max_buffer_blocks: int = 1_000_000,
    ) -> None:
        self.worker_id = worker_id
        self.fmt = fmt
        self.max_entry_blocks = max_entry_blocks
        self.max_entry_bytes = max_entry_bytes
        self.max_buffer_blocks = max_buffer_blocks
        self._buffer: deque[Batch] = deque()
        self.buffered_blocks = 0
        self.carry_dropped = 0  # lost events with no batch after them yet
        self.num_dropped = 0  # events lost here: buffer overflow, over max_entry_bytes

    # -- what is buffered ----------------------------------------------------------------------

    @property
    def num_batches(self) -> int:
        return len(self._buffer)

    @property
    def num_events(self) -> int:
        return sum(len(batch.events) for batch in self._buffer)

    @property
    def is_full(self) -> bool:
        """An entry's worth of blocks is waiting: no reason to linger for more."""
        return self.buffered_blocks >= self.max_entry_blocks

    @property
    def is_empty(self) -> bool:
        """Nothing to write: no batch, and no loss to report."""
        return not self._buffer and not self.carry_dropped

    def batches(self) -> list[Batch]:
        """The buffered batches, oldest first (a copy of the list, not of the batches)."""
        return list(self._buffer)

    def first_event_id(self) -> int | None:
        """Id of the oldest buffered event (None when no batch is buffered)."""
        return self._buffer[0].events[0].event_id if self._buffer else None

    # -- in ------------------------------------------------------------------------------------

    def add(self, events: Sequence[KVCacheEvent], *, ts_us: int, dropped: int = 0) -> int:
        """Buffer a non-empty batch; ``dropped``: events lost just before it. Returns the loss
        that staying within ``max_buffer_blocks`` made: the events of the batches dropped, and
        the losses they carried (0 mostly)."""
        weight = event_weight(events)
        self._buffer.append(Batch(events, ts_us, weight, dropped + self.carry_dropped))
        self.carry_dropped = 0
        self.buffered_blocks += weight
        if self.buffered_blocks > self.max_buffer_blocks:
            return self._drop_oldest()
        return 0

    def add_dropped(self, dropped: int) -> None:
        """Events were lost with no batch after them yet: the next batch or a marker says so."""
        self.carry_dropped += dropped

    def clear(self) -> None:
        """Forget everything buffered, losses included (the worker starts a new epoch)."""
        self._buffer.clear()
        self.buffered_blocks = 0
        self.carry_dropped = 0

    def _drop_oldest(self) -> int:
        """Drop whole batches, oldest first, until the buffer is within its bound; the loss
        (events dropped, and the losses they carried) moves to the first batch left, and is
        returned."""
        lost = 0
        while self._buffer and self.buffered_blocks > self.max_buffer_blocks:
            batch = self._buffer.popleft()
            self.buffered_blocks -= batch.weight
            lost += len(batch.events) + batch.dropped
            self.num_dropped += len(batch.events)
        if lost:
            if self._buffer:
                self._buffer[0].dropped += lost
            else:
                self.carry_dropped += lost
        return lost

    # -- out -----------------------------------------------------------------------------------

    def take_entries(self) -> list[Entry]:
        """Empty the buffer into entries (a new one at a loss, or when the next batch would
        take it over ``max_entry_blocks``). The carried loss stays: see ``take_carry``."""
        entries: list[Entry] = []
        current: Entry | None = None
        buffer = self._buffer
        max_blocks = self.max_entry_blocks
        while buffer:
            batch = buffer.popleft()
            if current is None or batch.dropped or current.weight + batch.weight > max_blocks:
                current = Entry(list(batch.events), batch.ts_us, batch.dropped, batch.weight)
                entries.append(current)
            else:
                current.events.extend(batch.events)
                current.weight += batch.weight
        self.buffered_blocks = 0
        return entries

    def take_carry(self) -> int:
        """The loss with no batch after it (a marker reports it); it is forgotten here."""
        carry, self.carry_dropped = self.carry_dropped, 0
        return carry

    def put_back(self, entries: Sequence[Entry], carry: int) -> int:
        """A failed write: ``entries`` go back to the front of the buffer, in order, and the
        loss ``carry`` with them. Returns the loss that staying within the bound made, as
        ``add`` does."""
        for entry in reversed(entries):
            self._buffer.appendleft(Batch(entry.events, entry.ts_us, entry.weight, entry.dropped))
            self.buffered_blocks += entry.weight
        self.carry_dropped += carry
        if self.carry_dropped and self._buffer:
            self._buffer[0].dropped += self.carry_dropped
            self.carry_dropped = 0
        if self.buffered_blocks > self.max_buffer_blocks:
            return self._drop_oldest()
        return 0

    def encode(
        self, entries: Sequence[Entry], epoch: int, *, carry: int = 0, next_seq: int = 0
    ) -> EncodedEntries:
        """Envelope fields for ``entries`` in ``epoch``; ``carry``: a loss after the last of
        them, reported with a marker numbered ``next_seq`` (the id the next event will have),
        as is a loss that an oversized last event leaves."""
        fields: list[Fields] = []
        lost = 0
        before = self.num_dropped
        for entry in entries:
            lost = self._encode(fields, entry.events, epoch, entry.ts_us, entry.dropped + lost)
        if carry + lost:
            marker = make_envelope(
                self.worker_id, epoch, [], dropped=carry + lost, fmt=self.fmt, next_seq=next_seq
            )
            fields.append(marker.fields())
        return EncodedEntries(fields, self.num_dropped - before)

    def _encode(
        self, out: list[Fields], events: list[KVCacheEvent], epoch: int, ts_us: int, dropped: int
    ) -> int:
        """Append the fields for ``events`` to ``out``, split in halves while over
        ``max_entry_bytes``; returns the lost events to carry onto what follows: an event that
        alone is too large for any consumer is dropped openly (the next entry says so, and a
        snapshot follows) rather than written and refused everywhere."""
        envelope = make_envelope(
            self.worker_id, epoch, events, dropped=dropped, fmt=self.fmt, ts_us=ts_us
        )
        if len(envelope.data) + ENVELOPE_OVERHEAD <= self.max_entry_bytes:
            out.append(envelope.fields())
            return 0
        if len(events) == 1:
            logger.error(
                "publisher %s: event %d is %d bytes encoded, over max_entry_bytes; dropped",
                self.worker_id,
                events[0].event_id,
                len(envelope.data),
            )
            self.num_dropped += 1
            return dropped + 1
        half = len(events) // 2
        lost = self._encode(out, events[:half], epoch, ts_us, dropped)
        return self._encode(out, events[half:], epoch, ts_us, lost)
