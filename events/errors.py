"""The errors ``events/`` raises about what it is given to read: one tree, one root to catch.

Errors::

    EventsError                 data that events/ cannot take; nothing was changed by it
    ├── EventCodecError         bytes that are not an event batch in ``events.codec``'s format
    ├── EnvelopeError           a stream entry that is not a valid envelope (names the field)
    │   └── OversizedEntryError an entry over the reader's ``max_entry_bytes``
    ├── SnapshotError           bytes that are not a snapshot (names the field)
    ├── InvalidEventError       an event the prefix index refuses (a bad hash, cache level, chain)
    └── InvalidWorkerIdError    a worker id that cannot name a worker's Redis keys

Every one of them is also a ``ValueError``, as each was before this tree: code that catches
``ValueError`` around a decode or an ``apply_event`` keeps working. The consumer catches
``EventsError``: whatever a stream entry, a snapshot or the registry holds, it is counted and
skipped, never a crash. Arguments out of range (a non-positive limit, an unknown format) are
the caller's bug, not data, and raise a plain ``ValueError``.
"""

from __future__ import annotations

__all__ = [
    "EnvelopeError",
    "EventCodecError",
    "EventsError",
    "InvalidEventError",
    "InvalidWorkerIdError",
    "OversizedEntryError",
    "SnapshotError",
]


class EventsError(Exception):
    """Base class of every error ``events/`` raises about the data it reads."""


class EventCodecError(EventsError, ValueError):
    """The bytes are not an event batch in ``events.codec``'s format."""


class EnvelopeError(EventsError, ValueError):
    """A stream entry that is not a valid envelope (the message names the field)."""


class OversizedEntryError(EnvelopeError):
    """A stream entry larger than the reader accepts (refused before it is parsed)."""


class SnapshotError(EventsError, ValueError):
    """Bytes that are not a snapshot in this format."""


class InvalidEventError(EventsError, ValueError):
    """An event the prefix index refuses; it changed nothing."""


class InvalidWorkerIdError(EventsError, ValueError):
    """A worker id that cannot name a worker's keys (empty, too long, braces, whitespace)."""
