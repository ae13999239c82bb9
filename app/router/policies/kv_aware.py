"""``kv_aware`` (the default): fewest prefill-token equivalents before the request's first token.

Per worker, in prefill-token units::

    own     = uncached tokens + host_hit * tokens to onboard from the host tier
    ahead   = load * (queued prefill tokens + decode * running sequences)
    cost    = own + ahead            (+ 4 prompts when the worker cannot fit the request)
                  - session * prompt tokens   (the worker that served the request's session last)

The session term is soft: the session's worker keeps the request while the others' costs are
not lower by more than ``session`` of a prompt (0.1 by default), so an agent's next call lands
where its context is even before that worker's events arrive, and leaves a loaded worker.
The lowest cost wins; ties go to the lower load, then to a seeded random choice. With a
temperature above 0 the choice is sampled from ``softmax(-cost / (temperature * prompt))``.
``docs/routing.md`` explains the choice of terms and weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Final

from app.router.policies.base import (
    Candidate,
    Cost,
    Decision,
    Policy,
    PolicyState,
    RouteRequest,
    Weights,
    decision,
    lowest,
    require,
    softmax_pick,
)

__all__ = ["POLICY", "KvAwareConfig", "kv_aware"]

# A worker that cannot fit the request without evicting in-use blocks pays this many prompts.
_MEMORY_PENALTY_PROMPTS: Final = 4.0


@dataclass(frozen=True, slots=True)
class KvAwareConfig:
    load: float
    decode: float
    host_hit: float
    temperature: float
    session: float


@lru_cache(maxsize=64)  # one per weights a router uses: built once, not per decision
def config(weights: Weights) -> KvAwareConfig:
    return KvAwareConfig(
        weights.load, weights.decode, weights.host_hit, weights.temperature, weights.session
    )


def kv_aware(
    request: RouteRequest,
    candidates: Sequence[Candidate],
    config: KvAwareConfig,
    state: PolicyState,
) -> Decision:
    """Fewest prefill-token equivalents before the first token; see the module docstring."""
    require(candidates)
    # Locals and plain comparisons: this loop runs for every worker on every request.
    tpb = request.tokens_per_block
    num_tokens = request.num_tokens
    most_cached = max(num_tokens - 1, 0)  # the last prompt token is always computed
    need_blocks = -(-num_tokens // tpb)
    w_load, w_decode, w_host = config.load, config.decode, config.host_hit
    penalty = _MEMORY_PENALTY_PROMPTS * num_tokens
    affinity = config.session * num_tokens
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
        if c.session and affinity:
            cost -= affinity
            costs.append(Cost(c.worker, cost, cached, own, load, c.fresh, affinity))
        else:
            costs.append(Cost(c.worker, cost, cached, own, load, c.fresh))
        loads.append(load)
    values = [c.cost for c in costs]
    if config.temperature > 0:
        index = softmax_pick(values, config.temperature * max(request.num_tokens, 1), state)
    else:
        index = lowest(values, loads, state, request)
    return decision("kv_aware", request, candidates[index], costs)


POLICY: Final = Policy("kv_aware", kv_aware, config)
