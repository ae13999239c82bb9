"""The prefix index's tables: what workers hold, behind one protocol (``Table``).

`PrefixIndex` keeps worker ids, slots and windows; what workers hold lives in a table chosen at
construction, with the same answers either way (tests replay random streams into both):

* `events.index.array_table.ArrayTable` (the default when numba imports): an open-addressing
  table of uint64 hashes in one numpy array, 32 bytes a row for up to 32 workers, probed by
  compiled kernels (`events.index.kernels`, which describes the layout). An event's whole
  chain is applied by one kernel call, a request's whole match by another.
* `DictTable`, here, pure Python and the source of truth (used without numba or with
  ``KVMESH_NO_NUMBA``, or with ``PrefixIndex(compiled=False)``): one dict for the whole
  cluster, ``_words: dict[hash, int]``, one integer word per block hash that at least one
  worker holds:

  * bits 0..64, the *link*: the hash of the parent the block was last stored under, or
    ``2**64`` for the root. Hashes are chained, so a parent is a property of the hash, not of
    a worker; the link is only read to dump a worker as replayable events. A parent the index
    does not know is kept as it is (the chain may have been trimmed).
  * bit ``65 + slot`` (``0 <= slot < S``, ``S = _shift``): worker ``slot`` holds the block;
  * bit ``65 + S + slot``: that worker holds it on the host tier (cache level 1), not the GPU.

  A match masks each word with the presence bits of the workers still in the running; a
  stored event of one tier is a few C-level passes (`map`, `zip`, `dict.update`).

Invariants (both tables): every host bit has its presence bit; a block no worker holds any
more leaves the table; a worker's blocks read back in the order they entered the table.

Also the vocabulary both tables share: the tiers (``GPU_TIER``, ``HOST_TIER``), uint64 arrays
(``U64Array``) and the `array` type code of uint64 words (``U64_CODE``).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterator, Sequence
from itertools import chain, repeat
from operator import and_, or_
from typing import Final, Protocol

import numpy as np
import numpy.typing as npt

__all__ = ["GPU_TIER", "HOST_TIER", "U64_CODE", "DictTable", "Table", "U64Array"]

GPU_TIER: Final = 0
HOST_TIER: Final = 1

_ROOT_LINK: Final = 1 << 64  # the link of a block stored at the root (no hash is this big)
_BASE: Final = 65  # bit of worker slot 0; below it, the link
_LINK_MASK: Final = (1 << _BASE) - 1
_INITIAL_SHIFT: Final = 32  # worker slots before the host bits have to move up

U64Array = npt.NDArray[np.uint64]
# uint64 words: "L" where a C long has 64 bits, since CPython converts a big int to an unsigned
# long digit by digit, but to an unsigned long long through a byte array (twice as slow).
U64_CODE: Final = "L" if array("L").itemsize == 8 else "Q"


def _slots_of(mask: int) -> Iterator[int]:
    """The worker slots whose presence bits are set in `mask`, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1 - _BASE
        mask ^= low


class Table(Protocol):
    """What the index asks of its table (`DictTable` here, numba's `ArrayTable`)."""

    def ensure_slot(self, slot: int) -> None: ...
    def set_alive(self, slot: int, alive: bool) -> None: ...
    def store(self, slot: int, links: array[int], levels: bytes | None, root: bool) -> int: ...
    def remove(self, slot: int, hashes: array[int]) -> int: ...
    def update(self, slot: int, block_hash: int, level: int) -> bool: ...
    def clear(self, slot: int) -> None: ...
    def match(
        self, block_hashes: Sequence[int] | U64Array, tiers: bool, monotone: bool
    ) -> tuple[list[int], list[int], list[int]]: ...
    def blocks_of(self, slot: int) -> dict[int, int]: ...
    def parent_of(self, block_hash: int) -> int | None: ...
    def parents_of(self, slot: int) -> dict[int, int | None]: ...
    def count(self, slot: int) -> tuple[int, int]: ...
    def __len__(self) -> int: ...
    def approx_bytes(self) -> int: ...


class DictTable:
    """The pure-Python table: one dict ``hash -> word`` (layout in the module docstring).

    The source of truth for `events.index.array_table.ArrayTable`, whose methods mirror
    these; the index uses it when numba is missing or ``KVMESH_NO_NUMBA`` is set.
    """

    __slots__ = ("_all", "_num_blocks", "_num_host", "_shift", "_words")

    def __init__(self) -> None:
        self._words: dict[int, int] = {}
        self._num_blocks: list[int] = []  # per slot: blocks held, any tier
        self._num_host: list[int] = []  # per slot: blocks held on the host tier
        self._all = 0  # presence bits of every registered worker
        self._shift = _INITIAL_SHIFT

    def ensure_slot(self, slot: int) -> None:
        """Make room for worker `slot`: past ``_shift`` slots the host bits move up."""
        while len(self._num_blocks) <= slot:
            self._num_blocks.append(0)
            self._num_host.append(0)
        if slot < self._shift:
            return
        shift = self._shift
        while shift <= slot:
            shift *= 2
        old_host = _BASE + self._shift
        keep = (1 << old_host) - 1
        new_host = _BASE + shift
        words = self._words
        for block_hash, word in list(words.items()):
            if word >> old_host:
                words[block_hash] = (word & keep) | ((word >> old_host) << new_host)
        self._shift = shift

    def set_alive(self, slot: int, alive: bool) -> None:
        bit = 1 << (_BASE + slot)
        self._all = self._all | bit if alive else self._all & ~bit

    def store(self, slot: int, links: array[int], levels: bytes | None, root: bool) -> int:
        """Worker `slot` stores the chain ``links[1:]`` below ``links[0]`` (or at the root);
        `levels`: each block's tier, None when all are on the GPU. Nonzero, with nothing
        changed, when the parent is in the chain, a level is not 0 or 1, or a hash repeats."""
        hashes: list[int] = links.tolist()
        parent = hashes.pop(0)
        n = len(hashes)
        if not root and parent in hashes:
            return 1
        if levels is not None and max(levels) > 1:
            return 1
        if len(set(hashes)) != n:
            return 1
        bit = 1 << (_BASE + slot)
        host_bit = bit << self._shift
        keep = ~(_LINK_MASK | host_bit)
        words = self._words
        link = _ROOT_LINK if root else parent
        if levels is None or levels.count(1) == n:
            # One tier for the whole chain: a few C-level passes, no bytecode per block.
            prev = list(map(words.get, hashes, repeat(0)))
            links_of = chain((link,), hashes)  # block k+1's parent is block k
            new = map(or_, links_of, repeat(bit if levels is None else bit | host_bit))
            num_held = sum(map(and_, prev, repeat(bit))) >> (_BASE + slot)
            num_host = sum(map(and_, prev, repeat(host_bit))) >> (_BASE + slot + self._shift)
            # A block already known gets the new link, and loses its host bit on the GPU tier.
            words.update(zip(hashes, map(or_, map(and_, prev, repeat(keep)), new), strict=False))
            self._num_blocks[slot] += n - num_held
            self._num_host[slot] += n - num_host if levels is not None else -num_host
            return 0
        num_new = num_host_delta = 0
        for block_hash, level in zip(hashes, levels, strict=True):
            word = words.get(block_hash, 0)
            if not word & bit:
                num_new += 1
            elif word & host_bit:
                num_host_delta -= 1
            word = (word & keep) | link | bit
            if level:
                word |= host_bit
                num_host_delta += 1
            words[block_hash] = word
            link = block_hash
        self._num_blocks[slot] += num_new
        self._num_host[slot] += num_host_delta
        return 0

    def remove(self, slot: int, hashes: array[int]) -> int:
        """Worker `slot` drops `hashes`; how many it did not hold."""
        bit = 1 << (_BASE + slot)
        host_bit = bit << self._shift
        keep = ~(bit | host_bit)
        present = ((1 << self._shift) - 1) << _BASE
        words = self._words
        get = words.get
        num_removed = num_host = unknown = 0
        for block_hash in hashes:
            word = get(block_hash, 0)
            if not word & bit:
                unknown += 1
                continue
            num_removed += 1
            if word & host_bit:
                num_host += 1
            word &= keep
            if word & present:
                words[block_hash] = word
            else:
                del words[block_hash]
        self._num_blocks[slot] -= num_removed
        self._num_host[slot] -= num_host
        return unknown

    def update(self, slot: int, block_hash: int, level: int) -> bool:
        """Worker `slot`'s block moves to tier `level` (-1: stays); False if not held."""
        bit = 1 << (_BASE + slot)
        word = self._words.get(block_hash, 0)
        if not word & bit:
            return False
        host_bit = bit << self._shift
        if level == HOST_TIER and not word & host_bit:
            self._words[block_hash] = word | host_bit
            self._num_host[slot] += 1
        elif level == GPU_TIER and word & host_bit:
            self._words[block_hash] = word & ~host_bit
            self._num_host[slot] -= 1
        return True

    def clear(self, slot: int) -> None:
        """Worker `slot` holds nothing (a scan of the whole table)."""
        if not self._num_blocks[slot]:
            return
        bit = 1 << (_BASE + slot)
        keep = ~(bit | (bit << self._shift))
        present = ((1 << self._shift) - 1) << _BASE
        words = self._words
        for block_hash in [h for h, w in words.items() if w & bit]:
            word = words[block_hash] & keep
            if word & present:
                words[block_hash] = word
            else:
                del words[block_hash]
        self._num_blocks[slot] = self._num_host[slot] = 0

    def match(
        self, block_hashes: Sequence[int] | U64Array, tiers: bool, monotone: bool
    ) -> tuple[list[int], list[int], list[int]]:
        """(slots, depths, host blocks among the leading ones if `tiers`), workers in the
        order they drop out: by depth, then slot."""
        hashes: Sequence[int] = (
            block_hashes.tolist() if isinstance(block_hashes, np.ndarray) else block_hashes
        )
        found = self._match_monotone(hashes) if monotone else self._walk(hashes)
        if not found:
            return [], [], []
        slots = [slot for slot, _ in found]
        depths = [depth for _, depth in found]
        if not tiers:
            return slots, depths, []
        num_host = self._num_host
        host_depth = max((depth for slot, depth in found if num_host[slot]), default=0)
        # (.get: a binary search may pass over a block nobody holds, if presence is not monotone)
        words = list(map(self._words.get, hashes[:host_depth], repeat(0)))
        host: list[int] = []
        for slot, depth in found:
            on_host = 0
            if num_host[slot]:
                host_shift = _BASE + self._shift + slot
                on_host = sum(map(and_, words[:depth], repeat(1 << host_shift))) >> host_shift
            host.append(on_host)
        return slots, depths, host

    def _walk(self, block_hashes: Sequence[int]) -> list[tuple[int, int]]:
        """(slot, leading blocks held) for each worker holding at least one."""
        get = self._words.get
        alive = self._all
        out: list[tuple[int, int]] = []
        depth = 0
        for block_hash in block_hashes:
            held = get(block_hash, 0) & alive
            if held != alive:
                if depth:
                    out.extend(zip(_slots_of(alive ^ held), repeat(depth)))
                if not held:
                    return out
                alive = held
            depth += 1
        if depth:
            out.extend(zip(_slots_of(alive), repeat(depth)))
        return out

    def _match_monotone(self, block_hashes: Sequence[int]) -> list[tuple[int, int]]:
        """Binary search for each point where workers drop out (exact if presence is monotone)."""
        get = self._words.get
        alive = self._all
        out: list[tuple[int, int]] = []
        n = len(block_hashes)
        lo = 0
        while alive:
            # The first i >= lo where some worker still in the running lacks block i.
            hi = n
            while lo < hi:
                mid = (lo + hi) >> 1
                if get(block_hashes[mid], 0) & alive == alive:
                    lo = mid + 1
                else:
                    hi = mid
            held = get(block_hashes[lo], 0) & alive if lo < n else 0
            if lo:
                out.extend(zip(_slots_of(alive ^ held), repeat(lo)))
            alive = held
            lo += 1
        return out

    def blocks_of(self, slot: int) -> dict[int, int]:
        bit = 1 << (_BASE + slot)
        host_bit = bit << self._shift
        return {
            h: HOST_TIER if w & host_bit else GPU_TIER for h, w in self._words.items() if w & bit
        }

    def parent_of(self, block_hash: int) -> int | None:
        link = self._words[block_hash] & _LINK_MASK
        return None if link == _ROOT_LINK else link

    def parents_of(self, slot: int) -> dict[int, int | None]:
        """`parent_of` for every block worker `slot` holds (one scan)."""
        bit = 1 << (_BASE + slot)
        return {
            h: None if w & _LINK_MASK == _ROOT_LINK else w & _LINK_MASK
            for h, w in self._words.items()
            if w & bit
        }

    def count(self, slot: int) -> tuple[int, int]:
        return self._num_blocks[slot], self._num_host[slot]

    def __len__(self) -> int:
        return len(self._words)

    def approx_bytes(self) -> int:
        words = self._words
        return (
            sys.getsizeof(words)
            + sum(map(sys.getsizeof, words))
            + sum(map(sys.getsizeof, words.values()))
        )
