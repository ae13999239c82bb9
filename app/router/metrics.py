"""The router's Prometheus metrics (``GET /metrics``), in a registry of its own per app.

Proxied requests are counted as they happen, decisions noted as they happen and counted at the
next scrape (or every ``_FOLD_EVERY``, 64); the rest is read at scrape time from what the runtime
already keeps, so routing pays nothing for it: the in-flight figures here, and
the cluster's (workers per state, per-worker lag, cordons, the consumer's counters) by
``app.cluster.metrics.ClusterMetrics``, registered beside them.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app.cluster.metrics import CONTENT_TYPE, ClusterMetrics
from app.cluster.view import ClusterView
from app.router.core import RouterCore
from app.router.policies import Decision

__all__ = ["CONTENT_TYPE", "RouterMetrics"]

# Decisions noted before they are counted, at the latest: a fold of 64 is ~0.1 ms on the loop
# (one of 1,024 was 2-3 ms, a stall in the request that made it).
_FOLD_EVERY = 64
_DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)


class RouterMetrics(Collector):
    def __init__(self, core: RouterCore, view: ClusterView) -> None:
        self._core = core
        # (policy, worker) -> its decisions' and expected cached tokens' counters (children are
        # never removed, so they can be kept)
        self._children: dict[tuple[str, str], tuple[Counter, Counter]] = {}
        self._completed: dict[tuple[str, int], Counter] = {}  # (worker, status) -> child
        # Decisions not counted yet (``observe_decision``): (policy, worker, fresh, expected
        # cached tokens, seconds, prompt tokens).
        self._pending: list[tuple[str, str, bool, int, float, int]] = []
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
            "Proxied completions, per worker and HTTP status (499: the client left first)",
            ["worker", "status"],
            registry=self.registry,
        )
        self.retries = Counter(
            "kvmesh_router_retries",
            "Requests sent again to the next best worker after a failure",
            registry=self.registry,
        )
        self.registry.register(self)
        self.registry.register(
            ClusterMetrics(
                view,
                states=lambda: {w: v.state for w, v in core.workers.items()},
                routed=lambda w: v.inflight_running if (v := core.workers.get(w)) else 0,
            )
        )

    def observe_decision(self, decision: Decision, seconds: float, num_tokens: int) -> None:
        """Noted now, counted at the next scrape (``render``) or with the ``_FOLD_EVERY``
        decisions noted before it: the five locked counter updates (~7 µs a decision in a busy
        router, its caches cold) run later, in one warm loop. The counters are exact at each
        ``render``; read directly they may lag by up to ``_FOLD_EVERY`` - 1 decisions. Both
        run on the event loop's thread."""
        pending = self._pending
        pending.append(
            (
                decision.policy,
                decision.worker,
                decision.fresh,
                decision.expected_cached_tokens,
                seconds,
                num_tokens,
            )
        )
        if len(pending) >= _FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        """Count the decisions noted since the last fold."""
        pending, self._pending = self._pending, []
        children = self._children
        for policy, worker, fresh, expected_tokens, seconds, num_tokens in pending:
            kept = children.get((policy, worker))
            if kept is None:  # ``labels()`` per decision was a third of its cost
                kept = children[(policy, worker)] = (
                    self.decisions.labels(policy=policy, worker=worker),
                    self.expected_cached_tokens.labels(worker=worker),
                )
            decided, expected = kept
            decided.inc()
            if not fresh:
                self.stale_decisions.labels(worker=worker).inc()
            expected.inc(expected_tokens)
            self.prompt_tokens.inc(num_tokens)
            self.decision_seconds.observe(seconds)

    def count_completion(self, worker: str, status: int) -> None:
        """One proxied completion ended with ``status`` (``labels()`` a request was ~3 µs)."""
        child = self._completed.get((worker, status))
        if child is None:
            child = self._completed[(worker, status)] = self.completions.labels(
                worker=worker, status=str(status)
            )
        child.inc()

    def render(self) -> bytes:
        self._fold()
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        """What only the router knows: what it sent to each worker and has not seen end."""
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
        for view in self._core.workers.values():
            inflight.add_metric([view.worker], view.inflight_running)
            queued.add_metric([view.worker], view.inflight_prefill_tokens)
        yield inflight
        yield queued
