"""Snapshots: a worker's whole reuse tree as replayable ``stored`` events.

A consumer that missed events (a gap, a new epoch, a trimmed stream, a Redis restart) forgets
what it knew about the worker, replays the worker's snapshot and then reads the stream after
it. A snapshot therefore says where it stands:

* ``event_id`` -- every event with an id up to and including it is reflected, none after it
  (for a manager: ``mgr.last_event_id``; -1 before the first event);
* ``epoch`` -- the worker start it belongs to;
* ``stream_id`` -- the id of the last stream entry written before the snapshot; the entries
  to apply come after it (those still holding ids ``<= event_id`` are skipped).

``manager_snapshot(mgr)`` builds one from a ``KVCacheManager``: per window (ascending), the
tree's blocks parents before children, one ``stored`` event per chain (a block's first child
continues its chain, other children start a new event whose ``parent_hash`` is the block),
with cache levels and priorities. Tokens are left out unless asked for: the prefix index
needs only hashes and levels, and tokens make a snapshot several times larger.

It is stored at ``kvmesh:{<worker>}:snapshot`` as one msgpack map
(``encode_snapshot``/``decode_snapshot``); the events inside use ``events.codec``.

Errors (``events.errors``)::

    SnapshotError       bytes that are not a snapshot (the message names the field); an
                        ``EventsError`` and a ``ValueError``
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack  # type: ignore[import-untyped]

from cache import KVCacheBlock, KVCacheEvent, KVCacheManager, StoredBlock, StoredData
from events.codec import encode_events, iter_decode_events
from events.errors import EventCodecError, SnapshotError

__all__ = [
    "Snapshot",
    "SnapshotError",
    "SnapshotSource",
    "decode_snapshot",
    "decode_snapshot_lazily",
    "encode_snapshot",
    "manager_snapshot",
]

SNAPSHOT_VERSION: Final = 1
_MAX_U64: Final = 2**64 - 1


@dataclass(frozen=True, slots=True)
class Snapshot:
    events: list[KVCacheEvent]
    event_id: int
    epoch: int = 0
    stream_id: str = "0-0"
    worker: str = ""
    # Wall-clock time the snapshot was taken (microseconds since the Unix epoch; 0 unknown).
    ts_us: int = field(default=0, compare=False)

    @property
    def num_blocks(self) -> int:
        return sum(
            len(event.data.blocks) for event in self.events if isinstance(event.data, StoredData)
        )


# The publisher calls this (synchronously, on the manager's thread) when it needs a snapshot;
# it fills in epoch, stream_id and worker itself.
SnapshotSource = Callable[[], Snapshot]


def _stored_block(block: KVCacheBlock, with_tokens: bool) -> StoredBlock:
    level = 0 if block.is_primary else 1
    if not with_tokens:
        return StoredBlock(block.hash, (), None, level, block.priority)
    key = block.key
    return StoredBlock(
        block.hash,
        key.tokens,
        key.extra_ids,
        level,
        block.priority,
        key.extra_keys,
        block.cache_salt,
        key.lora_task_id,
    )


def manager_snapshot(mgr: KVCacheManager, *, with_tokens: bool = False) -> Snapshot:
    """The manager's reuse trees as stored events, valid at its last event id.

    The manager's current iteration is flushed first: a removal joins the previous event when
    that is also a removal, without taking a new id, so a removal made after the snapshot could
    otherwise land in an event whose id the snapshot already covers, and be skipped.
    Call it on the manager's thread (its single writer), between two of its operations.
    """
    mgr.flush_iteration_events()
    event_id = mgr.last_event_id
    events: list[KVCacheEvent] = []
    for window in mgr.window_sizes:
        chain_tail: KVCacheBlock | None = None
        parent_hash: int | None = None
        blocks: list[StoredBlock] = []
        # tree_blocks() is a pre-order walk: a block is followed by one of its children if it
        # has any, so a chain continues exactly while the next block's parent is its tail.
        for block in mgr.tree_blocks(window):
            parent = block.prev_block
            if parent is None or parent is not chain_tail:
                if blocks:
                    events.append(KVCacheEvent(event_id, StoredData(parent_hash, blocks), window))
                parent_hash = None if parent is None or parent.block_id < 0 else parent.hash
                blocks = []
            blocks.append(_stored_block(block, with_tokens))
            chain_tail = block
        if blocks:
            events.append(KVCacheEvent(event_id, StoredData(parent_hash, blocks), window))
    return Snapshot(events, event_id)


# -- wire format -----------------------------------------------------------------------------


def encode_snapshot(snapshot: Snapshot) -> bytes:
    packed: bytes = msgpack.packb(
        {
            "v": SNAPSHOT_VERSION,
            "worker": snapshot.worker,
            "epoch": snapshot.epoch,
            "event_id": snapshot.event_id,
            "stream_id": snapshot.stream_id,
            "ts": snapshot.ts_us,
            "data": encode_events(snapshot.events),
        },
        use_bin_type=True,
    )
    return packed


def _field(raw: dict[Any, Any], name: str, kind: type) -> Any:
    if name not in raw:
        raise SnapshotError(f"malformed snapshot: {name}: missing")
    value = raw[name]
    if type(value) is not kind:
        raise SnapshotError(
            f"malformed snapshot: {name}: expected {kind.__name__}, got {type(value).__name__}"
        )
    return value


def decode_snapshot(data: bytes) -> Snapshot:
    """Read back what ``encode_snapshot`` wrote; raises ``SnapshotError``."""
    raw, event_id, epoch = _unpack(data)
    events = list(_events(_field(raw, "data", bytes)))
    return _header(raw, events, event_id, epoch)


def decode_snapshot_lazily(data: bytes) -> tuple[Snapshot, Iterator[KVCacheEvent]]:
    """The snapshot's header (``events`` left empty) and its events, decoded as they are
    iterated (a large snapshot takes a while: its reader can give the event loop back between
    events). Errors in the header raise at once, errors in an event when it is reached; both
    are ``SnapshotError``."""
    raw, event_id, epoch = _unpack(data)
    events = _events(_field(raw, "data", bytes))
    return _header(raw, [], event_id, epoch), events


def _unpack(data: bytes) -> tuple[dict[Any, Any], int, int]:
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise SnapshotError(f"malformed snapshot: not a msgpack document ({exc})") from exc
    if type(raw) is not dict:
        raise SnapshotError(f"malformed snapshot: expected a map, got {type(raw).__name__}")
    version = _field(raw, "v", int)
    if version != SNAPSHOT_VERSION:
        raise SnapshotError(f"malformed snapshot: v: unsupported version {version}")
    epoch = _field(raw, "epoch", int)
    if not 0 <= epoch <= _MAX_U64:
        raise SnapshotError(f"malformed snapshot: epoch: {epoch} is out of range")
    event_id = _field(raw, "event_id", int)
    if event_id < -1:
        raise SnapshotError(f"malformed snapshot: event_id: {event_id} is out of range")
    return raw, event_id, epoch


def _header(raw: dict[Any, Any], events: list[KVCacheEvent], event_id: int, epoch: int) -> Snapshot:
    return Snapshot(
        events=events,
        event_id=event_id,
        epoch=epoch,
        stream_id=_field(raw, "stream_id", str),
        worker=_field(raw, "worker", str),
        ts_us=_field(raw, "ts", int),
    )


def _events(data: bytes) -> Iterator[KVCacheEvent]:
    try:
        yield from iter_decode_events(data)
    except EventCodecError as exc:
        raise SnapshotError(f"malformed snapshot: data: {exc}") from exc
