"""The router's Prometheus metrics (``GET /metrics``), in a registry of its own per app.

Decisions and proxied requests are counted as they happen; the rest (workers per state,
per-worker lag and in-flight figures, the consumer's counters) is read at scrape time from what
the runtime already keeps, so routing pays nothing for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from app.router.policy import Decision
    from app.router.service import RouterRuntime

__all__ = ["CONTENT_TYPE", "RouterMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)
_STATES = ("up", "stale", "draining", "cordoned")
# Consumer counters exported as they are: (stats key, metric suffix, help).
_CONSUMER_COUNTERS = (
    ("entries", "entries", "Stream entries applied to the index"),
    ("blocks", "blocks", "Block events applied to the index"),
    ("resyncs", "resyncs", "Resynchronisations from a snapshot"),
    ("malformed", "malformed", "Entries or events skipped as malformed"),
    ("expired", "expired", "Workers dropped because their heartbeat expired"),
    ("errors", "errors", "Redis errors while consuming"),
    ("yields", "yields", "Times a batch was split to give the event loop back"),
)


class RouterMetrics(Collector):
    def __init__(self, runtime: RouterRuntime) -> None:
        self._runtime = runtime
        self.registry = CollectorRegistry(auto_describe=False)
        self.decisions = Counter(
            "kvmesh_router_decisions",
            "Routing decisions, per policy and chosen worker",
            ["policy", "worker"],
            registry=self.registry,
        )
        self.stale_decisions = Counter(
            "kvmesh_router_stale_decisions",
            "Decisions whose chosen worker's index data or load was not fresh",
            ["worker"],
            registry=self.registry,
        )
        self.expected_cached_tokens = Counter(
            "kvmesh_router_expected_cached_tokens",
            "Prompt tokens the chosen workers were expected to reuse",
            ["worker"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "kvmesh_router_prompt_tokens", "Prompt tokens routed", registry=self.registry
        )
        self.decision_seconds = Histogram(
            "kvmesh_router_decision_seconds",
            "Time to decide: tokens to hashes to matches to costs to a choice",
            buckets=_DECISION_BUCKETS,
            registry=self.registry,
        )
        self.completions = Counter(
            "kvmesh_router_completions",
            "Proxied completions, per worker and HTTP status",
            ["worker", "status"],
            registry=self.registry,
        )
        self.retries = Counter(
            "kvmesh_router_retries",
            "Requests sent again to the next best worker after a failure",
            registry=self.registry,
        )
        self.registry.register(self)

    def observe_decision(self, decision: Decision, seconds: float, num_tokens: int) -> None:
        self.decisions.labels(policy=decision.policy, worker=decision.worker).inc()
        if not decision.fresh:
            self.stale_decisions.labels(worker=decision.worker).inc()
        self.expected_cached_tokens.labels(worker=decision.worker).inc(
            decision.expected_cached_tokens
        )
        self.prompt_tokens.inc(num_tokens)
        self.decision_seconds.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        runtime = self._runtime
        states = GaugeMetricFamily(
            "kvmesh_router_workers", "Workers the router may route to, per state", labels=["state"]
        )
        views = runtime.core.workers.values()
        for state in _STATES:
            states.add_metric([state], sum(1 for v in views if v.state == state))
        yield states
        lag = GaugeMetricFamily(
            "kvmesh_router_index_lag_ms",
            "Age of the oldest stream entry of a worker not applied yet",
            labels=["worker"],
        )
        inflight = GaugeMetricFamily(
            "kvmesh_router_inflight_requests",
            "Requests the router sent to a worker that have not ended",
            labels=["worker"],
        )
        queued = GaugeMetricFamily(
            "kvmesh_router_inflight_prefill_tokens",
            "Prompt tokens the router sent to a worker that are not prefilled yet",
            labels=["worker"],
        )
        for view in views:
            status = runtime.status.get(view.worker)
            lag.add_metric([view.worker], status.lag_ms if status is not None else 0.0)
            inflight.add_metric([view.worker], view.inflight_running)
            queued.add_metric([view.worker], view.inflight_prefill_tokens)
        yield lag
        yield inflight
        yield queued
        cordons = GaugeMetricFamily(
            "kvmesh_router_worker_cordon",
            "1 for each worker an operator cordoned or drains (state: cordoned, draining, or "
            "drained once nothing is left in flight there)",
            labels=["worker", "state"],
        )
        for worker in sorted(runtime.cordons):
            report = runtime.cordon_report(worker) or {}
            state = "drained" if report.get("done") else str(report.get("state"))
            cordons.add_metric([worker, state], 1)
        yield cordons
        stats = runtime.consumer.stats()
        for key, suffix, text in _CONSUMER_COUNTERS:
            yield CounterMetricFamily(f"kvmesh_router_consumer_{suffix}", text, value=stats[key])
        yield GaugeMetricFamily(
            "kvmesh_router_consumer_apply_lag_ms",
            "Age of the last stream entry applied, when it was applied",
            value=stats["apply_lag_ms"],
        )
        yield GaugeMetricFamily(
            "kvmesh_router_index_blocks",
            "Distinct block hashes in the index",
            value=len(runtime.index),
        )
