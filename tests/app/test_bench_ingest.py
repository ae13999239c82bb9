"""``kvmesh bench ingest --quick``: vLLM events through the ingester to Redis, at test size."""

from __future__ import annotations

import json

import msgpack  # type: ignore[import-untyped]
import pytest

from app.bench import BENCHMARKS, load_benchmark
from app.bench.ingest import generate, run
from app.cli import main
from app.ingest.vllm import BlockRemoved, BlockStored, decode_batch

KEYS = {
    "block_events_per_s",
    "block_events_per_cpu_s",
    "vllm_events_per_s",
    "batches",
    "vllm_events",
    "block_events",
    "stored_blocks",
    "removed_blocks",
    "final_blocks",
    "kvmesh_entries",
    "seconds",
    "ingester_cpu_s",
    "consumer_resyncs",
    "index_exact",
    "tokens_per_block",
    "wire_form",
    "embedded_redis",
    "generate_seconds",
}


def test_registered() -> None:
    assert BENCHMARKS["ingest"] == "app.bench.ingest:run"
    assert load_benchmark("ingest") is run


def test_the_workload_is_reproducible_and_in_vllm_s_wire_form() -> None:
    work = generate(40)
    assert work.payloads == generate(40).payloads
    # 40 steps of 4 requests: 10 documents of 32 blocks stored once, 160 tails of 32 blocks;
    # past 96 cached tails, each new tail evicts the oldest, block by block.
    assert (len(work.payloads), work.stored_blocks, work.removed_blocks) == (40, 5440, 2048)
    assert work.num_events == 10 + 160 + 2048
    assert len(work.final) == 320 + 96 * 32
    first = msgpack.unpackb(work.payloads[0])
    assert set(first) == {"ts", "events", "data_parallel_rank"}  # a map: vLLM's current form
    last = decode_batch(work.payloads[-1])
    # Each request's tail is stored, then the oldest tail evicted, one block at a time: those of
    # requests 60..63 (vLLM hashes 2**40 + 32 k on).
    assert [type(e) for e in last.events] == ([BlockStored] + [BlockRemoved] * 32) * 4
    evicted = [h for e in last.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert evicted == list(range((1 << 40) + 60 * 32, (1 << 40) + 64 * 32))
    assert last.num_events == 4 + 128


def test_quick_run_prints_the_json_last(
    clean_redis_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("REDIS_URL", clean_redis_url)
    assert main(["bench", "ingest", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) == KEYS
    counts = {k: result[k] for k in ("batches", "vllm_events", "block_events", "stored_blocks")}
    assert counts == {
        "batches": 40,
        "vllm_events": 2218,
        "block_events": 7488,
        "stored_blocks": 5440,
    }
    assert (result["removed_blocks"], result["final_blocks"]) == (2048, 3392)
    assert (result["index_exact"], result["consumer_resyncs"]) == (True, 0)
    assert (result["tokens_per_block"], result["wire_form"], result["embedded_redis"]) == (
        16,
        "map",
        False,
    )
    assert result["block_events_per_s"] > 0
    assert result["block_events_per_cpu_s"] > 0
    assert 1 <= result["kvmesh_entries"] <= 40
