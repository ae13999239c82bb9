"""``FleetTable``: every worker's load and speed as one array, and ``kv_aware``'s decision on it
in one compiled call.

At 1,000 requests a second the candidates and the policy (per worker and request: a
``Candidate``, a pass of kv_aware's loop, a ``Cost``; ~50 Python calls for 16 workers) were
~45 µs of a ``/route``'s ~200 µs of router CPU, most of it the misses of caches that go cold
between requests (``tools/cold_route.py``). The table keeps each worker's terms in a float64
row, written again only when its view changes (``WorkerView.changed`` names it in ``dirty``),
and one numba kernel does what ``RouterCore.candidates`` and ``kv_aware`` do for a request:
the index's match spread over the workers, each eligible worker costed, the lowest found.

The kernel does kv_aware's arithmetic operation for operation, in the same order, on IEEE
doubles, converting Python's ints where Python converts them (every term is an integer far
below 2**53, exact as a double): the costs are the same floats, and the decision the same.
``kv_aware`` stays the reference. The core takes this path only for what it covers
(``RouterCore.decide``): kv_aware at temperature 0 with float weights, nothing excluded, no
predicted blocks pending, the compiled index; a tie goes to ``lowest`` (Python's seeded
choice). A test holds the two paths to the same decisions over random fleets.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from functools import lru_cache
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
U64Like = npt.NDArray[np.uint64] | Sequence[int]
_NO_MATCH = np.zeros((3, 0), dtype=np.int64)
_U64: Final = np.dtype(np.uint64)


def _u64(hashes: U64Like) -> npt.NDArray[np.uint64]:
    if isinstance(hashes, np.ndarray):
        return hashes
    return np.frombuffer(array("Q", hashes), _U64)


# The kernel's answers besides a position.
_TIE: Final = -1
_NONE: Final = -2

try:
    import numba

    @numba.njit(cache=True, nogil=True)
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
        lowest is shared, ``_NONE`` when no worker is eligible."""
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


@lru_cache(maxsize=64)
def _covered(config: KvAwareConfig) -> bool:
    """Whether the kernel reproduces kv_aware under ``config``: temperature 0 (sampling is
    Python's generator), and float weights (an int weight makes some of Python's terms ints,
    which JSON writes without a fraction)."""
    weights = (config.load, config.decode, config.host_hit, config.session)
    return config.temperature == 0 and all(type(w) is float for w in weights)


class FleetTable:
    """The rows of ``RouterCore``'s workers, in its worker-id order; see the module docstring.

    ``dirty``: the workers whose views changed since their row was written (each view adds
    itself, ``WorkerView.changed``). ``invalidate``: the workers, their order, or which of them
    admit requests for which model changed; everything is written again before the next
    decision."""

    __slots__ = (
        "_eligible",
        "_floats",
        "_ints",
        "_order",
        "_positions",
        "_rows",
        "_slot_pos",
        "_slots_version",
        "_speedless",
        "_stale",
        "dirty",
        "fresh",
    )

    def __init__(self) -> None:
        self.dirty: set[str] = set()
        self.fresh: list[bool] = []
        self._stale = True
        self._order: list[str] = []
        self._positions: dict[str, int] = {}
        self._rows = np.zeros((0, _COLUMNS), dtype=np.float64)
        self._floats = np.zeros((4, 0), dtype=np.float64)
        self._ints = np.zeros((3, 0), dtype=np.int64)
        self._speedless: list[int] = []  # positions whose worker reports no speed
        # model -> (mask by position, the eligible positions; None when all are)
        self._eligible: dict[str | None, tuple[npt.NDArray[np.uint8], list[int] | None]] = {}
        self._slot_pos = np.zeros(0, dtype=np.int64)
        self._slots_version = -1

    def invalidate(self) -> None:
        self._stale = True

    def _refresh(self, order: list[str], workers: dict[str, WorkerView]) -> None:
        if self._stale:
            self._stale = False
            self._order = list(order)
            self._positions = {worker: p for p, worker in enumerate(order)}
            n = len(order)
            self._rows = np.zeros((n, _COLUMNS), dtype=np.float64)
            self._floats = np.zeros((4, n), dtype=np.float64)
            self._ints = np.zeros((3, n), dtype=np.int64)
            self.fresh = [True] * n
            self._eligible.clear()
            self._slots_version = -1
            changed: Sequence[str] = order
        else:
            changed = [worker for worker in self.dirty if worker in self._positions]
        self.dirty.clear()
        rows, fresh, positions = self._rows, self.fresh, self._positions
        for worker in changed:
            view = workers[worker]
            queued, running, _, free = view.load_terms()
            step_s, prefill_s, decode_s, step_tokens = view.speed_terms()
            p = positions[worker]
            rows[p] = (queued, running, free, step_s, prefill_s, decode_s, step_tokens)
            fresh[p] = view.stale_reason is None
        self._speedless = [p for p in range(len(order)) if not rows[p, _PREFILL_S] > 0]

    def _eligible_for(
        self, model: str | None, workers: dict[str, WorkerView]
    ) -> tuple[npt.NDArray[np.uint8], list[int] | None]:
        found = self._eligible.get(model)
        if found is None:
            views = [workers[worker] for worker in self._order]
            mask = [
                view.admitting and (model is None or view.model is None or view.model == model)
                for view in views
            ]
            positions = None if all(mask) else [p for p, ok in enumerate(mask) if ok]
            found = self._eligible[model] = (np.array(mask, dtype=np.uint8), positions)
        return found

    def _slot_positions(self, index: PrefixIndex) -> npt.NDArray[np.int64]:
        if self._slots_version != index.slots_version:
            self._slots_version = index.slots_version
            positions = self._positions
            self._slot_pos = np.array(
                [positions.get(name, -1) if name else -1 for name in index.slot_names()],
                dtype=np.int64,
            )
        return self._slot_pos

    def kv_aware(
        self,
        order: list[str],
        workers: dict[str, WorkerView],
        index: PrefixIndex,
        request: RouteRequest,
        hashes: U64Like,
        config: KvAwareConfig,
        state: PolicyState,
        model: str | None,
        session_worker: str | None,
    ) -> Decision | None:
        """kv_aware's decision among ``order``'s eligible workers (``RouterCore.candidates``'
        rules), or None where the kernel does not cover the request (see the module): the
        caller then takes the candidates' path, which also says why no worker can take it."""
        if _kernel is None or not _covered(config):
            return None
        if self._stale or self.dirty:
            self._refresh(order, workers)
        eligible, positions = self._eligible_for(model, workers)
        if not (self._order if positions is None else positions):
            return None  # no worker can take it: the candidates' path says why
        if len(hashes):
            matched = index.match_slots(_u64(hashes))
            if matched is None:
                return None
            out, k = matched
        else:
            out, k = _NO_MATCH, 0
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
        floats, ints = self._floats, self._ints
        best = _kernel(
            out, k, self._slot_positions(index), self._rows, eligible, params, floats, ints
        )
        columns: list[list[Any]] = floats.tolist()  # cost, own, load, ttft
        for p in self._speedless:
            columns[3][p] = None
        affinities = [0.0] * len(self._order)
        if session_pos >= 0 and affinity:
            affinities[session_pos] = affinity
        columns += (ints[0].tolist(), affinities, self._order, self.fresh)
        if positions is not None:  # some workers are not candidates: their columns are skipped
            columns = [[column[p] for p in positions] for column in columns]
        cost, own, load, ttft, cached, affinities, names, fresh = columns
        costs = tuple(map(Cost, names, cost, cached, own, load, fresh, affinities, ttft))
        if best == _TIE:
            chosen = lowest(cost, load, state, request)
        else:
            chosen = best if positions is None else positions.index(best)
        return Decision(names[chosen], "kv_aware", cached[chosen], costs, fresh[chosen])
