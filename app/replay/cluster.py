"""The in-process cluster a replay runs: workers, their managers, the router, a virtual clock.

One ``KVCacheManager`` per worker (metadata only, block reuse on, events on) is driven the way
``app.worker.engine`` drives it with the ``guaranteed_no_evict`` scheduler:

* each worker has a FIFO waiting queue; a request is admitted when the blocks it needs to
  completion (``get_remaining_blocks_to_completion``) fit beside the reserve of every running
  request, and only with a chunk to run now; admission stops at the first that does not fit;
* a step's token budget goes to decodes first (one token each), then prefill chunks in
  admission order, whole blocks unless a chunk completes its prompt (chunked prefill);
* a step takes ``SimTiming.step_time(prefill tokens, decodes)`` of virtual time; at its end the
  prompts it completed are stored (``store_context_blocks``), the router hears ``prefilled``,
  finished requests leave with ``remove_sequence`` (storing for reuse) and ``finish``, and the
  manager's events travel the real path: ``take_events`` -> ``encode_events`` ->
  ``decode_events`` -> ``PrefixIndex.apply_event``; the router's load of the worker is
  refreshed (``manager_load`` plus running requests).

The router (``RouterCore`` with the policy under test) decides when a request arrives (trace
timestamp / speed), with the index and loads as they are then.

Decode coalescing: a step that only decodes, after an admission attempt that admitted nothing,
is followed by identical steps until the first of its sequences finishes (nothing can be
admitted before: the queue's head waits for blocks or a batch slot that only a finish frees).
Those k steps are one event, and each sequence grows by ``KVCacheManager.add_tokens(id, k)``.
When the router sends a request to a worker in such a run, the run is cut at the first step
boundary after the arrival, so the request is admitted exactly when step-by-step simulation
would admit it. The router's view of that worker stays as it was at the run's start (the same
running and waiting counts; only the decode blocks differ).

The generated tokens are not kept: decodes grow the manager's sequences (so blocks are
allocated, and cached blocks evicted, as in a worker), but a request's ``LlmRequest`` holds its
prompt only, so only prompt blocks are stored for reuse. A Mooncake trace gives the next turn
of a conversation its own block ids, so output blocks could never be matched anyway.

``pooled`` is the upper bound of the hit ratio: one manager with every worker's blocks and no
router. Its compute is the cluster's, pooled: step costs divided by the number of workers, and
the step's token budget and batch size multiplied by it, so that it is never the bottleneck
that a single worker of that size would be.

A request whose blocks to completion exceed what an idle worker has counts as failed (it is
refused at its worker's queue head, as the engine refuses it), not as an error.
"""

from __future__ import annotations

import gc
import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

import numpy as np
import numpy.typing as npt

from app.core.step_speed import MIN_STEPS, StepSpeed, speed_fields
from app.replay.config import REPLAY_TIMING, ClusterConfig
from app.replay.routers import CoreRouter, SingleWorker
from app.replay.trace import TokenSource, TraceRequest
from cache import (
    KVCacheEvent,
    KVCacheManager,
    LlmRequest,
    OutOfBlocksError,
    RequestState,
)
from events.publisher import manager_load

__all__ = [
    "POOLED",
    "REPLAY_TIMING",
    "ClusterConfig",
    "RequestRecord",
    "RunResult",
    "StepRecord",
    "run_policy",
]

POOLED: Final = "pooled"

_EVENT_BUFFER: Final = 1 << 22


@dataclass(slots=True)
class RequestRecord:
    """One trace request's outcome (times in seconds of virtual time)."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    worker: int = -1
    reused_tokens: int = 0
    first_token_s: float = math.nan
    finished_s: float = math.nan
    failed: bool = False


@dataclass(slots=True)
class StepRecord:
    """The prefill work of the steps of one worker, one entry per step that prefilled."""

    worker: int
    start_s: float
    prefill_tokens: int
    # (trace index, tokens) per request prefilled in the step: the load imbalance needs the
    # largest share of one request, which no placement can split between workers.
    chunks: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True)
class RunResult:
    policy: str
    config: ClusterConfig
    requests: list[RequestRecord]
    prefill_steps: list[StepRecord]
    num_steps: int
    num_events: int
    worker_ids: list[str]
    wall_s: float = 0.0
    # The cluster as configured (for pooled, ``config`` is the pooled one): its workers' speed
    # and step budget are what the TTFT floor assumes. None: ``config``.
    cluster_config: ClusterConfig | None = None


# -- workers ---------------------------------------------------------------------------------


_PREFILL: Final = 0
_DECODE: Final = 1


@dataclass(slots=True, eq=False)
class _Job:
    trace: TraceRequest
    record: RequestRecord
    request: LlmRequest | None = None
    state: int = _PREFILL
    position: int = 0
    generated: int = 0


@dataclass(slots=True)
class _Step:
    """The step a worker is running: what it computes and when it ends."""

    start_s: float
    duration_s: float  # of one step (all k of a coalesced decode run are equal)
    num_steps: int  # k: > 1 only for a coalesced decode run
    prefills: list[tuple[_Job, int]] = field(default_factory=list)  # (job, chunk end)
    decodes: list[_Job] = field(default_factory=list)
    prefill_tokens: int = 0

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s * self.num_steps


class _Router(Protocol):
    """What the cluster asks of its router (a ``RouterCore`` with a policy, or nothing)."""

    def route(self, job: _Job, tokens: npt.NDArray[np.uint32], now: float) -> int: ...
    def prefilled(self, job: _Job) -> None: ...
    def finish(self, job: _Job) -> None: ...
    def publish(self, worker: _Worker, events: list[KVCacheEvent]) -> None: ...


class _Worker:
    def __init__(
        self, index: int, worker_id: str, mgr: KVCacheManager, config: ClusterConfig
    ) -> None:
        self.index = index
        self.worker_id = worker_id
        self.mgr = mgr
        self.config = config
        self.timing = config.worker_timing(index)
        self.waiting: deque[_Job] = deque()
        self.running: list[_Job] = []
        self.step: _Step | None = None
        self.version = 0  # heap entries of older versions are stale
        # Its observed speed, fitted to the steps it ran and reported with its load, as a
        # kvmesh worker does (the router is told nothing of SimTiming).
        self.speed = StepSpeed()
        self.speed_fields: dict[str, int] = {}

    def observe(self, step: _Step) -> None:
        if not self.config.speed_reports:
            return
        before = self.speed.steps
        self.speed.observe(step.duration_s, step.prefill_tokens, len(step.decodes), step.num_steps)
        if before // MIN_STEPS != self.speed.steps // MIN_STEPS:
            self.speed_fields = speed_fields(self.speed.estimate(), self.config.max_tokens_per_step)

    def load(self) -> dict[str, int]:
        load = manager_load(self.mgr, num_waiting=len(self.waiting))
        load["running_requests"] = len(self.running)
        load.update(self.speed_fields)
        return load


class _Cluster:
    def __init__(
        self,
        config: ClusterConfig,
        tokens: TokenSource,
        max_sequence_length: int,
        make_router: Callable[[_Cluster], _Router],
    ) -> None:
        self.config = config
        self.tokens = tokens
        self.now = 0.0
        tpb = config.tokens_per_block
        self.workers = [
            _Worker(
                i,
                f"w{i}",
                KVCacheManager(
                    num_layers=1,
                    num_kv_heads=1,
                    head_dim=1,
                    tokens_per_block=tpb,
                    blocks_per_window={max_sequence_length: (config.blocks_per_worker, 0)},
                    max_num_sequences=config.max_batch_size,
                    max_sequence_length=max_sequence_length,
                    enable_partial_reuse=config.enable_partial_reuse,
                    event_buffer_max_size=_EVENT_BUFFER,
                    allocate_pools=False,
                    clock=self.clock,
                    report_leaf_takeover=True,
                ),
                config,
            )
            for i in range(config.num_workers)
        ]
        self.router = make_router(self)
        self._heap: list[tuple[float, int, int, int]] = []  # (end, seq, worker, version)
        self._seq = 0
        self._next_request_id = 1
        self.prefill_steps: list[StepRecord] = []
        self.num_steps = 0
        self.num_events = 0

    def clock(self) -> float:
        return self.now

    # -- the event loop ------------------------------------------------------------------------

    def run(
        self, trace: Sequence[TraceRequest], progress: Callable[[int], None]
    ) -> list[RequestRecord]:
        speed = self.config.speed
        records: list[RequestRecord] = []
        heap = self._heap
        i, n = 0, len(trace)
        while i < n or heap:
            arrival = trace[i].timestamp_ms / 1000.0 / speed if i < n else math.inf
            if heap and heap[0][0] <= arrival:
                end, _, w, version = heapq.heappop(heap)
                worker = self.workers[w]
                if version != worker.version:
                    continue
                self.now = end
                self._end_step(worker)
                continue
            self.now = arrival
            records.append(self._arrive(trace[i]))
            i += 1
            progress(1)
        return records

    def _arrive(self, trace: TraceRequest) -> RequestRecord:
        record = RequestRecord(trace.index, self.now, trace.input_length, trace.output_length)
        job = _Job(trace, record)
        array = self.tokens.tokens(trace)
        w = self.router.route(job, array, self.now)
        tokens: list[int] = array.tolist()
        record.worker = w
        job.request = LlmRequest(self._next_request_id, tokens, max_new_tokens=trace.output_length)
        self._next_request_id += 1
        worker = self.workers[w]
        worker.waiting.append(job)
        step = worker.step
        if step is None:
            self._start_step(worker)
        elif step.num_steps > 1 and step.duration_s > 0:
            # Cut a coalesced decode run at the first step boundary after now.
            done = max(1, math.ceil((self.now - step.start_s) / step.duration_s - 1e-9))
            if done < step.num_steps:
                step.num_steps = done
                self._push(worker)
        return record

    def _push(self, worker: _Worker) -> None:
        step = worker.step
        assert step is not None
        worker.version += 1
        self._seq += 1
        heapq.heappush(self._heap, (step.end_s, self._seq, worker.index, worker.version))

    # -- one step --------------------------------------------------------------------------------

    def _start_step(self, worker: _Worker) -> None:
        """Schedule the worker's next step at ``now`` (as ``Engine._schedule``), or idle."""
        mgr = worker.mgr
        config = self.config
        tpb = config.tokens_per_block
        budget = config.max_tokens_per_step
        free = mgr.get_num_free_blocks()
        remaining = mgr.get_remaining_blocks_to_completion
        for job in worker.running:
            assert job.request is not None
            free -= remaining(job.request)
        step = _Step(self.now, 0.0, 1)
        for job in worker.running:
            if job.state == _DECODE and budget > 0:
                step.decodes.append(job)
                budget -= 1
        for job in worker.running:
            if job.state == _PREFILL and budget > 0:
                budget -= self._add_chunk(step, job, budget)
        admitted = False
        while len(worker.running) < config.max_batch_size and worker.waiting:
            head = worker.waiting[0]
            request = head.request
            assert request is not None
            if budget < tpb and budget < request.prompt_len:
                break
            need = remaining(request)
            reused: int | None = None
            if need <= free:
                try:
                    reused = mgr.add_sequence(request)
                except OutOfBlocksError:
                    reused = None
            if reused is None:
                if not worker.running:  # an idle worker cannot hold it: it never will
                    worker.waiting.popleft()
                    self._fail(head)
                    continue
                break
            free -= need
            worker.waiting.popleft()
            head.position = reused
            head.record.reused_tokens = reused
            worker.running.append(head)
            admitted = True
            budget -= self._add_chunk(step, head, budget)
        if not step.prefills and not step.decodes:
            worker.step = None
            return
        num_prefill = sum(end - job.position for job, end in step.prefills)
        step.prefill_tokens = num_prefill
        step.duration_s = worker.timing.step_time(num_prefill, len(step.decodes))
        if num_prefill:
            chunks = tuple((job.record.index, end - job.position) for job, end in step.prefills)
            self.prefill_steps.append(StepRecord(worker.index, self.now, num_prefill, chunks))
        elif config.coalesce_decode and not admitted and len(step.decodes) == len(worker.running):
            # Pure decode and nothing admissible: identical steps until the first finish.
            step.num_steps = min(job.trace.output_length - job.generated for job in step.decodes)
        worker.step = step
        self._push(worker)

    def _add_chunk(self, step: _Step, job: _Job, budget: int) -> int:
        request = job.request
        assert request is not None
        remaining = request.prompt_len - job.position
        chunk = min(remaining, budget)
        if chunk < remaining:
            chunk -= chunk % self.config.tokens_per_block
            if chunk == 0:
                return 0
        step.prefills.append((job, job.position + chunk))
        return chunk

    def _end_step(self, worker: _Worker) -> None:
        step = worker.step
        assert step is not None
        mgr = worker.mgr
        router = self.router
        k = step.num_steps
        self.num_steps += k
        worker.observe(step)
        finished: list[_Job] = []
        for job, end in step.prefills:
            request = job.request
            assert request is not None
            job.position = end
            request.context_current_position = end
            request.is_first_context_chunk = False
            if end == request.prompt_len:
                mgr.store_context_blocks(request)
                request.state = RequestState.GENERATION_IN_PROGRESS
                job.state = _DECODE
                job.generated = 1  # the token sampled after the prompt
                job.record.first_token_s = self.now
                router.prefilled(job)
                if job.generated >= job.trace.output_length:
                    finished.append(job)
        for job in step.decodes:
            # The K/V slots of the k tokens these steps computed (add_token before each).
            assert job.request is not None
            mgr.add_tokens(job.request.request_id, k)
            job.generated += k
            if job.generated >= job.trace.output_length:
                finished.append(job)
        for job in finished:
            request = job.request
            assert request is not None
            mgr.remove_sequence(request.request_id, request)
            worker.running.remove(job)
            job.record.finished_s = self.now
            job.request = None
            router.finish(job)
        self._publish(worker)
        self._start_step(worker)

    def _fail(self, job: _Job) -> None:
        job.record.failed = True
        job.request = None
        self.router.finish(job)

    def _publish(self, worker: _Worker) -> None:
        events = worker.mgr.take_events()
        if events:
            self.num_events += len(events)
        self.router.publish(worker, events)


# -- routers ---------------------------------------------------------------------------------


def max_sequence_length(trace: Sequence[TraceRequest], tokens_per_block: int) -> int:
    """A manager length that holds every request of the trace (prompt plus output)."""
    longest = max(r.input_length + r.output_length for r in trace)
    return -(-longest // tokens_per_block) * tokens_per_block


def run_policy(
    trace: Sequence[TraceRequest],
    policy: str,
    config: ClusterConfig,
    tokens: TokenSource,
    progress: Callable[[int], None] = lambda n: None,
) -> RunResult:
    """Replay ``trace`` through a fresh cluster routed by ``policy`` (or ``pooled``)."""
    length = max_sequence_length(trace, config.tokens_per_block)
    cluster_config = config
    if policy == POOLED:
        config = config.pooled()
        cluster = _Cluster(config, tokens, length, lambda c: SingleWorker())
    else:
        cluster = _Cluster(config, tokens, length, lambda c: CoreRouter(c, policy))
    # Hundreds of thousands of block objects live as long as the run: out of the collector's
    # sight, and fewer passes over what each step allocates (nothing the run makes is cyclic
    # garbage, so the passes would find nothing).
    thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 1_000)
    try:
        records = cluster.run(trace, progress)
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
    return RunResult(
        policy,
        config,
        records,
        cluster.prefill_steps,
        cluster.num_steps,
        cluster.num_events,
        [w.worker_id for w in cluster.workers],
        cluster_config=cluster_config,
    )
