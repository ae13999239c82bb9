"""A random but reproducible workload on a real ``KVCacheManager``, for the transport tests.

Prompts are a shared opening (one of a few documents) plus a random tail; sequences grow, get
stored for reuse and removed, so blocks are stored, evicted, offloaded to the secondary level,
onboarded again and removed; partial reuse copies blocks or takes free leaves over. The seed
takes a leaf over without a ``removed`` event (TRTLLM_EVENTS.md section 3, rule 3), after which
no event stream can rebuild the tree exactly, so the manager is asked to report it
(``report_leaf_takeover=True``).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from cache import KVCacheManager, LlmRequest, OutOfBlocksError
from events.consumer import ConsumerConfig, EntryHook, EventConsumer
from events.index import PrefixIndex
from events.publisher import EventPublisher, PublisherConfig, manager_load, manager_registry_entry
from events.snapshot import manager_snapshot
from tests.cache.factories import make_manager
from tests.support.wait import eventually

TOKENS_PER_BLOCK = 4
PRIMARY_BLOCKS = 48
SECONDARY_BLOCKS = 16
MAX_LIVE = 4
DOCUMENTS = tuple(tuple(range(base, base + 16)) for base in (100, 200, 300, 400, 500))


class Workload:
    """Drives one manager; ``step()`` does one random operation."""

    def __init__(self, seed: int, *, event_buffer: int = 1_000_000) -> None:
        self.rng = random.Random(seed)
        self.mgr: KVCacheManager = make_manager(
            PRIMARY_BLOCKS,
            SECONDARY_BLOCKS,
            tokens_per_block=TOKENS_PER_BLOCK,
            events=event_buffer,
            report_leaf_takeover=True,
        )
        self.live: dict[int, LlmRequest] = {}
        self.next_request_id = 0

    def step(self) -> None:
        """One engine iteration: one random operation, then the manager's iteration flush."""
        self._operate()
        self.mgr.flush_iteration_events()

    def _operate(self) -> None:
        rng = self.rng
        if len(self.live) < MAX_LIVE and (not self.live or rng.random() < 0.4):
            document = rng.choice(DOCUMENTS)
            prompt = [*document[: rng.randint(2, 16)], *(rng.randrange(8) for _ in range(6))]
            request = LlmRequest(request_id=self.next_request_id, tokens=prompt)
            self.next_request_id += 1
            try:
                self.mgr.add_sequence(request)
            except OutOfBlocksError:
                return
            self.live[request.request_id] = request
            if rng.random() < 0.5:
                self.mgr.store_context_blocks(request)
            return
        request_id = rng.choice(list(self.live))
        request = self.live[request_id]
        if len(request.tokens) < 34 and rng.random() < 0.6:
            for _ in range(rng.randint(1, 4)):
                request.add_new_token(rng.randrange(8))
                self.mgr.add_token(request_id)
        else:
            del self.live[request_id]
            self.mgr.remove_sequence(request_id, request)

    def blocks(self) -> dict[int, int]:
        """Every block in the manager's reuse trees: hash -> tier (0 primary, 1 secondary)."""
        mgr = self.mgr
        return {
            b.hash: 0 if b.is_primary else 1
            for window in mgr.window_sizes
            for b in mgr.tree_blocks(window)
        }


def index_blocks(index: PrefixIndex, worker_id: str) -> dict[int, int]:
    """What the index holds for ``worker_id`` (hash -> tier), empty if it does not know it."""
    return index.worker_blocks(worker_id)


# -- publishers and consumers tuned for tests: short periods, short backoff -----------------------

FAST_PUBLISHER: dict[str, Any] = {
    "heartbeat_interval_s": 0.05,
    "heartbeat_ttl_s": 1.0,  # room for a loaded CI machine; expiry tests set their own
    "load_interval_s": 0.05,
    "backoff_initial_s": 0.01,
    "backoff_max_s": 0.1,
    "close_timeout_s": 2.0,
}
FAST_CONSUMER = ConsumerConfig(
    block_ms=20,
    registry_interval_s=0.05,
    liveness_interval_s=0.05,
    resync_delay_s=0.01,
    resync_delay_max_s=0.1,
    backoff_initial_s=0.01,
    backoff_max_s=0.1,
)


def make_publisher(
    redis_url: str, worker_id: str, workload: Workload, **overrides: Any
) -> EventPublisher:
    mgr = workload.mgr
    return EventPublisher(
        redis_url,
        worker_id,
        PublisherConfig(**{**FAST_PUBLISHER, **overrides}),
        snapshot_source=lambda: manager_snapshot(mgr),
        registry_entry=manager_registry_entry(mgr, url=f"http://{worker_id}:8001"),
        load_source=lambda: manager_load(mgr, num_waiting=len(workload.live)),
    )


def make_consumer(
    redis_url: str, *, on_entry: EntryHook | None = None, **overrides: Any
) -> EventConsumer:
    """A consumer with ``FAST_CONSUMER``'s settings; ``overrides``: ``ConsumerConfig`` fields."""
    return EventConsumer(redis_url, replace(FAST_CONSUMER, **overrides), on_entry=on_entry)


async def drive(
    workload: Workload,
    publisher: EventPublisher,
    num_publishes: int,
    *,
    steps_per_publish: int = 4,
    pause_s: float = 0.0,
) -> None:
    """Run the workload, handing its events to the publisher after every few steps."""
    for _ in range(num_publishes):
        for _ in range(steps_per_publish):
            workload.step()
        publisher.publish_from(workload.mgr)
        await asyncio.sleep(pause_s)


def last_event_id(workload: Workload) -> int:
    return workload.mgr.last_event_id


async def assert_index_exact(
    consumer: EventConsumer,
    workers: Mapping[str, tuple[Workload, EventPublisher]],
    timeout: float = 10.0,
) -> None:
    """Flush every publisher, wait until the consumer applied every event, compare the index
    with each manager's reuse tree, worker by worker and tier by tier."""
    for workload, publisher in workers.values():
        publisher.publish_from(workload.mgr)
        await publisher.flush(timeout)
    await eventually(
        lambda: all(
            consumer.last_seq(worker_id) == last_event_id(workload)
            for worker_id, (workload, _) in workers.items()
        ),
        timeout,
    )
    for worker_id, (workload, _) in workers.items():
        assert index_blocks(consumer.index, worker_id) == workload.blocks(), worker_id
