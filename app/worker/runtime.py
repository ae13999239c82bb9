"""``WorkerRuntime``: everything one worker process owns, and its lifecycle. No FastAPI here.

``WorkerRuntime.start(settings)`` builds, in order: the embedded Redis when no URL is given
(else it checks that Redis takes the URL's credentials: ``app.core.redis``), the
``KVCacheManager`` and its torch pools, the back-end, the engine, and the
``EventPublisher`` (whose start writes the first snapshot, the registry entry and the
heartbeat); then it starts the engine task. ``aclose`` stops admitting, stops the engine,
flushes the events and unregisters (the publisher's ``aclose``), and stops the embedded Redis.
An operator's drain (``admin_drain``) stops admitting without stopping; ``admin_resume`` undoes
it. ``app.worker.app`` serves a runtime over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from app.chat import ModelTokenizer
from app.core.embedded_redis import EmbeddedRedis
from app.core.redis import RedisCredentialsError, check_credentials
from app.core.serving import settle_heap
from app.core.sim_timing import SimTiming
from app.worker.backend import Backend, SimBackend
from app.worker.engine import Engine, EngineConfig, Job, VirtualClock
from app.worker.metrics import WorkerMetrics
from app.worker.settings import WorkerSettings
from cache import KVCacheManager, block_hashes_for_tokens
from events.publisher import EventPublisher, PublisherConfig, manager_registry_entry
from events.redis_io import redacted_url, redis_client
from events.snapshot import manager_snapshot

__all__ = ["WorkerRuntime", "build_backend", "build_manager"]

logger = logging.getLogger(__name__)

# Events the manager may hold between two drains (one step); the engine drains every step.
EVENT_BUFFER = 1_000_000


def build_manager(settings: WorkerSettings) -> KVCacheManager:
    shape = settings.shape
    primary, secondary = settings.blocks_per_level()
    return KVCacheManager(
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        tokens_per_block=shape.tokens_per_block,
        blocks_per_window={shape.max_seq_len: (primary, secondary)},
        max_num_sequences=settings.max_batch_size,
        max_sequence_length=shape.max_seq_len,
        dtype=settings.torch_dtype,
        device=settings.device,
        enable_block_reuse=settings.enable_block_reuse,
        enable_partial_reuse=settings.enable_partial_reuse,
        event_buffer_max_size=EVENT_BUFFER,
        allocate_pools=settings.allocate_pools,
        report_leaf_takeover=True,  # the stream stays exact for the routers' index
    )


def build_backend(
    settings: WorkerSettings, mgr: KVCacheManager, output_vocab: int | None = None
) -> Backend:
    """The model back-end; the sim one generates ids below ``output_vocab`` (the tokenizer's,
    so that a chat's answer decodes to text; default: the model's vocabulary)."""
    shape = settings.shape
    if settings.engine == "torch":
        from app.worker.torch_backend import TinyDecoder, TinyDecoderConfig, TorchBackend

        config = TinyDecoderConfig(
            num_layers=shape.num_layers,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            vocab_size=shape.vocab_size,
            dtype=settings.torch_dtype,
        )
        return TorchBackend(mgr, TinyDecoder(config))
    timing = SimTiming(
        step_overhead_s=settings.sim_step_overhead_ms / 1e3,
        prefill_s_per_token=settings.sim_prefill_us_per_token / 1e6,
        decode_s_per_sequence=settings.sim_decode_us_per_sequence / 1e6,
    )
    return SimBackend(output_vocab or shape.vocab_size, timing)


@dataclass(eq=False)
class WorkerRuntime:
    settings: WorkerSettings
    mgr: KVCacheManager
    backend: Backend
    engine: Engine
    publisher: EventPublisher
    metrics: WorkerMetrics
    redis: Redis
    embedded_redis: EmbeddedRedis | None = None
    engine_task: asyncio.Task[None] | None = None
    started_at: float = field(default_factory=time.time)
    shutting_down: bool = False  # drain() began: SIGTERM, or the app's lifespan ending
    tokenizer: ModelTokenizer | None = None  # --tokenizer: text prompts and chat

    @property
    def capacity_blocks(self) -> int:
        """Primary blocks of the cache: fixed at start, so handlers may read it."""
        return self._capacity_blocks

    def __post_init__(self) -> None:
        self._capacity_blocks = self.mgr.get_max_num_blocks()

    @classmethod
    async def start(cls, settings: WorkerSettings) -> WorkerRuntime:
        embedded: EmbeddedRedis | None = None
        redis_url = settings.redis_url
        if redis_url is None:
            embedded = await asyncio.to_thread(EmbeddedRedis().start)
            redis_url = embedded.url
            logger.info(
                "worker %s: started a private redis-server at %s", settings.worker_id, redis_url
            )
        redis = redis_client(redis_url, socket_timeout=1.0)
        try:
            await check_credentials(redis, f"worker {settings.worker_id}")
        except RedisCredentialsError:
            await redis.aclose()
            raise
        tokenizer = None
        if settings.tokenizer is not None:
            tokenizer = await asyncio.to_thread(ModelTokenizer.load, settings.tokenizer)
        mgr = build_manager(settings)
        backend = build_backend(settings, mgr, tokenizer.vocab_size if tokenizer else None)
        # The hasher is compiled on first use (numba): pay that now, not in the first request.
        await asyncio.to_thread(
            block_hashes_for_tokens, list(range(2 * mgr.tokens_per_block)), mgr.tokens_per_block
        )
        shape = settings.shape
        config = EngineConfig(
            max_batch_size=settings.max_batch_size,
            max_tokens_per_step=settings.max_tokens_per_step,
            max_queue_len=settings.max_queue_len,
            max_seq_len=shape.max_seq_len,
            scheduler=settings.scheduler,
            events_ring_blocks=settings.events_ring_blocks,
            worker_id=settings.worker_id,
        )
        metrics = WorkerMetrics()
        clock = VirtualClock() if settings.virtual_clock else time.monotonic
        engine = Engine(
            mgr,
            backend,
            config,
            clock=clock,
            on_step=metrics.observe_step,
            on_first_token=metrics.observe_ttft,
        )
        registry = manager_registry_entry(mgr, url=settings.url, device=settings.device)
        registry.update(
            engine=settings.engine,
            model=settings.model_name,
            preset=settings.model,
            vocab_size=shape.vocab_size,
            max_seq_len=shape.max_seq_len,
        )
        publisher = EventPublisher(
            redis_url,
            settings.worker_id,
            PublisherConfig(
                maxlen=settings.stream_maxlen,
                retain_s=settings.stream_retain_s,
                heartbeat_ttl_s=settings.heartbeat_ttl_s,
                heartbeat_interval_s=min(1.0, settings.heartbeat_ttl_s / 3),
                load_interval_s=0.5,
            ),
            snapshot_source=lambda: manager_snapshot(mgr),
            registry_entry=registry,
            load_source=lambda: engine.load,
        )
        engine.publisher = publisher
        runtime = cls(
            settings,
            mgr,
            backend,
            engine,
            publisher,
            metrics,
            redis,
            embedded,
        )
        runtime.tokenizer = tokenizer
        metrics.bind(settings.worker_id, engine, publisher)
        await publisher.start()
        settle_heap()  # every block of the pool, its key and links live as long as the process
        runtime.engine_task = asyncio.create_task(
            engine.run(), name=f"kvmesh-engine-{settings.worker_id}"
        )
        runtime.engine_task.add_done_callback(runtime._engine_done)
        primary, secondary = settings.blocks_per_level()
        logger.info(
            "worker %s: serving at %s (engine %s, model %s, %d GPU + %d host blocks of %d tokens)",
            settings.worker_id,
            settings.url,
            settings.engine,
            settings.model_name,
            primary,
            secondary,
            shape.tokens_per_block,
        )
        if publisher.registered:
            logger.info("worker %s: ready (registered in Redis)", settings.worker_id)
        else:
            # Serving, but no router can see it: say so, not "ready" (/ready answers 503).
            logger.warning(
                "worker %s: not ready: Redis at %s does not answer, so no router can see this "
                "worker; retrying in the background (GET /ready is 503 until it registers)",
                settings.worker_id,
                redacted_url(redis_url),
            )
        return runtime

    def _engine_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error(
                "worker %s: the engine task died",
                self.settings.worker_id,
                exc_info=task.exception(),
            )

    @property
    def engine_alive(self) -> bool:
        return self.engine_task is not None and not self.engine_task.done()

    async def redis_ok(self) -> bool:
        try:
            async with asyncio.timeout(1.0):
                await self.redis.ping()
        except Exception:
            return False
        return True

    def drain_report(self) -> dict[str, Any]:
        """Whether the worker admits new requests, and what is left in flight (``done``: none)."""
        engine = self.engine
        running, waiting = len(engine.running), engine.num_waiting
        return {
            "draining": engine.draining,
            "shutting_down": self.shutting_down,
            "running": running,
            "waiting": waiting,
            "done": engine.draining and not engine.jobs,
        }

    def admin_drain(self) -> dict[str, Any]:
        """An operator's drain (``POST /drain``): admit nothing new (503), let what is in flight
        finish, stay up; routers see ``draining`` in the registry at the next heartbeat."""
        if not self.engine.draining:
            self.engine.draining = True
            self.engine.drain_reason = "the worker is draining (an operator asked for it)"
            self.publisher.update_registry(draining=True)
            logger.info(
                "worker %s: draining on request (%d in flight)",
                self.settings.worker_id,
                len(self.engine.jobs),
            )
        return self.drain_report()

    def admin_resume(self) -> dict[str, Any]:
        """Undo ``admin_drain`` (``POST /resume``); a shutdown cannot be undone (ValueError)."""
        if self.shutting_down:
            raise ValueError("the worker is shutting down; it cannot resume")
        if self.engine.draining:
            self.engine.draining = False
            self.publisher.update_registry(draining=False)
            logger.info("worker %s: admitting again", self.settings.worker_id)
        return self.drain_report()

    async def drain(self) -> None:
        """Stop admitting, let in-flight requests finish (or abort them), flush the events."""
        settings = self.settings
        self.shutting_down = True
        self.engine.draining = True
        self.engine.drain_reason = "the worker is shutting down"
        # Routers read it with the next heartbeat and stop sending new requests here.
        self.publisher.update_registry(draining=True)
        logger.info(
            "worker %s: draining %d request(s) (at most %.1f s)",
            settings.worker_id,
            len(self.engine.jobs),
            settings.drain_timeout_s,
        )
        aborted = await self.engine.drain(settings.drain_timeout_s)
        if aborted:
            logger.warning(
                "worker %s: aborted %d request(s) at shutdown", settings.worker_id, aborted
            )
        if self.publisher.registered:  # else aclose makes the one last attempt
            with contextlib.suppress(TimeoutError):
                await self.publisher.flush(timeout=self.publisher.close_timeout_s)

    async def aclose(self) -> None:
        if not self.shutting_down:
            await self.drain()
        self.engine.stop()
        if self.engine_task is not None:
            await asyncio.gather(self.engine_task, return_exceptions=True)
        await self.publisher.aclose()
        await self.redis.aclose()
        if self.embedded_redis is not None:
            await asyncio.to_thread(self.embedded_redis.stop)
        logger.info("worker %s: stopped", self.settings.worker_id)

    def job_for(self, job_id: str) -> Job | None:
        return self.engine.jobs.get(job_id)
