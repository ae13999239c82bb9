"""``RouterCore``: what a router knows about its workers, and its decisions. Synchronous, no I/O.

The router service and ``kvmesh replay`` both drive one of these: the service from Redis (the
registry, heartbeats, load keys, the event streams through an ``EventConsumer``) and HTTP
responses; replay from its in-process cluster. The core owns:

* the ``PrefixIndex`` (shared with the consumer that fills it; the core only reads it);
* one ``WorkerView`` per worker that may take requests: URL, capacity, the load it last
  reported, whether its data is fresh, whether it drains or an operator cordoned it (then it
  takes nothing new), and the router's own in-flight accounting (prompt tokens sent and not
  prefilled yet, sequences and blocks in flight), which is newer than any report;
* the predicted cache (``app.router.predicted``): right after a decision the chosen worker is
  assumed to hold the request's blocks for ``predict_ttl_s`` (more, and at most twice that: see
  ``PredictedCache.purge``), until its ``stored`` events reach the index, so that a burst of
  requests sharing a new prefix lands together instead of scattering. For a worker without KV
  events (``approximate``, ``kvmesh register``) the predictions are all the router knows: they
  last ``approx_ttl_s`` exactly and at most the worker's capacity in blocks is kept, the least
  recently sent dropped first (an approximate prefix tree, as Dynamo's ``--no-kv-events``
  keeps);
* the policy state (seeded random generator, round-robin position);
* the fleet table (``app.router.fleet``): the views' load and speed terms as arrays, on which
  ``decide`` makes kv_aware's decisions in one compiled call where it can;
* sessions: the worker each session's last request went to (``x-session-id`` or OpenAI's
  ``user``), for kv_aware's soft affinity, the most recent ``MAX_SESSIONS`` kept.

Each worker serves one model (its registry entry's ``model``); a request naming a model is
routed among that model's workers (and those that named none).

A request's life: ``decide`` -> ``begin`` (counts it in flight, predicts its blocks) ->
``prefilled`` (its first token came back) -> ``finish`` (the response ended, well or not).

Predictions are whole chains from the root (a request's hashes from block 0), and so is what
the index holds for one of our workers, so a prediction extends a worker's match from where the
index's match ends: a set probe or two per extra block, none when the prediction adds nothing.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import numpy.typing as npt

from app.router.fleet import FleetTable
from app.router.policies import (
    Candidate,
    Decision,
    PolicyState,
    RouteRequest,
    Weights,
    policy_named,
)
from app.router.policies.kv_aware import POLICY as KV_AWARE
from app.router.policies.kv_aware import config as kv_aware_config
from app.router.predicted import PredictedCache
from app.router.views import InFlight, RoutingState, WorkerView
from cache import cache_salt_id
from cache.hashing import U64Array, block_hash_array
from events.index import PrefixIndex

__all__ = ["InFlight", "NoWorkerError", "RouterCore", "RoutingState", "WorkerView"]

_NO_MATCH = (0, 0)
Tokens = Sequence[int] | npt.NDArray[Any]
MAX_SESSIONS = 100_000


class NoWorkerError(Exception):
    """No worker can take the request (none registered and alive, or all excluded)."""


class RouterCore:
    """Routing state and decisions for one router (or one replay run); see the module docstring."""

    def __init__(
        self,
        index: PrefixIndex,
        *,
        tokens_per_block: int,
        policy: str = "kv_aware",
        weights: Weights | None = None,
        seed: int = 0,
        predict_ttl_s: float = 2.0,
        approx_ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if tokens_per_block <= 0:
            raise ValueError(f"tokens_per_block: must be positive, got {tokens_per_block}")
        self.index = index
        self.tokens_per_block = tokens_per_block
        self.policy = policy
        self.weights = weights or Weights()
        self.state = PolicyState(seed)
        self.clock = clock
        self.workers: dict[str, WorkerView] = {}
        self._order: list[str] = []  # worker ids, sorted: every router sees the same list
        self.inflight: dict[str, InFlight] = {}
        self.remote: dict[tuple[str, str], InFlight] = {}  # (router, request id): shared flights
        # Called with ("begin" | "prefilled" | "finish", the flight, its block hashes) for each
        # of this router's own flights: how they are shared with the other routers.
        self.flight_hooks: list[Callable[[str, InFlight, Sequence[int]], None]] = []
        self.sessions: OrderedDict[str, str] = OrderedDict()  # session -> its last worker
        self._named: list[str] | None = None  # the models named, sorted (cached)
        self.predicted = PredictedCache(predict_ttl_s, approx_ttl_s, clock)
        self._fleet = FleetTable(self.workers)  # kv_aware's compiled decision (``decide``)

    # -- workers -------------------------------------------------------------------------------

    def upsert_worker(
        self,
        worker: str,
        *,
        url: str | None = None,
        capacity_blocks: int = 0,
        draining: bool = False,
        cordon: str | None = None,
        model: str | None = None,
        foreign: bool = False,
        approximate: bool = False,
    ) -> WorkerView:
        view = self.workers.get(worker)
        if view is None:
            view = self.workers[worker] = WorkerView(worker, fleet_dirty=self._fleet.dirty)
            self._order = sorted(self.workers)
            self._recount(view)  # back after a lapse: its requests still in flight count
            self._fleet.invalidate()
        view.url = url
        if model != view.model:
            self._named = None
            self._fleet.invalidate()
        if draining != view.draining or cordon != view.cordon:
            self._fleet.invalidate()  # whether it admits requests
        view.model = model
        view.foreign = foreign
        view.approximate = approximate
        if capacity_blocks != view.capacity_blocks:
            view.capacity_blocks = capacity_blocks
            view.changed()
        view.draining = draining
        view.cordon = cordon
        return view

    def _recount(self, view: WorkerView) -> None:
        """A new view's in-flight figures, from the flights (its own and the other routers')
        that went to its worker and have not ended."""
        for flight in [*self.inflight.values(), *self.remote.values()]:
            if flight.worker != view.worker:
                continue
            prefill = 0 if flight.prefilled else flight.prefill_tokens
            if flight.router:
                view.remote_prefill_tokens += prefill
                view.remote_running += 1
                view.remote_blocks += flight.blocks
            else:
                view.inflight_prefill_tokens += prefill
                view.inflight_running += 1
                view.inflight_blocks += flight.blocks

    def remove_worker(self, worker: str) -> None:
        """Stop routing to ``worker`` (its in-flight requests stay counted until they finish)."""
        if self.workers.pop(worker, None) is not None:
            self._order = sorted(self.workers)
            self._named = None
            self._fleet.invalidate()
        self.predicted.forget(worker)

    def set_load(self, worker: str, load: dict[str, int]) -> None:
        view = self.workers.get(worker)
        if view is not None:
            view.set_load(load)

    def set_stale(self, worker: str, reason: str | None) -> None:
        """Mark ``worker``'s data stale (``reason``) or fresh (None)."""
        view = self.workers.get(worker)
        if view is not None and view.stale_reason != reason:
            view.stale_reason = reason
            view.changed()  # its candidates say whether it is fresh

    # -- decisions -----------------------------------------------------------------------------

    def hashes(
        self, tokens: Tokens, *, lora_task_id: int | None = None, cache_salt: str | None = None
    ) -> list[int]:
        """The chained hashes of the prompt's full blocks, as the workers' managers make them."""
        array = self.hash_array(tokens, lora_task_id=lora_task_id, cache_salt=cache_salt)
        hashes: list[int] = array.tolist()
        return hashes

    def hash_array(
        self, tokens: Tokens, *, lora_task_id: int | None = None, cache_salt: str | None = None
    ) -> U64Array:
        """``hashes`` as a uint64 array: what the index matches without converting them."""
        return block_hash_array(
            tokens,
            self.tokens_per_block,
            lora_task_id=lora_task_id,
            cache_salt_id=cache_salt_id(cache_salt) if cache_salt is not None else None,
        )

    def candidates(
        self,
        block_hashes: Sequence[int],
        *,
        exclude: Iterable[str] = (),
        tree_sizes: bool = True,
        model: str | None = None,
        session: str | None = None,
        hash_array: U64Array | None = None,
    ) -> list[Candidate]:
        """One ``Candidate`` per worker that may take a request (admitting, not excluded,
        serving ``model`` if one is named), in worker-id order so that every router sees the
        same list. ``tree_sizes=False`` leaves ``cached_blocks`` 0 (a policy that reads it
        declares so: ``needs_tree_sizes``); ``session``'s last worker is marked.
        ``hash_array``: ``block_hashes`` as ``hash_array`` gives them (the same hashes, the
        caller's to keep so), for the index's match."""
        now = self.predicted.purged_now()
        skip = set(exclude) if exclude else ()
        held = block_hashes if hash_array is None else hash_array
        matches = self.index.find_matches_by_tier(held) if block_hashes else {}
        session_worker = self.sessions.get(session) if session is not None else None
        out: list[Candidate] = []
        for worker in self._order:
            view = self.workers[worker]
            if not view.takes(model) or worker in skip:
                continue
            depth, gpu = matches.get(worker, _NO_MATCH)
            host = depth - gpu
            if now is not None:
                depth = self.predicted.depth(block_hashes, now, worker, depth)
            out.append(
                view.candidate(
                    depth,
                    host,
                    worker == session_worker,
                    self._num_cached(worker) if tree_sizes else 0,
                )
            )
        return out

    def _num_cached(self, worker: str) -> int:
        try:
            return self.index.num_blocks(worker)
        except KeyError:
            return 0

    def decide(
        self,
        block_hashes: Sequence[int],
        num_tokens: int,
        *,
        policy: str | None = None,
        weights: Weights | None = None,
        exclude: Iterable[str] = (),
        model: str | None = None,
        session: str | None = None,
        hash_array: U64Array | None = None,
    ) -> Decision:
        """Choose a worker for a prompt of ``num_tokens`` tokens whose full blocks hash to
        ``block_hashes`` (and ``hash_array``, see ``candidates``), among ``model``'s workers.
        Changes nothing a caller sees (it purges expired predictions and brings the fleet
        table up to date); ``begin`` records the choice."""
        chosen = policy_named(policy or self.policy)
        weights = weights or self.weights
        request = RouteRequest(
            num_tokens, self.tokens_per_block, block_hashes[-1] if block_hashes else num_tokens
        )
        if chosen is KV_AWARE and not exclude:  # in one compiled call where it covers it
            decision = self._compiled_kv_aware(
                block_hashes, hash_array, request, weights, model, session
            )
            if decision is not None:
                return decision
        candidates = self.candidates(
            block_hashes,
            exclude=exclude,
            tree_sizes=chosen.needs_tree_sizes,
            model=model,
            session=session,
            hash_array=hash_array,
        )
        if not candidates:
            raise NoWorkerError(self._why_none(exclude, model))
        return chosen(request, candidates, weights, self.state)

    def _compiled_kv_aware(
        self,
        block_hashes: Sequence[int],
        hash_array: U64Array | None,
        request: RouteRequest,
        weights: Weights,
        model: str | None,
        session: str | None,
    ) -> Decision | None:
        """kv_aware's decision by the fleet table (``app.router.fleet``), the candidates'
        rules and predictions included; None where the table does not cover it."""
        cache = self.predicted
        now = cache.purged_now()
        predicted = () if now is None else cache.workers()
        extend = None if now is None else partial(cache.depth, block_hashes, now)
        return self._fleet.kv_aware(
            self.index,
            request,
            block_hashes if hash_array is None else hash_array,
            kv_aware_config(weights),
            self.state,
            model,
            self.sessions.get(session) if session is not None else None,
            predicted,
            extend,
        )

    def _why_none(self, exclude: Iterable[str], model: str | None = None) -> str:
        """Why no worker can take a request, in the words of a 503."""
        if not self.workers:
            return "no worker is up"
        skip = set(exclude)
        left = [
            view
            for worker, view in self.workers.items()
            if worker not in skip and (model is None or view.model in (None, model))
        ]
        if not left and model is not None:
            return f"no worker serving {model!r} is up"
        if left and not any(view.admitting for view in left):
            return "every worker is draining or cordoned"
        return "no worker is left"

    def begin(
        self,
        request_id: str,
        decision: Decision,
        block_hashes: Sequence[int],
        num_tokens: int,
        session: str | None = None,
    ) -> InFlight:
        """Count a request sent to ``decision.worker`` as in flight, predict its blocks, and
        remember the worker as its session's."""
        if request_id in self.inflight:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        worker = decision.worker
        if session is not None:
            sessions = self.sessions
            sessions[session] = worker
            sessions.move_to_end(session)
            if len(sessions) > MAX_SESSIONS:
                sessions.popitem(last=False)
        flight = InFlight(
            request_id,
            worker,
            prefill_tokens=num_tokens - decision.expected_cached_tokens,
            blocks=-(-num_tokens // self.tokens_per_block),
        )
        self.inflight[request_id] = flight
        view = self.workers.get(worker)
        if view is not None:
            view.inflight_prefill_tokens += flight.prefill_tokens
            view.inflight_running += 1
            view.inflight_blocks += flight.blocks
            view.num_decisions += 1
            view.changed()
        if block_hashes:
            self.predict(worker, block_hashes)
        for hook in self.flight_hooks:
            hook("begin", flight, block_hashes)
        return flight

    def prefilled(self, request_id: str) -> None:
        """The request's prompt is processed (its first token came back)."""
        flight = self.inflight.get(request_id)
        if flight is None or flight.prefilled:
            return
        flight.prefilled = True
        view = self.workers.get(flight.worker)
        if view is not None:
            view.inflight_prefill_tokens -= flight.prefill_tokens
            view.changed()
        for hook in self.flight_hooks:
            hook("prefilled", flight, ())

    def finish(self, request_id: str) -> None:
        """The request ended (completed, failed or cancelled): it leaves the accounting."""
        self.prefilled(request_id)
        flight = self.inflight.pop(request_id, None)
        if flight is None:
            return
        view = self.workers.get(flight.worker)
        if view is not None:
            view.inflight_running -= 1
            view.inflight_blocks -= flight.blocks
            view.changed()
        for hook in self.flight_hooks:
            hook("finish", flight, ())

    # -- the other routers' flights ------------------------------------------------------------

    def begin_remote(
        self,
        router: str,
        request_id: str,
        worker: str,
        prefill_tokens: int,
        blocks: int,
        block_hashes: Sequence[int],
    ) -> None:
        """Another router sent a request to ``worker``: count it, predict its blocks."""
        key = (router, request_id)
        if key in self.remote:
            return
        flight = InFlight(request_id, worker, prefill_tokens, blocks, router=router)
        flight.started_at = self.clock()
        self.remote[key] = flight
        view = self.workers.get(worker)
        if view is not None:
            view.remote_prefill_tokens += prefill_tokens
            view.remote_running += 1
            view.remote_blocks += blocks
            view.changed()
        if block_hashes:
            self.predict(worker, block_hashes)

    def prefilled_remote(self, router: str, request_id: str) -> None:
        flight = self.remote.get((router, request_id))
        if flight is None or flight.prefilled:
            return
        flight.prefilled = True
        view = self.workers.get(flight.worker)
        if view is not None:  # (never below 0: the view may be newer than the flight)
            view.remote_prefill_tokens = max(view.remote_prefill_tokens - flight.prefill_tokens, 0)
            view.changed()

    def finish_remote(self, router: str, request_id: str) -> None:
        self.prefilled_remote(router, request_id)
        flight = self.remote.pop((router, request_id), None)
        if flight is None:
            return
        view = self.workers.get(flight.worker)
        if view is not None:
            view.remote_running = max(view.remote_running - 1, 0)
            view.remote_blocks = max(view.remote_blocks - flight.blocks, 0)
            view.changed()

    def forget_remote(self, router: str | None = None, older_than_s: float | None = None) -> int:
        """End the shared flights of ``router`` (it died), or those older than
        ``older_than_s`` (their end was lost); how many."""
        now = self.clock()
        gone = [
            key
            for key, flight in self.remote.items()
            if (router is not None and key[0] == router)
            or (older_than_s is not None and now - flight.started_at > older_than_s)
        ]
        for other, request_id in gone:
            self.finish_remote(other, request_id)
        return len(gone)

    def models(self) -> dict[str, list[str]]:
        """Each named model -> its workers that are up (``GET /v1/models``)."""
        out: dict[str, list[str]] = {}
        for worker in self._order:
            view = self.workers[worker]
            if view.model is not None and view.state == "up":
                out.setdefault(view.model, []).append(worker)
        return out

    def named_models(self) -> list[str]:
        """The models the workers name (any state), sorted."""
        named = self._named
        if named is None:
            models = {view.model for view in self.workers.values()}
            named = self._named = sorted(m for m in models if m is not None)
        return named

    def serves(self, model: str) -> bool:
        """Whether any worker this core knows (in any state) can take ``model``'s requests."""
        return any(view.model in (None, model) for view in self.workers.values())

    # -- the predicted cache -------------------------------------------------------------------

    def predict(self, worker: str, block_hashes: Sequence[int]) -> None:
        """Assume ``worker`` holds ``block_hashes`` (a chain from the root) for the TTL (an
        approximate worker's: ``approx_ttl_s``, within its capacity)."""
        if not block_hashes:
            return
        view = self.workers.get(worker)
        if view is not None and view.approximate:
            self.predicted.predict_approximate(worker, view.capacity_blocks, block_hashes)
        else:
            self.predicted.predict(worker, block_hashes)

    def unpredict(self, worker: str, block_hashes: Sequence[int]) -> None:
        """Forget that ``worker`` holds ``block_hashes``: the request never reached it."""
        self.predicted.unpredict(worker, block_hashes)

    def num_predicted(self, worker: str) -> int:
        return self.predicted.num_predicted(worker)
