"""``kvmesh bench faults``: registered, its pieces, and one ``--quick --json`` run end to end.

The fault scenarios' outcomes are asserted exactly in ``tests/e2e/test_faults.py``; here the
quick run must finish, report every figure ``docs/reliability.md`` quotes, and hold the same
invariants: nothing unclear, nothing lost that a resync did not account for, indexes exact.
"""

from __future__ import annotations

import os

import pytest

from app.bench import BENCHMARKS, load_benchmark
from app.bench.faults import (
    QUICK,
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


@pytest.mark.timeout(300)
def test_quick_run() -> None:
    report = run_quick_bench("faults")
    kill = report["kill_worker"]
    assert kill["requests"] == QUICK["kill_worker"]["num_requests"]
    assert kill["unclear"] == 0 and kill["sent_to_victim_after_gone"] == 0
    assert kill["completed"] + kill["failed"] == kill["requests"]
    # The TTL, the router's 100 ms load read, and the bench's own polling of /workers, all on a
    # 2-core machine that is also running the load, the workers and Redis: 3.15 s was seen.
    assert kill["gone_after_s"] <= kill["heartbeat_ttl_s"] + 2.0
    restart = report["redis_restart"]
    assert (restart["unclear"], restart["failed"], restart["publisher_dropped"]) == (0, 0, 0)
    assert restart["index_exact"] is True and restart["recovered_s"] > 0
    router = report["router_restart"]
    assert router["index_exact"] is True
    assert router["entries"] == 4 * 2_000
    assert router["cold_start_ready_s"] > 0 and router["restart_ready_s"] > 0
    cut = report["publisher_cut_off"]
    assert cut["dropped_events"] == cut["dropped_in_stream"] > 0
    assert cut["resync_reasons"] == {"dropped": 1}
    assert cut["index_exact"] == {"w0": True, "w1": True}
    load = report["load"]
    assert load["requests"] == load["completed"] + load["rejected"] == 200
    assert load["unclear"] == load["failed"] == 0
    assert load["p99_ms"] >= load["p50_ms"] > 0
    assert set(load["rss_max_mib"]) == {"router", "w0", "w1", "w2", "w3", "redis", "client"}
    # The bounds docs/reliability.md states (sim workers import torch: about 380 MiB each).
    assert load["rss_max_mib"]["router"] < 400
    assert max(load["rss_max_mib"][w] for w in ("w0", "w1", "w2", "w3")) < 600
    publishers = report["publishers"]
    assert publishers["publishers"] == 8
    assert publishers["index_exact"] is True
    assert (publishers["dropped"], publishers["resyncs"], publishers["malformed"]) == (0, 0, 0)
    assert publishers["consumer_rss_max_mib"] < 400
    assert publishers["lag_max_ms"] > 0
