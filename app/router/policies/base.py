"""What every routing policy reads and returns, and the pieces they share.

Inputs: ``RouteRequest`` (the prompt's length and the cache's block size), one ``Candidate`` per
worker that may take the request (its match, its load), the policy's own config (built from the
router's ``Weights``: the knobs of every policy by their public names, as the HTTP API's
``routing.weights``, the router's flags and replay's ``--weight`` spell them), and
``PolicyState`` (the seeded generator and the round-robin position). Output: a ``Decision`` with
one ``Cost`` per candidate, "lower wins" for every policy (a policy that does not score workers
reports its own rank).

A policy is a ``Policy``: its name, its function, how it reads its config from ``Weights``, and
the inputs it needs beyond the candidates' match and load (``needs_tree_sizes``: SGLang's
reference counts every block each worker holds, which costs the router a pass over the index;
only a policy that declares it gets it).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

__all__ = [
    "MAX_WEIGHT",
    "Candidate",
    "Cost",
    "Decision",
    "Policy",
    "PolicyState",
    "RouteRequest",
    "Weights",
    "decision",
    "lowest",
    "plain_costs",
    "require",
    "softmax_pick",
]


# The largest weight taken. Any larger is no knob but an overflow: a decode weight of 1e308 made
# kv_aware's costs inf, and inf x a load weight of 0 is NaN, which no comparison can rank.
MAX_WEIGHT = 1e9


@dataclass(frozen=True, slots=True)
class Weights:
    """Every policy's knobs by their public names; each policy reads its own (``Policy.config``).

    ``load``, ``decode``, ``host_hit``, ``temperature``: kv_aware (``decode`` also weighs
    least_loaded's running sequences; ``temperature`` also dynamo's sampling);
    ``dynamo_overlap_weight``: dynamo; ``sglang_*``: sglang; ``session``: kv_aware's session
    affinity."""

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
    # kv_aware: a session's last worker is preferred by this fraction of the prompt's prefill.
    session: float = 0.1

    def __post_init__(self) -> None:
        names = ("load", "decode", "host_hit", "temperature", "dynamo_overlap_weight", "session")
        for name in names:
            value = getattr(self, name)
            if not 0 <= value <= MAX_WEIGHT:  # NaN is neither
                bound = f"{MAX_WEIGHT:,.0f}"
                raise ValueError(f"{name}: must be a number from 0 to {bound}, got {value!r}")
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


@dataclass(slots=True, kw_only=True)
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
    cached_blocks: int = 0  # blocks of any request it holds (SGLang's tree size; if needed)
    fresh: bool = True  # whether its index data and load are current
    session: bool = False  # it served the request's session last (x-session-id or user)
    # Its observed speed, as it reports it (app.core.step_speed); prefill_s 0: not reported.
    step_s: float = 0.0  # fixed time of an engine step
    prefill_s: float = 0.0  # per prompt token computed
    decode_s: float = 0.0  # per sequence decoded in a step
    step_tokens: int = 0  # token budget of one step (prefill chunks and decodes)

    def cached_tokens(self, request: RouteRequest) -> int:
        """Prompt tokens it would reuse: the last prompt token is always computed."""
        return min(self.matched_blocks * request.tokens_per_block, max(request.num_tokens - 1, 0))


# Not frozen, for speed (one per worker per decision): treat it as immutable. No slots either:
# ``/route`` answers with every worker's Cost, and orjson writes a dataclass from its
# ``__dict__`` at ~0.35 µs, from slots at ~1.5 µs (16 workers: 5.7 against 25 µs an answer).
@dataclass
class Cost:
    worker: str
    cost: float
    cached_tokens: int  # prompt tokens it is expected to reuse
    prefill_tokens: float  # the request's own prefill work there (onboarding included)
    load: float  # the load term (prefill-token units for kv_aware; the policy's own otherwise)
    fresh: bool
    affinity: float = 0.0  # kv_aware: what the session's affinity took off the cost
    ttft_s: float | None = None  # kv_aware: predicted time to the first token (a known speed)


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


C = TypeVar("C")


@dataclass(frozen=True, slots=True)
class Policy(Generic[C]):
    """A routing policy: see the module docstring."""

    name: str
    choose: Callable[[RouteRequest, Sequence[Candidate], C, PolicyState], Decision]
    config: Callable[[Weights], C]  # its own knobs, read from the router's weights
    needs_tree_sizes: bool = False  # Candidate.cached_blocks filled in

    def __call__(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        weights: Weights,
        state: PolicyState,
    ) -> Decision:
        return self.choose(request, candidates, self.config(weights), state)


def decision(policy: str, request: RouteRequest, chosen: Candidate, costs: list[Cost]) -> Decision:
    return Decision(
        worker=chosen.worker,
        policy=policy,
        expected_cached_tokens=chosen.cached_tokens(request),
        costs=tuple(costs),
        fresh=chosen.fresh,
    )


def plain_costs(
    request: RouteRequest, candidates: Sequence[Candidate], values: Sequence[float]
) -> list[Cost]:
    """Costs of a policy that ranks workers by ``values`` (the other fields as kv_aware's)."""
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


def require(candidates: Sequence[Any]) -> None:
    if not candidates:
        raise ValueError("no candidate workers")


def lowest(
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


def softmax_pick(values: Sequence[float], scale: float, state: PolicyState) -> int:
    """Sample an index with probability proportional to exp(-value / scale)."""
    low = min(values)
    if not scale > 0:  # a temperature so small it underflowed (5e-324 x a spread below 1)
        weights = [1.0 if v == low else 0.0 for v in values]  # the limit: the lowest, evenly
    else:
        weights = [math.exp(-(v - low) / scale) for v in values]
    return state.rng.choices(range(len(values)), weights=weights)[0]
