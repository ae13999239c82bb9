"""Routing policies: pure functions from one request and a view of every worker to a choice.

The router service and ``kvmesh replay`` call the same functions with the same inputs, so a
replay measures exactly the code that routes live traffic. Nothing here does I/O, reads a clock
or keeps state between calls except what the caller passes in (``PolicyState``).

``base`` holds what they share (inputs, outputs, ``Policy``); each policy has its module:
``kv_aware`` (the default), ``dynamo`` and ``sglang`` (the published formulas of NVIDIA
Dynamo's KV router and SGLang's ``cache_aware``, as faithfully as their inputs allow, so that
every comparison is made in one run on the same index and load), and ``simple`` (the three
cache-blind baselines, a few lines each: ``round_robin``, ``random``, ``least_loaded``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from app.router.policies import dynamo, kv_aware, sglang, simple
from app.router.policies.base import (
    Candidate,
    Cost,
    Decision,
    Policy,
    PolicyState,
    RouteRequest,
    Weights,
)

__all__ = [
    "POLICIES",
    "Candidate",
    "Cost",
    "Decision",
    "Policy",
    "PolicyState",
    "RouteRequest",
    "Weights",
    "choose",
    "policy_named",
]

POLICIES: Final[dict[str, Policy[Any]]] = {
    p.name: p
    for p in (
        kv_aware.POLICY,
        simple.ROUND_ROBIN,
        simple.RANDOM,
        simple.LEAST_LOADED,
        dynamo.POLICY,
        sglang.POLICY,
    )
}


def policy_named(name: str) -> Policy[Any]:
    """The policy named ``name`` (``KeyError`` naming the known ones if there is none)."""
    try:
        return POLICIES[name]
    except KeyError:
        raise KeyError(f"policy: unknown {name!r}; known: {', '.join(POLICIES)}") from None


def choose(
    name: str,
    request: RouteRequest,
    candidates: Sequence[Candidate],
    weights: Weights,
    state: PolicyState,
) -> Decision:
    """Run the policy named ``name`` with its config read from ``weights``."""
    return policy_named(name)(request, candidates, weights, state)
