"""Routing policies as tables: candidates in, the chosen worker and every cost out."""

from __future__ import annotations

import math
import random
import re

import orjson
import pytest

from app.router.policies import (
    POLICIES,
    Candidate,
    PolicyState,
    RouteRequest,
    Weights,
    choose,
)

# Each policy called as the router calls it: (request, candidates, weights, state).
kv_aware, round_robin, least_loaded = (
    POLICIES[n] for n in ("kv_aware", "round_robin", "least_loaded")
)
dynamo, sglang = POLICIES["dynamo"], POLICIES["sglang"]

TPB = 16
# Queued prefill at full weight, so that the tables read as token counts.
W = Weights(load=1.0, decode=8.0)


def req(num_tokens: int, key: int = 0) -> RouteRequest:
    return RouteRequest(num_tokens, TPB, key)


def cand(worker: str, **fields: int | bool) -> Candidate:
    values: dict[str, int | bool] = {"free_blocks": 1_000, "capacity_blocks": 1_000}
    values.update(fields)
    return Candidate(worker=worker, **values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("candidates", "num_tokens", "weights", "worker", "costs"),
    [
        # Idle workers: the longest match wins; the last prompt token is always computed.
        (
            [cand("a", matched_blocks=2), cand("b", matched_blocks=8)],
            128,
            W,
            "b",
            {"a": 96.0, "b": 1.0},
        ),
        # Host-tier hits cost host_hit per token: 4 host blocks = 64 tokens * 0.25 = 16.
        (
            [cand("a", matched_blocks=4), cand("b", matched_blocks=8, host_blocks=4)],
            129,
            W,
            "b",
            {"a": 65.0, "b": 1.0 + 16.0},
        ),
        # Queued prefill ahead counts token for token (load 1): b's cache does not pay for it.
        (
            [cand("a"), cand("b", matched_blocks=4, queued_prefill_tokens=100)],
            128,
            W,
            "a",
            {"a": 128.0, "b": 64.0 + 100.0},
        ),
        # Running sequences: decode tokens each (8 by default).
        (
            [cand("a", running=3), cand("b", running=1)],
            64,
            W,
            "b",
            {"a": 64.0 + 24.0, "b": 64.0 + 8.0},
        ),
        # load weight 0: the cache alone decides.
        (
            [cand("a"), cand("b", matched_blocks=4, queued_prefill_tokens=100)],
            128,
            Weights(load=0.0),
            "b",
            {"a": 128.0, "b": 64.0},
        ),
        # A worker that cannot fit the request pays 4 prompts.
        (
            [cand("a", free_blocks=3), cand("b", queued_prefill_tokens=200)],
            64,
            W,
            "b",
            {"a": 64.0 + 256.0, "b": 264.0},
        ),
        # A prompt ending in a partial block needs that block too: 65 tokens are 5 blocks
        # (rounded up), so a with 4 free cannot fit them and pays 4 prompts (4 * 65 = 260).
        (
            [cand("a", free_blocks=4), cand("b", queued_prefill_tokens=100)],
            65,
            W,
            "b",
            {"a": 65.0 + 260.0, "b": 165.0},
        ),
        # The same prompt fits exactly in 5 free blocks: no penalty, a wins.
        (
            [cand("a", free_blocks=5), cand("b", queued_prefill_tokens=100)],
            65,
            W,
            "a",
            {"a": 65.0, "b": 165.0},
        ),
    ],
)
def test_kv_aware_costs(
    candidates: list[Candidate],
    num_tokens: int,
    weights: Weights,
    worker: str,
    costs: dict[str, float],
) -> None:
    decision = kv_aware(req(num_tokens), candidates, weights, PolicyState())
    assert decision.worker == worker
    assert {c.worker: c.cost for c in decision.costs} == costs
    assert decision.policy == "kv_aware"


def test_kv_aware_reports_cached_tokens_and_freshness() -> None:
    decision = kv_aware(
        req(100),
        [cand("a", matched_blocks=6, fresh=False), cand("b", matched_blocks=1)],
        W,
        PolicyState(),
    )
    assert (decision.worker, decision.expected_cached_tokens, decision.fresh) == ("a", 96, False)
    assert [(c.worker, c.cached_tokens, c.prefill_tokens, c.fresh) for c in decision.costs] == [
        ("a", 96, 4.0, False),
        ("b", 16, 84.0, True),
    ]


def test_costs_are_written_as_the_route_answer_gives_them() -> None:
    """A ``/route`` answer carries every worker's Cost as a JSON object, its fields in order.
    Cost keeps a ``__dict__`` (no slots): orjson's fast path for a dataclass (16 costs in
    5.7 µs against 25 with slots)."""
    decision = kv_aware(req(100), [cand("a", matched_blocks=6), cand("b")], W, PolicyState())
    assert all(vars(cost) for cost in decision.costs)
    assert orjson.loads(orjson.dumps(decision.costs)) == [
        {
            "worker": "a",
            "cost": 4.0,
            "cached_tokens": 96,
            "prefill_tokens": 4.0,
            "load": 0.0,
            "fresh": True,
            "affinity": 0.0,
            "ttft_s": None,
        },
        {
            "worker": "b",
            "cost": 100.0,
            "cached_tokens": 0,
            "prefill_tokens": 100.0,
            "load": 0.0,
            "fresh": True,
            "affinity": 0.0,
            "ttft_s": None,
        },
    ]
    assert list(orjson.loads(orjson.dumps(decision.costs[0]))) == [
        "worker",
        "cost",
        "cached_tokens",
        "prefill_tokens",
        "load",
        "fresh",
        "affinity",
        "ttft_s",
    ]


def test_kv_aware_ties_go_to_the_lower_load_then_a_choice_seeded_by_the_request() -> None:
    # Equal cost (64): a by its cache under load, b idle and cold. b has the lower load.
    tied = [cand("a", matched_blocks=2, queued_prefill_tokens=32), cand("b", running=0)]
    assert kv_aware(req(64), tied, W, PolicyState()).worker == "b"
    # Equal cost and load: the choice depends on (seed, request key) only, not on history.
    same = [cand("a"), cand("b"), cand("c")]
    picks = [kv_aware(req(64, key), same, W, PolicyState(seed=0)).worker for key in range(60)]
    again = [kv_aware(req(64, key), same, W, PolicyState(seed=0)).worker for key in range(60)]
    assert picks == again
    assert set(picks) == {"a", "b", "c"}
    state = PolicyState(seed=0)
    for _ in range(5):  # earlier decisions do not change the next tie-break
        kv_aware(req(64, 99), same, W, state)
    assert kv_aware(req(64, 7), same, W, state).worker == picks[7]


def test_kv_aware_with_temperature_samples_by_softmax() -> None:
    candidates = [cand("a", matched_blocks=4), cand("b")]
    state = PolicyState(seed=3)
    hot = Weights(temperature=1.0)
    picks = [kv_aware(req(128), candidates, hot, state).worker for _ in range(2_000)]
    # costs 64 and 128: scale = temperature * prompt = 128, weights 1 and e^-0.5 (p(a) 0.62)
    rng = random.Random(3)
    expected = [rng.choices("ab", weights=[1.0, math.exp(-0.5)])[0] for _ in range(2_000)]
    assert "".join(picks) == "".join(expected)
    assert 1_150 < picks.count("a") < 1_340
    cold = [kv_aware(req(128), candidates, W, state).worker for _ in range(20)]
    assert set(cold) == {"a"}


def test_a_temperature_that_underflows_samples_the_lowest() -> None:
    """dynamo's scale is temperature x the logits' spread: 5e-324 x 1/16 is 0.0, the limit of
    the softmax, which puts all its weight on the lowest (it divided by zero)."""
    candidates = [cand("a", queued_prefill_tokens=1), cand("b"), cand("c", queued_prefill_tokens=1)]
    state = PolicyState(seed=3)
    tiny = Weights(temperature=5e-324)
    decisions = [dynamo(req(64), candidates, tiny, state) for _ in range(20)]
    assert [c.cost for c in decisions[0].costs] == [4.0 + 1 / 16 + 4, 8.0, 4.0 + 1 / 16 + 4]
    assert {d.worker for d in decisions} == {"b"}
    # Two lowest: each as likely, as the seeded generator draws them, and never the other.
    tied = [cand("a"), cand("b", queued_prefill_tokens=1), cand("c")]
    state = PolicyState(seed=5)
    picks = [dynamo(req(64), tied, tiny, state).worker for _ in range(50)]
    rng = random.Random(5)
    assert picks == [rng.choices("abc", weights=[1.0, 0.0, 1.0])[0] for _ in range(50)]
    assert set(picks) == {"a", "c"}


def test_round_robin_cycles_and_ranks() -> None:
    candidates = [cand("a"), cand("b"), cand("c")]
    state = PolicyState()
    decisions = [round_robin(req(32), candidates, W, state) for _ in range(4)]
    assert [d.worker for d in decisions] == ["a", "b", "c", "a"]
    assert [c.cost for c in decisions[1].costs] == [2.0, 0.0, 1.0]


def test_least_loaded_ignores_the_cache() -> None:
    candidates = [cand("a", matched_blocks=8, running=2), cand("b", running=1)]
    decision = least_loaded(req(128), candidates, W, PolicyState())
    assert decision.worker == "b"
    assert [c.cost for c in decision.costs] == [16.0, 8.0]
    assert decision.expected_cached_tokens == 0


@pytest.mark.parametrize(
    ("candidates", "num_tokens", "worker", "logits"),
    [
        # logit = overlap_weight * (uncached + queued) / bs + active blocks + request blocks
        (
            [cand("a", matched_blocks=6), cand("b", active_blocks=2)],
            128,
            "a",
            {"a": 2.0 + 8.0, "b": 8.0 + 10.0},
        ),
        (
            [cand("a", matched_blocks=6, active_blocks=20), cand("b")],
            128,
            "b",
            {"a": 2.0 + 28.0, "b": 8.0 + 8.0},
        ),
        (
            [cand("a", matched_blocks=6, queued_prefill_tokens=160), cand("b")],
            128,
            "b",
            {"a": 12.0 + 8.0, "b": 16.0},
        ),
    ],
)
def test_dynamo_logits(
    candidates: list[Candidate], num_tokens: int, worker: str, logits: dict[str, float]
) -> None:
    decision = dynamo(req(num_tokens), candidates, W, PolicyState())
    assert decision.worker == worker
    assert {c.worker: c.cost for c in decision.costs} == logits


@pytest.mark.parametrize(
    ("candidates", "worker", "why"),
    [
        # Balanced, best match 96/128 = 0.75 > 0.3: the longest match.
        ([cand("a", matched_blocks=6), cand("b", matched_blocks=1)], "a", "match"),
        # Balanced, best match 16/128 = 0.125 <= 0.3: the smallest tree.
        (
            [cand("a", matched_blocks=1, cached_blocks=50), cand("b", cached_blocks=10)],
            "b",
            "smallest tree",
        ),
        # Imbalanced (70 - 1 > 64 and 70 > 1.5): the idlest, whatever the cache.
        ([cand("a", matched_blocks=8, running=70), cand("b", running=1)], "b", "balance"),
        # 70 - 10 = 60 is not > 64: balanced, so the cache decides.
        ([cand("a", matched_blocks=8, running=70), cand("b", running=10)], "a", "match"),
    ],
)
def test_sglang_cache_aware(candidates: list[Candidate], worker: str, why: str) -> None:
    assert sglang(req(128), candidates, W, PolicyState()).worker == worker, why


# SGLang's router is imbalanced iff max - min > balance_abs AND max > balance_rel * min; the
# costs are the uncached tokens when the cache decides (a holds 127 of 128: the last prompt
# token is always computed), the running requests when the balance does.
@pytest.mark.parametrize(
    ("running_a", "running_b", "worker", "costs"),
    [
        # 65 - 1 = 64, exactly balance_abs (not more): balanced, the cache decides.
        (65, 1, "a", [1.0, 128.0]),
        # 66 - 1 = 65 > 64 and 66 > 1.5 * 1: imbalanced, the idlest wins.
        (66, 1, "b", [66.0, 1.0]),
        # 195 - 130 = 65 > 64 but 195 is exactly 1.5 * 130 (not more): balanced.
        (195, 130, "a", [1.0, 128.0]),
        # 196 - 130 = 66 > 64 and 196 > 195: imbalanced.
        (196, 130, "b", [196.0, 130.0]),
    ],
    ids=["abs_boundary", "abs_past", "rel_boundary", "rel_past"],
)
def test_sglang_balance_thresholds_are_strict(
    running_a: int, running_b: int, worker: str, costs: list[float]
) -> None:
    candidates = [cand("a", matched_blocks=8, running=running_a), cand("b", running=running_b)]
    decision = sglang(req(128), candidates, W, PolicyState())
    assert decision.worker == worker
    assert [(c.worker, c.cost) for c in decision.costs] == [("a", costs[0]), ("b", costs[1])]


def test_every_policy_is_registered_and_refuses_an_empty_list() -> None:
    assert sorted(POLICIES) == [
        "dynamo",
        "kv_aware",
        "least_loaded",
        "random",
        "round_robin",
        "sglang",
    ]
    # The inputs beyond match and load that a policy declares (the core fills in only those).
    assert [name for name, p in POLICIES.items() if p.needs_tree_sizes] == ["sglang"]
    for name in POLICIES:
        with pytest.raises(ValueError, match="no candidate workers"):
            choose(name, req(16), [], W, PolicyState())
    with pytest.raises(KeyError, match="policy: unknown 'nope'; known: kv_aware, round_robin"):
        choose("nope", req(16), [cand("a")], W, PolicyState())


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"load": -1.0}, "load: must be a number from 0 to 1,000,000,000, got -1.0"),
        (
            {"temperature": float("inf")},
            "temperature: must be a number from 0 to 1,000,000,000, got inf",
        ),
        ({"decode": 1e308}, "decode: must be a number from 0 to 1,000,000,000, got 1e+308"),
        ({"session": float("nan")}, "session: must be a number from 0 to 1,000,000,000, got nan"),
        ({"sglang_cache_threshold": 1.5}, "sglang_cache_threshold: must be within 0..1"),
    ],
)
def test_bad_weights_name_the_field(changes: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        W.updated(**changes)
    assert W.updated(load=None, decode=2.0) == Weights(load=1.0, decode=2.0)


# -- kv_aware with the speeds workers report (seconds, then tokens at the fastest speed) ------

# 10 ms a step, 100 us a prompt token, 150 us a decode, 8,192 tokens a step.
SPEED = {"step_s": 0.01, "prefill_s": 100e-6, "decode_s": 150e-6, "step_tokens": 8_192}


def fast(worker: str, **fields: float | int | bool) -> Candidate:
    return cand(worker, **{**SPEED, **fields})  # type: ignore[arg-type]


def test_kv_aware_keeps_a_hot_prefix_on_a_busy_worker_until_its_queue_outweighs_it() -> None:
    # a holds 3,200 of the 4,096 tokens but has 20,000 queued and 40 running; b is idle, cold.
    busy = fast("a", matched_blocks=200, queued_prefill_tokens=20_000, running=40)
    decision = kv_aware(req(4_096), [busy, fast("b")], Weights(), PolicyState())
    a, b = decision.costs
    # a: own 896 tokens = 0.0896 s; 20,896 tokens in steps of 8,192 - 40 = 3 steps of
    # 10 ms + 40 x 150 us; ahead = 2.0 s + 3 x 16 ms = 2.048 s; cost 896 + 0.1 x 20,480.
    assert a.ttft_s == pytest.approx(0.0896 + 2.048)
    assert (a.cached_tokens, a.prefill_tokens) == (3_200, 896)
    assert a.load == pytest.approx(2_048.0)
    assert a.cost == pytest.approx(2_944.0)
    # b: own 4,096 tokens = 0.4096 s, one step of 10 ms (100 tokens) ahead of its first token.
    assert b.ttft_s == pytest.approx(0.4196)
    assert b.cost == pytest.approx(4_096.0 + 10.0)
    assert decision.worker == "a"  # a's first token is later, but b would recompute 3,200
    # Twice the queue: 40,896 tokens in 6 steps, ahead 4.096 s: now b's first token wins.
    busier = fast("a", matched_blocks=200, queued_prefill_tokens=40_000, running=40)
    decision = kv_aware(req(4_096), [busier, fast("b")], Weights(), PolicyState())
    assert decision.cost_of("a").cost == pytest.approx(896.0 + 4_096.0)
    assert decision.worker == "b"
    # With load 1 the choice is the earliest predicted first token: b, even at 20,000.
    assert kv_aware(req(4_096), [busy, fast("b")], Weights(load=1.0), PolicyState()).worker == "b"


def test_kv_aware_charges_a_slower_worker_its_slowness_as_wait() -> None:
    # a is twice as slow: its own tokens are still 3,072 of work (a token recomputed is a token
    # recomputed), but they take 6,144 tokens' time at the fastest speed (b's), so it waits
    # 3,072 + 100 (one step) tokens beyond them, at the load weight.
    slow = fast("a", prefill_s=200e-6, matched_blocks=64)  # 1,024 cached
    decision = kv_aware(req(4_096), [slow, fast("b")], Weights(), PolicyState())
    a, b = decision.costs
    assert a.ttft_s == pytest.approx(3_072 * 200e-6 + 0.01)
    assert a.load == pytest.approx(0.1 * (6_144 + 100 - 3_072))
    assert a.cost == pytest.approx(3_072 + 317.2)
    assert b.cost == pytest.approx(4_096.0 + 10.0)
    assert decision.worker == "a"  # its cache outweighs its slowness
    cold = fast("a", prefill_s=200e-6)
    decision = kv_aware(req(4_096), [cold, fast("b")], Weights(), PolicyState())
    assert decision.cost_of("a").cost == pytest.approx(4_096 + 0.1 * (8_192 + 100 - 4_096))
    assert decision.worker == "b"  # cold on both: the fast one


def test_kv_aware_costs_a_worker_without_a_speed_in_tokens_at_the_fastest_one() -> None:
    # c reports no speed (an ingested engine): its tokens count as the fastest worker's, and
    # each running sequence as `decode` (8) prompt tokens; no TTFT is predicted for it.
    decision = kv_aware(
        req(1_024),
        [fast("a", queued_prefill_tokens=1_000), cand("c", running=10)],
        Weights(),
        PolicyState(),
    )
    a, c = decision.costs
    assert a.cost == pytest.approx(1_024.0 + 0.1 * (1_000 + 100))
    assert (c.cost, c.ttft_s) == (1_024.0 + 0.1 * 80, None)
    assert decision.worker == "c"
