"""The compiled kernels of the prefix index's `ArrayTable` (numba), and the layout they share.

`events.index.array_table.ArrayTable` keeps what `events.index.tables.DictTable` keeps (the
pure-Python table, the source of truth; tests check that both give the same answers) in one
numpy array probed by these kernels:

``rows``, uint64, shape ``(capacity, 3 + W)``, capacity a power of two; one row per block hash
that at least one worker holds:

* ``rows[i, KEY]``: the hash;
* ``rows[i, LINK]``: the parent it was last stored under; its own hash at the root (no block
  is its own parent: a stored event that says so is refused);
* ``rows[i, SEQ]``: 1, 2, ... in order of entry, 0 for an empty row. Reading a worker's blocks
  sorts by it, so that they come in the order of the pure-Python table (a dict);
* ``rows[i, BITS + j]``: workers ``32 j .. 32 j + 31``: bit ``s`` says worker ``32 j + s``
  holds the block, bit ``32 + s`` that it holds it on the host tier.

Probing is linear from ``(hash * 0x9E3779B97F4A7C15) >> (64 - log2 capacity)``; a removal
shifts the rows behind it back (no tombstones), so a probe stops at the first empty row. The
table doubles past 3/4 full. A row is 32 bytes with up to 32 workers (two to a cache line), so
a block of a request or of an event costs one cache miss, and a kernel issues the misses of a
whole event or request back to back instead of one dict probe per Python step.

``meta`` (int64): rows in use, the next sequence number, log2 capacity, the fill limit.
Counts per worker slot (blocks held, of which on the host tier) live in ``counts``.

The entry points (``store``, ``remove``, ``update``, ``clear``, ``rehash``, ``match``,
``blocks_of``, ``row_of``) are called by `ArrayTable` only; the helpers they inline start with
an underscore. Importing this module raises ImportError when numba is missing or
``KVMESH_NO_NUMBA`` is set; the index then uses the pure-Python table.
"""

from __future__ import annotations

import os
from typing import Final

import numpy as np

if os.environ.get("KVMESH_NO_NUMBA"):
    raise ImportError("KVMESH_NO_NUMBA is set")

import numba

__all__ = [
    "BAD_LEVEL",
    "BITS",
    "DUPLICATE",
    "FULL",
    "INITIAL_LOG2",
    "KEY",
    "LIMIT",
    "LINK",
    "LOG2",
    "NEXT_SEQ",
    "OK",
    "OWN_ANCESTOR",
    "SEQ",
    "TOUCHED",
    "USED",
    "blocks_of",
    "clear",
    "match",
    "rehash",
    "remove",
    "row_of",
    "store",
    "update",
]

KEY: Final = 0
LINK: Final = 1
SEQ: Final = 2
BITS: Final = 3
USED: Final = 0
NEXT_SEQ: Final = 1
LOG2: Final = 2
LIMIT: Final = 3
TOUCHED: Final = 4  # a sink for the prefetching loads, so that they are not optimised away

INITIAL_LOG2: Final = 8
OK: Final = 0
DUPLICATE: Final = -1
OWN_ANCESTOR: Final = -2
BAD_LEVEL: Final = -3
FULL: Final = -4

# numba freezes module globals as constants; uint64 ones keep the arithmetic unsigned.
_GOLD = np.uint64(0x9E3779B97F4A7C15)
_U0 = np.uint64(0)
_U1 = np.uint64(1)
_U32 = np.uint64(32)
_U64 = np.uint64(64)
_LOW = np.uint64(0xFFFFFFFF)


@numba.njit(cache=True, nogil=True, inline="always")
def _home(h, shift):  # type: ignore[no-untyped-def]
    return np.int64((h * _GOLD) >> shift)


@numba.njit(cache=True, nogil=True, inline="always")
def _find(rows, h, shift, mask):  # type: ignore[no-untyped-def]
    """The row of `h`, or ``-1 - i`` where `i` is the empty row that ends its probe."""
    i = _home(h, shift)
    while True:
        if rows[i, SEQ] == _U0:
            return -1 - i
        if rows[i, KEY] == h:
            return i
        i = (i + 1) & mask


@numba.njit(cache=True, nogil=True, inline="always")
def _held(rows, i):  # type: ignore[no-untyped-def]
    """Whether any worker still holds row `i` (a worker bit in any word's low half)."""
    for c in range(BITS, rows.shape[1]):  # noqa: SIM110 (numba compiles no generators)
        if rows[i, c] & _LOW:
            return True
    return False


@numba.njit(cache=True, nogil=True, inline="always")
def _shift_of(meta):  # type: ignore[no-untyped-def]
    return _U64 - np.uint64(meta[LOG2])


@numba.njit(cache=True, nogil=True)
def _delete(rows, meta, i):  # type: ignore[no-untyped-def]
    """Empty row `i`, moving back the rows whose probe passes it (backward-shift deletion)."""
    mask = rows.shape[0] - 1
    shift = _shift_of(meta)
    width = rows.shape[1]
    j = i
    while True:
        j = (j + 1) & mask
        if rows[j, SEQ] == _U0:
            break
        home = _home(rows[j, KEY], shift)
        # Row j may fill the hole at i unless its home lies cyclically in (i, j].
        if (j > i and (home <= i or home > j)) or (j < i and home <= i and home > j):
            for c in range(width):
                rows[i, c] = rows[j, c]
            i = j
    for c in range(width):
        rows[i, c] = _U0
    meta[USED] -= 1


@numba.njit(cache=True, nogil=True)
def _has_duplicate(links, first):  # type: ignore[no-untyped-def]
    """Whether a hash repeats in ``links[first:]``: pairwise when short, else through a
    scratch table of positions (linear probing, at most half full)."""
    end = links.shape[0]
    if end - first <= 8:
        for a in range(first, end):
            for b in range(a + 1, end):
                if links[a] == links[b]:
                    return True
        return False
    log2 = 4
    while (1 << log2) < 2 * (end - first):
        log2 += 1
    seen = np.zeros(1 << log2, dtype=np.int64)  # position + 1 of the hash in the slot; 0: empty
    mask = (1 << log2) - 1
    shift = _U64 - np.uint64(log2)
    for a in range(first, end):
        h = links[a]
        j = _home(h, shift)
        while seen[j]:
            if links[seen[j] - 1] == h:
                return True
            j = (j + 1) & mask
        seen[j] = a + 1
    return False


@numba.njit(cache=True, nogil=True)
def store(rows, meta, counts, links, levels, slot, root):  # type: ignore[no-untyped-def]
    """Worker `slot` stores the chain ``links[1:]`` below ``links[0]`` (or at the root).

    `levels` holds each block's tier, or is empty when all are on the GPU. Returns OK, or an
    error code with nothing changed: OWN_ANCESTOR, BAD_LEVEL, DUPLICATE (checked in that
    order, the pure-Python table's), FULL (grow the table and call again).
    """
    n = links.shape[0] - 1
    if not root:
        parent = links[0]
        for k in range(1, n + 1):
            if links[k] == parent:
                return OWN_ANCESTOR
    uniform = levels.shape[0] == 0
    if not uniform:
        for k in range(n):
            if levels[k] > 1:
                return BAD_LEVEL
    if _has_duplicate(links, 1):
        return DUPLICATE
    if meta[USED] + n > meta[LIMIT]:
        return FULL
    mask = rows.shape[0] - 1
    shift = _shift_of(meta)
    # Touch every block's home row first: the loads are independent, so their cache misses
    # overlap, and the probes below find the rows in cache.
    touched = _U0
    for k in range(1, n + 1):
        touched ^= rows[_home(links[k], shift), SEQ]
    meta[TOUCHED] = np.int64(touched & _LOW)
    col = BITS + (slot >> 5)
    bit = _U1 << np.uint64(slot & 31)
    host = bit << _U32
    num_new = 0
    num_host = 0
    for k in range(1, n + 1):
        h = links[k]
        link = h if (root and k == 1) else links[k - 1]
        i = _find(rows, h, shift, mask)
        if i < 0:
            i = -1 - i
            rows[i, KEY] = h
            rows[i, SEQ] = np.uint64(meta[NEXT_SEQ])
            meta[NEXT_SEQ] += 1
            meta[USED] += 1
        rows[i, LINK] = link
        word = rows[i, col]
        if not word & bit:
            num_new += 1
        if not uniform and levels[k - 1]:
            if not word & host:
                num_host += 1
            word |= bit | host
        else:
            if word & host:
                num_host -= 1
            word = (word | bit) & ~host
        rows[i, col] = word
    counts[slot, 0] += num_new
    counts[slot, 1] += num_host
    return OK


@numba.njit(cache=True, nogil=True)
def remove(rows, meta, counts, hashes, slot):  # type: ignore[no-untyped-def]
    """Worker `slot` drops `hashes`; a row no worker holds any more leaves. Returns how many
    of them it did not hold."""
    mask = rows.shape[0] - 1
    shift = _shift_of(meta)
    col = BITS + (slot >> 5)
    bit = _U1 << np.uint64(slot & 31)
    host = bit << _U32
    unknown = 0
    for k in range(hashes.shape[0]):
        i = _find(rows, hashes[k], shift, mask)
        if i < 0 or not rows[i, col] & bit:
            unknown += 1
            continue
        counts[slot, 0] -= 1
        if rows[i, col] & host:
            counts[slot, 1] -= 1
        rows[i, col] &= ~(bit | host)
        if not _held(rows, i):
            _delete(rows, meta, i)
    return unknown


@numba.njit(cache=True, nogil=True)
def update(rows, meta, counts, hashes, slot, level):  # type: ignore[no-untyped-def]
    """Worker `slot`'s block ``hashes[0]`` moves to tier `level` (-1: stays). Returns False if
    the worker does not hold it."""
    i = _find(rows, hashes[0], _shift_of(meta), rows.shape[0] - 1)
    col = BITS + (slot >> 5)
    bit = _U1 << np.uint64(slot & 31)
    if i < 0 or not rows[i, col] & bit:
        return False
    host = bit << _U32
    if level == 1 and not rows[i, col] & host:
        rows[i, col] |= host
        counts[slot, 1] += 1
    elif level == 0 and rows[i, col] & host:
        rows[i, col] &= ~host
        counts[slot, 1] -= 1
    return True


@numba.njit(cache=True, nogil=True)
def clear(rows, counts, slot):  # type: ignore[no-untyped-def]
    """Worker `slot` holds nothing; rows left with no worker are marked empty (SEQ 0). Returns
    how many: the caller rehashes, since those marks cut probe chains."""
    col = BITS + (slot >> 5)
    keep = ~((_U1 << np.uint64(slot & 31)) * (_U1 | (_U1 << _U32)))
    emptied = 0
    for i in range(rows.shape[0]):
        if rows[i, SEQ] == _U0:
            continue
        rows[i, col] &= keep
        if not _held(rows, i):
            rows[i, SEQ] = _U0
            emptied += 1
    counts[slot, 0] = 0
    counts[slot, 1] = 0
    return emptied


@numba.njit(cache=True, nogil=True)
def rehash(rows, meta, log2, width):  # type: ignore[no-untyped-def]
    """A table of ``2**log2`` rows and `width` columns holding the live rows of `rows`."""
    cap = 1 << log2
    out = np.zeros((cap, width), dtype=np.uint64)
    mask = cap - 1
    shift = _U64 - np.uint64(log2)
    used = 0
    for i in range(rows.shape[0]):
        if rows[i, SEQ] == _U0:
            continue
        j = -1 - _find(out, rows[i, KEY], shift, mask)
        for c in range(rows.shape[1]):
            out[j, c] = rows[i, c]
        used += 1
    meta[USED] = used
    meta[LOG2] = log2
    meta[LIMIT] = cap - (cap >> 2)
    return out


@numba.njit(cache=True, nogil=True)
def _emit(out, k, dropped, base, depth):  # type: ignore[no-untyped-def]
    """Record `depth` for the workers of `dropped` (bits of word `base // 32`), lowest first."""
    while dropped:
        low = dropped & (~dropped + _U1)
        s = 0
        while (low >> np.uint64(s)) != _U1:
            s += 1
        out[0, k] = base + s
        out[1, k] = depth
        k += 1
        dropped ^= low
    return k


@numba.njit(cache=True, nogil=True)
def match(rows, meta, hashes, alive0, out, tiers, monotone):  # type: ignore[no-untyped-def]
    """Per worker slot in `alive0` (presence words), the number of leading `hashes` it holds.

    Writes ``out[0, :k]`` slots and ``out[1, :k]`` depths, in the order the pure-Python walk
    finds them (by depth, then slot), and returns k. With `tiers`, ``out[2, :k]`` is how many
    of those leading blocks each holds on the host tier. `monotone` binary-searches the points
    where workers drop out (exact only when presence is monotone along the chain).
    """
    mask = rows.shape[0] - 1
    shift = _shift_of(meta)
    width = alive0.shape[0]
    alive = alive0.copy()
    n = hashes.shape[0]
    k = 0
    depth = 0
    while True:
        # The first depth at which some worker still in the running lacks the block.
        if monotone:
            lo = depth
            hi = n
            while lo < hi:
                mid = (lo + hi) >> 1
                i = _find(rows, hashes[mid], shift, mask)
                full = i >= 0
                if full:
                    for w in range(width):
                        if rows[i, BITS + w] & alive[w] != alive[w]:
                            full = False
                            break
                if full:
                    lo = mid + 1
                else:
                    hi = mid
            depth = lo
        else:
            while depth < n:
                i = _find(rows, hashes[depth], shift, mask)
                if i < 0:
                    break
                full = True
                for w in range(width):
                    if rows[i, BITS + w] & alive[w] != alive[w]:
                        full = False
                        break
                if not full:
                    break
                depth += 1
        # Those that lack block `depth` (every one past the end) drop out with that depth.
        i = _find(rows, hashes[depth], shift, mask) if depth < n else -1
        any_left = False
        for w in range(width):
            held = rows[i, BITS + w] & alive[w] if i >= 0 else _U0
            if depth:
                k = _emit(out, k, alive[w] ^ held, 32 * w, depth)
            alive[w] = held
            if held:
                any_left = True
        if not any_left:
            break
        depth += 1
    if tiers:
        # Host blocks among each worker's leading ones (their rows are in cache by now).
        for j in range(k):
            out[2, j] = 0
        longest = 0
        for j in range(k):
            longest = max(longest, out[1, j])
        for d in range(longest):
            i = _find(rows, hashes[d], shift, mask)
            if i < 0:  # a binary search may pass over a block nobody holds
                continue
            for j in range(k):
                s = out[0, j]
                if d < out[1, j] and (rows[i, BITS + (s >> 5)] >> _U32) & (
                    _U1 << np.uint64(s & 31)
                ):
                    out[2, j] += 1
    return k


@numba.njit(cache=True, nogil=True)
def blocks_of(rows, slot):  # type: ignore[no-untyped-def]
    """Worker `slot`'s hashes, tiers and links, in order of entry."""
    col = BITS + (slot >> 5)
    bit = _U1 << np.uint64(slot & 31)
    host = bit << _U32
    n = 0
    for i in range(rows.shape[0]):
        if rows[i, SEQ] != _U0 and rows[i, col] & bit:
            n += 1
    seqs = np.empty(n, dtype=np.uint64)
    keys = np.empty(n, dtype=np.uint64)
    links = np.empty(n, dtype=np.uint64)
    on_host = np.empty(n, dtype=np.uint8)
    n = 0
    for i in range(rows.shape[0]):
        if rows[i, SEQ] != _U0 and rows[i, col] & bit:
            seqs[n] = rows[i, SEQ]
            keys[n] = rows[i, KEY]
            links[n] = rows[i, LINK]
            on_host[n] = 1 if rows[i, col] & host else 0
            n += 1
    order = np.argsort(seqs)
    return keys[order], on_host[order], links[order]


@numba.njit(cache=True, nogil=True)
def row_of(rows, meta, hashes):  # type: ignore[no-untyped-def]
    return _find(rows, hashes[0], _shift_of(meta), rows.shape[0] - 1)
