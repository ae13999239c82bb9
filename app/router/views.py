"""What a ``RouterCore`` keeps per worker (``WorkerView``: its registry fields, its last load
report, the router's own in-flight accounting and the other routers' share of it) and per
request in flight (``InFlight``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from app.core.step_speed import speed_from_load
from app.router.policies.base import Candidate

__all__ = ["InFlight", "RoutingState", "WorkerView"]

_CANDIDATES = 64  # candidates a view keeps (see WorkerView.candidate)

RoutingState = Literal["up", "stale", "draining", "cordoned"]


@dataclass(slots=True)
class WorkerView:
    worker: str
    url: str | None = None
    model: str | None = None  # the model it serves (None: any; an engine ingested unnamed)
    foreign: bool = False  # an engine behind kvmesh ingest: it takes the client's body as sent
    approximate: bool = False  # no KV events: matched against what this router sent it
    capacity_blocks: int = 0
    draining: bool = False  # the worker said so in its registry entry
    cordon: str | None = None  # "cordoned" or "draining": an operator's (app.cluster.fleet)
    stale_reason: str | None = None  # why its index data or load is not current; None: fresh
    load: dict[str, int] = field(default_factory=dict)  # as the worker last reported it
    # The router's own accounting of what it sent there.
    inflight_prefill_tokens: int = 0
    inflight_running: int = 0
    inflight_blocks: int = 0
    num_decisions: int = 0
    # What the other routers sent there, as they shared it (app.router.share).
    remote_prefill_tokens: int = 0
    remote_running: int = 0
    remote_blocks: int = 0
    _terms: tuple[int, int, int, int] | None = None
    _speed: tuple[float, float, float, int] | None = None  # parsed from load; see speed_terms
    _candidates: dict[tuple[int, int, bool, int], Candidate] = field(default_factory=dict)
    # Its core's set of the views whose rows of the fleet table are out of date
    # (``app.router.fleet``): ``changed`` adds this one.
    fleet_dirty: set[str] | None = field(default=None, repr=False, compare=False)

    def load_terms(self) -> tuple[int, int, int, int]:
        """(queued prefill tokens, running, active blocks, free blocks): the worker's report
        combined with the router's own accounting, which is newer. Cached until either
        changes (``changed``), since every request reads it for every worker."""
        terms = self._terms
        if terms is None:
            terms = self._terms = self._load_terms()
        return terms

    def changed(self) -> None:
        """Its load, capacity or freshness changed: the cached terms are read again."""
        self._terms = None
        self._candidates.clear()
        if self.fleet_dirty is not None:
            self.fleet_dirty.add(self.worker)

    def set_load(self, load: dict[str, int]) -> None:
        """The worker's new load report: a new dict each time (one changed in place and given
        again would equal itself, and keep the candidates built from it)."""
        unchanged = load == self.load
        self.load = load
        if unchanged:  # an idle worker reports the same load: its candidates stay built
            return
        self._speed = None  # parsed again from the new report, once
        self.changed()

    def candidate(
        self, matched_blocks: int, host_blocks: int, session: bool, cached_blocks: int
    ) -> Candidate:
        """The worker as a policy sees it for a request whose first ``matched_blocks`` it
        holds (``host_blocks`` of them on the host tier). Requests that share a prefix (a
        system prompt, an agent's context) match a worker to the same depth, so a candidate is
        the same for many requests until the view changes: it is built once (16 keyword
        fields are ~0.8 µs, per worker per request) and kept, the last ``_CANDIDATES`` kinds.
        Candidates are never changed once built (``Candidate``), so one may serve many
        decisions."""
        key = (matched_blocks, host_blocks, session, cached_blocks)
        kept = self._candidates
        found = kept.get(key)
        if found is None:
            if len(kept) >= _CANDIDATES:
                kept.clear()
            found = kept[key] = self._candidate(*key)
        return found

    def _candidate(
        self, matched_blocks: int, host_blocks: int, session: bool, cached_blocks: int
    ) -> Candidate:
        queued, running, active, free = self.load_terms()
        step_s, prefill_s, decode_s, step_tokens = self.speed_terms()
        return Candidate(
            worker=self.worker,
            matched_blocks=matched_blocks,
            host_blocks=host_blocks,
            queued_prefill_tokens=queued,
            running=running,
            active_blocks=active,
            free_blocks=free,
            capacity_blocks=self.capacity_blocks,
            cached_blocks=cached_blocks,
            fresh=self.stale_reason is None,
            session=session,
            step_s=step_s,
            prefill_s=prefill_s,
            decode_s=decode_s,
            step_tokens=step_tokens,
        )

    def speed_terms(self) -> tuple[float, float, float, int]:
        """(step s, prefill s per token, decode s per sequence, step token budget) as the
        worker last reported them (app.core.step_speed); all 0 when it reports no speed.
        Cached until its next report."""
        speed = self._speed
        if speed is None:
            reported = speed_from_load(self.load)
            if reported is None:
                speed = (0.0, 0.0, 0.0, 0)
            else:
                timing, budget = reported
                speed = (
                    timing.step_overhead_s,
                    timing.prefill_s_per_token,
                    timing.decode_s_per_sequence,
                    budget,
                )
            self._speed = speed
        return speed

    def _load_terms(self) -> tuple[int, int, int, int]:
        prefill = self.inflight_prefill_tokens + self.remote_prefill_tokens
        running = self.inflight_running + self.remote_running
        blocks = self.inflight_blocks + self.remote_blocks
        load = self.load
        if not load:
            return prefill, running, blocks, self.capacity_blocks
        reported_running = load.get("running_requests", load.get("active_sequences", 0))
        free = load.get("free_blocks_0", self.capacity_blocks)
        return (
            prefill,
            max(running, reported_running + load.get("waiting_requests", 0)),
            max(blocks, load.get("used_blocks_0", 0)),
            max(free - blocks, 0),
        )

    @property
    def admitting(self) -> bool:
        """Whether new requests may go there."""
        return not self.draining and self.cordon is None

    def takes(self, model: str | None) -> bool:
        """Whether a new request for ``model`` (None: any) may go there: it admits requests
        and serves that model, or names none."""
        return self.admitting and (model is None or self.model is None or self.model == model)

    @property
    def state(self) -> RoutingState:
        if self.draining or self.cordon == "draining":
            return "draining"
        if self.cordon is not None:
            return "cordoned"
        return "stale" if self.stale_reason is not None else "up"

    def as_dict(self) -> dict[str, Any]:
        return {
            "worker": self.worker,
            "url": self.url,
            "model": self.model,
            "approximate": self.approximate,
            "state": self.state,
            "stale_reason": self.stale_reason,
            "capacity_blocks": self.capacity_blocks,
            "load": dict(self.load),
            "inflight": {
                "prefill_tokens": self.inflight_prefill_tokens,
                "running": self.inflight_running,
                "blocks": self.inflight_blocks,
            },
            "other_routers": {
                "prefill_tokens": self.remote_prefill_tokens,
                "running": self.remote_running,
                "blocks": self.remote_blocks,
            },
            "decisions": self.num_decisions,
            "speed": self._speed_dict(),
        }

    def _speed_dict(self) -> dict[str, float] | None:
        step_s, prefill_s, decode_s, _ = self.speed_terms()
        if not prefill_s:
            return None
        return {
            "step_s": step_s,
            "prefill_s_per_token": prefill_s,
            "decode_s_per_sequence": decode_s,
        }


@dataclass(slots=True)
class InFlight:
    request_id: str
    worker: str
    prefill_tokens: int  # uncached prompt tokens, until prefilled
    blocks: int
    prefilled: bool = False
    router: str = ""  # another router's id, for a flight it shared; "" for this router's own
    started_at: float = 0.0  # the core's clock when it began (for the remote ones' age)
    shared: bool = False  # its begin was published to the other routers (app.router.share)
