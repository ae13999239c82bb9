from __future__ import annotations

import numpy as np

from app.bench import BENCHMARKS, load_benchmark
from app.bench.index import (
    NUM_EVENTS_QUICK,
    NUM_REQUESTS_QUICK,
    NUM_WORKERS,
    REQUEST_TOKENS,
    TOKENS_PER_BLOCK,
    make_requests,
    make_workload,
    run,
)
from cache import StoredData, block_hashes_for_tokens
from events.codec import decode_events
from events.index import PrefixIndex
from tests.app.bench_cli import run_quick_bench

KEYS = {
    "apply_events_per_s",
    "apply_blocks_per_s",
    "match_p50_us",
    "match_p99_us",
    "hash_and_match_p50_us",
    "bytes_per_block",
    "events",
    "blocks",
    "workers",
}


def test_registered() -> None:
    assert BENCHMARKS["index"] == "app.bench.index:run"
    assert load_benchmark("index") is run


def test_workload_is_chained_chat_sessions() -> None:
    workload = make_workload(300)
    assert make_workload(300).entries == workload.entries  # seeded
    assert len(workload.entries) == 300
    index = PrefixIndex()
    num_blocks = 0
    for worker, blob in workload.entries:
        (event,) = decode_events(blob)
        assert isinstance(event.data, StoredData)
        parent = event.data.parent_hash
        # Every event continues a chain its worker already holds (or starts at the root).
        assert parent is None or parent in index.worker_blocks(worker)
        index.apply_event(worker, event)
        num_blocks += len(event.data.blocks)
    assert num_blocks == workload.num_blocks == index.stats()["entries"]  # nothing stored twice
    assert len(index.workers()) == NUM_WORKERS
    # Requests: continued conversations and shared system prompts hit; cold ones miss.
    requests = make_requests(workload, 40)
    assert all(len(r) == REQUEST_TOKENS for r in requests)
    best = [
        max(index.find_matches(block_hashes_for_tokens(r, TOKENS_PER_BLOCK)).values(), default=0)
        for r in requests
    ]
    assert all(b == 0 for b in best[3::4])
    assert all(b >= 512 // TOKENS_PER_BLOCK for b in best[2::4])
    assert np.mean([b for k, b in enumerate(best) if k % 4 < 2]) > 40


def test_quick_run_from_the_command_line() -> None:
    report = run_quick_bench("index")
    assert report.keys() >= KEYS
    assert report["events"] == NUM_EVENTS_QUICK
    assert report["workers"] == NUM_WORKERS
    assert report["requests"] == NUM_REQUESTS_QUICK
    assert report["entries"] == report["blocks"] > NUM_EVENTS_QUICK
    for key in KEYS - {"events", "blocks", "workers"}:
        assert isinstance(report[key], int | float) and report[key] > 0, key
    assert report["match_p50_us"] <= report["match_p99_us"]
