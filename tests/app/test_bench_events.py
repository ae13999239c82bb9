"""``kvmesh bench events --quick``: the real pipeline end to end, at test size."""

from __future__ import annotations

import json

import pytest

from app.bench import BENCHMARKS, load_benchmark
from app.bench.events import NUM_WORKERS, record, run
from app.cli import main

KEYS = {
    "block_events_per_s",
    "latency_p50_ms",
    "latency_p99_ms",
    "latency_max_ms",
    "latency_samples",
    "latency_rate_block_events_per_s",
    "latency_achieved_block_events_per_s",
    "throughput_block_events",
    "throughput_batches",
    "throughput_entries",
    "throughput_seconds",
    "throughput_consumer_cpu_s",
    "throughput_publisher_cpu_s",
    "index_exact",
    "embedded_redis",
    "events_source",
    "workers",
    "generate_seconds",
    "throughput_events",
    "block_events_per_s_gpu_only",
    "gpu_only_block_events",
    "gpu_only_events",
    "gpu_only_consumer_cpu_s",
    "gpu_only_publisher_cpu_s",
    "reads_rate_block_events_per_s",
    *(
        f"reads_{figure}_{interval}"
        for figure in ("per_s", "cpu_s", "entries", "latency_p50_ms", "latency_p99_ms")
        for interval in ("0ms", "5ms")
    ),
}


def test_registered() -> None:
    assert BENCHMARKS["events"] == "app.bench.events:run"
    assert load_benchmark("events") is run


def test_recording_is_reproducible_and_exact() -> None:
    first = record("w0", 5, num_requests=12)
    again = record("w0", 5, num_requests=12)
    assert [len(b) for b in first.batches] == [len(b) for b in again.batches]
    assert first.tree == again.tree
    assert first.last_seq == sum(len(b) for b in first.batches) - 1  # ids 0.., none dropped
    assert first.batches[0][0].type == "created"
    # Blocks are stored when a request is removed: 4 removals (8 live), 128 or 256 new each.
    assert first.block_counts[1:] == [c for c in first.block_counts[1:] if c in (128, 256)]
    assert first.block_events == sum(first.block_counts) >= 4 * 128


def test_quick_run_prints_the_json_last(
    clean_redis_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("REDIS_URL", clean_redis_url)
    assert main(["bench", "events", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) == KEYS
    assert result["workers"] == NUM_WORKERS
    assert result["embedded_redis"] is False
    assert result["index_exact"] is True
    assert result["block_events_per_s"] > 0
    assert result["block_events_per_s_gpu_only"] > 0
    # Host offload turns most block events into an event of their own; without it, one event
    # carries a request's evictions.
    assert result["throughput_events"] > 10 * result["gpu_only_events"]
    assert result["throughput_block_events"] > 4 * 40 * 128
    assert 0 < result["latency_p50_ms"] <= result["latency_p99_ms"] <= result["latency_max_ms"]
    assert result["latency_samples"] > 10
    # At most one read per 5 ms: what the workers flush meanwhile comes in one reply. (Not
    # compared with the 0 ms reader's rate: that one reads as often as the CPU left to it
    # allows, 101 a second in a suite run beside another test process.)
    assert result["reads_per_s_5ms"] <= 210  # 200, and one more
    assert result["reads_entries_0ms"] > 0 and result["reads_entries_5ms"] > 0
