"""`ArrayTable`: the prefix index's compiled table, the `Table` protocol on numba's kernels.

Its methods mirror `events.index.tables.DictTable`'s (the source of truth); the arrays it owns
and the kernels that probe them are described in `events.index.kernels`. ``self_test`` runs
every kernel once on a small table and checks the answers, so that the index can fall back to
the dict table where numba imports but cannot compile (no LLVM, a broken cache).

Importing this module raises ImportError when numba is missing or ``KVMESH_NO_NUMBA`` is set.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from events.index import kernels
from events.index.kernels import BITS, FULL, INITIAL_LOG2, LINK, LOG2, NEXT_SEQ, USED
from events.index.tables import U64_CODE, U64Array

__all__ = ["ArrayTable", "self_test"]

_NO_LEVELS: Final = np.zeros(0, dtype=np.uint8)
_NO_LEVELS.flags.writeable = False  # the type of the levels made from bytes: one compilation


_U64_DTYPE: Final = np.dtype(np.uint64)
_U8_DTYPE: Final = np.dtype(np.uint8)


def _u64(values: Sequence[int]) -> U64Array:
    return np.frombuffer(array(U64_CODE, values), _U64_DTYPE)


class ArrayTable:
    """The compiled table; its methods mirror `events.index.tables.DictTable`'s."""

    __slots__ = ("_alive", "_counts", "_meta", "_out", "_rows")

    def __init__(self) -> None:
        self._meta = np.zeros(5, dtype=np.int64)
        self._meta[NEXT_SEQ] = 1
        self._rows = kernels.rehash(
            np.zeros((0, BITS + 1), np.uint64), self._meta, INITIAL_LOG2, BITS + 1
        )
        self._alive = np.zeros(1, dtype=np.uint64)  # presence bits of the registered slots
        self._counts = np.zeros((32, 2), dtype=np.int64)  # per slot: blocks, host blocks
        self._out = np.zeros((3, 32), dtype=np.int64)  # match results (single-threaded)

    def ensure_slot(self, slot: int) -> None:
        """Make room for worker `slot` (a word of bits per 32 slots)."""
        width = (slot >> 5) + 1
        if width <= self._alive.shape[0]:
            return
        rows = self._rows
        extra = np.zeros((rows.shape[0], width - self._alive.shape[0]), dtype=np.uint64)
        self._rows = np.ascontiguousarray(np.hstack((rows, extra)))
        self._alive = np.concatenate(
            (self._alive, np.zeros(width - self._alive.shape[0], np.uint64))
        )
        self._counts = np.vstack(
            (self._counts, np.zeros((32 * width - len(self._counts), 2), np.int64))
        )
        self._out = np.zeros((3, 32 * width), dtype=np.int64)

    def set_alive(self, slot: int, alive: bool) -> None:
        bit = np.uint64(1 << (slot & 31))
        if alive:
            self._alive[slot >> 5] |= bit
        else:
            self._alive[slot >> 5] &= ~bit

    def store(self, slot: int, links: array[int], levels: bytes | None, root: bool) -> int:
        """`links`: the parent (anything at the root), then the chain's hashes."""
        arr = np.frombuffer(links, _U64_DTYPE)
        lv = _NO_LEVELS if levels is None else np.frombuffer(levels, _U8_DTYPE)
        code: int = kernels.store(self._rows, self._meta, self._counts, arr, lv, slot, root)
        while code == FULL:
            self._grow(len(links))
            code = kernels.store(self._rows, self._meta, self._counts, arr, lv, slot, root)
        return code

    def _grow(self, n: int) -> None:
        meta = self._meta
        log2 = int(meta[LOG2])
        while (1 << log2) - (1 << log2 >> 2) < int(meta[USED]) + n:
            log2 += 1
        self._rows = kernels.rehash(self._rows, meta, log2, self._rows.shape[1])

    def remove(self, slot: int, hashes: array[int]) -> int:
        """Drop worker `slot`'s `hashes`; how many it did not hold."""
        unknown: int = kernels.remove(
            self._rows, self._meta, self._counts, np.frombuffer(hashes, _U64_DTYPE), slot
        )
        return unknown

    def update(self, slot: int, block_hash: int, level: int) -> bool:
        hashes = _u64((block_hash,))
        held: bool = kernels.update(self._rows, self._meta, self._counts, hashes, slot, level)
        return held

    def clear(self, slot: int) -> None:
        if kernels.clear(self._rows, self._counts, slot):
            log2 = int(self._meta[LOG2])
            self._rows = kernels.rehash(self._rows, self._meta, log2, self._rows.shape[1])

    def match(
        self, block_hashes: Sequence[int] | U64Array, tiers: bool, monotone: bool
    ) -> tuple[list[int], list[int], list[int]]:
        """(slots, depths, host blocks among the leading ones if `tiers`), workers in the
        order they drop out."""
        out, k = self._match(block_hashes, tiers, monotone)
        if not k:
            return [], [], []
        # One slice and one conversion, not three of each: ~1 µs a request, 2-3 µs with the
        # caches cold (as a router's are between requests).
        if tiers:
            slots, depths, host = out[:, :k].tolist()
            return slots, depths, host
        slots, depths = out[:2, :k].tolist()
        return slots, depths, []

    def match_raw(
        self, block_hashes: Sequence[int] | U64Array, monotone: bool
    ) -> tuple[npt.NDArray[np.int64], int]:
        """`match` with tiers, as the kernel leaves it: (out, k), ``out[0, :k]`` the slots,
        ``out[1, :k]`` the depths, ``out[2, :k]`` the host blocks. `out` is the table's own,
        written again by the next match: read it first."""
        return self._match(block_hashes, True, monotone)

    def _match(
        self, block_hashes: Sequence[int] | U64Array, tiers: bool, monotone: bool
    ) -> tuple[npt.NDArray[np.int64], int]:
        if isinstance(block_hashes, np.ndarray) and block_hashes.dtype == np.uint64:
            arr = block_hashes
        else:
            arr = _hash_array(block_hashes)
        out = self._out
        return out, kernels.match(self._rows, self._meta, arr, self._alive, out, tiers, monotone)

    def blocks_of(self, slot: int) -> dict[int, int]:
        keys, on_host, _ = kernels.blocks_of(self._rows, slot)
        return dict(zip(keys.tolist(), on_host.tolist(), strict=True))

    def parents_of(self, slot: int) -> dict[int, int | None]:
        keys, _, links = kernels.blocks_of(self._rows, slot)
        return {
            h: None if link == h else link
            for h, link in zip(keys.tolist(), links.tolist(), strict=True)
        }

    def parent_of(self, block_hash: int) -> int | None:
        i = -1
        if type(block_hash) is int and 0 <= block_hash < 1 << 64:
            i = kernels.row_of(self._rows, self._meta, _u64((block_hash,)))
        if i < 0:
            raise KeyError(block_hash)
        link = int(self._rows[i, LINK])
        return None if link == block_hash else link

    def count(self, slot: int) -> tuple[int, int]:
        blocks, host = self._counts[slot].tolist()
        return blocks, host

    def __len__(self) -> int:
        return int(self._meta[USED])

    def approx_bytes(self) -> int:
        return int(self._rows.nbytes + self._counts.nbytes + self._out.nbytes)


def _hash_array(block_hashes: Sequence[int] | npt.NDArray[Any]) -> U64Array:
    """A request's hashes as uint64; a hash that cannot be one ends the request there (no
    worker holds it, so a match stops at it anyway)."""
    try:
        return _u64(block_hashes)  # type: ignore[arg-type]
    except (TypeError, OverflowError):
        pass
    good = array(U64_CODE)
    for h in block_hashes:
        try:
            good.append(h)
        except (TypeError, OverflowError):
            break
    return np.frombuffer(good, dtype=np.uint64) if good else np.zeros(0, np.uint64)


def self_test() -> None:
    """Run every kernel once on a small table (numba compiles them, or loads them from its
    cache) and check the answers; raises if numba cannot, so the index can fall back."""
    table = ArrayTable()
    table.ensure_slot(33)
    table.set_alive(0, True)
    table.set_alive(33, True)
    if table.store(0, array(U64_CODE, [0, 11, 12, 13]), None, True):
        raise RuntimeError("store refused a good chain")
    table.store(33, array(U64_CODE, [0, 11, 12, 13]), bytes([0, 1, 0]), True)
    table.update(0, 12, 1)
    table.remove(0, array(U64_CODE, [13, 99]))
    table._grow(1_000)
    found = (
        table.match([11, 12, 13], True, False),
        table.match(np.array([11, 12, 13], np.uint64), False, True),
        table.blocks_of(33),
        table.parent_of(11),
        table.parent_of(12),
        table.parents_of(33),
    )
    expected: tuple[object, ...] = (
        ([0, 33], [2, 3], [1, 1]),
        ([0, 33], [2, 3], []),
        {11: 0, 12: 1, 13: 0},
        None,
        11,
        {11: None, 12: 11, 13: 12},
    )
    table.clear(33)
    if found != expected or table.count(33) != (0, 0) or len(table) != 2:
        raise RuntimeError(f"the compiled prefix index answers {found}, not {expected}")
