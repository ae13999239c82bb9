"""LRUEvictionPolicy: which free block is handed out next (evictionPolicy.cpp).

Free blocks wait in FIFO queues indexed by (cache level, priority 0..100). A new block comes from
the head of the lowest non-empty priority queue of its level; a released block joins the tail (or
the head, for rewinds). The queues are intrusive doubly linked lists threaded through the blocks,
with one sentinel per queue, so claim and release are O(1) and allocate nothing; a bit mask per
level finds the lowest non-empty priority without scanning.

Invariants: a queued block has ref_count == 0 and sits in the queue of the level of its memory
slot at the time it was released; `q_level`/`q_priority` record where it was queued, and removal
uses them (not the block's current priority), as the C++ policy does with its stored iterators.

Retention durations: a block released with a duration and a non-default priority gets an expiry
time; `refresh()` moves expired blocks that are still free back to the default priority, at the
tail of its queue. Expiries live in a heap with lazy deletion (a stale entry's token no longer
matches the block's).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterator, Sequence

from cache.block import KVCacheBlock
from cache.errors import OutOfBlocksError
from cache.retention import DEFAULT_PRIORITY, MAX_PRIORITY

PRIMARY_LEVEL = 0
SECONDARY_LEVEL = 1
NUM_LEVELS = 2
NUM_PRIORITIES = MAX_PRIORITY + 1
DEFAULT_SECONDARY_OFFLOAD_MIN_PRIORITY = 30


class _Sentinel(KVCacheBlock):
    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(-2, -1, True)
        self.q_prev = self
        self.q_next = self


class LRUEvictionPolicy:
    def __init__(
        self,
        blocks: Sequence[KVCacheBlock],
        secondary_offload_min_priority: int | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._queues = [[_Sentinel() for _ in range(NUM_PRIORITIES)] for _ in range(NUM_LEVELS)]
        self._masks = [0, 0]  # bit p set <=> queue (level, p) is non-empty
        self._num_free = [0, 0]
        self._threshold = (
            DEFAULT_SECONDARY_OFFLOAD_MIN_PRIORITY
            if secondary_offload_min_priority is None
            else secondary_offload_min_priority
        )
        self._clock = clock or time.monotonic
        self._expiry_heap: list[tuple[float, int, int, KVCacheBlock]] = []
        self._expiry_seq = 0
        self._blocks = blocks
        for block in blocks:
            self._enqueue(
                block,
                PRIMARY_LEVEL if block.is_primary else SECONDARY_LEVEL,
                DEFAULT_PRIORITY,
                front=False,
            )

    @property
    def secondary_offload_min_priority(self) -> int:
        return self._threshold

    def _enqueue(self, block: KVCacheBlock, level: int, priority: int, front: bool) -> None:
        sentinel = self._queues[level][priority]
        after: KVCacheBlock | None
        before: KVCacheBlock | None
        if front:
            after, before = sentinel, sentinel.q_next
        else:
            after, before = sentinel.q_prev, sentinel
        assert after is not None and before is not None
        block.q_prev = after
        block.q_next = before
        after.q_next = block
        before.q_prev = block
        block.q_level = level
        block.q_priority = priority
        self._masks[level] |= 1 << priority
        self._num_free[level] += 1

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.q_prev, block.q_next
        assert prev is not None and nxt is not None
        prev.q_next = nxt
        nxt.q_prev = prev
        block.q_prev = block.q_next = None
        level, priority = block.q_level, block.q_priority
        sentinel = self._queues[level][priority]
        if sentinel.q_next is sentinel:
            self._masks[level] &= ~(1 << priority)
        self._num_free[level] -= 1
        block.q_level = -1

    def get_free_block(self, level: int) -> tuple[KVCacheBlock, bool]:
        """Head of the lowest-priority non-empty queue and whether it may be offloaded.

        The block stays queued: the caller claims it.
        """
        mask = self._masks[level]
        if not mask:
            raise OutOfBlocksError(f"no free blocks at cache level {level}")
        priority = (mask & -mask).bit_length() - 1
        block = self._queues[level][priority].q_next
        assert block is not None
        return block, level == PRIMARY_LEVEL and priority >= self._threshold

    def get_num_free_blocks(self, level: int) -> int:
        return self._num_free[level]

    def take_free_blocks(self, level: int, count: int) -> list[KVCacheBlock]:
        """The next `count` blocks `get_free_block` would hand out, taken out of their queues at
        once (popleft_n). Each keeps `q_priority`, the queue it came from; the caller claims
        them (priority, duration). Raises OutOfBlocksError, taking nothing, if too few are free.
        """
        if count > self._num_free[level]:
            raise OutOfBlocksError(
                f"{count} blocks asked at cache level {level}, {self._num_free[level]} free"
            )
        taken: list[KVCacheBlock] = []
        if count <= 0:
            return taken
        queues = self._queues[level]
        mask = self._masks[level]
        append = taken.append
        while count:
            priority = (mask & -mask).bit_length() - 1
            sentinel = queues[priority]
            block = sentinel.q_next
            assert block is not None
            while count and block is not sentinel:
                assert block is not None
                append(block)
                block.q_level = -1
                block.q_prev = None
                nxt = block.q_next
                block.q_next = None
                block = nxt
                count -= 1
            assert block is not None
            sentinel.q_next = block
            block.q_prev = sentinel
            if block is sentinel:
                mask &= ~(1 << priority)
        self._masks[level] = mask
        self._num_free[level] -= len(taken)
        return taken

    def release_blocks(self, blocks: Sequence[KVCacheBlock]) -> None:
        """`release_block` for each block in turn, at the tails of their queues (append_n)."""
        queues = self._queues
        masks = self._masks
        num_free = self._num_free
        for block in blocks:
            if block.q_level >= 0:
                raise RuntimeError(f"block {block.block_id} is already free")
            level = PRIMARY_LEVEL if block.is_primary else SECONDARY_LEVEL
            priority = block.priority
            sentinel = queues[level][priority]
            last = sentinel.q_prev
            assert last is not None
            block.q_prev = last
            block.q_next = sentinel
            last.q_next = block
            sentinel.q_prev = block
            block.q_level = level
            block.q_priority = priority
            masks[level] |= 1 << priority
            num_free[level] += 1
            if block.duration_s is not None and priority != DEFAULT_PRIORITY:
                block.expiry_token += 1
                self._expiry_seq += 1
                expiry = self._clock() + block.duration_s
                heapq.heappush(
                    self._expiry_heap, (expiry, self._expiry_seq, block.expiry_token, block)
                )

    def iter_free(self, level: int) -> Iterator[KVCacheBlock]:
        """The free blocks of `level` in the order they would be handed out (lazily)."""
        mask = self._masks[level]
        while mask:
            priority = (mask & -mask).bit_length() - 1
            yield from self.queued_blocks(level, priority)
            mask &= mask - 1

    def claim_block(
        self, block: KVCacheBlock, priority: int | None = None, duration_s: float | None = None
    ) -> None:
        """Take `block` out of its free queue (if queued); set its priority if given.

        The duration is always overwritten, None clearing it, as in the C++ policy.
        """
        if block.q_level >= 0:
            self._unlink(block)
        block.expiry_token += 1  # any pending expiry no longer applies
        if priority is not None:
            block.priority = priority
        block.duration_s = duration_s

    def release_block(self, block: KVCacheBlock, to_front: bool = False) -> None:
        """Queue a block whose last reference is gone (at the head for rewinds)."""
        if block.q_level >= 0:
            raise RuntimeError(f"block {block.block_id} is already free")
        level = PRIMARY_LEVEL if block.is_primary else SECONDARY_LEVEL
        self._enqueue(block, level, block.priority, to_front)
        if block.duration_s is not None and block.priority != DEFAULT_PRIORITY:
            block.expiry_token += 1
            self._expiry_seq += 1
            expiry = self._clock() + block.duration_s
            heapq.heappush(self._expiry_heap, (expiry, self._expiry_seq, block.expiry_token, block))

    def refresh(self) -> None:
        """Demote free blocks whose retention expired to the default priority (no event)."""
        now = self._clock()
        heap = self._expiry_heap
        while heap and heap[0][0] <= now:
            _, _, token, block = heapq.heappop(heap)
            if token != block.expiry_token or block.q_level < 0:
                continue  # claimed (and maybe released again) since
            level = block.q_level
            self._unlink(block)
            block.priority = DEFAULT_PRIORITY
            block.duration_s = None
            self._enqueue(block, level, DEFAULT_PRIORITY, front=False)

    def queued_blocks(self, level: int, priority: int) -> Iterator[KVCacheBlock]:
        sentinel = self._queues[level][priority]
        block = sentinel.q_next
        while block is not sentinel:
            assert block is not None
            yield block
            block = block.q_next

    def free_order(self, level: int) -> list[int]:
        """Ids of the free blocks of `level` in the order they would be handed out."""
        return [b.block_id for p in range(NUM_PRIORITIES) for b in self.queued_blocks(level, p)]

    def verify_queue_integrity(self) -> bool:
        """False if a queued block sits at the wrong level or still has references."""
        counted = [0, 0]
        for level in range(NUM_LEVELS):
            for priority in range(NUM_PRIORITIES):
                non_empty = False
                for block in self.queued_blocks(level, priority):
                    non_empty = True
                    counted[level] += 1
                    if block.ref_count > 0 or block.is_primary != (level == PRIMARY_LEVEL):
                        return False
                    if block.q_level != level or block.q_priority != priority:
                        return False
                if non_empty != bool(self._masks[level] >> priority & 1):
                    return False
        return counted == self._num_free
