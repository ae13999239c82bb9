"""The worker's ring of recent KV events, for ``GET /events``: bounded in blocks, not events.

A bound in events would let a few thousand stored events hold hundreds of thousands of block
objects, which every full pass of the cyclic collector walks; so each event weighs its blocks,
and the oldest go once the ring holds more than ``max_blocks`` (the newest always stays).
"""

from __future__ import annotations

from collections import deque

from cache import KVCacheEvent, RemovedData, StoredData

__all__ = ["EventRing"]


def _num_blocks(event: KVCacheEvent) -> int:
    data = event.data
    # ``rows()``, not ``blocks``: reading ``blocks`` would make a StoredBlock per block that
    # nothing on the worker's path needs (the codec packs the rows).
    if type(data) is StoredData:
        return len(data.rows()) or 1
    if type(data) is RemovedData:
        return len(data.block_hashes) or 1
    return 1


class EventRing:
    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._ring: deque[tuple[KVCacheEvent, int]] = deque()  # (event, its blocks)
        self._blocks = 0

    def __len__(self) -> int:
        return len(self._ring)

    def extend(self, events: list[KVCacheEvent]) -> None:
        ring = self._ring
        for event in events:
            weight = _num_blocks(event)
            ring.append((event, weight))
            self._blocks += weight
        while self._blocks > self.max_blocks and len(ring) > 1:
            self._blocks -= ring.popleft()[1]

    def after(self, since: int, limit: int) -> tuple[list[KVCacheEvent], int | None, int | None]:
        """Up to ``limit`` events with ids above ``since``, and the oldest and latest ids the
        ring holds (None when empty)."""
        ring = self._ring
        if not ring:
            return [], None, None
        chosen = [event for event, _ in ring if event.event_id > since][:limit]
        return chosen, ring[0][0].event_id, ring[-1][0].event_id
