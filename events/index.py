"""The cluster-wide prefix index: which worker holds which KV block, on which tier.

A router feeds every worker's KV events into one `PrefixIndex` (ours, or TensorRT-LLM's JSON
dicts) and asks, for the chained block hashes of a request, how many leading blocks each worker
already holds. Pure and synchronous: no asyncio, no Redis; it imports only `cache` event types.

Layout: one dict for the whole cluster, ``_words: dict[hash, int]``. For each block hash that
at least one worker holds it keeps one integer word, and nothing else is allocated per block:

* bits 0..64, the *link*: the hash of the parent the block was last stored under, or ``2**64``
  for the root. Hashes are chained, so a parent is a property of the hash, not of a worker;
  the link is only read to dump a worker as replayable events. A parent the index does not
  know is kept as it is (the chain may have been trimmed).
* bit ``65 + slot`` (``0 <= slot < S``, ``S = _shift``): worker ``slot`` holds the block;
* bit ``65 + S + slot``: that worker holds it on the host tier (cache level 1), not the GPU.

Invariants: every host bit has its presence bit; a word with no presence bit left is deleted.
A match masks each word with the presence bits of the workers still in the running, so the
link costs it nothing. Keeping the link in the word rather than in a second dict halves the
dict probes of an apply (they are cache misses once the index outgrows the CPU caches), and
putting it in the low bits makes a new word one `|` of the parent's hash with the worker's bit.

Workers get slots in order of first appearance; a removed worker's slot is reused; past ``S``
workers the host bits move up (one pass over the index). A match is one dict lookup and two
integer operations per block of the request (`find_matches`), and stops as soon as no worker
is left. With ``assume_monotone=True`` the match binary-searches instead, which is exact only
when "worker holds block i" implies it holds blocks 0..i-1 (true for our own workers, whose
eviction frees a block's whole subtree; not for engines that evict interior blocks alone), so
the default is the exact walk.

Applying a stored event costs a few C-level passes over its hashes (`map`, `zip`,
`dict.update`); no Python bytecode runs per block unless the blocks of one event sit on
different tiers. Forgetting a worker (`remove_worker`, a `created` event) and reading one
(`worker_blocks`, `dump_events`) scan the whole index: those are rare (a restart, a
resynchronisation); matches and events are not.

Errors: malformed events raise `ValueError` naming what is wrong, before anything changes (the
consumer counts and skips them); questions about a worker the index has never seen raise
`KeyError`. Events that name a block the worker does not hold (a removal or an update after a
missed event) are not errors: they are skipped and counted in `num_unknown_block_refs`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Sequence
from functools import reduce
from itertools import chain, repeat
from operator import and_, attrgetter, or_
from typing import Any, Final

from cache import (
    CreatedData,
    KVCacheEvent,
    RemovedData,
    StoredBlock,
    StoredData,
    UpdatedData,
)

__all__ = ["GPU_TIER", "HOST_TIER", "PrefixIndex"]

GPU_TIER: Final = 0
HOST_TIER: Final = 1

_MAX_HASH: Final = 2**64 - 1
_ROOT_LINK: Final = 1 << 64  # the link of a block stored at the root (no hash is this big)
_BASE: Final = 65  # bit of worker slot 0; below it, the link
_LINK_MASK: Final = (1 << _BASE) - 1
_INITIAL_SHIFT: Final = 32  # worker slots before the host bits have to move up
_LEVELS: Final = frozenset((GPU_TIER, HOST_TIER))

_hash_of = attrgetter("block_hash")
_level_of = attrgetter("cache_level")


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
            raise ValueError(f"{what}: block hash {h!r} is not an int")
        if not 0 <= h <= _MAX_HASH:
            raise ValueError(f"{what}: block hash {h} is outside 0..2**64-1")
    raise ValueError(f"{what}: bad block hashes")


def _slots_of(mask: int) -> Iterator[int]:
    """The worker slots whose presence bits are set in `mask`, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1 - _BASE
        mask ^= low


class PrefixIndex:
    """Block hash -> workers holding it, per tier; longest-prefix matches per worker."""

    __slots__ = (
        "_all",
        "_free_slots",
        "_monotone",
        "_names",
        "_num_blocks",
        "_num_host",
        "_shift",
        "_slots",
        "_windows",
        "_words",
        "num_unknown_block_refs",
    )

    def __init__(self, *, assume_monotone: bool = False) -> None:
        self._words: dict[int, int] = {}
        self._slots: dict[str, int] = {}
        self._names: list[str] = []  # slot -> worker id ("" while the slot is free)
        self._free_slots: list[int] = []
        self._num_blocks: list[int] = []  # per slot: blocks held, any tier
        self._num_host: list[int] = []  # per slot: blocks held on the host tier
        self._windows: list[int] = []  # per slot: window size of its last event
        self._all = 0  # presence bits of every registered worker
        self._shift = _INITIAL_SHIFT
        self._monotone = assume_monotone
        # Removed/updated events that named a block the worker did not hold.
        self.num_unknown_block_refs = 0

    # -- workers -------------------------------------------------------------------------------

    def workers(self) -> list[str]:
        """Registered workers, in slot order (first appearance; removed workers' slots reused)."""
        return sorted(self._slots, key=self._slots.__getitem__)

    def _slot(self, worker_id: str) -> int:
        slot = self._slots.get(worker_id)
        if slot is not None:
            return slot
        if self._free_slots:
            slot = self._free_slots.pop()
            self._names[slot] = worker_id
            self._num_blocks[slot] = self._num_host[slot] = self._windows[slot] = 0
        else:
            slot = len(self._names)
            if slot >= self._shift:
                self._move_host_bits(self._shift * 2)
            self._names.append(worker_id)
            self._num_blocks.append(0)
            self._num_host.append(0)
            self._windows.append(0)
        self._slots[worker_id] = slot
        self._all |= 1 << (_BASE + slot)
        return slot

    def _move_host_bits(self, shift: int) -> None:
        """Make room for `shift` worker slots: the host bits move up."""
        old_host = _BASE + self._shift
        keep = (1 << old_host) - 1
        new_host = _BASE + shift
        words = self._words
        for block_hash, word in list(words.items()):
            if word >> old_host:
                words[block_hash] = (word & keep) | ((word >> old_host) << new_host)
        self._shift = shift

    def _clear_slot(self, slot: int) -> None:
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

    def remove_worker(self, worker_id: str) -> bool:
        """Forget a worker and free its slot; False if it was not registered."""
        slot = self._slots.pop(worker_id, None)
        if slot is None:
            return False
        self._clear_slot(slot)
        self._names[slot] = ""
        self._free_slots.append(slot)
        self._all &= ~(1 << (_BASE + slot))
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
                    raise ValueError(f"malformed TensorRT-LLM event: {exc}") from exc
            elif event is None:
                return
            elif not isinstance(event, KVCacheEvent):
                raise ValueError(f"not a KV cache event: {type(event).__name__}")
        data = event.data
        if type(data) is StoredData:
            slot = self._apply_stored(worker_id, data)
        elif type(data) is RemovedData:
            slot = self._apply_removed(worker_id, data)
        elif type(data) is UpdatedData:
            slot = self._apply_updated(worker_id, data)
        elif type(data) is CreatedData:
            slot = self._slot(worker_id)
            self._clear_slot(slot)
        else:
            raise ValueError(f"unknown event data {type(data).__name__}")
        self._windows[slot] = event.window_size

    def _apply_stored(self, worker_id: str, data: StoredData) -> int:
        blocks = data.blocks
        parent = data.parent_hash
        if type(blocks) is not list:
            raise ValueError(f"stored event: blocks must be a list, got {type(blocks).__name__}")
        if parent is not None and (type(parent) is not int or not 0 <= parent <= _MAX_HASH):
            raise ValueError(f"stored event: bad parent_hash {parent!r}")
        if not blocks:
            return self._slot(worker_id)
        hashes: list[int] = list(map(_hash_of, blocks))
        _check_hashes(hashes, "stored event")
        if parent in hashes:
            raise ValueError(f"stored event: block {parent} is its own ancestor")
        # The common case, every block on the GPU tier, costs one pass; a falsy level is 0.
        all_host = False
        if any(map(_level_of, blocks)):
            levels = set(map(_level_of, blocks))
            if not levels <= _LEVELS:
                bad = min(levels - _LEVELS, key=repr)
                raise ValueError(f"stored event: cache_level must be 0 or 1, got {bad!r}")
            if len(levels) > 1:
                return self._apply_stored_mixed(worker_id, parent, hashes, blocks)
            all_host = True
        slot = self._slots.get(worker_id)
        if slot is None:
            slot = self._slot(worker_id)
            new_worker = True
        else:
            new_worker = False
        bit_shift = _BASE + slot
        bit = 1 << bit_shift
        host_shift = bit_shift + self._shift
        host_bit = 1 << host_shift
        words = self._words
        prev = list(map(words.get, hashes, repeat(0)))
        # Block k+1's parent is block k; the first hangs below `parent`.
        links = chain((_ROOT_LINK if parent is None else parent,), hashes)
        new = map(or_, links, repeat(bit | host_bit if all_host else bit))
        n = len(hashes)
        if any(prev):
            if len(set(hashes)) != n:
                if new_worker:
                    self.remove_worker(worker_id)
                raise ValueError("stored event: a block hash appears twice in one chain")
            num_held = sum(map(and_, prev, repeat(bit))) >> bit_shift
            num_host = sum(map(and_, prev, repeat(host_bit))) >> host_shift
            # A block already known gets the new link, and loses its host bit on the GPU tier.
            new = map(or_, map(and_, prev, repeat(~(_LINK_MASK | host_bit))), new)
            words.update(zip(hashes, new, strict=False))
        else:
            # Every block is new to the index: a repeated hash shows as a smaller growth.
            size = len(words)
            words.update(zip(hashes, new, strict=False))
            if len(words) - size != n:
                for block_hash in hashes:
                    words.pop(block_hash, None)
                if new_worker:
                    self.remove_worker(worker_id)
                raise ValueError("stored event: a block hash appears twice in one chain")
            num_held = num_host = 0
        self._num_blocks[slot] += n - num_held
        self._num_host[slot] += n - num_host if all_host else -num_host
        return slot

    def _apply_stored_mixed(
        self, worker_id: str, parent: int | None, hashes: list[int], blocks: list[StoredBlock]
    ) -> int:
        """A stored event whose blocks sit on both tiers: one step per block."""
        if len(set(hashes)) != len(hashes):
            raise ValueError("stored event: a block hash appears twice in one chain")
        slot = self._slot(worker_id)
        bit = 1 << (_BASE + slot)
        host_bit = bit << self._shift
        keep = ~(_LINK_MASK | host_bit)
        words = self._words
        get = words.get
        num_new = num_host_delta = 0
        link = _ROOT_LINK if parent is None else parent
        for block_hash, level in zip(hashes, map(_level_of, blocks), strict=True):
            word = get(block_hash, 0)
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
        return slot

    def _apply_removed(self, worker_id: str, data: RemovedData) -> int:
        hashes = data.block_hashes
        if type(hashes) is not list:
            raise ValueError(
                f"removed event: block_hashes must be a list, got {type(hashes).__name__}"
            )
        _check_hashes(hashes, "removed event")
        slot = self._slot(worker_id)
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
        self.num_unknown_block_refs += unknown
        return slot

    def _apply_updated(self, worker_id: str, data: UpdatedData) -> int:
        block_hash = data.block_hash
        _check_hashes([block_hash], "updated event")
        diff = data.cache_level
        level = None
        if diff is not None:
            level = diff.new_value
            if type(level) is not int or level not in _LEVELS:
                raise ValueError(f"updated event: cache_level must become 0 or 1, got {level!r}")
        slot = self._slot(worker_id)
        bit = 1 << (_BASE + slot)
        word = self._words.get(block_hash, 0)
        if not word & bit:
            self.num_unknown_block_refs += 1
            return slot
        if level is None:  # a priority change: the index does not rank by priority
            return slot
        host_bit = bit << self._shift
        if level == HOST_TIER and not word & host_bit:
            self._words[block_hash] = word | host_bit
            self._num_host[slot] += 1
        elif level == GPU_TIER and word & host_bit:
            self._words[block_hash] = word & ~host_bit
            self._num_host[slot] -= 1
        return slot

    # -- matching ------------------------------------------------------------------------------

    def _match_slots(self, block_hashes: Sequence[int]) -> list[tuple[int, int]]:
        """(slot, number of leading blocks held) for each worker holding at least one."""
        if self._monotone:
            return self._match_monotone(block_hashes)
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

    def find_matches(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Per worker, how many leading blocks of the request it holds (any tier); no zeros."""
        names = self._names
        return {names[slot]: depth for slot, depth in self._match_slots(block_hashes)}

    def find_matches_by_tier(self, block_hashes: Sequence[int]) -> dict[str, tuple[int, int]]:
        """Per worker: (leading blocks held on any tier, how many of those are on the GPU)."""
        matches = self._match_slots(block_hashes)
        if not matches:
            return {}
        names, num_host, shift = self._names, self._num_host, self._shift
        host_depth = max((depth for slot, depth in matches if num_host[slot]), default=0)
        words: list[int] = []
        if host_depth:
            words = list(map(self._words.__getitem__, block_hashes[:host_depth]))
        out: dict[str, tuple[int, int]] = {}
        for slot, depth in matches:
            on_host = 0
            if num_host[slot]:
                host_shift = _BASE + shift + slot
                on_host = sum(map(and_, words[:depth], repeat(1 << host_shift))) >> host_shift
            out[names[slot]] = (depth, depth - on_host)
        return out

    # -- state ---------------------------------------------------------------------------------

    def worker_blocks(self, worker_id: str) -> dict[int, int]:
        """Every block `worker_id` holds: hash -> tier (0 GPU, 1 host). Scans the index."""
        bit = 1 << (_BASE + self._slots[worker_id])
        host_bit = bit << self._shift
        return {
            h: HOST_TIER if w & host_bit else GPU_TIER for h, w in self._words.items() if w & bit
        }

    def parent_of(self, block_hash: int) -> int | None:
        """The parent `block_hash` was last stored under (KeyError if no worker holds it)."""
        link = self._words[block_hash] & _LINK_MASK
        return None if link == _ROOT_LINK else link

    def dump_events(self, worker_id: str, *, window_size: int | None = None) -> list[KVCacheEvent]:
        """`worker_id`'s blocks as stored events that rebuild them when replayed in order.

        Parents come before children; each event is one chain (block k+1's parent is block k),
        split where the tree branches; a chain whose first parent the worker does not hold
        keeps that parent's hash. Event ids count from 0; `window_size` defaults to that of the
        worker's last event. The index keeps no tokens, so the stored blocks carry none.
        """
        window = self._windows[self._slots[worker_id]] if window_size is None else window_size
        held = self.worker_blocks(worker_id)
        parent_of = self.parent_of
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
        return self._num_blocks[self._slots[worker_id]]

    def __len__(self) -> int:
        """Distinct block hashes held by at least one worker."""
        return len(self._words)

    def stats(self) -> dict[str, Any]:
        """Blocks per worker and per tier (state only, so equal after a dump and replay)."""
        per_worker: dict[str, dict[str, int]] = {}
        for worker_id, slot in sorted(self._slots.items()):
            total, host = self._num_blocks[slot], self._num_host[slot]
            per_worker[worker_id] = {"blocks": total, "gpu": total - host, "host": host}
        return {
            "workers": len(per_worker),
            "blocks": len(self._words),
            "entries": sum(w["blocks"] for w in per_worker.values()),
            "gpu_entries": sum(w["gpu"] for w in per_worker.values()),
            "host_entries": sum(w["host"] for w in per_worker.values()),
            "per_worker": per_worker,
        }

    def approx_bytes(self) -> int:
        """Rough memory of the index: its dict, the hash keys and the words."""
        words = self._words
        return (
            sys.getsizeof(words)
            + sum(map(sys.getsizeof, words))
            + sum(map(sys.getsizeof, words.values()))
        )
