"""kvmesh KV event wire format, Redis Streams transport and cluster prefix index.

`events.index.PrefixIndex` is pure; the transport modules (keys, envelope, batching, redis_io,
publisher, consumer) talk to Redis. Every error raised about the data read is an
`EventsError` (`events.errors`). Nothing here imports `app`.
"""

from events.errors import (
    EnvelopeError,
    EventCodecError,
    EventsError,
    InvalidEventError,
    InvalidWorkerIdError,
    OversizedEntryError,
    SnapshotError,
)
from events.index import PrefixIndex

__all__ = [
    "EnvelopeError",
    "EventCodecError",
    "EventsError",
    "InvalidEventError",
    "InvalidWorkerIdError",
    "OversizedEntryError",
    "PrefixIndex",
    "SnapshotError",
]
