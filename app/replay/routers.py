"""What routes a replay cluster's requests: ``CoreRouter`` (the router service's ``RouterCore``
and policy, fed through the real event path; several of them for ``--routers N``, sharing their
flights as ``app.router.share`` does) and ``SingleWorker`` (``pooled``: no router at all).

They see the cluster through small protocols (its config, workers and clock; a job's trace
index), so that the cluster module imports them and not the other way round."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from app.replay.config import ClusterConfig
from app.router.core import RouterCore
from cache import KVCacheEvent, block_hashes_for_tokens
from events.codec import decode_events, encode_events
from events.index import PrefixIndex

__all__ = ["CoreRouter", "SingleWorker"]


class _Trace(Protocol):
    @property
    def index(self) -> int: ...


class _Job(Protocol):
    @property
    def trace(self) -> _Trace: ...


class _Worker(Protocol):
    @property
    def index(self) -> int: ...
    @property
    def worker_id(self) -> str: ...
    def load(self) -> dict[str, int]: ...


class _Cluster(Protocol):
    @property
    def config(self) -> ClusterConfig: ...
    @property
    def workers(self) -> Sequence[_Worker]: ...
    def clock(self) -> float: ...


class CoreRouter:
    """The router service's ``RouterCore`` and policy, fed through the real event path; with
    ``config.routers`` > 1, that many cores (each its own index, in-flight view and
    predictions), requests dealt round robin, each core's flights applied to the others'
    (``begin_remote``, ..., as ``app.router.share`` does) unless ``config.share`` is off."""

    def __init__(self, cluster: _Cluster, policy: str) -> None:
        config = cluster.config
        self.config = config
        self.cores = [
            RouterCore(
                PrefixIndex(),
                tokens_per_block=config.tokens_per_block,
                policy=policy,
                weights=config.weights,
                seed=config.seed + r,
                predict_ttl_s=config.predict_ttl_s,
                approx_ttl_s=config.approx_ttl_s,
                clock=cluster.clock,
            )
            for r in range(config.routers)
        ]
        self.core = self.cores[0]
        self.workers = cluster.workers
        for core in self.cores:
            for worker in cluster.workers:
                core.upsert_worker(
                    worker.worker_id,
                    capacity_blocks=config.blocks_per_worker,
                    approximate=config.no_events,
                )
                core.set_load(worker.worker_id, worker.load())
        self._index_of = {worker.worker_id: worker.index for worker in cluster.workers}
        self._router_of: dict[str, int] = {}  # request -> the core that routed it
        self._next = 0
        # (due, worker, encoded events or None, load): what reaches the routers late.
        self._late: deque[tuple[float, str, bytes | None, dict[str, int]]] = deque()
        self._clock = cluster.clock

    def route(self, job: _Job, tokens: npt.NDArray[np.uint32], now: float) -> int:
        self._deliver(now)
        r = self._next
        self._next = (r + 1) % len(self.cores)
        core = self.cores[r]
        # core.hashes, on the array (no list -> array conversion per request).
        hashes = block_hashes_for_tokens(tokens, core.tokens_per_block)
        decision = core.decide(hashes, len(tokens))
        request_id = str(job.trace.index)
        flight = core.begin(request_id, decision, hashes, len(tokens))
        self._router_of[request_id] = r
        for other in self._others(r):
            other.begin_remote(
                str(r), request_id, decision.worker, flight.prefill_tokens, flight.blocks, hashes
            )
        return self._index_of[decision.worker]

    def _others(self, r: int) -> list[RouterCore]:
        if not self.config.share:
            return []
        return [core for i, core in enumerate(self.cores) if i != r]

    def prefilled(self, job: _Job) -> None:
        request_id = str(job.trace.index)
        r = self._router_of[request_id]
        self.cores[r].prefilled(request_id)
        for other in self._others(r):
            other.prefilled_remote(str(r), request_id)

    def finish(self, job: _Job) -> None:
        request_id = str(job.trace.index)
        r = self._router_of.pop(request_id)
        self.cores[r].finish(request_id)
        for other in self._others(r):
            other.finish_remote(str(r), request_id)

    def publish(self, worker: _Worker, events: list[KVCacheEvent]) -> None:
        blob = encode_events(events) if events and not self.config.no_events else None
        load = worker.load()
        if self.config.event_delay_s > 0:
            self._late.append(
                (self._clock() + self.config.event_delay_s, worker.worker_id, blob, load)
            )
            return
        self._apply(worker.worker_id, blob, load)

    def _deliver(self, now: float) -> None:
        late = self._late
        while late and late[0][0] <= now:
            _, worker, blob, load = late.popleft()
            self._apply(worker, blob, load)

    def _apply(self, worker: str, blob: bytes | None, load: dict[str, int]) -> None:
        for core in self.cores:
            if blob is not None:
                apply = core.index.apply_event
                for event in decode_events(blob):
                    apply(worker, event)
            if not self.config.no_events:  # a worker without events publishes no load either
                core.set_load(worker, load)


class SingleWorker:
    """``pooled``: one worker takes everything; no index, no router state."""

    def route(self, job: _Job, tokens: npt.NDArray[np.uint32], now: float) -> int:
        return 0

    def prefilled(self, job: _Job) -> None:
        pass

    def finish(self, job: _Job) -> None:
        pass

    def publish(self, worker: _Worker, events: list[KVCacheEvent]) -> None:
        pass
