"""Prometheus metrics of a ``ClusterView``, read at scrape time from what the view keeps.

The router registers this collector beside its own counters; the standalone dashboard serves
it alone. The names keep the ``kvmesh_router_`` prefix they had when only the router followed
the cluster: dashboards and alerts written against them still match.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app.cluster.view import ClusterView

__all__ = ["CONTENT_TYPE", "STATES", "ClusterMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STATES = ("up", "stale", "draining", "cordoned")
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


class ClusterMetrics(Collector):
    """``states``: each worker's state as the reader sees it (the router: the workers it may
    route to); ``routed``: what a router has in flight on a worker (0 for the dashboard)."""

    def __init__(
        self,
        view: ClusterView,
        states: Callable[[], Mapping[str, str]],
        routed: Callable[[str], int] = lambda worker: 0,
    ) -> None:
        self._view = view
        self._states = states
        self._routed = routed

    def collect(self) -> Iterator[Metric]:
        view = self._view
        states = GaugeMetricFamily(
            "kvmesh_router_workers", "Workers the router may route to, per state", labels=["state"]
        )
        counts = Counter(self._states().values())
        for state in STATES:
            states.add_metric([state], counts[state])
        yield states
        lag = GaugeMetricFamily(
            "kvmesh_router_index_lag_ms",
            "Age of the oldest stream entry of a worker not applied yet",
            labels=["worker"],
        )
        for worker, member in sorted(view.members.items()):
            lag.add_metric([worker], member.lag_ms)
        yield lag
        cordons = GaugeMetricFamily(
            "kvmesh_router_worker_cordon",
            "1 for each worker an operator cordoned or drains (state: cordoned, draining, or "
            "drained once nothing is left in flight there)",
            labels=["worker", "state"],
        )
        for worker in sorted(view.cordons):
            report = view.cordon_report(worker, routed=self._routed(worker)) or {}
            state = "drained" if report.get("done") else str(report.get("state"))
            cordons.add_metric([worker, state], 1)
        yield cordons
        stats = view.consumer.stats()
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
            value=len(view.index),
        )
