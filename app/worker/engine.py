"""The worker's engine: the single writer of its ``KVCacheManager``, and continuous batching.

Every manager call runs on one asyncio task, ``Engine.run``. HTTP handlers never touch the
manager: they ``submit`` a ``Job`` (appended to the waiting queue, which only the engine pops),
``cancel`` one (a flag the engine acts on), or ``call`` a function that the engine runs between
two steps and whose result they await. Handlers and the engine share one thread, so what a
handler reads between two steps is consistent.

One iteration of the loop:

1. run the queued admin calls, then act on cancellations;
2. schedule (the manager's own capacity calls, as TensorRT-LLM's capacity scheduler):
   * ``guaranteed_no_evict`` (TensorRT-LLM's default): every running request keeps
     ``get_remaining_blocks_to_completion`` blocks in reserve; a waiting request is admitted only
     when its own need to completion fits in what is left, so nobody is ever preempted;
   * ``max_utilization``: decodes take ``get_needed_blocks_one_step``; when those do not fit,
     the newest running requests are paused (``start_scheduling`` and
     ``scheduling_remove_sequence`` tell how much that frees) and preempted: their blocks are
     stored for reuse and released, and they go back to the head of the queue to be recomputed
     (mostly from the cache) later. Waiting requests are admitted while their next-step need fits;
   * the step's token budget (``max_tokens_per_step``) goes to decodes first (one token each),
     then to prefill chunks in admission order, each a multiple of ``tokens_per_block`` unless it
     completes its prompt (chunked prefill); admission is FIFO within a priority (lower value
     first, as vLLM), and stops at the first request that does not fit (no overtaking);
3. the back-end computes the step; with a real clock the engine sleeps out the modelled time,
   with a virtual clock it advances the clock instead;
4. bookkeeping: ``store_context_blocks`` when a prompt is complete, ``store_new_block`` after every
   token, ``remove_sequence`` (storing for reuse) when a request is done; ``refresh_blocks``;
5. the manager's events go to the ``EventPublisher`` and the recent-events ring; the load
   figures (``load``) are refreshed for the publisher and the metrics.

Manager protocol of one request: ``add_sequence`` allocates the prompt's blocks (reusing what
is cached); prefill chunks run from the reused length; the token sampled after the prompt is
appended to the request, and before each decode step ``add_token`` gives the sequence the slot
for that last token's K/V. So during decoding the manager's sequence is one token shorter than
the request: the last sampled token has no K/V yet, and it is never stored.

A failure inside a step is logged; the requests of that step fail (their sequences are released
without storing) and the loop carries on. It never dies silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from app.core.step_speed import MIN_STEPS, StepSpeed, speed_fields
from app.worker.backend import Backend, Decode, PrefillChunk, StepBatch, StepOutput
from app.worker.event_ring import EventRing
from app.worker.jobs import (
    DrainingError,
    DuplicateJobError,
    EngineError,
    Job,
    JobState,
    QueueFullError,
    VirtualClock,
)
from cache import (
    KVCacheEvent,
    KVCacheManager,
    LlmRequest,
    OutOfBlocksError,
    RequestState,
)
from events.publisher import EventPublisher, manager_load

__all__ = [
    "DrainingError",
    "DuplicateJobError",
    "Engine",
    "EngineConfig",
    "EngineError",
    "Job",
    "JobState",
    "QueueFullError",
    "VirtualClock",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_SPEED_REFIT = MIN_STEPS


def _ignore(*args: object) -> None:
    """The default of the engine's callbacks."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_batch_size: int = 64
    max_tokens_per_step: int = 8_192
    max_queue_len: int = 1_024
    max_seq_len: int = 8_192
    scheduler: Literal["guaranteed_no_evict", "max_utilization"] = "guaranteed_no_evict"
    events_ring_blocks: int = 4_096
    worker_id: str = "worker"  # for the logs


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0  # tokens prefilled, recomputation after preemption included
    reused_tokens: int = 0  # prompt tokens whose KV cache was reused (once per request)
    computed_tokens: int = 0  # prompt tokens that had to be computed (once per request)
    generated_tokens: int = 0
    submitted: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    preemptions: int = 0
    errors: int = 0
    events: int = 0


class Engine:
    """The engine loop and its queues; see the module docstring."""

    def __init__(
        self,
        mgr: KVCacheManager,
        backend: Backend,
        config: EngineConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        publisher: EventPublisher | None = None,
        on_step: Callable[[float, StepBatch], None] | None = None,
        on_first_token: Callable[[Job], None] | None = None,
    ) -> None:
        self.mgr = mgr
        self.backend = backend
        self.config = config
        self.clock = clock
        self.virtual = isinstance(clock, VirtualClock)
        self.publisher = publisher
        self.on_step = on_step or _ignore
        self.on_first_token = on_first_token or _ignore
        self.tokens_per_block = mgr.tokens_per_block
        self.jobs: dict[str, Job] = {}  # live jobs (waiting or running) by id
        self.running: list[Job] = []  # admission order
        # heap of (priority, 0 if preempted else 1, arrival seq, job)
        self._waiting: list[tuple[int, int, int, Job]] = []
        self._num_waiting = 0
        self._seq = itertools.count()
        self._request_ids = itertools.count(1)
        self._calls: deque[tuple[Callable[[KVCacheManager], Any], asyncio.Future[Any]]] = deque()
        self._cancels: list[Job] = []
        self._wakeup = asyncio.Event()
        self._stopped = False
        self.draining = False
        self.drain_reason = "the worker is shutting down"  # said to a request refused meanwhile
        self.stats = EngineStats()
        self.recent_events = EventRing(config.events_ring_blocks)  # for GET /events
        self.load: dict[str, int] = {}
        # The steps' observed speed, published with the load for the router's TTFT estimate;
        # refitted every _SPEED_REFIT steps (the fit is not free, and speeds change slowly).
        self.speed = StepSpeed()
        self._speed_fields: dict[str, int] = {}
        self._dropped_seen = 0  # manager events dropped, as last reported to the publisher
        self._refresh_load()

    # -- handlers' side ------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def submit(self, job: Job) -> None:
        """Queue a job (never waits). Raises DrainingError, DuplicateJobError, QueueFullError."""
        if self.draining or self._stopped:
            raise DrainingError(self.drain_reason if self.draining else "the engine has stopped")
        if job.job_id in self.jobs:
            raise DuplicateJobError(f"request_id {job.job_id!r} is already in flight")
        if self._num_waiting >= self.config.max_queue_len:
            raise QueueFullError(
                f"the queue is full ({self._num_waiting} of {self.config.max_queue_len} waiting)"
            )
        job.arrival_s = self.clock()
        self.jobs[job.job_id] = job
        self._enqueue(job)
        self.stats.submitted += 1
        self._wakeup.set()

    def cancel(self, job_id: str) -> bool:
        """Ask the engine to cancel a live job (its blocks are freed at the next iteration)."""
        job = self.jobs.get(job_id)
        if job is None or job.cancel_requested:
            return job is not None
        job.cancel_requested = True
        self._cancels.append(job)
        self._wakeup.set()
        return True

    async def call(self, fn: Callable[[KVCacheManager], T]) -> T:
        """Run ``fn(manager)`` on the engine task between two steps and return its result."""
        if self._stopped:
            raise DrainingError("the engine has stopped")
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._calls.append((fn, future))
        self._wakeup.set()
        return await future

    # -- the loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        """The engine task: iterate while there is work, sleep on the wake-up event otherwise.

        If the loop ever ends other than by ``stop`` (a bug), every live job and pending call
        fails at once instead of waiting for ever."""
        try:
            while not self._stopped:
                # Cleared before the iteration looks at the queues: whatever arrives while it
                # runs sets it again, so the wait below cannot miss it.
                self._wakeup.clear()
                stepped = False
                if self._calls or self._cancels or self.running or self._num_waiting:
                    stepped = await self._iterate()
                if not stepped:
                    # Nothing could run: wait for a submission, a call, a cancellation.
                    await self._wakeup.wait()
                else:
                    # Let handlers run between steps even when a step takes no modelled time.
                    await asyncio.sleep(0)
        finally:
            self._shut_down()

    async def _iterate(self) -> bool:
        """One iteration (see the module docstring); True if a step ran."""
        started = time.perf_counter()
        batch = StepBatch()
        output: StepOutput | None = None
        try:
            self._run_calls()
            self._process_cancels()
            self._schedule(batch)
            if batch:
                output = self.backend.execute(batch)
        except Exception:
            self._fail_step(batch)
            output = None
        model_time = output.model_time_s if output is not None else 0.0
        if self.virtual:
            assert isinstance(self.clock, VirtualClock)
            self.clock.advance(model_time)
        else:
            remaining = model_time - (time.perf_counter() - started)
            if remaining > 0:
                await asyncio.sleep(remaining)
        try:
            if output is not None:
                self._apply(batch, output)
        except Exception:
            self._fail_step(batch)
        finally:
            # Whatever happened, the events of this iteration leave the manager now.
            try:
                self.mgr.refresh_blocks()
                self._publish()
            except Exception:
                self.stats.errors += 1
                logger.exception("worker %s: publishing the events failed", self.config.worker_id)
        if not batch:
            return False
        self.stats.steps += 1
        if output is not None:
            # The modelled time when there is one (sim), else the step's own wall time.
            took = model_time or (time.perf_counter() - started)
            self.speed.observe(took, batch.num_prefill_tokens, len(batch.decodes))
            if self.speed.steps % _SPEED_REFIT == 0:
                self._speed_fields = speed_fields(
                    self.speed.estimate(), self.config.max_tokens_per_step
                )
        try:
            self.on_step(time.perf_counter() - started, batch)
        except Exception:
            logger.exception("worker %s: the step callback failed", self.config.worker_id)
        return True

    def _shut_down(self) -> None:
        """The loop has ended: fail what still waits on it."""
        self._stopped = True
        while self._calls:
            _, future = self._calls.popleft()
            if not future.done():
                future.set_exception(DrainingError("the engine has stopped"))
        for job in list(self.jobs.values()):
            job.error = "the engine stopped"
            self._finish(job, "aborted")

    def stop(self) -> None:
        """End the loop after the current iteration; what is still pending then fails."""
        self._stopped = True
        self._wakeup.set()

    async def drain(self, timeout_s: float) -> int:
        """Admit nothing new, give live jobs ``timeout_s`` to finish, abort the rest.

        Returns how many were aborted."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.jobs and time.monotonic() < deadline:
            job = next(iter(self.jobs.values()))
            try:
                await asyncio.wait_for(asyncio.shield(job.done), deadline - time.monotonic())
            except TimeoutError:
                break
        aborted = list(self.jobs.values())
        for job in aborted:
            job.cancel_requested = True
            self._cancels.append(job)
        if aborted:
            self._wakeup.set()
            await asyncio.gather(*(asyncio.shield(job.done) for job in aborted))
        return len(aborted)

    def events_after(
        self, since: int, limit: int
    ) -> tuple[list[KVCacheEvent], int | None, int | None]:
        """Recent events (``EventRing.after``)."""
        return self.recent_events.after(since, limit)

    # -- queue ---------------------------------------------------------------------------------

    def _enqueue(self, job: Job, *, preempted: bool = False) -> None:
        """Queue by (priority, preempted first, arrival): the key is unique, jobs are never
        compared."""
        job.state = JobState.WAITING
        key = (job.priority, 0 if preempted else 1, next(self._seq))
        heapq.heappush(self._waiting, (*key, job))
        self._num_waiting += 1

    def _peek_waiting(self) -> Job | None:
        while self._waiting:
            job = self._waiting[0][-1]
            if job.state is JobState.WAITING:
                return job
            heapq.heappop(self._waiting)  # cancelled while waiting
        return None

    # -- one iteration -------------------------------------------------------------------------

    def _run_calls(self) -> None:
        while self._calls:
            fn, future = self._calls.popleft()
            if future.done():  # the caller went away
                continue
            try:
                future.set_result(fn(self.mgr))
            except Exception as exc:
                future.set_exception(exc)

    def _process_cancels(self) -> None:
        cancels, self._cancels = self._cancels, []
        for job in cancels:
            if job.finished:
                continue
            if job.state is JobState.WAITING:
                self._num_waiting -= 1
            else:
                self._release(job, store=job.state is JobState.DECODE)
            reason: Literal["cancelled", "aborted"] = "aborted" if self.draining else "cancelled"
            self._finish(job, reason)
            self.stats.cancelled += 1

    def _schedule(self, batch: StepBatch) -> None:
        """Fill ``batch`` (built by the caller, so a failure half way knows what it touched)."""
        mgr = self.mgr
        budget = self.config.max_tokens_per_step
        if self.config.scheduler == "max_utilization":
            free = self._make_room_for_decodes()
        else:
            free = mgr.get_num_free_blocks() - sum(
                mgr.get_remaining_blocks_to_completion(job.request)
                for job in self.running
                if job.request is not None
            )
        # Decodes: one token each; the slot for the last sampled token's K/V first.
        for job in list(self.running):
            if job.state is JobState.DECODE and budget > 0:
                request = job.request
                assert request is not None
                try:
                    mgr.add_token(job.request_id)
                except OutOfBlocksError:  # only when the reservation was short
                    self._preempt(job)
                    continue
                batch.decodes.append(Decode(job.request_id, request.tokens, job.seed))
                budget -= 1
        # Prefill chunks of the running requests, in admission order.
        for job in self.running:
            if job.state is JobState.PREFILL and budget > 0:
                budget -= self._add_chunk(batch, job, budget)
        # Admission: FIFO within a priority, no overtaking, only with a chunk to run now (the
        # micro-batch: blocks are not allocated to requests that would only wait in them).
        tpb = self.tokens_per_block
        while len(self.running) < self.config.max_batch_size:
            head = self._peek_waiting()
            if head is None:
                break
            # Built once while it waits: a request hashes its prompt on first use.
            request = head.request or self._new_request(head)
            head.request = request
            if budget < tpb and budget < request.prompt_len:
                break
            if self.config.scheduler == "max_utilization":
                need = mgr.get_needed_blocks_one_step(request)
            else:
                need = mgr.get_remaining_blocks_to_completion(request)
            reused: int | None = None
            if need <= free:
                with contextlib.suppress(OutOfBlocksError):  # refused: nothing changed
                    reused = mgr.add_sequence(request)
            if reused is None:
                if not self.running:  # nothing will free blocks: waiting would be for ever
                    self._refuse(head, f"needs {need} blocks, {max(free, 0)} can be had")
                    continue
                break
            free -= need
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
            head.state = JobState.PREFILL
            head.position = reused
            head.admitted_reused = reused
            if head.admitted_s is None:
                head.admitted_s = self.clock()
            self.running.append(head)
            budget -= self._add_chunk(batch, head, budget)

    def _add_chunk(self, batch: StepBatch, job: Job, budget: int) -> int:
        """Plan the job's next prompt chunk within ``budget``; returns the tokens it takes.
        A chunk is a multiple of the block size unless it completes the prompt."""
        request = job.request
        assert request is not None
        remaining = request.prompt_len - job.position
        chunk = min(remaining, budget)
        if chunk < remaining:
            chunk -= chunk % self.tokens_per_block
            if chunk == 0:
                return 0
        batch.prefills.append(
            PrefillChunk(
                job.request_id, request.tokens, job.position, job.position + chunk, job.seed
            )
        )
        return chunk

    def _refuse(self, job: Job, reason: str) -> None:
        """A waiting job that cannot fit in an idle cache (pinned blocks): 503, not a hang."""
        heapq.heappop(self._waiting)
        self._num_waiting -= 1
        job.request = None
        job.error = f"no room in the KV cache for this request: {reason}"
        logger.warning("worker %s: refusing %s: %s", self.config.worker_id, job.job_id, job.error)
        self._finish(job, "error")
        self.stats.failed += 1

    def _make_room_for_decodes(self) -> int:
        """max_utilization: preempt the newest running jobs until every decode fits; returns
        the blocks left free for admissions."""
        mgr = self.mgr
        decoding = [job for job in self.running if job.state is JobState.DECODE]
        need = sum(mgr.get_needed_blocks_one_step(job.request) for job in decoding if job.request)
        free = mgr.get_num_free_blocks()
        if need <= free:
            return free - need
        mgr.start_scheduling()
        victims: list[Job] = []
        for job in reversed(self.running):
            if need <= mgr.get_scheduling_num_free_blocks():
                break
            mgr.scheduling_remove_sequence(job.request_id)
            victims.append(job)
            if job.state is JobState.DECODE and job.request is not None:
                need -= mgr.get_needed_blocks_one_step(job.request)
        for job in victims:
            self._preempt(job)
        return max(mgr.get_num_free_blocks() - need, 0)

    def _new_request(self, job: Job) -> LlmRequest:
        """The manager's view of a job: prompt plus what it generated before a preemption."""
        request = LlmRequest(
            next(self._request_ids),
            job.prompt + job.output if job.output else job.prompt,
            max_new_tokens=job.max_tokens - len(job.output),
            lora_task_id=job.lora_task_id,
            cache_salt_id=job.cache_salt_id,
            cache_salt=job.cache_salt,
            retention=job.retention,
            token_words=job.words,
        )
        job.request_id = request.request_id
        return request

    def _apply(self, batch: StepBatch, output: StepOutput) -> None:
        mgr = self.mgr
        tokens = output.tokens
        jobs = self._running_by_request_id()
        now = self.clock()
        for chunk in batch.prefills:
            job = jobs.get(chunk.request_id)
            if job is None:
                continue
            request = job.request
            assert request is not None
            job.position = chunk.end
            request.context_current_position = chunk.end
            request.is_first_context_chunk = False
            self.stats.prefill_tokens += chunk.end - chunk.start
            if chunk.completes_prompt:
                mgr.store_context_blocks(request)
                request.state = RequestState.GENERATION_IN_PROGRESS
                job.state = JobState.DECODE
                if not job.output:  # the prompt's first prefill (not a recompute)
                    job.cached_tokens = min(job.admitted_reused, len(job.prompt))
                    self.stats.reused_tokens += job.cached_tokens
                    self.stats.computed_tokens += len(job.prompt) - job.cached_tokens
                self._emit(job, request, tokens[chunk.request_id], now)
        for decode in batch.decodes:
            job = jobs.get(decode.request_id)
            if job is not None:
                assert job.request is not None
                self._emit(job, job.request, tokens[decode.request_id], now)

    def _emit(self, job: Job, request: LlmRequest, token: int, now: float) -> None:
        request.add_new_token(token)
        self.mgr.store_new_block(request)
        job.output.append(token)
        self.stats.generated_tokens += 1
        if job.first_token_s is None:
            job.first_token_s = now
            self.on_first_token(job)
        if len(job.output) >= job.max_tokens:
            self._release(job, store=True)
            self._finish(job, "length")
            self.stats.finished += 1
        else:
            job.updated.set()

    def _running_by_request_id(self) -> dict[int, Job]:
        return {job.request_id: job for job in self.running}

    def _release(self, job: Job, *, store: bool) -> None:
        """Give a running job's blocks back (stored for reuse first when ``store``)."""
        if job.request is not None and job.state in (JobState.PREFILL, JobState.DECODE):
            self.mgr.remove_sequence(job.request_id, job.request if store else None)
        job.request = None
        if job in self.running:
            self.running.remove(job)

    def _preempt(self, job: Job) -> None:
        """Free a running job's blocks and queue it again (recomputed later, mostly cached)."""
        logger.info(
            "worker %s: preempting %s (%d prompt + %d generated tokens): out of blocks",
            self.config.worker_id,
            job.job_id,
            len(job.prompt),
            len(job.output),
        )
        self._release(job, store=job.state is JobState.DECODE)
        job.num_preemptions += 1
        self.stats.preemptions += 1
        self._enqueue(job, preempted=True)  # ahead of every new arrival of its priority

    def _finish(self, job: Job, reason: Literal["length", "cancelled", "aborted", "error"]) -> None:
        job.state = JobState.FINISHED
        job.finish_reason = reason
        job.finished_s = self.clock()
        self.jobs.pop(job.job_id, None)
        job.updated.set()
        if not job.done.done():
            job.done.set_result(None)

    def _fail_step(self, batch: StepBatch) -> None:
        """A step raised: log it, fail the jobs it touched, keep the loop alive."""
        self.stats.errors += 1
        logger.exception(
            "worker %s: engine step failed; failing the requests of this step",
            self.config.worker_id,
        )
        ids = {c.request_id for c in batch.prefills} | {d.request_id for d in batch.decodes}
        for job in [job for job in self.running if job.request_id in ids]:
            try:
                self._release(job, store=False)
            except Exception:
                logger.exception(
                    "worker %s: could not release the blocks of %s",
                    self.config.worker_id,
                    job.job_id,
                )
                if job in self.running:
                    self.running.remove(job)
            job.error = "internal error in the engine step"
            self._finish(job, "error")
            self.stats.failed += 1

    def _publish(self) -> None:
        events = self.mgr.take_events()
        total_dropped = self.mgr.num_dropped_events
        dropped, self._dropped_seen = total_dropped - self._dropped_seen, total_dropped
        if events:
            self.recent_events.extend(events)
            self.stats.events += len(events)
        if self.publisher is not None and (events or dropped):
            self.publisher.publish(events, dropped=dropped)
        self._refresh_load()

    def _refresh_load(self) -> None:
        load = manager_load(self.mgr, num_waiting=self._num_waiting)
        load["running_requests"] = len(self.running)
        # Totals since start, so that a reader can compute a hit rate over any interval.
        load["reused_tokens"] = self.stats.reused_tokens
        load["computed_tokens"] = self.stats.computed_tokens
        load.update(self._speed_fields)
        self.load = load
