"""kvmesh KV event wire format, Redis Streams transport and cluster prefix index.

`events.index.PrefixIndex` is pure; the transport modules (keys, envelope, publisher, consumer)
talk to Redis. Nothing here imports `app`.
"""

from events.index import PrefixIndex

__all__ = ["PrefixIndex"]
