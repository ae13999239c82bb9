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

The worker *pushes*: ``publish(events, dropped=n)`` is synchronous and never waits; a
background flusher task turns what is buffered into stream entries (``events.envelope``), with
a fresh snapshot (``events.snapshot``) before the next entry whenever events were lost, so
that consumers resynchronise instead of missing them. A heartbeat task keeps the worker's
registry entry and heartbeat key, a load task its load hash.

The parts, one concept each (each module's docstring has the rules it keeps)::

    config.py     PublisherConfig, and the registry and load fields of a KVCacheManager
    publisher.py  EventPublisher: lifecycle (start, aclose), publish, flush, stats; EventSource
    flusher.py    Flusher: the buffer and the one task writing the stream and the snapshot
                  (trimming, losses, stream resets); new_epoch
    heartbeat.py  Heartbeat: the registry entry, heartbeat key and load hash, and their tasks

Background tasks log, back off and carry on; only ``aclose`` stops them. Settings are one
``PublisherConfig``; a setting out of range raises ``ValueError`` when the config is made.
"""

from events.publisher.config import PublisherConfig, manager_load, manager_registry_entry
from events.publisher.flusher import new_epoch
from events.publisher.publisher import EventPublisher, EventSource

__all__ = [
    "EventPublisher",
    "EventSource",
    "PublisherConfig",
    "manager_load",
    "manager_registry_entry",
    "new_epoch",
]
