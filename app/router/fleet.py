"""``FleetTable``: every worker's load and speed as one array, and ``kv_aware``'s decision on it
in one compiled call.

At 1,000 requests a second the candidates and the policy (per worker and request: a
``Candidate``, a pass of kv_aware's loop, a ``Cost``; ~50 Python calls for 16 workers) were
~45 µs of a ``/route``'s ~200 µs of router CPU, most of it the misses of caches that go cold
between requests (``tools/cold_route.py``). The table keeps each worker's terms in a float64
row, written again only when its view changes (``WorkerView.changed`` names it in ``dirty``),
and one numba kernel does what ``RouterCore.candidates`` and ``kv_aware`` do for a request:
the index's match spread over the workers, each eligible worker costed, the lowest found. The
depth of a worker with predicted blocks is extended in Python, as the candidates extend it
(those workers alone), and handed to the kernel.

The kernel does kv_aware's arithmetic operation for operation, in the same order, on IEEE
doubles, converting Python's ints where Python converts them: the costs are the same floats,
and the decision the same. That holds while every integer term is exact as a double (below
2**53): a worker whose report says more leaves the decisions to the Python path until it says
less. ``kv_aware`` stays the reference, and the core takes this path only for what it covers
(``RouterCore.decide``): kv_aware at temperature 0, nothing excluded, the compiled index; a
tie goes to ``lowest`` (Python's seeded choice). A test holds the two paths
to the same decisions over random fleets.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from app.router.policies.base import Cost, Decision, PolicyState, RouteRequest, lowest
from app.router.policies.kv_aware import MEMORY_PENALTY_PROMPTS, KvAwareConfig
from app.router.views import WorkerView
from events.index import PrefixIndex

__all__ = ["FleetTable", "compiled"]

# A row's columns: the load terms (``WorkerView.load_terms``) and the speed terms
# (``WorkerView.speed_terms``) kv_aware reads.
_QUEUED, _RUNNING, _FREE, _STEP_S, _PREFILL_S, _DECODE_S, _STEP_TOKENS = range(7)
_COLUMNS: Final = 7
_EXACT: Final = 1 << 53  # integers up to this are exact as doubles
_NO_MATCH: Final = np.zeros((3, 0), dtype=np.int64)
_OTHER_MODEL: Final = "\0other"  # the eligibility of every model that no worker names

# The kernel's answers besides a position.
_TIE: Final = -1
_NONE: Final = -2

try:
    import numba

    # Not ``nogil``: it writes the table's buffers, which one thread owns, and reads the index's
    # match output, which the next match writes (nothing between the match and this call runs
    # one: see ``FleetTable.kv_aware``).
    @numba.njit(cache=True)
    def _kernel(  # pragma: no cover - compiled
        out: Any,
        k: int,
        slot_pos: Any,
        rows: Any,
        eligible: Any,
        params: Any,
        floats: Any,
        ints: Any,
    ) -> int:
        """kv_aware over the table. ``out[:, :k]``: the index's match (slots, depths, host
        blocks); ``params``: prompt tokens, tokens per block, load, decode, host_hit,
        session x prompt, the session's position (-1: none), the memory penalty. Writes, per
        eligible position ``p``, ``floats[:, p]`` (cost, own prefill, load term, TTFT or NaN) and
        ``ints[0, p]`` (cached tokens); returns the lowest position, ``_TIE`` when the
        lowest is shared, ``_NONE`` when no worker is eligible. ``ints[3, p]`` >= 0 is a
        worker's depth extended by its predicted blocks, which replaces the index's;
        ``ints[1]`` and ``ints[2]`` are the depths and host blocks, spread here."""
        n = rows.shape[0]
        depth = ints[1]
        host = ints[2]
        for p in range(n):
            depth[p] = 0
            host[p] = 0
        for j in range(k):
            slot = out[0, j]
            if slot < slot_pos.shape[0]:
                p = slot_pos[slot]
                if p >= 0:
                    depth[p] = out[1, j]
                    host[p] = out[2, j]
        for p in range(n):
            if ints[3, p] >= 0:
                depth[p] = ints[3, p]
        num_tokens = np.int64(params[0])
        tpb = np.int64(params[1])
        w_load, w_decode, w_host = params[2], params[3], params[4]
        affinity = params[5]
        session_pos = np.int64(params[6])
        most_cached = max(num_tokens - 1, 0)
        need_blocks = -(-num_tokens // tpb)
        penalty = params[7]
        reference = math.inf
        for p in range(n):
            if eligible[p] and rows[p, _PREFILL_S] > 0 and rows[p, _PREFILL_S] < reference:
                reference = rows[p, _PREFILL_S]
        best = _NONE
        low = math.inf
        tied = False
        for p in range(n):
            if not eligible[p]:
                continue
            matched = depth[p]
            cached = matched * tpb
            if cached > most_cached:
                cached = most_cached
            host_tokens = host[p] * tpb
            if host_tokens > cached:
                host_tokens = cached
            own = np.float64(num_tokens - cached) + w_host * np.float64(host_tokens)
            queued = rows[p, _QUEUED]
            running = rows[p, _RUNNING]
            prefill_s = rows[p, _PREFILL_S]
            if prefill_s > 0:
                chunk = rows[p, _STEP_TOKENS] - running
                if chunk < tpb:
                    chunk = np.float64(tpb)
                steps = -((-(queued + own)) // chunk)
                if steps == 0:
                    steps = 1.0
                own_s = own * prefill_s
                ahead_s = queued * prefill_s + steps * (
                    rows[p, _STEP_S] + running * rows[p, _DECODE_S]
                )
                ttft = own_s + ahead_s
                load = w_load * (ttft / reference - own)
            else:
                ttft = math.nan
                load = w_load * (queued + w_decode * running)
            cost = own + load
            if rows[p, _FREE] < need_blocks - matched:
                cost += penalty
            if p == session_pos and affinity:
                cost -= affinity
            floats[0, p] = cost
            floats[1, p] = own
            floats[2, p] = load
            floats[3, p] = ttft
            ints[0, p] = cached
            if best == _NONE or cost < low:
                best = p
                low = cost
                tied = False
            elif cost == low:
                tied = True
        return _TIE if tied else best

except ImportError:  # pragma: no cover - numba is a declared dependency
    _kernel = None  # type: ignore[assignment]


def compiled() -> bool:
    """Whether the kernel is there (numba imports)."""
    return _kernel is not None


class FleetTable:
    """The rows of a ``RouterCore``'s workers (``workers``, its dict, read in place), in
    worker-id order; see the module docstring.

    ``dirty``: the workers whose views changed since their row was written (each view adds
    itself, ``WorkerView.changed``). ``invalidate``: the workers, or which of them admit
    requests for which model, changed; everything is written again before the next decision.
    """

    __slots__ = (
        "_eligible",
        "_floats",
        "_fresh",
        "_inexact",
        "_ints",
        "_models",
        "_order",
        "_positions",
        "_rows",
        "_slot_of",
        "_slot_pos",
        "_slots_version",
        "_speedless",
        "_stale",
        "dirty",
        "workers",
    )

    def __init__(self, workers: dict[str, WorkerView]) -> None:
        self.workers = workers
        self.dirty: set[str] = set()
        self._stale = True
        self._order: list[str] = []
        self._positions: dict[str, int] = {}
        self._models: set[str] = set()  # the models workers name
        self._rows = np.zeros((0, _COLUMNS), dtype=np.float64)
        self._fresh: list[bool] = []
        self._floats = np.zeros((4, 0), dtype=np.float64)
        self._ints = np.zeros((4, 0), dtype=np.int64)
        self._speedless: list[int] = []  # positions whose worker reports no speed
        self._inexact: set[str] = set()  # workers with a term too large for a double
        # model -> (mask by position, the eligible positions; None when all are)
        self._eligible: dict[str | None, tuple[npt.NDArray[np.uint8], list[int] | None]] = {}
        self._slot_pos = np.zeros(0, dtype=np.int64)  # index slot -> position, -1: none
        self._slot_of: dict[str, int] = {}  # worker -> index slot
        self._slots_version = -1

    def invalidate(self) -> None:
        self._stale = True

    def _refresh(self) -> None:
        workers = self.workers
        if self._stale:
            order = sorted(workers)
            n = len(order)
            self._order = order
            self._positions = {worker: p for p, worker in enumerate(order)}
            self._models = {view.model for view in workers.values() if view.model is not None}
            self._rows = np.zeros((n, _COLUMNS), dtype=np.float64)
            self._fresh = [True] * n
            self._floats = np.zeros((4, n), dtype=np.float64)
            self._ints = np.zeros((4, n), dtype=np.int64)
            self._ints[3] = -1
            self._inexact.clear()
            self._eligible.clear()
            self._slots_version = -1
            changed: Collection[str] = order
        else:
            changed = self.dirty
        rows, fresh, positions, inexact = self._rows, self._fresh, self._positions, self._inexact
        for worker in changed:
            p = positions.get(worker)
            if p is None:  # gone: the table was invalidated
                continue
            view = workers[worker]
            queued, running, _, free = view.load_terms()
            step_s, prefill_s, decode_s, step_tokens = view.speed_terms()
            if all(-_EXACT < term < _EXACT for term in (queued, running, free, step_tokens)):
                rows[p] = (queued, running, free, step_s, prefill_s, decode_s, step_tokens)
                inexact.discard(worker)
            else:
                inexact.add(worker)
            fresh[p] = view.stale_reason is None
        # Written in full: only now is the table current (a row that raised leaves it stale).
        self._stale = False
        self.dirty.clear()
        self._speedless = [p for p in range(len(self._order)) if not rows[p, _PREFILL_S] > 0]

    def _eligible_for(self, model: str | None) -> tuple[npt.NDArray[np.uint8], list[int] | None]:
        key = model if model is None or model in self._models else _OTHER_MODEL
        found = self._eligible.get(key)
        if found is None:
            mask = [self.workers[worker].takes(model) for worker in self._order]
            positions = None if all(mask) else [p for p, ok in enumerate(mask) if ok]
            found = self._eligible[key] = (np.array(mask, dtype=np.uint8), positions)
        return found

    def _slots(self, index: PrefixIndex) -> npt.NDArray[np.int64]:
        """Index slot -> position (-1: not one of the workers), read again when the index's
        slots change; and ``_slot_of``, worker -> slot."""
        if self._slots_version != index.slots_version:
            self._slots_version = index.slots_version
            positions = self._positions
            names = index.slot_names()
            self._slot_pos = np.array(
                [positions.get(name, -1) if name else -1 for name in names], dtype=np.int64
            )
            self._slot_of = {name: slot for slot, name in enumerate(names) if name}
        return self._slot_pos

    def kv_aware(
        self,
        index: PrefixIndex,
        request: RouteRequest,
        hashes: Sequence[int] | npt.NDArray[np.uint64],
        config: KvAwareConfig,
        state: PolicyState,
        model: str | None,
        session_worker: str | None,
        predicted: Collection[str] = (),
        extend: Callable[[str, int], int] | None = None,
    ) -> Decision | None:
        """kv_aware's decision among the eligible workers (``RouterCore.candidates``' rules),
        or None where the kernel does not cover the request (see the module): the caller then
        takes the candidates' path, which also says why no worker can take it.
        ``predicted``: the workers with predicted blocks, whose index depth ``extend`` turns
        into the depth the candidates would give them; it runs between the match and the
        kernel, so it must not match against the index (the kernel reads the match's output)."""
        if _kernel is None or config.temperature:  # sampling: Python's generator
            return None
        if self._stale or self.dirty:
            self._refresh()
        if self._inexact:
            return None
        eligible, positions = self._eligible_for(model)
        if not (self._order if positions is None else positions):
            return None  # no worker can take it: the candidates' path says why
        if len(hashes):
            matched = index.match_slots(hashes)
            if matched is None:
                return None
            out, k = matched
        else:
            out, k = _NO_MATCH, 0
        slot_pos = self._slots(index)
        num_tokens = request.num_tokens
        session_pos = self._positions.get(session_worker, -1) if session_worker else -1
        affinity = config.session * num_tokens
        params = np.array(
            (
                num_tokens,
                request.tokens_per_block,
                config.load,
                config.decode,
                config.host_hit,
                affinity,
                session_pos,
                MEMORY_PENALTY_PROMPTS * num_tokens,
            ),
            dtype=np.float64,
        )
        ints = self._ints
        extended: list[int] = []  # positions whose ``ints[3]`` goes back to -1 after the call
        try:
            if predicted and extend is not None:
                self._extend(out, k, eligible, predicted, extend, extended)
            best = _kernel(out, k, slot_pos, self._rows, eligible, params, self._floats, ints)
        finally:
            for p in extended:
                ints[3, p] = -1
        return self._decision(best, positions, session_pos, affinity, state, request)

    def _extend(
        self,
        out: npt.NDArray[np.int64],
        k: int,
        eligible: npt.NDArray[np.uint8],
        predicted: Collection[str],
        extend: Callable[[str, int], int],
        extended: list[int],
    ) -> None:
        """``ints[3]`` set for the eligible predicted workers whose depth the predictions
        extend, their positions appended to ``extended``."""
        depth_of = dict(zip(*out[:2, :k].tolist(), strict=True))  # slot -> index depth
        slot_of, positions, overrides = self._slot_of, self._positions, self._ints[3]
        for worker in predicted:
            p = positions.get(worker)
            if p is None or not eligible[p]:
                continue
            slot = slot_of.get(worker)
            depth = depth_of.get(slot, 0) if slot is not None else 0
            longer = extend(worker, depth)
            if longer != depth:
                extended.append(p)
                overrides[p] = longer

    def _decision(
        self,
        best: int,
        positions: list[int] | None,
        session_pos: int,
        affinity: float,
        state: PolicyState,
        request: RouteRequest,
    ) -> Decision:
        """The ``Decision`` of the kernel's answer: a ``Cost`` per eligible worker."""
        columns: list[list[Any]] = self._floats.tolist()  # cost, own, load, ttft
        for p in self._speedless:
            columns[3][p] = None
        affinities = [0.0] * len(self._order)
        if session_pos >= 0 and affinity:
            affinities[session_pos] = affinity
        columns += (self._ints[0].tolist(), affinities, self._order, self._fresh)
        if positions is not None:  # some workers are not candidates: their columns are skipped
            columns = [[column[p] for p in positions] for column in columns]
        cost, own, load, ttft, cached, affinities, names, fresh = columns
        costs = tuple(map(Cost, names, cost, cached, own, load, fresh, affinities, ttft))
        if best == _TIE:
            chosen = lowest(cost, load, state, request)
        else:
            chosen = best if positions is None else positions.index(best)
        return Decision(names[chosen], "kv_aware", cached[chosen], costs, fresh[chosen])
