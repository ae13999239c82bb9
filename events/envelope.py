"""The envelope around one batch of KV events: one Redis stream entry.

A stream entry is a flat map of fields (all stored by Redis as strings)::

    v          format version (1)
    worker     the worker id
    epoch      an id that changes on every worker (re)start (an unsigned 64-bit integer)
    seq_first  event id of the first event inside
    seq_last   event id of the last event inside
    dropped    events lost since the previous entry of this epoch (by the manager's bounded
               queue or the publisher's buffer); non-zero means consumers must resynchronise
    fmt        "msgpack" (``events.codec``) or "json" (TensorRT-LLM's ``to_dict`` shapes)
    ts         optional: microseconds since the Unix epoch when the publisher received the
               oldest batch inside (for latency measurements; 0 or absent when unknown)
    data       the encoded batch

An entry may hold no events: a *marker* that only says ``dropped``. Its range is empty,
``seq_last == seq_first - 1``, and ``seq_first`` is the id the next event will have.

Event ids inside an entry increase strictly, from ``seq_first`` to ``seq_last``. 64-bit hashes
survive both formats exactly (msgpack uint64; JSON integers are exact in Python).

Errors (``events.errors``; both are ``EventsError`` and ``ValueError``)::

    EnvelopeError              a malformed entry; the message names the field
    └── OversizedEntryError    an entry over the reader's ``max_entry_bytes``
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Final

from cache import KVCacheEvent
from events.codec import decode_events, encode_events
from events.errors import EnvelopeError, EventCodecError, InvalidWorkerIdError, OversizedEntryError
from events.keys import validate_worker_id

__all__ = [
    "DEFAULT_MAX_ENTRY_BYTES",
    "FMT_JSON",
    "FMT_MSGPACK",
    "FORMAT_VERSION",
    "Envelope",
    "EnvelopeError",
    "OversizedEntryError",
    "decode_envelope",
    "make_envelope",
]

FORMAT_VERSION: Final = 1
FMT_MSGPACK: Final = "msgpack"
FMT_JSON: Final = "json"
FORMATS: Final = (FMT_MSGPACK, FMT_JSON)
DEFAULT_MAX_ENTRY_BYTES: Final = 8 * 1024 * 1024
_MAX_U64: Final = 2**64 - 1

_FIELDS: Final = ("v", "worker", "epoch", "seq_first", "seq_last", "dropped", "fmt", "data")
_BYTE_FIELDS: Final = {name.encode(): name for name in (*_FIELDS, "ts")}


@dataclass(frozen=True, slots=True)
class Envelope:
    """One stream entry; ``data`` stays encoded until ``events()`` is called."""

    worker: str
    epoch: int
    seq_first: int
    seq_last: int
    dropped: int
    fmt: str
    data: bytes
    ts_us: int = 0
    v: int = FORMAT_VERSION

    @property
    def is_marker(self) -> bool:
        """True for an entry that carries no events (only ``dropped``)."""
        return self.seq_last < self.seq_first

    def fields(self) -> dict[str, bytes | str | int]:
        """The fields to ``XADD`` (the field order is the documented one)."""
        out: dict[str, bytes | str | int] = {
            "v": self.v,
            "worker": self.worker,
            "epoch": self.epoch,
            "seq_first": self.seq_first,
            "seq_last": self.seq_last,
            "dropped": self.dropped,
            "fmt": self.fmt,
        }
        if self.ts_us:
            out["ts"] = self.ts_us
        out["data"] = self.data
        return out

    def events(self) -> list[KVCacheEvent]:
        """Decode ``data``; raises ``EnvelopeError`` naming ``data`` when it is malformed or
        when the event ids inside do not run from ``seq_first`` to ``seq_last``."""
        try:
            if self.fmt == FMT_MSGPACK:
                events = decode_events(self.data)
            else:
                events = _decode_json(self.data)
        except EnvelopeError:
            raise
        except (EventCodecError, ValueError, TypeError, OverflowError, RecursionError) as exc:
            # Whatever the bytes hold, a bad batch is one EnvelopeError: counted, not a crash.
            raise EnvelopeError(f"data: {exc}") from exc
        if not events:
            if not self.is_marker:
                raise EnvelopeError(
                    f"data: no events, but seq_first..seq_last is {self.seq_first}..{self.seq_last}"
                )
            return events
        ids = [event.event_id for event in events]
        if ids[0] != self.seq_first or ids[-1] != self.seq_last:
            raise EnvelopeError(
                f"data: event ids run {ids[0]}..{ids[-1]}, "
                f"but seq_first..seq_last is {self.seq_first}..{self.seq_last}"
            )
        if any(a >= b for a, b in pairwise(ids)):
            raise EnvelopeError("data: event ids do not increase strictly")
        return events


def _refuse_constant(name: str) -> Any:
    raise EnvelopeError(f"data: {name} is not a valid value in an event")


def _refuse_float(text: str) -> Any:
    # Every number in an event is an integer (ids, hashes, tokens, levels); int() of a float
    # would silently truncate a hash, and of 1e400 (inf) raise OverflowError.
    raise EnvelopeError(f"data: {text[:40]} is not an integer")


def _decode_json(data: bytes) -> list[KVCacheEvent]:
    try:
        raw = json.loads(data, parse_constant=_refuse_constant, parse_float=_refuse_float)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EnvelopeError(f"data: not a JSON document ({exc})") from exc
    except RecursionError:
        # json's C scanner recurses once per nesting level: 100k ``[`` exhaust the stack.
        raise EnvelopeError("data: JSON nested too deeply") from None
    if not isinstance(raw, list):
        raise EnvelopeError(f"data: expected a JSON list of events, got {type(raw).__name__}")
    out: list[KVCacheEvent] = []
    for i, item in enumerate(raw):
        if not item:  # TensorRT-LLM serialises a missing event as {}
            continue
        if not isinstance(item, dict):
            raise EnvelopeError(f"data: event {i} is a {type(item).__name__}, not an object")
        try:
            out.append(KVCacheEvent.from_dict(item))
        except (ValueError, AttributeError, TypeError, OverflowError, RecursionError) as exc:
            raise EnvelopeError(f"data: event {i}: {exc}") from exc
    return out


def _encode_json(events: Sequence[KVCacheEvent]) -> bytes:
    return json.dumps([event.to_dict() for event in events], separators=(",", ":")).encode()


def make_envelope(
    worker: str,
    epoch: int,
    events: Sequence[KVCacheEvent],
    *,
    dropped: int = 0,
    fmt: str = FMT_MSGPACK,
    ts_us: int = 0,
    next_seq: int | None = None,
) -> Envelope:
    """Encode ``events`` into an envelope. A marker (no events) needs ``next_seq``, the id the
    next event will have; it becomes ``seq_first`` (and ``seq_last`` is one less)."""
    validate_worker_id(worker)
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if not 0 <= epoch <= _MAX_U64:
        raise ValueError(f"epoch must be an unsigned 64-bit integer, got {epoch}")
    if dropped < 0:
        raise ValueError(f"dropped must be >= 0, got {dropped}")
    if events:
        seq_first, seq_last = events[0].event_id, events[-1].event_id
    elif next_seq is None:
        raise ValueError("an envelope without events needs next_seq")
    else:
        seq_first, seq_last = next_seq, next_seq - 1
    data = encode_events(events) if fmt == FMT_MSGPACK else _encode_json(events)
    return Envelope(worker, epoch, seq_first, seq_last, dropped, fmt, data, ts_us)


# -- decoding --------------------------------------------------------------------------------


def _text(value: bytes | str, name: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return value.decode()
    except UnicodeDecodeError as exc:
        raise EnvelopeError(f"{name}: not UTF-8 text") from exc


def _uint(value: bytes | str, name: str, *, minimum: int = 0) -> int:
    try:
        number = int(value)
    except ValueError:
        raise EnvelopeError(f"{name}: not an integer: {value[:40]!r}") from None
    if not minimum <= number <= _MAX_U64:
        raise EnvelopeError(f"{name}: {number} is out of range")
    return number


def decode_envelope(
    fields: Mapping[bytes, bytes] | Mapping[str, Any],
    *,
    max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
) -> Envelope:
    """Read an envelope from a stream entry's fields (as redis-py returns them, bytes or str).

    Raises ``EnvelopeError`` naming the first bad field; an entry whose fields and values
    total more than ``max_entry_bytes`` bytes is refused as oversized before anything else.
    The events inside are decoded later, by ``Envelope.events()``.
    """
    got: dict[str, bytes | str] = {}
    size = 0
    for key, value in fields.items():
        name = _BYTE_FIELDS.get(key) if isinstance(key, bytes) else key
        if not isinstance(value, bytes | str):
            raise EnvelopeError(f"{name or key!r}: expected bytes, got {type(value).__name__}")
        size += len(key) + len(value)
        if name is not None:
            got[name] = value
    if size > max_entry_bytes:
        raise OversizedEntryError(f"data: entry of {size} bytes is larger than {max_entry_bytes}")
    for name in _FIELDS:
        if name not in got:
            raise EnvelopeError(f"{name}: missing")
    v = _uint(got["v"], "v")
    if v != FORMAT_VERSION:
        raise EnvelopeError(f"v: unsupported format version {v} (this reader knows 1)")
    worker_text = _text(got["worker"], "worker")
    try:
        worker = validate_worker_id(worker_text)
    except InvalidWorkerIdError as exc:
        raise EnvelopeError(f"worker: {exc}") from exc
    fmt = _text(got["fmt"], "fmt")
    if fmt not in FORMATS:
        raise EnvelopeError(f"fmt: unknown format {fmt[:40]!r}")
    seq_first = _uint(got["seq_first"], "seq_first")
    seq_last = _uint(got["seq_last"], "seq_last", minimum=-1)
    if seq_last < seq_first - 1:
        raise EnvelopeError(f"seq_last: {seq_last} is before seq_first {seq_first}")
    data = got["data"]
    return Envelope(
        worker=worker,
        epoch=_uint(got["epoch"], "epoch"),
        seq_first=seq_first,
        seq_last=seq_last,
        dropped=_uint(got["dropped"], "dropped"),
        fmt=fmt,
        data=data if isinstance(data, bytes) else data.encode(),
        ts_us=_uint(got["ts"], "ts") if "ts" in got else 0,
        v=v,
    )
