"""Fleet admin: cordoned and draining workers, kept in Redis so every router honours them.

An operator cordons a worker that misbehaves (no new requests; those in flight finish) and
drains one before maintenance (cordoned, and the worker itself stops admitting; done when
nothing is left in flight). Both are written to one Redis hash, ``kvmesh:cordons`` (worker id
-> ``{"state": "cordoned" | "draining", "since": <unix seconds>}``), which every router reads
with the workers' loads: a router replica, or a router started later, honours what another was
told. Nothing expires it: a cordon outlives the worker's restarts until someone uncordons it
(``kubectl cordon`` does the same for nodes).

The hash is written by operators through any router's admin API, never by the workers, and
read on every load tick; an entry that does not parse is skipped (and counted), so a stray
write cannot stop routing.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal

from redis.asyncio import Redis

from events import keys

__all__ = ["Cordon", "CordonState", "clear_cordon", "parse_cordons", "set_cordon"]

CordonState = Literal["cordoned", "draining"]
_STATES: frozenset[str] = frozenset(("cordoned", "draining"))


@dataclass(frozen=True, slots=True)
class Cordon:
    """A worker taken out of rotation by an operator; ``draining``: the worker was also asked
    to stop admitting, and is done once nothing is left in flight there."""

    state: CordonState
    since: float  # unix seconds

    def as_dict(self) -> dict[str, Any]:
        return {"state": self.state, "since": self.since}


def parse_cordons(raw: Any) -> tuple[dict[str, Cordon], int]:
    """The hash's entries as ``Cordon``s, and how many were skipped as malformed."""
    cordons: dict[str, Cordon] = {}
    bad = 0
    if not isinstance(raw, dict):
        return cordons, bad
    for name, value in raw.items():
        try:
            worker = keys.validate_worker_id(name.decode() if isinstance(name, bytes) else name)
            entry = json.loads(value)
            state, since = entry["state"], entry["since"]
            if state not in _STATES or not isinstance(since, int | float):
                raise ValueError(f"not a cordon: {entry!r}")
        except (ValueError, TypeError, KeyError, UnicodeDecodeError):
            bad += 1
            continue
        cordons[worker] = Cordon(state, float(since))
    return cordons, bad


async def set_cordon(redis: Redis, worker: str, state: CordonState) -> Cordon:
    """Cordon (or drain) ``worker`` for every router; keeps the first ``since`` when the state
    does not change."""
    worker = keys.validate_worker_id(worker)
    raw = await redis.hget(keys.CORDONS_KEY, worker)
    previous = parse_cordons({worker: raw})[0].get(worker) if raw is not None else None
    if previous is not None and previous.state == state:
        return previous
    cordon = Cordon(state, time.time())
    await redis.hset(keys.CORDONS_KEY, worker, json.dumps(cordon.as_dict()))
    return cordon


async def clear_cordon(redis: Redis, worker: str) -> bool:
    """Put ``worker`` back in rotation; False if it was not cordoned."""
    removed: int = await redis.hdel(keys.CORDONS_KEY, keys.validate_worker_id(worker))
    return removed > 0
