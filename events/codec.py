"""Compact msgpack wire format for batches of ``cache.KVCacheEvent``.

``encode_events(events)`` packs a list of events into one msgpack array; ``decode_events(data)``
reads it back into equal events (``to_dict()`` of each is unchanged). Every event is a short
array, its payload depending on the type code::

    created  [event_id, window_size, 0, num_blocks_per_cache_level]
    stored   [event_id, window_size, 1, parent_hash or nil, [block, ...]]
    removed  [event_id, window_size, 2, [block_hash, ...]]
    updated  [event_id, window_size, 3, block_hash, [old, new] or nil, [old, new] or nil]

where the two diffs of ``updated`` are the cache level and the priority, and a stored block is::

    [block_hash, [token, ...], [extra_id, ...] or nil, cache_level, priority,
     [[mm_hash (bin or str), start_offset], ...], cache_salt or nil, lora_id or nil]

An event whose ``attention_dp_rank`` is set carries it as one more, last element. Block hashes
are unsigned 64-bit integers and travel as msgpack uint64, so every value up to 2**64 - 1
round-trips exactly. Encoding hands the token tuples of ``StoredBlock`` to the packer as they
are (ormsgpack, which writes msgpack's own bytes); decoding asks msgpack for tuples, so no
Python code runs per token beyond one C-level type check per stored event, and the blocks of
the shape workers send are checked by column, not one by one.

Malformed input (bytes that are not msgpack, or msgpack of the wrong shape) raises
``EventCodecError`` (``events.errors``: an ``EventsError`` and a ``ValueError``) that says what is
wrong and where.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain
from typing import Any, Final

import msgpack  # type: ignore[import-untyped]
import ormsgpack

from cache import (
    CreatedData,
    EventDiff,
    KVCacheEvent,
    RemovedData,
    StoredBlock,
    StoredData,
    UpdatedData,
)
from events.errors import EventCodecError

__all__ = [
    "TYPE_CREATED",
    "TYPE_REMOVED",
    "TYPE_STORED",
    "TYPE_UPDATED",
    "EventCodecError",
    "decode_events",
    "encode_events",
    "iter_decode_events",
]

TYPE_CREATED: Final = 0
TYPE_STORED: Final = 1
TYPE_REMOVED: Final = 2
TYPE_UPDATED: Final = 3

_TYPE_NAMES: Final = {
    TYPE_CREATED: "created",
    TYPE_STORED: "stored",
    TYPE_REMOVED: "removed",
    TYPE_UPDATED: "updated",
}
# Length of each event array without the optional trailing attention_dp_rank.
_EVENT_LEN: Final = {TYPE_CREATED: 4, TYPE_STORED: 5, TYPE_REMOVED: 4, TYPE_UPDATED: 6}
_BLOCK_LEN: Final = 8
_MAX_U64: Final = 2**64 - 1
_INT_ONLY: Final = frozenset((int,))
_TUPLE_ONLY: Final = frozenset((tuple,))
_BLOCK_LENS: Final = frozenset((_BLOCK_LEN,))


# -- encoding --------------------------------------------------------------------------------


def _diff(diff: EventDiff | None) -> tuple[int, int] | None:
    return None if diff is None else (diff.old_value, diff.new_value)


def _event_array(event: KVCacheEvent) -> list[Any]:
    data = event.data
    out: list[Any]
    if isinstance(data, StoredData):
        out = [event.event_id, event.window_size, TYPE_STORED, data.parent_hash, data.rows()]
    elif isinstance(data, RemovedData):
        out = [event.event_id, event.window_size, TYPE_REMOVED, data.block_hashes]
    elif isinstance(data, UpdatedData):
        out = [
            event.event_id,
            event.window_size,
            TYPE_UPDATED,
            data.block_hash,
            _diff(data.cache_level),
            _diff(data.priority),
        ]
    elif isinstance(data, CreatedData):
        out = [event.event_id, event.window_size, TYPE_CREATED, data.num_blocks_per_cache_level]
    else:
        raise EventCodecError(f"event {event.event_id}: cannot encode event data {data!r}")
    if event.attention_dp_rank is not None:
        out.append(event.attention_dp_rank)
    return out


# ormsgpack packs the same bytes as msgpack's packb(use_bin_type=True), ~3x faster (a 128-block
# stored event: 18 against 55 µs; packing was 8 % of a worker's CPU). msgpack still decodes:
# it is the faster of the two there, and gives tuples. The types msgpack refuses and ormsgpack
# would pack (dataclasses, datetimes, UUIDs, enums) are passed to _as_msgpack_would.
_PACK_OPTIONS: Final = (
    ormsgpack.OPT_PASSTHROUGH_DATACLASS
    | ormsgpack.OPT_PASSTHROUGH_DATETIME
    | ormsgpack.OPT_PASSTHROUGH_UUID
    | ormsgpack.OPT_PASSTHROUGH_ENUM
)


def _as_msgpack_would(value: object) -> int:
    """msgpack packs an int enum as its int and refuses the other passed-through types."""
    if isinstance(value, int):
        return int(value)
    raise TypeError(f"can not serialize {type(value).__name__!r} object")


def encode_events(events: Iterable[KVCacheEvent]) -> bytes:
    """Pack ``events`` into one msgpack array (see the module docstring for the layout)."""
    arrays = [_event_array(event) for event in events]
    try:
        packed: bytes = ormsgpack.packb(arrays, default=_as_msgpack_would, option=_PACK_OPTIONS)
    except (OverflowError, TypeError, ValueError) as exc:
        # e.g. a hash outside -2**63 .. 2**64 - 1, or a token that is not an int
        raise EventCodecError(f"cannot encode KV cache events: {exc}") from exc
    return packed


# -- decoding --------------------------------------------------------------------------------


def _fail(where: str, message: str) -> EventCodecError:
    return EventCodecError(f"malformed KV event batch: {where}: {message}")


def _type_name(value: object) -> str:
    if isinstance(value, tuple):
        return "array"
    if isinstance(value, dict):
        return "map"
    return "nil" if value is None else type(value).__name__


def _int(value: object, where: str, what: str) -> int:
    if type(value) is not int:
        raise _fail(where, f"{what} must be an integer, got {_type_name(value)}")
    return value


def _hash(value: object, where: str, what: str) -> int:
    h = _int(value, where, what)
    if not 0 <= h <= _MAX_U64:
        raise _fail(where, f"{what} {h} is not an unsigned 64-bit integer")
    return h


def _opt_int(value: object, where: str, what: str) -> int | None:
    return None if value is None else _int(value, where, what)


def _array(value: object, where: str, what: str) -> tuple[Any, ...]:
    if type(value) is not tuple:
        raise _fail(where, f"{what} must be an array, got {_type_name(value)}")
    return value


def _ints(value: object, where: str, what: str) -> tuple[int, ...]:
    items = _array(value, where, what)
    if items and not set(map(type, items)) <= _INT_ONLY:
        raise _fail(where, f"{what} must be an array of integers")
    return items


def _hashes(value: object, where: str, what: str) -> list[int]:
    hashes = _ints(value, where, what)
    if hashes and (min(hashes) < 0 or max(hashes) > _MAX_U64):
        raise _fail(where, f"{what} must be unsigned 64-bit integers")
    return list(hashes)


def _shape(value: object, where: str, what: str, length: int) -> tuple[Any, ...]:
    items = _array(value, where, what)
    if len(items) != length:
        raise _fail(where, f"{what} must have {length} elements, got {len(items)}")
    return items


def _event_diff(value: object, where: str, what: str) -> EventDiff | None:
    if value is None:
        return None
    old, new = _shape(value, where, what, 2)
    return EventDiff(_int(old, where, f"{what} old value"), _int(new, where, f"{what} new value"))


def _mm_keys(value: object, where: str) -> tuple[tuple[bytes | str, int], ...]:
    keys = _array(value, where, "mm_keys")
    for key in keys:
        mm_hash, offset = _shape(key, where, "an mm key", 2)
        if not isinstance(mm_hash, bytes | str):
            raise _fail(where, f"an mm key hash must be bin or str, got {_type_name(mm_hash)}")
        _int(offset, where, "an mm key offset")
    return keys


def _stored_block(value: object, where: str) -> StoredBlock:
    fields = _array(value, where, "a stored block")
    if len(fields) != _BLOCK_LEN:
        raise _fail(where, f"a stored block must have {_BLOCK_LEN} elements, got {len(fields)}")
    block_hash, tokens, extra_ids, level, priority, mm_keys, salt, lora = fields
    # Token values are checked once per event, in bulk, by _stored_blocks.
    _array(tokens, where, "tokens")
    if extra_ids is not None:
        _ints(extra_ids, where, "extra_ids")
        if len(extra_ids) != len(tokens):
            counts = f"{len(extra_ids)} entries for {len(tokens)} tokens"
            raise _fail(where, f"extra_ids has {counts}")
    if salt is not None and type(salt) is not str:
        raise _fail(where, f"cache_salt must be a str or nil, got {_type_name(salt)}")
    return StoredBlock(
        _hash(block_hash, where, "block_hash"),
        tokens,
        extra_ids,
        _int(level, where, "cache_level"),
        _int(priority, where, "priority"),
        _mm_keys(mm_keys, where) if mm_keys else (),
        salt,
        _opt_int(lora, where, "lora_id"),
    )


def _plain_stored_blocks(raw: tuple[Any, ...]) -> list[StoredBlock] | None:
    """The blocks of the shape a worker sends (no extra ids, multimodal keys, salt or LoRA),
    checked column by column at C level; None when any block is otherwise (the caller then
    checks block by block, and names what is wrong). Tokens are checked by the caller."""
    if not raw or set(map(type, raw)) != _TUPLE_ONLY or set(map(len, raw)) != _BLOCK_LENS:
        return None
    hashes, tokens, extra_ids, levels, priorities, mm_keys, salts, loras = zip(*raw, strict=True)
    count = len(raw)
    if not (
        set(map(type, hashes)) == _INT_ONLY
        and min(hashes) >= 0
        and max(hashes) <= _MAX_U64
        and set(map(type, tokens)) == _TUPLE_ONLY
        and set(map(type, levels)) == _INT_ONLY
        and set(map(type, priorities)) == _INT_ONLY
        and extra_ids.count(None) == count
        and mm_keys.count(()) == count
        and salts.count(None) == count
        and loras.count(None) == count
    ):
        return None
    return list(
        map(StoredBlock, hashes, tokens, extra_ids, levels, priorities, mm_keys, salts, loras)
    )


def _stored_blocks(value: object, where: str) -> list[StoredBlock]:
    raw = _array(value, where, "blocks")
    blocks = _plain_stored_blocks(raw)
    if blocks is None:
        blocks = [_stored_block(b, f"{where}, block {i}") for i, b in enumerate(raw)]
    token_types = set(map(type, chain.from_iterable(b.tokens for b in blocks)))
    if not token_types <= _INT_ONLY:
        bad = sorted(t.__name__ for t in token_types - _INT_ONLY)
        raise _fail(where, f"tokens must be integers, found {', '.join(bad)}")
    return blocks


def _decode_event(index: int, value: object) -> KVCacheEvent:
    # The shapes a worker with a host tier sends most (an offload's cache-level update, a
    # removal) are recognised with a few type tests; anything else, or anything odd, takes the
    # validating path, which names what is wrong.
    if type(value) is tuple and type(value[2] if len(value) > 2 else None) is int:
        code = value[2]
        if code == TYPE_REMOVED and len(value) == 4:
            event_id, window_size, _, hashes = value
            if (
                type(event_id) is int
                and type(window_size) is int
                and type(hashes) is tuple
                and hashes
                and set(map(type, hashes)) <= _INT_ONLY
                and min(hashes) >= 0
                and max(hashes) <= _MAX_U64
            ):
                return KVCacheEvent(event_id, RemovedData(list(hashes)), window_size)
        elif code == TYPE_UPDATED and len(value) == 6:
            event_id, window_size, _, block_hash, level, priority = value
            if (
                type(event_id) is int
                and type(window_size) is int
                and type(block_hash) is int
                and 0 <= block_hash <= _MAX_U64
                and priority is None
                and type(level) is tuple
                and len(level) == 2
                and type(level[0]) is int
                and type(level[1]) is int
            ):
                diff = EventDiff(level[0], level[1])
                return KVCacheEvent(event_id, UpdatedData(block_hash, diff, None), window_size)
    return _decode_event_checked(index, value)


def _decode_event_checked(index: int, value: object) -> KVCacheEvent:
    where = f"event {index}"
    items = _array(value, where, "an event")
    if len(items) < 3:
        raise _fail(where, f"an event needs at least 3 elements, got {len(items)}")
    event_id = _int(items[0], where, "event_id")
    window_size = _int(items[1], where, "window_size")
    code = _int(items[2], where, "type code")
    length = _EVENT_LEN.get(code)
    if length is None:
        raise _fail(where, f"unknown event type code {code}")
    where = f"event {index} ({_TYPE_NAMES[code]}, id {event_id})"
    if len(items) not in (length, length + 1):
        expected = f"{length} or {length + 1}"
        raise _fail(where, f"the event must have {expected} elements, got {len(items)}")
    rank = _opt_int(items[length], where, "attention_dp_rank") if len(items) > length else None
    data: CreatedData | StoredData | RemovedData | UpdatedData
    if code == TYPE_STORED:
        parent = items[3]
        data = StoredData(
            None if parent is None else _hash(parent, where, "parent_hash"),
            _stored_blocks(items[4], where),
        )
    elif code == TYPE_REMOVED:
        data = RemovedData(_hashes(items[3], where, "block_hashes"))
    elif code == TYPE_UPDATED:
        data = UpdatedData(
            _hash(items[3], where, "block_hash"),
            _event_diff(items[4], where, "cache_level diff"),
            _event_diff(items[5], where, "priority diff"),
        )
    else:
        data = CreatedData(list(_ints(items[3], where, "num_blocks_per_cache_level")))
    return KVCacheEvent(event_id, data, window_size, rank)


def decode_events(data: bytes) -> list[KVCacheEvent]:
    """Read back what ``encode_events`` wrote; raises ``EventCodecError`` (a ``ValueError``)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise EventCodecError(f"expected bytes, got {type(data).__name__}")
    try:
        raw = msgpack.unpackb(data, use_list=False, raw=False, strict_map_key=True)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        # ValueError covers msgpack's ExtraData, FormatError, StackError and bad UTF-8.
        raise EventCodecError(
            f"malformed KV event batch: not a msgpack document ({type(exc).__name__}: {exc})"
        ) from exc
    if type(raw) is not tuple:
        raise EventCodecError(
            f"malformed KV event batch: expected an array of events, got {_type_name(raw)}"
        )
    return [_decode_event(i, item) for i, item in enumerate(raw)]


def iter_decode_events(data: bytes) -> Iterator[KVCacheEvent]:
    """``decode_events``, one event at a time: for a large batch (a snapshot) whose reader
    wants to give the event loop back between events. ``EventCodecError`` comes when the bad
    event is reached (the events before it have been yielded)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise EventCodecError(f"expected bytes, got {type(data).__name__}")
    unpacker = msgpack.Unpacker(
        use_list=False, raw=False, strict_map_key=True, max_buffer_size=max(len(data), 1)
    )
    unpacker.feed(data)
    try:
        count = unpacker.read_array_header()
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise EventCodecError(
            f"malformed KV event batch: expected an array of events ({type(exc).__name__}: {exc})"
        ) from exc
    for i in range(count):
        try:
            item = unpacker.unpack()
        except (msgpack.UnpackException, ValueError, TypeError, StopIteration) as exc:
            raise _fail(f"event {i}", f"not msgpack ({type(exc).__name__}: {exc})") from exc
        yield _decode_event(i, item)
    if unpacker.tell() != len(data):
        raise EventCodecError("malformed KV event batch: extra bytes after the events")
