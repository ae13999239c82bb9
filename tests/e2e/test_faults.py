"""Faults injected into real processes, each with its measured outcome asserted exactly.

The scenarios are ``app.bench.faults``'s (one copy: ``kvmesh bench faults`` runs them with
larger numbers and prints the figures for ``docs/reliability.md``); here they run small, each
with its own private ``redis-server``, ``kvmesh worker`` and ``kvmesh router`` processes.

* ``kill -9`` of a worker under load through a router;
* the Redis server killed and restarted, empty, under load;
* a router killed and restarted over W workers x B blocks;
* a publisher cut off from Redis until its buffer overflows (the same path, with a real
  ``KVCacheManager`` and a bare consumer, is
  ``tests/events/test_publisher_consumer.py::test_drop_path_snapshot_and_resync_while_redis_refuses_the_worker``).

A request either completes, or is rejected (429/503) or fails (502, or an error event ending
its stream) with OpenAI's error body; ``unclear`` counts everything else (a hang, a dropped
connection, a 500): it must be 0 everywhere.
"""

from __future__ import annotations

from app.bench.faults import (
    kill_worker_under_load,
    publisher_cut_off,
    redis_restart_under_load,
    router_restart,
)

HEARTBEAT_TTL_S = 2.0
# The consumer checks heartbeats every 0.5 s and the router syncs every 20 ms; polling adds
# 20 ms more. A heartbeat key outlives the last beat by at most its TTL.
DETECTION_SLACK_S = 1.0


def test_kill_9_of_a_worker_under_load() -> None:
    result = kill_worker_under_load(
        num_workers=3, num_requests=150, rate=50.0, heartbeat_ttl_s=HEARTBEAT_TTL_S
    )
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


def test_redis_killed_and_restarted_empty_under_load() -> None:
    # 1,000 requests in 5 s; Redis is killed 1.5 s in, away 0.5 s, back empty. A 6 s TTL
    # makes the workers beat once a second: the registry stays empty for up to a second after
    # the restart, long enough that a router forgetting them would answer 503 (it did, in about
    # half the runs, before the consumer held them).
    result = redis_restart_under_load(
        num_workers=3, num_requests=1_000, rate=200.0, outage_s=0.5, heartbeat_ttl_s=6.0
    )
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


def test_a_router_restarted_rebuilds_the_exact_index() -> None:
    result = router_restart(num_workers=4, num_blocks=5_000)
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


def test_a_publisher_cut_off_until_its_buffer_overflows() -> None:
    result = publisher_cut_off(num_blocks=2_048, buffer_blocks=256)
    assert result["dropped_events"] > 0
    # The count reached the consumer in the stream, which resynchronised once from the
    # snapshot written after the loss; every event lost is accounted for by that snapshot.
    assert result["dropped_in_stream"] == result["dropped_events"]
    assert result["publisher_snapshots"] == 2  # at start, and after the loss
    assert result["resync_reasons"] == {"dropped": 1}
    assert (result["malformed"], result["expired"]) == (0, 0)
    assert result["index_exact"] == {"w0": True, "w1": True}
    assert result["recovered_s"] < 5.0
