"""One engine's event stream republished as a kvmesh worker: the piece every ingester shares.

An ingester turns each stream of events it reads (an engine, or one data-parallel or attention-DP
rank of it) into one kvmesh worker. A ``Republisher`` is that worker: its ``EventPublisher``, and
the ``PrefixIndex`` of exactly what was published to it, whose dump is the snapshot the publisher
writes when consumers need one (at start, after events were lost, on request). The snapshot is
exact as long as nothing was lost upstream.

What is engine-specific stays with the engine (``app.ingest.trtllm``, ``app.ingest.vllm``): a
subclass says which event id the snapshot covers (``last_event_id``) and resets its own state
before ``restart`` (the engine restarted: a new epoch, an empty index).
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from events.index import PrefixIndex
from events.publisher import EventPublisher, PublisherConfig
from events.snapshot import Snapshot

__all__ = ["Republisher", "rank_worker_id", "registry_entry"]


def rank_worker_id(worker_id: str, rank: int | None) -> str:
    """The kvmesh worker id of one rank of an engine, ``<worker-id>-dp<rank>`` (``worker_id``
    itself for an engine without ranks)."""
    return worker_id if rank is None else f"{worker_id}-dp{rank}"


def registry_entry(
    source: str, url: str | None, tokens_per_block: int | None, model: str | None = None
) -> dict[str, Any]:
    """The registry fields of an ingested worker: the engine's URL (where routers send its
    requests), ``device`` and ``source`` the engine (``trtllm``, ``vllm``, ``sglang``), its block
    size (None: not registered), and the model it serves (``--served-model-name``; left out:
    routers send it any model's requests)."""
    entry: dict[str, Any] = {
        "url": url,
        "device": source,
        "tokens_per_block": tokens_per_block,
        "source": source,
    }
    if model is not None:
        entry["model"] = model
    return entry


class Republisher:
    """One engine stream as a kvmesh worker: its publisher and the index of what it published.

    Callers feed ``index`` the events they hand ``publisher`` (synchronously, in the same step,
    so that the snapshot always matches what was published)."""

    __slots__ = ("index", "publisher", "worker_id")

    def __init__(
        self,
        redis: Redis,
        worker_id: str,
        config: PublisherConfig,
        entry: dict[str, Any],
    ) -> None:
        self.worker_id = worker_id
        self.index = PrefixIndex()
        self.publisher = EventPublisher(
            redis,
            worker_id,
            config,
            snapshot_source=self.snapshot,
            registry_entry=entry,
        )

    def last_event_id(self) -> int:
        """The id of the last kvmesh event the index holds (-1: none yet)."""
        raise NotImplementedError

    def snapshot(self) -> Snapshot:
        """What the worker holds, as the events that rebuild it, up to ``last_event_id``."""
        index = self.index
        events = index.dump_events(self.worker_id)
        return Snapshot(events, self.last_event_id())

    def local_blocks(self) -> dict[int, int]:
        """What the ingester believes the worker holds: block hash -> tier."""
        index = self.index
        return index.worker_blocks(self.worker_id)

    def restart(self) -> None:
        """The engine restarted: an empty index and a new epoch (consumers resynchronise). A
        subclass resets its own state first, then calls this."""
        self.index = PrefixIndex()
        self.publisher.new_epoch()
