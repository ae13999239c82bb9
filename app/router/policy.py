"""Routing policies: pure functions from one request and a view of every worker to a choice.

The router service and ``kvmesh replay`` call the same functions with the same inputs, so a
replay measures exactly the code that routes live traffic. Nothing here does I/O, reads a clock
or keeps state between calls except what the caller passes in (``PolicyState``: the seeded
random generator and the round-robin counter).

Inputs:

* ``RouteRequest``: the prompt's length in tokens and the cache's tokens per block;
* one ``Candidate`` per worker that may take the request: how many leading blocks of the
  request it holds (any tier, and how many of those on the host tier), and its load;
* ``Weights`` (per router, overridable per request).

Every policy returns a ``Decision``: the chosen worker, the tokens it is expected to reuse, and
one ``Cost`` per candidate, so that ``/route`` and ``/route/explain`` can show why. Costs are
"lower wins" for every policy (a policy that does not score workers reports its own rank).

``kv_aware`` (the default) estimates the prompt tokens each worker would have to process before
the request's first token, in prefill-token units::

    own     = uncached tokens + host_hit * tokens to onboard from the host tier
    ahead   = load * (queued prefill tokens + decode * running sequences)
    cost    = own + ahead            (+ a memory penalty when the worker cannot fit the request)

The lowest cost wins; ties go to the lower load, then to a seeded random choice. With a
temperature above 0 the choice is sampled from ``softmax(-cost / (temperature * prompt))``.
``docs/routing.md`` explains the choice of terms and weights.

``dynamo`` and ``sglang`` copy the published formulas of NVIDIA Dynamo's KV router and of
SGLang's router (``cache_aware``) as faithfully as their inputs allow, so that every comparison
is made in one run on the same index and load.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Final

__all__ = [
    "POLICIES",
    "Candidate",
    "Cost",
    "Decision",
    "PolicyFn",
    "PolicyState",
    "RouteRequest",
    "Weights",
    "choose",
    "dynamo",
    "kv_aware",
    "least_loaded",
    "random_choice",
    "round_robin",
    "sglang",
]

# A worker that cannot fit the request without evicting in-use blocks pays this many prompts.
_MEMORY_PENALTY_PROMPTS: Final = 4.0


@dataclass(frozen=True, slots=True)
class Weights:
    """Tunable terms of the cost-based policies (``kv_aware``; ``dynamo`` reads its own two)."""

    load: float = 0.1  # how much the prefill queued ahead weighs against the request's own
    decode: float = 8.0  # prefill tokens one running sequence is worth (its share of each step)
    host_hit: float = 0.25  # cost of onboarding a host-tier token, as a fraction of recomputing
    temperature: float = 0.0  # 0: lowest cost wins; > 0: softmax sampling
    # NVIDIA Dynamo's KV router: logit = overlap_score_weight * prefill blocks + decode blocks.
    dynamo_overlap_weight: float = 1.0
    # SGLang router's cache_aware thresholds.
    sglang_cache_threshold: float = 0.3
    sglang_balance_abs: int = 64
    sglang_balance_rel: float = 1.5

    def __post_init__(self) -> None:
        for name in ("load", "decode", "host_hit", "temperature", "dynamo_overlap_weight"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
        if not 0 <= self.sglang_cache_threshold <= 1:
            raise ValueError("sglang_cache_threshold: must be within 0..1")
        if self.sglang_balance_abs < 0 or not self.sglang_balance_rel >= 1:
            raise ValueError("sglang_balance_abs must be >= 0 and sglang_balance_rel >= 1")

    def updated(self, **changes: float | int | None) -> Weights:
        """A copy with the non-None ``changes`` applied (validated again)."""
        given = {name: value for name, value in changes.items() if value is not None}
        return replace(self, **given) if given else self  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class RouteRequest:
    num_tokens: int  # prompt tokens
    tokens_per_block: int
    # Seeds the tie-break, so that routers with the same index and loads choose alike whatever
    # their history (the router uses the prompt's last block hash).
    key: int = 0

    @property
    def num_blocks(self) -> int:
        """Full blocks of the prompt (the ones a worker can have cached)."""
        return self.num_tokens // self.tokens_per_block


@dataclass(slots=True)
class Candidate:
    """One worker as a policy sees it. Loads combine the worker's report with the router's own
    accounting of what it sent (the router's figures are newer). Not frozen, for speed (a
    router builds one per worker per request); treat it as immutable."""

    worker: str
    matched_blocks: int = 0  # leading blocks of the request held, any tier
    host_blocks: int = 0  # of those, on the host tier
    queued_prefill_tokens: int = 0  # prompt tokens sent to it and not prefilled yet
    running: int = 0  # sequences in flight (prefilling or decoding)
    active_blocks: int = 0  # KV blocks in use by running sequences
    free_blocks: int = 0  # blocks it can still allocate (evicting cached ones if need be)
    capacity_blocks: int = 0
    cached_blocks: int = 0  # blocks of any request it holds in the index (SGLang's tree size)
    fresh: bool = True  # whether its index data and load are current

    def cached_tokens(self, request: RouteRequest) -> int:
        """Prompt tokens it would reuse: the last prompt token is always computed."""
        return min(self.matched_blocks * request.tokens_per_block, max(request.num_tokens - 1, 0))


@dataclass(slots=True)
class Cost:  # not frozen, for speed (one per worker per decision); treat it as immutable
    worker: str
    cost: float
    cached_tokens: int  # prompt tokens it is expected to reuse
    prefill_tokens: float  # the request's own prefill work there (onboarding included)
    load: float  # the load term (prefill-token units for kv_aware; the policy's own otherwise)
    fresh: bool


@dataclass(frozen=True, slots=True)
class Decision:
    worker: str
    policy: str
    expected_cached_tokens: int
    costs: tuple[Cost, ...]
    fresh: bool  # whether the chosen worker's data was fresh

    def cost_of(self, worker: str) -> Cost:
        return next(c for c in self.costs if c.worker == worker)


@dataclass(slots=True)
class PolicyState:
    """What policies keep between calls: a seeded generator and the round-robin position."""

    seed: int = 0
    rng: random.Random = field(init=False)
    next_index: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)


PolicyFn = Callable[[RouteRequest, Sequence[Candidate], Weights, PolicyState], Decision]


def _decision(policy: str, request: RouteRequest, chosen: Candidate, costs: list[Cost]) -> Decision:
    return Decision(
        worker=chosen.worker,
        policy=policy,
        expected_cached_tokens=chosen.cached_tokens(request),
        costs=tuple(costs),
        fresh=chosen.fresh,
    )


def _plain_costs(
    request: RouteRequest, candidates: Sequence[Candidate], values: Sequence[float]
) -> list[Cost]:
    return [
        Cost(
            c.worker,
            float(v),
            c.cached_tokens(request),
            float(request.num_tokens - c.cached_tokens(request)),
            float(c.queued_prefill_tokens),
            c.fresh,
        )
        for c, v in zip(candidates, values, strict=True)
    ]


def _require(candidates: Sequence[Candidate]) -> None:
    if not candidates:
        raise ValueError("no candidate workers")


def _lowest(
    values: Sequence[float], tie_keys: Sequence[float], state: PolicyState, request: RouteRequest
) -> int:
    """Index of the lowest value; ties by the lower tie key, then a random choice seeded by the
    router's seed and the request (the same for every router, whatever it decided before)."""
    best = min(values)
    tied = [i for i, v in enumerate(values) if v == best]
    if len(tied) > 1:
        low = min(tie_keys[i] for i in tied)
        tied = [i for i in tied if tie_keys[i] == low]
    if len(tied) == 1:
        return tied[0]
    return tied[random.Random((state.seed << 64) ^ request.key).randrange(len(tied))]


def _softmax_pick(values: Sequence[float], scale: float, state: PolicyState) -> int:
    """Sample an index with probability proportional to exp(-value / scale)."""
    low = min(values)
    weights = [math.exp(-(v - low) / scale) for v in values]
    return state.rng.choices(range(len(values)), weights=weights)[0]


# -- policies ----------------------------------------------------------------------------------


def kv_aware(
    request: RouteRequest, candidates: Sequence[Candidate], weights: Weights, state: PolicyState
) -> Decision:
    """Fewest prefill-token equivalents before the first token; see the module docstring."""
    _require(candidates)
    # Locals and plain comparisons: this loop runs for every worker on every request.
    tpb = request.tokens_per_block
    num_tokens = request.num_tokens
    most_cached = max(num_tokens - 1, 0)  # the last prompt token is always computed
    need_blocks = -(-num_tokens // tpb)
    w_load, w_decode, w_host = weights.load, weights.decode, weights.host_hit
    penalty = _MEMORY_PENALTY_PROMPTS * num_tokens
    costs: list[Cost] = []
    loads: list[float] = []
    for c in candidates:
        cached = c.matched_blocks * tpb
        if cached > most_cached:
            cached = most_cached
        host_tokens = c.host_blocks * tpb
        if host_tokens > cached:
            host_tokens = cached
        own = (num_tokens - cached) + w_host * host_tokens
        load = w_load * (c.queued_prefill_tokens + w_decode * c.running)
        cost = own + load
        if c.free_blocks < need_blocks - c.matched_blocks:
            cost += penalty
        costs.append(Cost(c.worker, cost, cached, own, load, c.fresh))
        loads.append(load)
    values = [c.cost for c in costs]
    if weights.temperature > 0:
        index = _softmax_pick(values, weights.temperature * max(request.num_tokens, 1), state)
    else:
        index = _lowest(values, loads, state, request)
    return _decision("kv_aware", request, candidates[index], costs)


def round_robin(
    request: RouteRequest, candidates: Sequence[Candidate], weights: Weights, state: PolicyState
) -> Decision:
    """Each worker in turn (the position survives changes in the candidate list)."""
    _require(candidates)
    index = state.next_index % len(candidates)
    state.next_index = index + 1
    ranks = [(i - index) % len(candidates) for i in range(len(candidates))]
    return _decision(
        "round_robin", request, candidates[index], _plain_costs(request, candidates, ranks)
    )


def random_choice(
    request: RouteRequest, candidates: Sequence[Candidate], weights: Weights, state: PolicyState
) -> Decision:
    """Uniformly at random (seeded)."""
    _require(candidates)
    index = state.rng.randrange(len(candidates))
    ranks = [0.0 if i == index else 1.0 for i in range(len(candidates))]
    return _decision("random", request, candidates[index], _plain_costs(request, candidates, ranks))


def least_loaded(
    request: RouteRequest, candidates: Sequence[Candidate], weights: Weights, state: PolicyState
) -> Decision:
    """Fewest queued prefill tokens plus running sequences (as kv_aware weighs them); cache
    blind."""
    _require(candidates)
    values = [c.queued_prefill_tokens + weights.decode * c.running for c in candidates]
    index = _lowest(values, [float(c.active_blocks) for c in candidates], state, request)
    return _decision(
        "least_loaded", request, candidates[index], _plain_costs(request, candidates, values)
    )


def dynamo(
    request: RouteRequest, candidates: Sequence[Candidate], weights: Weights, state: PolicyState
) -> Decision:
    """NVIDIA Dynamo's KV router (``DefaultWorkerSelector``): per worker, in blocks,

        prefill = (request tokens - overlap blocks * block size + queued prefill tokens) / bs
        decode  = active blocks + the request's blocks
        logit   = overlap_score_weight * prefill + decode

    lowest wins (temperature 0, random among ties), else softmax over the logits normalised
    to [0, 1] with the temperature."""
    _require(candidates)
    tpb = request.tokens_per_block
    request_blocks = -(-request.num_tokens // tpb)
    costs: list[Cost] = []
    for c in candidates:
        new_tokens = request.num_tokens - c.matched_blocks * tpb
        prefill = max(new_tokens + c.queued_prefill_tokens, 0) / tpb
        decode = c.active_blocks + request_blocks
        logit = weights.dynamo_overlap_weight * prefill + decode
        cached = c.cached_tokens(request)
        costs.append(
            Cost(c.worker, logit, cached, float(request.num_tokens - cached), decode, c.fresh)
        )
    values = [c.cost for c in costs]
    if weights.temperature > 0:
        spread = max(values) - min(values)
        index = _softmax_pick(values, weights.temperature * (spread or 1.0), state)
    else:
        index = _lowest(values, [0.0] * len(values), state, request)
    return _decision("dynamo", request, candidates[index], costs)


def sglang(
    request: RouteRequest, candidates: Sequence[Candidate], weights: Weights, state: PolicyState
) -> Decision:
    """SGLang router's ``cache_aware``: load is requests in flight. If the busiest and the idlest
    differ by more than ``balance_abs`` and by more than ``balance_rel`` times, the idlest wins;
    else the longest match wins if it covers more than ``cache_threshold`` of the prompt; else
    the worker holding the fewest cached blocks (the smallest tree)."""
    _require(candidates)
    running = [c.running for c in candidates]
    low, high = min(running), max(running)
    matched = [c.cached_tokens(request) for c in candidates]
    if high - low > weights.sglang_balance_abs and high > low * weights.sglang_balance_rel:
        values = [float(r) for r in running]
    else:
        best = max(matched)
        rate = best / request.num_tokens if request.num_tokens else 0.0
        if rate > weights.sglang_cache_threshold:
            values = [float(request.num_tokens - m) for m in matched]
        else:
            values = [float(c.cached_blocks) for c in candidates]
    index = _lowest(values, [float(r) for r in running], state, request)
    return _decision(
        "sglang", request, candidates[index], _plain_costs(request, candidates, values)
    )


POLICIES: dict[str, PolicyFn] = {
    "kv_aware": kv_aware,
    "round_robin": round_robin,
    "random": random_choice,
    "least_loaded": least_loaded,
    "dynamo": dynamo,
    "sglang": sglang,
}


def choose(
    policy: str,
    request: RouteRequest,
    candidates: Sequence[Candidate],
    weights: Weights,
    state: PolicyState,
) -> Decision:
    """Run the policy named ``policy`` (``KeyError`` naming the known ones if there is none)."""
    try:
        fn = POLICIES[policy]
    except KeyError:
        raise KeyError(f"policy: unknown {policy!r}; known: {', '.join(POLICIES)}") from None
    return fn(request, candidates, weights, state)
