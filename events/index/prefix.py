"""`PrefixIndex`: which worker holds which KV block, on which tier, and the longest prefix of a
request each one holds.

Workers get slots in order of first appearance; a removed worker's slot is reused. What the
slots hold lives in a table (`events.index.tables`): numba's `ArrayTable` when it imports and
passes its self-test, else the pure-Python `DictTable`. A match walks the request's blocks and
stops as soon as no worker is left. With ``assume_monotone=True`` it binary-searches instead,
which is exact only when "worker holds block i" implies it holds blocks 0..i-1 (true for our
own workers, whose eviction frees a block's whole subtree; not for engines that evict interior
blocks alone), so the default is the exact walk. `find_matches` takes a list of ints or,
faster, the uint64 array that `cache.hashing.block_hash_array` returns.

Applying a stored event checks it in C where it can (`array("L")` converts and range-checks
the hashes) and leaves the rest to the table, which refuses a bad chain (its parent inside
it, a level above 1, a hash twice) before changing anything; the slow checks then name the
fault. Forgetting a worker (`remove_worker`, a `created` event) and reading one
(`worker_blocks`, `dump_events`) scan the whole table: those are rare (a restart, a
resynchronisation); matches and events are not.

Errors: malformed events raise `InvalidEventError` (a `ValueError`) naming what is wrong,
before anything changes (the consumer counts and skips them); questions about a worker the
index has never seen raise `KeyError`. Events that name a block the worker does not hold (a
removal or an update after a missed event) are not errors: they are skipped and counted in
`num_unknown_block_refs`. One widening: a hash in a stored or removed event may be any
integer type that converts to a uint64 (a numpy integer too); a float, a str or an
out-of-range value is refused as before.
"""

from __future__ import annotations

import functools
import logging
from array import array
from collections.abc import Iterable, Sequence
from functools import reduce
from operator import or_
from typing import Any, Final, NoReturn

import numpy as np
import numpy.typing as npt

from cache import (
    CreatedData,
    KVCacheEvent,
    RemovedData,
    StoredBlock,
    StoredData,
    UpdatedData,
)
from events.errors import InvalidEventError
from events.index.tables import GPU_TIER, HOST_TIER, U64_CODE, DictTable, Table, U64Array

try:  # numba's table; without numba (or with KVMESH_NO_NUMBA) the dict table serves
    from events.index.array_table import ArrayTable as _ArrayTable
    from events.index.array_table import self_test as _self_test
except ImportError:  # pragma: no cover
    _ArrayTable = None  # type: ignore[assignment,misc]
    _self_test = None  # type: ignore[assignment]

__all__ = ["PrefixIndex"]

_log = logging.getLogger(__name__)

_MAX_HASH: Final = 2**64 - 1
_LEVELS: Final = frozenset((GPU_TIER, HOST_TIER))


@functools.cache
def _compiled_table_works() -> bool:
    """Whether numba's table imports, compiles and answers right (checked once a process)."""
    if _ArrayTable is None or _self_test is None:
        return False
    try:
        _self_test()
    except Exception:  # numba present but broken: the dict table gives the same answers
        _log.warning("the compiled prefix index fails its self-test; using the dict", exc_info=True)
        return False
    return True


def _check_hashes(hashes: list[Any], what: str) -> None:
    """Every element an int in 0..2**64-1, in one C-level pass.

    OR-ing them raises on a float or a str, leaves a non-int type when numpy is mixed in,
    and sets a bit at 64 or above (or the sign) when one is out of range.
    """
    try:
        folded = reduce(or_, hashes, 0)
        if type(folded) is int and not folded >> 64:
            return
    except TypeError:
        pass
    for h in hashes:
        if type(h) is not int:
            raise InvalidEventError(f"{what}: block hash {h!r} is not an int")
        if not 0 <= h <= _MAX_HASH:
            raise InvalidEventError(f"{what}: block hash {h} is outside 0..2**64-1")
    raise InvalidEventError(f"{what}: bad block hashes")


def _hash_words(hashes: list[Any], what: str) -> array[int]:
    """`hashes` as uint64 words; InvalidEventError naming the first bad one."""
    try:
        return array(U64_CODE, hashes)
    except (TypeError, OverflowError):
        _check_hashes(hashes, what)
    raise InvalidEventError(f"{what}: bad block hashes")


class PrefixIndex:
    """Block hash -> workers holding it, per tier; longest-prefix matches per worker."""

    __slots__ = (
        "_free_slots",
        "_monotone",
        "_names",
        "_slots",
        "_table",
        "_windows",
        "compiled",
        "num_unknown_block_refs",
        "slots_version",
    )

    def __init__(self, *, assume_monotone: bool = False, compiled: bool | None = None) -> None:
        """`compiled`: the numba table (True), the pure-Python one (False), or the numba one
        when it can be had (None, the default)."""
        if compiled is None:
            compiled = _compiled_table_works()
        elif compiled and not _compiled_table_works():
            raise RuntimeError("the compiled prefix index needs numba (and no KVMESH_NO_NUMBA)")
        self.compiled = compiled
        self._table: Table = _ArrayTable() if compiled else DictTable()
        self._slots: dict[str, int] = {}
        self._names: list[str] = []  # slot -> worker id ("" while the slot is free)
        self._free_slots: list[int] = []
        self._windows: list[int] = []  # per slot: window size of its last event
        self._monotone = assume_monotone
        # Removed/updated events that named a block the worker did not hold.
        self.num_unknown_block_refs = 0
        self.slots_version = 0  # counts the changes of which worker has which slot

    # -- workers -------------------------------------------------------------------------------

    def workers(self) -> list[str]:
        """Registered workers, in slot order (first appearance; removed workers' slots reused)."""
        return sorted(self._slots, key=self._slots.__getitem__)

    def _slot(self, worker_id: str) -> int:
        slot = self._slots.get(worker_id)
        if slot is None:
            slot = self._next_slot()
            self._register(worker_id, slot)
        return slot

    def _next_slot(self) -> int:
        """The slot a new worker would get (the table made ready for it); not yet taken."""
        slot = self._free_slots[-1] if self._free_slots else len(self._names)
        self._table.ensure_slot(slot)
        return slot

    def _register(self, worker_id: str, slot: int) -> None:
        if self._free_slots and self._free_slots[-1] == slot:
            self._free_slots.pop()
            self._names[slot] = worker_id
            self._windows[slot] = 0
        else:
            self._names.append(worker_id)
            self._windows.append(0)
        self._slots[worker_id] = slot
        self.slots_version += 1
        self._table.set_alive(slot, True)

    def remove_worker(self, worker_id: str) -> bool:
        """Forget a worker and free its slot; False if it was not registered."""
        slot = self._slots.pop(worker_id, None)
        if slot is None:
            return False
        self._table.clear(slot)
        self._table.set_alive(slot, False)
        self._names[slot] = ""
        self._free_slots.append(slot)
        self.slots_version += 1
        return True

    # -- events --------------------------------------------------------------------------------

    def apply_events(
        self, worker_id: str, events: Iterable[KVCacheEvent | dict[str, Any] | None]
    ) -> None:
        for event in events:
            self.apply_event(worker_id, event)

    def apply_event(self, worker_id: str, event: KVCacheEvent | dict[str, Any] | None) -> None:
        """Apply one event of `worker_id`: ours, or TensorRT-LLM's JSON dict.

        `{}` and None are skipped (TensorRT-LLM's serializer turns a missing event into `{}`).
        A `created` event means the worker (re)started: all it held is forgotten. Raises
        ValueError, before changing anything, when the event is malformed.
        """
        if type(event) is not KVCacheEvent:
            if isinstance(event, dict):
                if not event:
                    return
                try:
                    event = KVCacheEvent.from_dict(event)
                except ValueError as exc:
                    raise InvalidEventError(f"malformed TensorRT-LLM event: {exc}") from exc
            elif event is None:
                return
            elif not isinstance(event, KVCacheEvent):
                raise InvalidEventError(f"not a KV cache event: {type(event).__name__}")
        data = event.data
        if type(data) is StoredData:
            slot = self._apply_stored(worker_id, data)
        elif type(data) is RemovedData:
            slot = self._apply_removed(worker_id, data)
        elif type(data) is UpdatedData:
            slot = self._apply_updated(worker_id, data)
        elif type(data) is CreatedData:
            slot = self._slot(worker_id)
            self._table.clear(slot)
        else:
            raise InvalidEventError(f"unknown event data {type(data).__name__}")
        self._windows[slot] = event.window_size

    def _apply_stored(self, worker_id: str, data: StoredData) -> int:
        blocks = data.blocks
        parent = data.parent_hash
        if type(blocks) is not list:
            raise InvalidEventError(
                f"stored event: blocks must be a list, got {type(blocks).__name__}"
            )
        if parent is not None and (type(parent) is not int or not 0 <= parent <= _MAX_HASH):
            raise InvalidEventError(f"stored event: bad parent_hash {parent!r}")
        if not blocks:
            return self._slot(worker_id)
        # One pass in the common case, every block on the GPU tier (a falsy level is 0).
        hashes = [block.block_hash for block in blocks if not block.cache_level]
        levels: list[Any] | None = None
        if len(hashes) != len(blocks):
            hashes = [block.block_hash for block in blocks]
            levels = [block.cache_level for block in blocks]
        # Ints in range and levels 0..255 convert in C; anything else takes the checks below.
        # The table refuses a parent inside the chain, a level above 1 or a repeated hash
        # without changing anything, and the checks then say which it was.
        try:
            links = array(U64_CODE, hashes)
            tiers = None if levels is None else bytes(levels)
        except (TypeError, OverflowError, ValueError):
            links, tiers = self._check_stored(parent, hashes, levels)
        links.insert(0, 0 if parent is None else parent)
        slot = self._slots.get(worker_id)
        if slot is None:
            slot = self._next_slot()
            if self._table.store(slot, links, tiers, parent is None):
                self._refuse_stored(parent, hashes, levels)
            self._register(worker_id, slot)
        elif self._table.store(slot, links, tiers, parent is None):
            self._refuse_stored(parent, hashes, levels)
        return slot

    def _refuse_stored(
        self, parent: int | None, hashes: list[Any], levels: list[Any] | None
    ) -> NoReturn:
        self._check_stored(parent, hashes, levels)
        raise InvalidEventError("stored event: refused by the table")  # the check raises first

    @staticmethod
    def _check_stored(
        parent: int | None, hashes: list[Any], levels: list[Any] | None
    ) -> tuple[array[int], bytes | None]:
        """Raise InvalidEventError for the first thing wrong with a stored chain (hashes,
        parent inside the chain, levels, a repeated hash); else its words and tiers. `levels`
        None: every block on the GPU tier."""
        _check_hashes(hashes, "stored event")
        if parent in hashes:
            raise InvalidEventError(f"stored event: block {parent} is its own ancestor")
        tiers = None
        if levels is not None and any(levels):  # a falsy level is the GPU tier
            distinct = set(levels)
            if not distinct <= _LEVELS:
                bad = min(distinct - _LEVELS, key=repr)
                raise InvalidEventError(f"stored event: cache_level must be 0 or 1, got {bad!r}")
            tiers = bytes(1 if level else 0 for level in levels)
        if len(set(hashes)) != len(hashes):
            raise InvalidEventError("stored event: a block hash appears twice in one chain")
        return array(U64_CODE, hashes), tiers

    def _apply_removed(self, worker_id: str, data: RemovedData) -> int:
        hashes = data.block_hashes
        if type(hashes) is not list:
            raise InvalidEventError(
                f"removed event: block_hashes must be a list, got {type(hashes).__name__}"
            )
        words = _hash_words(hashes, "removed event")
        slot = self._slot(worker_id)
        self.num_unknown_block_refs += self._table.remove(slot, words)
        return slot

    def _apply_updated(self, worker_id: str, data: UpdatedData) -> int:
        block_hash = data.block_hash
        _check_hashes([block_hash], "updated event")
        diff = data.cache_level
        level = -1  # a priority change: the index does not rank by priority
        if diff is not None:
            level = diff.new_value
            if type(level) is not int or level not in _LEVELS:
                raise InvalidEventError(
                    f"updated event: cache_level must become 0 or 1, got {level!r}"
                )
        slot = self._slot(worker_id)
        if not self._table.update(slot, block_hash, level):
            self.num_unknown_block_refs += 1
        return slot

    # -- matching ------------------------------------------------------------------------------

    def find_matches(self, block_hashes: Sequence[int] | U64Array) -> dict[str, int]:
        """Per worker, how many leading blocks of the request it holds (any tier); no zeros.

        `block_hashes`: a list of ints, or a uint64 array (`cache.block_hash_array`)."""
        slots, depths, _ = self._table.match(block_hashes, False, self._monotone)
        return dict(zip(map(self._names.__getitem__, slots), depths, strict=True))

    def find_matches_by_tier(
        self, block_hashes: Sequence[int] | U64Array
    ) -> dict[str, tuple[int, int]]:
        """Per worker: (leading blocks held on any tier, how many of those are on the GPU)."""
        slots, depths, host = self._table.match(block_hashes, True, self._monotone)
        names = self._names
        return {
            names[slot]: (depth, depth - on_host)
            for slot, depth, on_host in zip(slots, depths, host, strict=True)
        }

    def match_slots(
        self, block_hashes: Sequence[int] | U64Array
    ) -> tuple[npt.NDArray[np.int64], int] | None:
        """`find_matches_by_tier` as the compiled table leaves it, for a caller that reads it
        in its own kernel: (out, k), ``out[0, :k]`` worker slots (`slot_names`), ``out[1, :k]``
        their depths, ``out[2, :k]`` how many of those blocks are on the host tier. `out` is
        the index's own and the next match writes it again. None with the pure-Python table.
        """
        if _ArrayTable is None or not isinstance(self._table, _ArrayTable):
            return None
        return self._table.match_raw(block_hashes, self._monotone)

    def slot_names(self) -> list[str]:
        """Worker id by slot ("" for a free slot): what `match_slots`' slots name. A copy; it
        changes when `slots_version` does."""
        return list(self._names)

    # -- state ---------------------------------------------------------------------------------

    def worker_blocks(self, worker_id: str) -> dict[int, int]:
        """Every block `worker_id` holds: hash -> tier (0 GPU, 1 host); none for a worker the
        index does not know. Scans the index."""
        slot = self._slots.get(worker_id)
        return self._table.blocks_of(slot) if slot is not None else {}

    def parent_of(self, block_hash: int) -> int | None:
        """The parent `block_hash` was last stored under (KeyError if no worker holds it)."""
        return self._table.parent_of(block_hash)

    def dump_events(self, worker_id: str, *, window_size: int | None = None) -> list[KVCacheEvent]:
        """`worker_id`'s blocks as stored events that rebuild them when replayed in order.

        Parents come before children; each event is one chain (block k+1's parent is block k),
        split where the tree branches; a chain whose first parent the worker does not hold
        keeps that parent's hash. Event ids count from 0; `window_size` defaults to that of the
        worker's last event. The index keeps no tokens, so the stored blocks carry none. A
        worker the index does not know gives no events.
        """
        if worker_id not in self._slots:
            return []
        window = self._windows[self._slots[worker_id]] if window_size is None else window_size
        held = self.worker_blocks(worker_id)
        parent_of = self._table.parents_of(self._slots[worker_id]).__getitem__
        children: dict[int, list[int]] = {}
        roots: list[tuple[int | None, int]] = []
        for block_hash in held:
            parent = parent_of(block_hash)
            if parent is not None and parent in held:
                children.setdefault(parent, []).append(block_hash)
            else:
                roots.append((parent, block_hash))
        events: list[KVCacheEvent] = []
        emitted: set[int] = set()
        stack = roots[::-1]
        while stack:
            parent, block_hash = stack.pop()
            blocks: list[StoredBlock] = []
            while True:
                blocks.append(StoredBlock(block_hash, (), cache_level=held[block_hash]))
                emitted.add(block_hash)
                kids = children.get(block_hash)
                if not kids:
                    break
                stack.extend((block_hash, kid) for kid in reversed(kids[1:]))
                block_hash = kids[0]
            events.append(KVCacheEvent(len(events), StoredData(parent, blocks), window))
        # Links that loop (only a broken stream makes them) are unreachable from any root.
        for block_hash in held.keys() - emitted:
            block = StoredBlock(block_hash, (), cache_level=held[block_hash])
            events.append(
                KVCacheEvent(len(events), StoredData(parent_of(block_hash), [block]), window)
            )
        return events

    def num_blocks(self, worker_id: str) -> int:
        """Blocks `worker_id` holds, any tier."""
        return self._table.count(self._slots[worker_id])[0]

    def __len__(self) -> int:
        """Distinct block hashes held by at least one worker."""
        return len(self._table)

    def stats(self) -> dict[str, Any]:
        """Blocks per worker and per tier (state only, so equal after a dump and replay)."""
        per_worker: dict[str, dict[str, int]] = {}
        for worker_id, slot in sorted(self._slots.items()):
            total, host = self._table.count(slot)
            per_worker[worker_id] = {"blocks": total, "gpu": total - host, "host": host}
        return {
            "workers": len(per_worker),
            "blocks": len(self._table),
            "entries": sum(w["blocks"] for w in per_worker.values()),
            "gpu_entries": sum(w["gpu"] for w in per_worker.values()),
            "host_entries": sum(w["host"] for w in per_worker.values()),
            "per_worker": per_worker,
        }

    def approx_bytes(self) -> int:
        """Rough memory of the index's table (for the dict: the dict, its keys and words)."""
        return self._table.approx_bytes()
