"""One worker as the cluster view knows it (``Member``), and how the view reads what Redis holds
about it: the load hash, the heartbeat's TTL, the stream's tail.

A member's data is *stale* (``Member.stale_reason``; reported, never silently used as fresh)
when the consumer is resynchronising it, when its heartbeat reports an event id the consumer has
not applied within 2 s (``behind_heartbeat``), when the entries not read yet are older than
``max_lag_ms`` (``lagging``), when its heartbeat is late (under a third of its TTL left), or when
it has published no load, or when it registered no URL. The view adds ``redis_unreachable``
while Redis does not answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from app.cluster.fleet import Cordon
from events.consumer import WorkerState

__all__ = ["MAX_I64", "MIN_I64", "Member", "MemberState", "id_key", "id_text", "parse_load"]

# A load field's range, as Redis's HINCRBY holds it; other counts workers and routers report
# are read within it too (app.router.share).
MAX_I64 = (1 << 63) - 1
MIN_I64 = -(1 << 63)

MemberState = Literal["up", "stale", "draining", "cordoned"]


@dataclass(slots=True)
class Member:
    """A registered, alive worker: its registry fields, the sync loop's readings, and what the
    two make of it. ``follow`` is the consumer's record of its stream."""

    worker: str
    follow: WorkerState
    lag_ms: float = 0.0
    heartbeat_age_s: float | None = None
    heartbeat_ttl_s: float | None = None
    load: dict[str, int] = field(default_factory=dict)
    has_load: bool = False
    cordon: Cordon | None = None
    stale_reason: str | None = None

    @property
    def info(self) -> dict[str, Any]:
        return self.follow.info

    @property
    def url(self) -> str | None:
        url = self.info.get("url")
        return url if isinstance(url, str) and url else None

    @property
    def capacity_blocks(self) -> int:
        capacity = self.info.get("capacity") or [0]
        try:
            blocks = int(capacity[0])
        except (TypeError, ValueError, IndexError, OverflowError):  # OverflowError: Infinity
            return 0
        return min(max(blocks, 0), MAX_I64)  # as a load field's range, and never below 0

    @property
    def tokens_per_block(self) -> int | None:
        tpb = self.info.get("tokens_per_block")
        return tpb if isinstance(tpb, int) and not isinstance(tpb, bool) and tpb > 0 else None

    @property
    def approximate(self) -> bool:
        """A worker without KV events (``kvmesh register``): routers match what they sent it."""
        return bool(self.info.get("approximate"))

    @property
    def draining(self) -> bool:
        """The worker says so in its registry entry (its own drain, or a shutdown)."""
        return bool(self.info.get("draining"))

    @property
    def state(self) -> MemberState:
        if self.draining or (self.cordon is not None and self.cordon.state == "draining"):
            return "draining"
        if self.cordon is not None:
            return "cordoned"
        return "stale" if self.stale_reason is not None else "up"

    def judge(self, max_lag_ms: float) -> str | None:
        """Why its data is stale (see the module docstring), or None."""
        follow = self.follow
        if self.url is None:  # nothing can be sent there, whatever its index says
            return "no_url"
        if not follow.synced:
            return "resyncing"
        if follow.stale is not None:  # its heartbeat reports events the index has not got
            return follow.stale
        if self.lag_ms > max_lag_ms:
            return "lagging"
        if (
            self.heartbeat_age_s is not None
            and self.heartbeat_ttl_s
            and self.heartbeat_age_s > self.heartbeat_ttl_s * 2 / 3
        ):
            return "heartbeat_late"
        if not self.has_load and not self.approximate:  # it has none to publish
            return "no_load"
        return None

    def in_flight(self) -> tuple[int, int]:
        """(running, waiting) requests, as the worker last reported them."""
        load = self.load
        return load.get("running_requests", load.get("active_sequences", 0)), load.get(
            "waiting_requests", 0
        )


def parse_load(raw: Any) -> dict[str, int]:
    """A load hash as Redis returns it; fields that are not 64-bit integers (what Redis's own
    ``HINCRBY`` holds) are left out. The bound keeps the policies' arithmetic finite: a speed of
    10**308 ns per token made a cost of inf, and with a load weight of 0 inf x 0, NaN,
    which no worker should win or lose by."""
    if not isinstance(raw, dict):
        return {}
    load: dict[str, int] = {}
    for name, value in raw.items():
        try:
            number = int(value)
        except (TypeError, ValueError):
            continue
        if MIN_I64 <= number <= MAX_I64:
            load[name.decode() if isinstance(name, bytes) else str(name)] = number
    return load


def id_text(entry_id: bytes | str) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


def id_key(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry id as (ms, seq), for comparisons."""
    ms, _, seq = id_text(entry_id).partition("-")
    return int(ms), int(seq or 0)
