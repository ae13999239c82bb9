"""``kvmesh bench faults``: registered, its pieces, and one ``--quick --json`` run end to end,
whose every scenario's outcome is asserted exactly here (each runs once in the suite).

Real processes: a private ``redis-server``, ``kvmesh worker`` and ``kvmesh router`` per
scenario. A request either completes, or is rejected (429/503) or fails (502, or an error event
ending its stream) with OpenAI's error body; ``unclear`` counts everything else (a hang, a
dropped connection, a 500): it must be 0 everywhere.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from app.bench import BENCHMARKS, load_benchmark
from app.bench.faults import (
    Outcome,
    counts_of,
    rss_kib,
    run,
    summarize,
    synthetic_events,
    synthetic_tree,
)
from cache import StoredData
from tests.app.bench_cli import run_quick_bench


def test_registered() -> None:
    assert BENCHMARKS["faults"] == "app.bench.faults:run"
    assert load_benchmark("faults") is run


def test_summarize_counts_each_kind_and_times_only_the_completed() -> None:
    outcomes = [
        Outcome(0, False, due=1.0, ended=1.010, status=200, kind="completed"),
        Outcome(1, True, due=2.0, ended=2.030, status=200, kind="completed"),
        Outcome(2, False, due=3.0, ended=3.500, status=503, kind="rejected"),
        Outcome(3, True, due=4.0, ended=4.100, status=200, kind="failed"),
        Outcome(4, False, due=5.0, ended=35.0, kind="unclear", detail="no answer within 30 s"),
    ]
    summary = summarize(outcomes)
    assert {k: summary[k] for k in ("requests", "streaming", "completed", "rejected")} == {
        "requests": 5,
        "streaming": 2,
        "completed": 2,
        "rejected": 1,
    }
    assert (summary["failed"], summary["unclear"]) == (1, 1)
    assert summary["unclear_samples"] == ["no answer within 30 s"]
    assert (summary["p50_ms"], summary["max_ms"]) == (30.0, 30.0)


def test_synthetic_blocks_are_what_the_tree_says() -> None:
    events = synthetic_events(3, 1_000)
    blocks = [b for e in events if isinstance(e.data, StoredData) for b in e.data.blocks]
    assert [e.event_id for e in events] == list(range(16))  # 15 chains of 64, one of 40
    assert {b.block_hash: b.cache_level for b in blocks} == synthetic_tree(3, 1_000)
    assert counts_of(synthetic_tree(3, 1_000)) == {"blocks": 1_000, "gpu": 768, "host": 232}


def test_rss_of_this_process_and_of_none() -> None:
    kib = rss_kib(os.getpid())
    assert kib is not None and kib > 1_000
    assert rss_kib(None) is None


HEARTBEAT_TTL_S = 2.0  # the kill scenario's
# The consumer checks heartbeats every 0.5 s and the router syncs every 20 ms; polling adds
# 20 ms more. A heartbeat key outlives the last beat by at most its TTL.
DETECTION_SLACK_S = 1.0
pytestmark = pytest.mark.timeout(420)  # the fixture's one run counts against the first test


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    """One ``kvmesh bench faults --quick --json`` run, as a user runs it."""
    return run_quick_bench("faults", timeout_s=400)


def test_kill_9_of_a_worker_under_load(report: dict[str, Any]) -> None:
    result = report["kill_worker"]
    assert (result["requests"], result["heartbeat_ttl_s"]) == (150, HEARTBEAT_TTL_S)
    # Nothing hung, and every request that did not complete was told why.
    assert result["unclear"] == 0, result["unclear_samples"]
    assert result["completed"] + result["failed"] == result["requests"] == 150
    assert result["rejected"] == 0  # two workers were left throughout
    # The kill hit requests in flight. Those waiting for a whole answer were retried on
    # another worker; only streams already under way could fail, each with an error event.
    assert result["in_flight_at_kill"] > 0
    assert result["failed"] == result["in_flight_failed"] == result["in_flight_failed_streams"]
    assert result["in_flight_completed"] == result["in_flight_at_kill"] - result["failed"]
    assert result["router_retries"] >= 1
    # Out of rotation and out of the index within the heartbeat TTL (plus the check interval);
    # no request went to it afterwards.
    assert result["victim_blocks_before"] > 0
    assert result["gone_after_s"] <= HEARTBEAT_TTL_S + DETECTION_SLACK_S
    assert result["unindexed_after_s"] <= HEARTBEAT_TTL_S + DETECTION_SLACK_S
    assert result["sent_to_victim_after_gone"] == 0
    assert result["routable_at_end"] == result["survivors"] == ["w1", "w2"]


def test_redis_killed_and_restarted_empty_under_load(report: dict[str, Any]) -> None:
    result = report["redis_restart"]
    assert (result["workers"], result["heartbeat_ttl_s"]) == (3, 6.0)
    # Every request answered 200: none hung, none failed, and none was told "no worker is up"
    # while the workers registered again (the registry and heartbeats restart empty too).
    assert result["statuses"] == {"200": 1_000}, result["unclear_samples"]
    assert (result["completed"], result["rejected"], result["failed"]) == (1_000, 0, 0)
    # A worker's first /ready once Redis answers is 200 (not a dead pooled connection's 503).
    assert result["worker_ready_after_restart"] == {"w0": 200, "w1": 200, "w2": 200}
    # The workers kept serving through the outage (the router routes on what it last knew).
    assert result["outage_requests"] > 0
    assert result["outage_completed"] == result["outage_requests"] - result["outage_rejected"]
    # No event was lost: the publishers buffered, then wrote fresh snapshots that every
    # router loaded, one resynchronisation per worker, and nothing else.
    assert result["publisher_dropped"] == 0
    assert result["publisher_snapshots"] >= 2 * 3
    assert result["observer_redis_restarts"] == result["router_redis_restarts"] == 1
    assert result["observer_resync_reasons"] == {"redis_restart": 3}
    assert result["router_resyncs"] == 3
    assert result["observer_malformed"] == 0
    # Recovered, then exact: the in-process router's index equals every worker's reuse tree
    # block by block and tier by tier, the routing router's counts per worker and tier too.
    assert result["recovered_s"] < 5.0
    assert result["index_exact"] is True
    assert sorted(result["blocks"]) == ["w0", "w1", "w2"]
    assert all(counts["blocks"] > 0 for counts in result["blocks"].values())


def test_a_router_restarted_rebuilds_the_exact_index(report: dict[str, Any]) -> None:
    result = report["router_restart"]
    # Both starts were ready with every worker's blocks per tier (the scenario waits for it);
    # the first rebuilt them from the streams, the restart from the snapshots alone.
    assert result["entries"] == 20_000
    assert result["cold_start_consumer"]["snapshot_loads"] == 4
    assert result["cold_start_consumer"]["entries"] >= 4
    assert result["cold_start_consumer"]["resyncs"] == 0
    assert result["restart_consumer"] == {
        "snapshot_loads": 4,
        "entries": 0,
        "skipped_entries": 0,
        "resyncs": 0,
    }
    assert result["restart_ready_s"] < 30.0
    assert result["index_exact"] is True
    assert result["cold_start_ready_s"] > 0


def test_a_publisher_cut_off_until_its_buffer_overflows(report: dict[str, Any]) -> None:
    result = report["publisher_cut_off"]
    assert result["dropped_events"] > 0
    # The count reached the consumer in the stream, which resynchronised once from the
    # snapshot written after the loss; every event lost is accounted for by that snapshot.
    assert result["dropped_in_stream"] == result["dropped_events"]
    assert result["publisher_snapshots"] == 2  # at start, and after the loss
    assert result["resync_reasons"] == {"dropped": 1}
    assert (result["malformed"], result["expired"]) == (0, 0)
    assert result["index_exact"] == {"w0": True, "w1": True}
    assert result["recovered_s"] < 5.0


def test_load_and_memory(report: dict[str, Any]) -> None:
    load = report["load"]
    assert load["requests"] == load["completed"] + load["rejected"] == 200
    assert load["unclear"] == load["failed"] == 0
    assert load["p99_ms"] >= load["p50_ms"] > 0
    assert set(load["rss_max_mib"]) == {"router", "w0", "w1", "w2", "w3", "redis", "client"}
    # The bounds docs/reliability.md states (sim workers import torch: about 380 MiB each).
    assert load["rss_max_mib"]["router"] < 400
    assert max(load["rss_max_mib"][w] for w in ("w0", "w1", "w2", "w3")) < 600


def test_publishers_into_one_consumer(report: dict[str, Any]) -> None:
    publishers = report["publishers"]
    assert publishers["publishers"] == 8
    assert publishers["index_exact"] is True
    assert (publishers["dropped"], publishers["resyncs"], publishers["malformed"]) == (0, 0, 0)
    assert report["cpus"] == os.cpu_count()
