"""kvmesh replay: trace parsing, token derivation, the cluster's hit ratios against a hand
computation, decode coalescing against step-by-step simulation, and the CLI end to end."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.cli import main as cli_main
from app.core.sim_timing import SimTiming
from app.replay.cluster import (
    POOLED,
    ClusterConfig,
    RequestRecord,
    RunResult,
    StepRecord,
    run_policy,
)
from app.replay.report import (
    format_table,
    largest_prefill,
    load_imbalance,
    prefill_load,
    summarise,
    ttft_floor,
)
from app.replay.routers import CoreRouter
from app.replay.trace import (
    TRACE_BLOCK_TOKENS,
    TokenSource,
    TraceError,
    TraceRequest,
    load_trace,
    parse_trace,
)

DATA = Path(__file__).resolve().parents[1] / "data"
SLICE = DATA / "mooncake_conversation_200.jsonl"
DEMO_TRACE = Path(__file__).resolve().parents[2] / "app" / "demo" / "conversations.jsonl"
TPB = 64
NUM_WORKERS = 4
BLOCKS_PER_WORKER = 20_000
# Steps take no time: every request is done before the next arrives, even at equal timestamps.
INSTANT = SimTiming(0.0, 0.0, 0.0)


@pytest.fixture(scope="module")
def trace() -> list[TraceRequest]:
    return load_trace(SLICE)


@pytest.fixture(scope="module")
def tokens() -> TokenSource:
    return TokenSource(seed=0)


def sequential(num_workers: int = NUM_WORKERS) -> ClusterConfig:
    return ClusterConfig(
        num_workers=num_workers,
        blocks_per_worker=BLOCKS_PER_WORKER,
        tokens_per_block=TPB,
        timing=INSTANT,
    )


# -- the trace ---------------------------------------------------------------------------------


def test_slice_is_the_first_200_requests(trace: list[TraceRequest]) -> None:
    assert len(trace) == 200
    assert trace[0] == TraceRequest(0, 0, 6758, 500, tuple(range(14)))
    assert [r.index for r in trace] == list(range(200))
    assert trace[-1].timestamp_ms == 72_000


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "t:2: not JSON"),
        ("[1, 2]", "t:2: expected a JSON object, got list"),
        ('{"input_length": 5, "output_length": 1, "hash_ids": [1]}', "t:2: field 'timestamp'"),
        (
            '{"timestamp": "5", "input_length": 5, "output_length": 1, "hash_ids": [1]}',
            "t:2: field 'timestamp' must be an integer, got '5'",
        ),
        (
            '{"timestamp": 5, "input_length": 0, "output_length": 1, "hash_ids": [1]}',
            "t:2: field 'input_length' must be >= 1, got 0",
        ),
        (
            '{"timestamp": 5, "input_length": 5, "output_length": 1.5, "hash_ids": [1]}',
            "t:2: field 'output_length' must be an integer, got 1.5",
        ),
        (
            '{"timestamp": 5, "input_length": 5, "output_length": 1, "hash_ids": []}',
            "t:2: field 'hash_ids' must be a non-empty list",
        ),
        (
            '{"timestamp": 5, "input_length": 5, "output_length": 1, "hash_ids": [1, -2]}',
            "t:2: field 'hash_ids'[1] must be an integer >= 0, got -2",
        ),
        (
            '{"timestamp": 5, "input_length": 513, "output_length": 1, "hash_ids": [1]}',
            "t:2: field 'input_length' 513 does not fit 1 hash_ids of 512 tokens (must be in "
            "1..512)",
        ),
        (
            '{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [1]}',
            "t:2: field 'timestamp' 1 goes back in time (previous 7)",
        ),
    ],
)
def test_bad_lines_name_the_line_and_field(line: str, message: str) -> None:
    good = '{"timestamp": 7, "input_length": 5, "output_length": 1, "hash_ids": [1]}'
    with pytest.raises(TraceError) as info:
        parse_trace([good, line], source="t")
    assert str(info.value).startswith(message)


def test_float_integers_blank_lines_and_limit() -> None:
    lines = [
        '{"timestamp": 0.0, "input_length": 600, "output_length": 2, "hash_ids": [3, 4]}',
        "   ",
        '{"timestamp": 10, "input_length": 1, "output_length": 1, "hash_ids": [9]}',
        "garbage that the limit never reads",
    ]
    assert parse_trace(lines, limit=2) == [
        TraceRequest(0, 0, 600, 2, (3, 4)),
        TraceRequest(1, 10, 1, 1, (9,)),
    ]


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read the trace"):
        load_trace(tmp_path / "absent.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="the trace has no requests"):
        load_trace(tmp_path / "empty.jsonl")


def test_the_shipped_traces_read_as_gzip(tmp_path: Path) -> None:
    """The full Mooncake traces that docs/benchmarks.md replays ship gzipped in the repo."""
    traces = Path(__file__).resolve().parents[2] / "benchmarks" / "traces"
    conversation = load_trace(traces / "mooncake_conversation.jsonl.gz")
    assert len(conversation) == 5_719
    assert conversation[0] == load_trace(SLICE)[0]  # the tests' slice is its first 200
    assert len(load_trace(traces / "mooncake_synthetic.jsonl.gz", limit=10)) == 10
    (tmp_path / "cut.jsonl.gz").write_bytes(
        (traces / "mooncake_conversation.jsonl.gz").read_bytes()[:1_000]
    )
    with pytest.raises(TraceError, match=r"cut.jsonl.gz: not a readable gzip file \("):
        load_trace(tmp_path / "cut.jsonl.gz")


# -- tokens ------------------------------------------------------------------------------------


def test_equal_ids_give_equal_tokens() -> None:
    source = TokenSource(seed=0)
    a = TraceRequest(0, 0, 2 * TRACE_BLOCK_TOKENS + 100, 1, (7, 8, 9))
    b = TraceRequest(1, 0, 3 * TRACE_BLOCK_TOKENS, 1, (7, 8, 9))
    c = TraceRequest(2, 0, 2 * TRACE_BLOCK_TOKENS, 1, (7, 5))
    ta, tb, tc = source.tokens(a), source.tokens(b), source.tokens(c)
    assert ta.dtype == np.uint32
    assert len(ta) == a.input_length
    assert len(tb) == b.input_length
    # a's partial last block is a prefix of the same id's full block in b
    assert np.array_equal(ta, tb[: len(ta)])
    assert np.array_equal(tc[:TRACE_BLOCK_TOKENS], tb[:TRACE_BLOCK_TOKENS])
    assert not np.array_equal(tc[TRACE_BLOCK_TOKENS:], tb[TRACE_BLOCK_TOKENS : 2 * 512])
    # the same in a fresh source (no state but the seed), different with another seed
    assert np.array_equal(TokenSource(seed=0).tokens(b), tb)
    assert not np.array_equal(TokenSource(seed=1).tokens(b), tb)
    assert source.token_list(a) == ta.tolist()
    assert len(source) == 4  # one cached array per id
    assert source.block(8) is source.block(8)
    assert int(tb.max()) < source.vocab_size


# -- hit ratios against a hand computation -------------------------------------------------------


Key = tuple[tuple[int, ...], int, int]


def keys_of(request: TraceRequest) -> list[Key]:
    """The blocks add_sequence matches, as (trace-id prefix, cache block index, tokens): the
    first input_length - 1 tokens (the last one is always computed) in blocks of TPB, the tail
    partial. A block's tokens are fixed by the trace ids up to the trace block it lies in, so
    a partial last trace block shares its whole cache blocks with a longer one."""
    usable = request.input_length - 1
    out = []
    for c in range(-(-usable // TPB)):
        trace_block = c * TPB // TRACE_BLOCK_TOKENS
        out.append((request.hash_ids[: trace_block + 1], c, min(TPB, usable - c * TPB)))
    return out


def hand_reused(trace: list[TraceRequest], worker_of: list[int]) -> list[int]:
    """Tokens each request reuses when each runs alone on its worker and nothing is evicted:
    its leading blocks that an earlier request on that worker stored (whole blocks only; a
    partial block matches an equal partial block)."""
    stored: dict[int, set[Key]] = {}
    reused = []
    for request, worker in zip(trace, worker_of, strict=True):
        seen = stored.setdefault(worker, set())
        total = 0
        for key in keys_of(request):
            if key not in seen:
                break
            total += key[2]
        reused.append(total)
        seen.update(keys_of(request))
    return reused


def check_hits(result: RunResult, trace: list[TraceRequest], worker_of: list[int]) -> float:
    expected = hand_reused(trace, worker_of)
    assert [r.worker for r in result.requests] == worker_of
    assert [r.reused_tokens for r in result.requests] == expected
    figures = summarise(result)
    prompt = sum(r.input_length for r in trace)
    assert figures["hit_ratio"] == sum(expected) / prompt
    assert figures["failed"] == 0
    assert figures["completed"] == len(trace)
    ratio: float = figures["hit_ratio"]
    return ratio


def test_hit_ratios_match_the_hand_computation(
    trace: list[TraceRequest], tokens: TokenSource
) -> None:
    # Nothing is evicted: the most any worker must hold is below its capacity.
    blocks = [-(-(r.input_length + r.output_length) // TPB) for r in trace]
    assert sum(blocks) < BLOCKS_PER_WORKER * NUM_WORKERS
    for w in range(NUM_WORKERS):
        assert sum(blocks[w::NUM_WORKERS]) < BLOCKS_PER_WORKER

    rr = run_policy(trace, "round_robin", sequential(), tokens)
    rr_ratio = check_hits(rr, trace, [i % NUM_WORKERS for i in range(len(trace))])
    pooled = run_policy(trace, POOLED, sequential(), tokens)
    pooled_ratio = check_hits(pooled, trace, [0] * len(trace))
    # The figures themselves, so that a change in the trace or the rules shows.
    assert round(rr_ratio, 6) == 0.043063
    assert round(pooled_ratio, 6) == 0.059257
    assert pooled.config.num_workers == 1
    assert pooled.config.blocks_per_worker == NUM_WORKERS * BLOCKS_PER_WORKER


def test_a_request_that_never_fits_fails(tokens: TokenSource) -> None:
    trace = [
        TraceRequest(0, 0, 1000, 10, (1, 2)),
        TraceRequest(1, 0, 5000, 10, tuple(range(3, 13))),  # 79 blocks to completion
        TraceRequest(2, 0, 1000, 10, (1, 2)),
    ]
    config = ClusterConfig(num_workers=1, blocks_per_worker=40, tokens_per_block=TPB)
    result = run_policy(trace, "round_robin", config, tokens)
    assert [r.failed for r in result.requests] == [False, True, False]
    figures = summarise(result)
    assert figures["failed"] == 1
    assert figures["completed"] == 2
    assert figures["hit_ratio"] == (999 // TPB * TPB + 999 % TPB) / 2000


# -- the virtual clock -------------------------------------------------------------------------


def test_timing_of_one_request_alone(tokens: TokenSource) -> None:
    timing = SimTiming(0.01, 1e-4, 1e-3)
    config = ClusterConfig(
        num_workers=1,
        blocks_per_worker=1_000,
        tokens_per_block=TPB,
        timing=timing,
        max_tokens_per_step=1_024,
    )
    trace = [TraceRequest(0, 2_000, 2_500, 40, (1, 2, 3, 4, 5))]
    (record,) = run_policy(trace, "round_robin", config, tokens).requests
    assert record.arrival_s == 2.0
    # 2,500 tokens in chunks of 1,024, 1,024, 452; then 39 decode steps of one sequence
    prefill = 3 * 0.01 + 2_500 * 1e-4
    assert record.first_token_s == pytest.approx(2.0 + prefill)
    assert record.finished_s == pytest.approx(2.0 + prefill + 39 * (0.01 + 1e-3))


def test_decode_coalescing_changes_nothing(trace: list[TraceRequest], tokens: TokenSource) -> None:
    """Coalesced decode runs (cut when a request arrives) against every step simulated."""
    config = ClusterConfig(
        num_workers=2,
        blocks_per_worker=6_000,
        tokens_per_block=TPB,
        speed=2.0,  # busy enough that arrivals cut decode runs and queues form
    )
    part = trace[:60]
    fast = run_policy(part, "round_robin", config, tokens)
    slow = run_policy(part, "round_robin", replace(config, coalesce_decode=False), tokens)
    assert fast.num_steps == slow.num_steps
    assert len(fast.prefill_steps) == len(slow.prefill_steps)
    for a, b in zip(fast.requests, slow.requests, strict=True):
        assert (a.worker, a.reused_tokens) == (b.worker, b.reused_tokens)
        assert a.first_token_s == pytest.approx(b.first_token_s, rel=1e-9)
        assert a.finished_s == pytest.approx(b.finished_s, rel=1e-9)
    queued = [r for r in fast.requests if r.first_token_s - r.arrival_s > 1.0]
    assert queued  # the case is not trivial


# -- load imbalance ----------------------------------------------------------------------------


def test_load_imbalance_by_hand() -> None:
    """Three 60 s windows on 4 workers; chunks are (request, tokens)."""
    steps = [
        # window 0: a=100 on w0, b=40 on w1. Mean 35, but request a alone is 100: 1.0.
        StepRecord(0, 0.0, 100, ((0, 100),)),
        StepRecord(1, 10.0, 40, ((1, 40),)),
        # window 1: w0 computes c=30+20 (two steps) and d=30: 80. Bound max(20, 50): 1.6.
        StepRecord(0, 60.0, 60, ((2, 30), (3, 30))),
        StepRecord(0, 61.0, 20, ((2, 20),)),
        # window 2: four requests of 60, two of them on w3: 120 / max(60, 60) = 2.0.
        StepRecord(1, 130.0, 60, ((4, 60),)),
        StepRecord(2, 131.0, 60, ((5, 60),)),
        StepRecord(3, 132.0, 60, ((6, 60),)),
        StepRecord(3, 133.0, 60, ((7, 60),)),
    ]
    result = RunResult(
        "hand", ClusterConfig(num_workers=4), [], steps, 8, 0, ["w0", "w1", "w2", "w3"]
    )
    load = prefill_load(result)
    largest = largest_prefill(result)
    assert load.tolist() == [[100, 40, 0, 0], [80, 0, 0, 0], [0, 60, 60, 120]]
    assert largest.tolist() == [100, 50, 60]
    # Ratios 1.0, 1.6 and 2.0 weighted by the windows' prefill, 140, 80 and 240.
    expected = (1.0 * 140 + 1.6 * 80 + 2.0 * 240) / 460
    assert summarise(result)["load_imbalance"] == pytest.approx(expected, rel=1e-12)
    assert load_imbalance(load, largest) == pytest.approx(748 / 460, rel=1e-12)
    # Over the mean alone (the bound before), windows 0 and 1 read 100/35 and 80/20.
    assert load_imbalance(load) == pytest.approx((100 / 35 * 140 + 4 * 80 + 2 * 240) / 460)
    with pytest.raises(ValueError, match=r"largest: shape \(2,\), the load has \(3,\)"):
        load_imbalance(load, largest[:2])


def test_one_request_a_window_is_balanced_whatever_the_policy(tokens: TokenSource) -> None:
    """Four 20,000-token requests two minutes apart on 8 workers: each window holds one request
    (prefilled in three steps of at most 8,192 tokens), which no placement can spread, so every
    policy scores 1.0. Over the mean alone each window read 8.0, the number of workers."""
    trace = [
        TraceRequest(i, i * 120_000, 20_000, 4, tuple(range(100 * i, 100 * i + 40)))
        for i in range(4)
    ]
    for policy in ("kv_aware", "round_robin"):
        result = run_policy(trace, policy, ClusterConfig(), tokens)
        load = prefill_load(result)
        assert load.sum(axis=1).tolist() == [20_000, 0, 20_000, 0, 20_000, 0, 20_000]
        assert len(result.prefill_steps) == 4 * 3
        assert summarise(result)["load_imbalance"] == 1.0
        assert load_imbalance(load) == 8.0


def test_round_robin_on_the_demo_trace_is_balanced(tokens: TokenSource) -> None:
    """The demo trace: 192 requests in 28.5 minutes, 6.6 a minute for 8 workers. Round robin
    gives each worker 24; the bound of each window counts the request no placement can split,
    so it scores below the issue's target of 1.5 (over the mean alone it read 2.65, for a
    placement as even as requests allow). kv_aware sends every request to the worker that holds
    the trace's shared first block (the cluster is ~1 % busy, so its load term never outweighs
    the 512 tokens saved): it is less even than round robin, and the measure says so."""
    trace = load_trace(DEMO_TRACE)
    rr = run_policy(trace, "round_robin", ClusterConfig(), tokens)
    kv = run_policy(trace, "kv_aware", ClusterConfig(), tokens)
    assert sorted(Counter(r.worker for r in rr.requests).values()) == [24] * 8
    assert len({r.worker for r in kv.requests}) == 1
    rr_imbalance = summarise(rr)["load_imbalance"]
    assert 1.0 < rr_imbalance < 1.5
    assert summarise(kv)["load_imbalance"] > rr_imbalance


# -- the CLI -----------------------------------------------------------------------------------


def test_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_main(
        [
            "replay",
            "--trace",
            str(SLICE),
            "--limit",
            "40",
            "--workers",
            "2",
            "--blocks-per-worker",
            "8000",
            "--tokens-per-block",
            "64",
            "--policy",
            "kv_aware",
            "--policy",
            "round_robin",
            "--policy",
            "pooled",
            "--speed",
            "4",
            "--jobs",
            "1",
            "--plot",
            str(tmp_path / "plots"),
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[1].split()[:3] == ["policy", "hit", "ttft"]
    assert [line.split()[0] for line in lines[2:5]] == ["kv_aware", "round_robin", "pooled"]
    result = json.loads(lines[-1])
    assert list(result) == ["policies"]
    assert list(result["policies"]) == ["kv_aware", "round_robin", "pooled"]
    for figures in result["policies"].values():
        assert figures["requests"] == 40
        assert figures["completed"] == 40
        for key in ("hit_ratio", "ttft_p50_s", "ttft_p99_s", "ttft_floor_p99_s", "e2e_p50_s"):
            assert math.isfinite(figures[key])
        assert figures["ttft_p50_s"] <= figures["ttft_p90_s"] <= figures["ttft_p99_s"]
        assert figures["load_imbalance"] >= 1.0
    assert result["policies"]["pooled"]["load_imbalance"] == 1.0
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == [
        "hit_ratio.png",
        "prefill_load_kv_aware.png",
        "prefill_load_pooled.png",
        "prefill_load_round_robin.png",
        "ttft_cdf.png",
    ]
    assert all((tmp_path / "plots" / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)


def test_cli_bad_trace_is_exit_2_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
        '{"timestamp": 1, "input_length": 5, "output_length": 1}\n'
    )
    assert cli_main(["replay", "--trace", str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"kvmesh replay: error: {bad}:2: field 'hash_ids' is missing\n"


def test_cli_bad_flag_values(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["--speed", "0"],
        ["--policy", "nope"],
        ["--weight", "nope=1"],
        ["--max-tokens-per-step", "-3"],
    ):
        with pytest.raises(SystemExit) as info:
            cli_main(["replay", "--trace", str(SLICE), *argv])
        assert info.value.code == 2
    assert "Traceback" not in capsys.readouterr().err
    # accepted by the parser, refused by the configuration
    assert cli_main(["replay", "--trace", str(SLICE), "--max-tokens-per-step", "8"]) == 2
    assert "max_tokens_per_step: must be >= tokens_per_block (64), got 8" in (
        capsys.readouterr().err
    )


def test_table_formats_every_policy() -> None:
    figures = {
        "hit_ratio": 0.5,
        "ttft_p50_s": 0.1,
        "ttft_p90_s": 0.2,
        "ttft_p99_s": 0.3,
        "ttft_floor_p99_s": 0.25,
        "e2e_p50_s": 1.0,
        "e2e_p99_s": 2.0,
        "load_imbalance": 1.25,
        "requests_per_s": 3.0,
        "tokens_per_s": 12_345.0,
        "requests": 10,
        "failed": 0,
        "wall_s": 1.5,
    }
    table = format_table({"kv_aware": figures, "round_robin": figures}).splitlines()
    assert table[1].split() == [
        "kv_aware", "0.500", "0.100", "0.200", "0.300", "0.250", "1.00", "2.00", "1.25",
        "3.00", "12,345", "10", "0", "1.5",
    ]  # fmt: skip
    assert len({len(line) for line in table}) == 1


# -- router replicas and engines without events -------------------------------------------------


def _burst() -> list[TraceRequest]:
    """8 requests 1 ms apart sharing a 4-block prefix, each with a block of its own; slow
    steps, so the burst is placed before any worker's events could arrive."""
    return [TraceRequest(i, i, 5 * TRACE_BLOCK_TOKENS, 4, (1, 2, 3, 4, 100 + i)) for i in range(8)]


def _replicas(**options: object) -> ClusterConfig:
    return replace(
        sequential(),
        timing=SimTiming(0.05, 1e-4, 1e-4),
        event_delay_s=0.5,
        **options,  # type: ignore[arg-type]
    )


def test_router_replicas_share_their_decisions(tokens: TokenSource) -> None:
    burst = _burst()
    one = run_policy(burst, "kv_aware", _replicas(), tokens)
    shared = run_policy(burst, "kv_aware", _replicas(routers=4), tokens)
    apart = run_policy(burst, "kv_aware", _replicas(routers=4, share=False), tokens)
    worker_sets = [{r.worker for r in run.requests} for run in (one, shared, apart)]
    # Sharing: the 4 replicas place the burst as one router does, on one worker.
    assert [r.worker for r in shared.requests] == [r.worker for r in one.requests]
    assert len(worker_sets[0]) == 1
    # Without: each replica's first request of the burst is a tie (no events yet, no load
    # seen), broken by its own seed: the prefix lands on several workers.
    assert len(worker_sets[2]) > 1
    assert summarise(apart)["hit_ratio"] < summarise(shared)["hit_ratio"]


def test_without_events_the_router_routes_by_what_it_sent(
    trace: list[TraceRequest], tokens: TokenSource
) -> None:
    # Every request is done before the next and nothing is evicted: what the router sent a
    # worker is what it holds, so routing on that finds every prompt block the events would.
    exact = run_policy(trace, "kv_aware", sequential(), tokens)
    approximate = run_policy(trace, "kv_aware", replace(sequential(), no_events=True), tokens)
    assert approximate.num_events == exact.num_events > 0  # the workers made them; unread
    assert summarise(approximate)["hit_ratio"] == summarise(exact)["hit_ratio"] > 0


def test_replica_flags_reach_the_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--trace", str(DEMO_TRACE), "--limit", "20", "--workers", "2"]
    argv += ["--routers", "0", "--json"]
    assert cli_main(argv) == 2
    assert capsys.readouterr().err == "kvmesh replay: error: routers: must be >= 1, got 0\n"


def test_the_ttft_floor_is_each_request_alone_on_an_idle_worker() -> None:
    """``ttft_floor``: the uncached prompt at one worker's speed, in steps of its budget; for
    pooled, the cluster's worker speed, not the pooled one."""
    config = ClusterConfig(
        num_workers=4,
        timing=SimTiming(step_overhead_s=0.01, prefill_s_per_token=1e-4),
        max_tokens_per_step=1_000,
    )
    records = [
        RequestRecord(0, 0.0, 2_500, 1, reused_tokens=0, first_token_s=1.0, finished_s=2.0),
        RequestRecord(1, 0.0, 2_500, 1, reused_tokens=2_000, first_token_s=1.0, finished_s=2.0),
        RequestRecord(2, 0.0, 64, 1, reused_tokens=64, first_token_s=1.0, finished_s=2.0),
    ]
    # 2,500 tokens in 3 steps; 500 in 1; none computed still takes a step.
    expected = [0.25 + 0.03, 0.05 + 0.01, 0.01]
    result = RunResult("kv_aware", config, records, [], 3, 0, ["w0"])
    assert ttft_floor(result, records).tolist() == pytest.approx(expected)
    pooled = RunResult(POOLED, config.pooled(), records, [], 3, 0, ["w0"], cluster_config=config)
    assert ttft_floor(pooled, records).tolist() == pytest.approx(expected)
    figures = summarise(result)
    assert figures["ttft_floor_p50_s"] == pytest.approx(0.06)
    assert figures["ttft_floor_p99_s"] == pytest.approx(np.percentile(expected, 99))


def test_slow_workers_take_slow_factor_times_as_long(tokens: TokenSource) -> None:
    """``--slow-workers 1 --slow-factor 3``: the same cold request takes three times as long to
    its first token on the slow worker (round robin sends the second there); pooled adds the
    workers' speeds (1 + 1/3 of a fast worker)."""
    timing = SimTiming(step_overhead_s=0.01, prefill_s_per_token=1e-4, decode_s_per_sequence=1e-3)
    config = ClusterConfig(num_workers=2, timing=timing, slow_workers=1, slow_factor=3.0)
    assert config.worker_timing(0) == timing
    slow = config.worker_timing(1)
    fields = [slow.step_overhead_s, slow.prefill_s_per_token, slow.decode_s_per_sequence]
    assert fields == pytest.approx([0.03, 3e-4, 3e-3])
    pooled = config.pooled().timing
    assert pooled.prefill_s_per_token == pytest.approx(1e-4 / (1 + 1 / 3))
    trace = [
        TraceRequest(i, i * 60_000, 1_000, 2, tuple(range(10 * i, 10 * i + 2))) for i in range(2)
    ]
    records = run_policy(trace, "round_robin", config, tokens).requests
    assert [r.worker for r in records] == [0, 1]
    ttft = [r.first_token_s - r.arrival_s for r in records]
    assert ttft == pytest.approx([0.01 + 0.1, 3 * (0.01 + 0.1)])
    with pytest.raises(ValueError, match=r"slow_workers: must be within 0\.\.2, got 3"):
        ClusterConfig(num_workers=2, slow_workers=3)


def test_replay_workers_report_the_speed_they_fit_unless_told_not_to(
    trace: list[TraceRequest], tokens: TokenSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The routers see each worker's fitted speed in its load (exactly the simulated one: the
    steps follow the linear model), or none with ``speed_reports`` off."""
    cores: list[CoreRouter] = []
    init = CoreRouter.__init__

    def keep(self: CoreRouter, cluster: Any, policy: str) -> None:
        init(self, cluster, policy)
        cores.append(self)

    monkeypatch.setattr(CoreRouter, "__init__", keep)
    config = ClusterConfig(num_workers=2, blocks_per_worker=4_000, speed=8.0)
    run_policy(trace[:60], "kv_aware", config, tokens)
    run_policy(trace[:60], "kv_aware", replace(config, speed_reports=False), tokens)
    reported, silent = ([v.load for v in c.core.workers.values()] for c in cores)
    for load in reported:
        assert load["step_overhead_us"] == pytest.approx(10_000, rel=1e-3)
        assert load["prefill_ns_per_token"] == pytest.approx(100_000, rel=1e-3)
        assert load["max_tokens_per_step"] == 8_192
    assert all("prefill_ns_per_token" not in load for load in silent)
