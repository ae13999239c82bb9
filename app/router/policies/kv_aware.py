"""``kv_aware`` (the default): the work the request's cache misses cause, plus the time it waits
for its first token, weighed.

Per worker, from the speed the worker reports (``Candidate.step_s``, ``prefill_s``,
``decode_s``, ``step_tokens``: fitted to its own steps, ``app.core.step_speed``)::

    own     = uncached tokens + host_hit * tokens to onboard from the host tier     (tokens)
    steps   = ceil((queued prefill tokens + own) / (step_tokens - running))
    ttft    = (queued prefill tokens + own) * prefill_s + steps * (step_s + running * decode_s)
    wait    = ttft / reference prefill_s - own     the time beyond its own tokens at the fastest
                                                   speed: the queue, the steps, a slow worker
    cost    = own + load * wait                    (+ 4 prompts when the worker cannot fit it)
                  - session * prompt               (the worker that served the session last)

``running`` sequences each take a token of every step's budget and ``decode_s`` of its time.
``load`` (0.1) is the trade-off between this request's wait and the work its misses cause:
every token it recomputes is a token that the requests queued behind it on that worker wait
for, and a second copy of a prefix competes for cache space, which a greedy TTFT estimate
(``load`` 1: the earliest predicted first token) sees none of. ``own`` is in tokens whatever
the worker's speed (a token recomputed is a token of cache and compute used); a slow worker's
slowness is wait, so that a mixed fleet's slow workers still take their share.
``docs/routing.md`` has the measurements.

Costs are in prompt tokens (at the fastest reported speed). A worker that reports no speed (an
ingested engine, a ``kvmesh register`` server, a worker before its first 32 steps) waits
``queued prefill tokens + decode * running`` tokens, as the fastest one would.

The session term is soft: the session's worker keeps the request while the others' costs are
not lower by more than ``session`` of a prompt (0.1 by default), so an agent's next call lands
where its context is even before that worker's events arrive, and leaves a loaded worker.
The lowest cost wins; ties go to the lower load, then to a seeded random choice. With a
temperature above 0 the choice is sampled from ``softmax(-cost / (temperature * prompt))``.

This function is the policy's definition. ``RouterCore.decide`` makes the same decisions in one
compiled call (``app.router.fleet``, its arithmetic mirrored step for step): a change here is a
change there, and ``tests/app/test_router_fleet.py`` fails until both agree.
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

__all__ = ["MEMORY_PENALTY_PROMPTS", "POLICY", "KvAwareConfig", "kv_aware"]

# A worker that cannot fit the request without evicting in-use blocks pays this many prompts.
MEMORY_PENALTY_PROMPTS: Final = 4.0


@dataclass(frozen=True, slots=True)
class KvAwareConfig:
    load: float
    decode: float
    host_hit: float
    temperature: float
    session: float


@lru_cache(maxsize=64)  # one per weights a router uses: built once, not per decision
def config(weights: Weights) -> KvAwareConfig:
    # Floats: the cache takes Weights(load=1) for Weights(load=1.0) (they are equal), so an int
    # kept as one would make the costs' types depend on which came first.
    return KvAwareConfig(
        float(weights.load),
        float(weights.decode),
        float(weights.host_hit),
        float(weights.temperature),
        float(weights.session),
    )


def kv_aware(
    request: RouteRequest,
    candidates: Sequence[Candidate],
    config: KvAwareConfig,
    state: PolicyState,
) -> Decision:
    """The lowest of own prefill + ``load`` x the wait; see the module docstring."""
    require(candidates)
    # Locals and plain comparisons: this loop runs for every worker on every request.
    tpb = request.tokens_per_block
    num_tokens = request.num_tokens
    most_cached = max(num_tokens - 1, 0)  # the last prompt token is always computed
    need_blocks = -(-num_tokens // tpb)
    w_load, w_decode, w_host = config.load, config.decode, config.host_hit
    penalty = MEMORY_PENALTY_PROMPTS * num_tokens
    affinity = config.session * num_tokens
    # Seconds -> prefill tokens at the fastest reported speed (0 when none reports one: then
    # every candidate is costed in tokens).
    reference = min((c.prefill_s for c in candidates if c.prefill_s > 0), default=0.0)
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
        queued = c.queued_prefill_tokens
        prefill_s = c.prefill_s
        ttft: float | None
        if prefill_s > 0:
            decodes = c.running
            chunk = c.step_tokens - decodes
            if chunk < tpb:
                chunk = tpb
            steps = -(-(queued + own) // chunk) or 1
            own_s = own * prefill_s
            ahead_s = queued * prefill_s + steps * (c.step_s + decodes * c.decode_s)
            ttft = own_s + ahead_s
            # The wait beyond its own tokens at the fastest speed: the queue, the steps, and
            # (on a slower worker) the slowness of its own prefill.
            load = w_load * (ttft / reference - own)
        else:
            ttft = None
            load = w_load * (queued + w_decode * c.running)
        cost = own + load
        if c.free_blocks < need_blocks - c.matched_blocks:
            cost += penalty
        if c.session and affinity:
            cost -= affinity
            costs.append(Cost(c.worker, cost, cached, own, load, c.fresh, affinity, ttft))
        else:
            costs.append(Cost(c.worker, cost, cached, own, load, c.fresh, 0.0, ttft))
        loads.append(load)
    values = [c.cost for c in costs]
    if config.temperature > 0:
        index = softmax_pick(values, config.temperature * max(request.num_tokens, 1), state)
    else:
        index = lowest(values, loads, state, request)
    return decision("kv_aware", request, candidates[index], costs)


POLICY: Final = Policy("kv_aware", kv_aware, config)
