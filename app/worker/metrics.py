"""The worker's Prometheus metrics (``GET /metrics``), in a registry of its own per app.

Histograms (step time, time to first token) are observed by the engine's callbacks. Everything
else is read at scrape time from what the engine and the publisher already keep (the load
figures refreshed after every step, the engine's counters, the publisher's stats, and the
manager's statistics fetched through the engine just before the scrape), so the hot path pays
nothing for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app.worker.backend import StepBatch
from app.worker.engine import Engine, Job
from events.publisher import EventPublisher

__all__ = ["CONTENT_TYPE", "WorkerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class WorkerMetrics(Collector):
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.step_seconds = Histogram(
            "kvmesh_worker_step_seconds",
            "Wall time of one engine step (scheduling, model, bookkeeping)",
            buckets=_STEP_BUCKETS,
            registry=self.registry,
        )
        self.ttft_seconds = Histogram(
            "kvmesh_worker_time_to_first_token_seconds",
            "Arrival to first token, on the engine's clock",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self._bound: tuple[str, Engine, EventPublisher] | None = None
        self.kv_stats: Any = None  # the manager's KvCacheStats as of the last scrape

    def bind(self, worker_id: str, engine: Engine, publisher: EventPublisher) -> None:
        """What the scrape reads (made after these metrics, which the engine reports to)."""
        self._bound = (worker_id, engine, publisher)
        self.registry.register(self)

    def observe_step(self, seconds: float, batch: StepBatch) -> None:
        self.step_seconds.observe(seconds)

    def observe_ttft(self, job: Job) -> None:
        if job.first_token_s is not None:
            self.ttft_seconds.observe(job.first_token_s - job.arrival_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        if self._bound is None:
            return
        worker, engine, publisher_ = self._bound
        load = engine.load

        blocks = GaugeMetricFamily(
            "kvmesh_worker_blocks", "KV cache blocks by level and state", labels=["level", "state"]
        )
        for level in (0, 1):
            blocks.add_metric([str(level), "used"], load.get(f"used_blocks_{level}", 0))
            blocks.add_metric([str(level), "free"], load.get(f"free_blocks_{level}", 0))
        yield blocks
        yield GaugeMetricFamily(
            "kvmesh_worker_queue_depth", "Requests waiting for admission", value=engine.num_waiting
        )
        yield GaugeMetricFamily(
            "kvmesh_worker_running_sequences", "Sequences being computed", value=len(engine.running)
        )
        if self.kv_stats is not None:
            yield GaugeMetricFamily(
                "kvmesh_worker_cache_hit_rate",
                "Reused blocks / (reused + missed) blocks since start",
                value=self.kv_stats.cache_hit_rate,
            )
        stats = engine.stats
        prompt = CounterMetricFamily(
            "kvmesh_worker_prompt_tokens",
            "Prompt tokens whose KV cache was reused or computed",
            labels=["kind"],
        )
        prompt.add_metric(["reused"], stats.reused_tokens)
        prompt.add_metric(["computed"], stats.prefill_tokens)
        yield prompt
        yield CounterMetricFamily(
            "kvmesh_worker_generated_tokens", "Tokens generated", value=stats.generated_tokens
        )
        requests = CounterMetricFamily(
            "kvmesh_worker_requests", "Requests by outcome", labels=["outcome"]
        )
        for outcome, value in (
            ("finished", stats.finished),
            ("cancelled", stats.cancelled),
            ("failed", stats.failed),
        ):
            requests.add_metric([outcome], value)
        yield requests
        yield CounterMetricFamily(
            "kvmesh_worker_preemptions", "Requests preempted for lack of blocks", stats.preemptions
        )
        yield CounterMetricFamily(
            "kvmesh_worker_engine_errors", "Engine steps that raised", value=stats.errors
        )
        publisher = publisher_.stats()
        events = CounterMetricFamily(
            "kvmesh_worker_events", "KV events published or dropped", labels=["worker", "outcome"]
        )
        events.add_metric([worker, "published"], publisher["events"])
        events.add_metric([worker, "dropped"], publisher["dropped"])
        yield events
        yield GaugeMetricFamily(
            "kvmesh_worker_event_buffer_blocks",
            "Blocks of events waiting to be written to Redis",
            value=publisher["buffered_blocks"],
        )
