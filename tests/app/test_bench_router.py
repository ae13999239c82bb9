from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from app.bench import BENCHMARKS, load_benchmark
from app.bench.chat import DEMO_MODEL, conversation
from app.bench.fleet import CAPACITY_BLOCKS, events_per_worker, worker_loads
from app.bench.index import NUM_WORKERS, REQUEST_TOKENS, make_workload
from app.bench.router import DURATION_QUICK_S, RATE_QUICK, run
from app.chat import ModelTokenizer
from cache import StoredData
from events.codec import decode_events
from tests.app.bench_cli import run_quick_bench

KEYS = {
    "decision_p50_us",
    "decision_p99_us",
    "hash_p50_us",
    "match_p50_us",
    "decide_p50_us",
    "candidates_p50_us",
    "policy_p50_us",
    "http_p50_ms",
    "http_p99_ms",
    "http_rate",
    "http_errors",
    "http_same_choice",
    "workers",
    "router_workers",
    "index_blocks",
    "index_entries",
    "prompt_tokens",
    "router_cpu_s",
    "client_cpu_s",
}


def test_registered() -> None:
    assert BENCHMARKS["router"] == "app.bench.router:run"
    assert load_benchmark("router") is run


def test_every_worker_reports_a_load_within_its_capacity() -> None:
    loads = worker_loads()
    assert sorted(loads) == sorted(f"worker-{i}" for i in range(NUM_WORKERS))
    for load in loads.values():
        assert load["free_blocks_0"] + load["used_blocks_0"] == CAPACITY_BLOCKS
        assert load["free_blocks_0"] > 0
    assert worker_loads() == loads  # seeded


def test_events_are_renumbered_per_worker_without_gaps() -> None:
    workload = make_workload(200)
    per_worker = events_per_worker(workload.entries)
    for events in per_worker.values():
        assert [e.event_id for e in events] == list(range(len(events)))
    original = [e for _, blob in workload.entries for e in decode_events(blob)]
    assert sum(map(len, per_worker.values())) == len(original)
    blocks = sum(len(e.data.blocks) for e in original if isinstance(e.data, StoredData))
    assert blocks == workload.num_blocks


def test_quick_run_from_the_command_line() -> None:
    report = run_quick_bench("router", "--rate", "150")
    assert report.keys() >= KEYS
    assert report["workers"] == report["router_workers"] == NUM_WORKERS
    assert report["router_processes"] == 1
    assert report["prompt_tokens"] == REQUEST_TOKENS
    # Nothing is evicted and no worker stores a block twice: one index entry per stored block.
    assert report["index_entries"] == report["stored_blocks"]
    assert 0 < report["index_blocks"] <= report["index_entries"]

    assert 0 < report["decision_p50_us"] <= report["decision_p99_us"]
    for part in ("hash", "match", "candidates", "policy"):
        assert 0 < report[f"{part}_p50_us"] <= report["decision_p99_us"], part

    num_requests = round(150 * DURATION_QUICK_S)  # --rate 150, not RATE_QUICK
    assert num_requests != round(RATE_QUICK * DURATION_QUICK_S)
    assert report["http_errors"] == 0, report["http_error_samples"]
    assert report["http_ok"] == report["http_requests"] == num_requests
    assert report["http_rate"] > 0
    assert 0 < report["http_p50_ms"] <= report["http_p99_ms"] <= report["http_max_ms"]
    # The router's own index and loads match the in-process core's: the same choices.
    assert report["http_same_choice"] == 1.0
    assert report["router_cpu_s"] is None or report["router_cpu_s"] > 0
    if report["router_cpu_s"]:  # Linux: the idle window is read from /proc too
        # The busy figure is the whole CPU less the idle rate over the timed part, per request.
        idle_s = report["router_idle_cpu_ms_per_s"] / 1e3 * report["http_seconds"]
        busy = max(report["router_cpu_s"] - idle_s, 0.0) / num_requests * 1e6
        # (within what rounding the rate to 0.1 ms/s and the seconds to 1 ms can move it)
        assert report["router_busy_cpu_us_per_request"] == pytest.approx(busy, abs=1.0)

    # The chat case: a conversation of at least 4,096 tokens as transformers renders it.
    reference = AutoTokenizer.from_pretrained(str(DEMO_MODEL))
    chat = conversation(ModelTokenizer.load(DEMO_MODEL))
    ids = reference.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    assert report["chat_prompt_tokens"] == len(ids) >= 4_096
    assert report["chat_messages"] == len(chat)
    for stage in ("render", "tokenize", "hash", "decide", "total"):
        assert 0 < report[f"chat_{stage}_p50_us"] <= report[f"chat_{stage}_p99_us"], stage
