"""``PredictedCache``: the blocks a router assumes its workers hold because it sent them a
request (``RouterCore``'s predicted cache; ``app.router.core`` says what it is for), with its
pieces: a generation of the blocks predicted to a worker, and a worker's match extended by what
was predicted to it."""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

__all__ = [
    "Generation",
    "PredictedCache",
    "approximate_depth",
    "extended_depth",
    "predicted_depth",
]


def predicted_depth(
    block_hashes: Sequence[int],
    depth: int,
    newer: Generation | None,
    older: Generation | None,
) -> int:
    """``depth`` extended by the blocks predicted (in either generation) after it."""
    num_blocks = len(block_hashes)
    newer_blocks = newer.blocks if newer is not None else ()
    older_blocks = older.blocks if older is not None else ()
    while depth < num_blocks:
        block_hash = block_hashes[depth]
        if block_hash in newer_blocks or block_hash in older_blocks:
            depth += 1
        else:
            break
    return depth


def approximate_depth(
    block_hashes: Sequence[int], depth: int, now: float, predicted: dict[int, float]
) -> int:
    """``depth`` extended by the blocks predicted to an approximate worker and unexpired."""
    num_blocks = len(block_hashes)
    while depth < num_blocks and predicted.get(block_hashes[depth], 0.0) > now:
        depth += 1
    return depth


def extended_depth(
    block_hashes: Sequence[int],
    depth: int,
    now: float,
    newer: Generation | None,
    older: Generation | None,
    approx: dict[int, float] | None,
) -> int:
    """A worker's index ``depth`` for a request, extended by the blocks predicted to it in
    either generation and, for an approximate worker, unexpired (they count as GPU blocks:
    they were just made)."""
    if newer is not None or older is not None:
        depth = predicted_depth(block_hashes, depth, newer, older)
    if approx:
        depth = approximate_depth(block_hashes, depth, now, approx)
    return depth


class Generation:
    """The blocks predicted to one worker during one generation (``PredictedCache.purge``), and
    the last block of each chain that put them there: chained hashes make the last block name
    the whole chain, so a prompt sent again in the same generation (a retry, ``n`` samples, an
    evaluation's fixed prompts) costs one set probe instead of 256 inserts."""

    __slots__ = ("blocks", "leaves")

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.leaves: set[int] = set()

    def add(self, block_hashes: Sequence[int]) -> None:
        leaf = block_hashes[-1]
        if leaf not in self.leaves:
            self.blocks.update(block_hashes)
            self.leaves.add(leaf)

    def discard(self, block_hashes: Sequence[int]) -> None:
        self.blocks.difference_update(block_hashes)
        # Another chain may have shared those blocks: a chain whose leaf stays known would
        # not put them back when predicted again.
        self.leaves.clear()


class PredictedCache:
    """Per worker, the blocks predicted to it: two ``Generation``s, or for an approximate
    worker (no KV events) each block with its expiry. Synchronous; ``clock`` is the core's."""

    __slots__ = (
        "approx",
        "approx_expiries",
        "approx_ttl_s",
        "clock",
        "newer",
        "older",
        "predict_ttl_s",
        "rotate_at",
    )

    def __init__(
        self, predict_ttl_s: float, approx_ttl_s: float, clock: Callable[[], float]
    ) -> None:
        self.predict_ttl_s = predict_ttl_s
        self.approx_ttl_s = approx_ttl_s
        self.clock = clock
        # worker -> what was predicted to it since the last rotation, and in the generation
        # before (see ``purge``); an approximate worker's: block hash -> expiry, ordered by
        # recency, and the expiries in the order they come.
        self.newer: dict[str, Generation] = {}
        self.older: dict[str, Generation] = {}
        self.rotate_at = -math.inf
        self.approx: dict[str, OrderedDict[int, float]] = {}
        self.approx_expiries: deque[tuple[float, str, Sequence[int]]] = deque()

    def purged_now(self) -> float | None:
        """The clock's time, the predictions purged to it; None (not read) when there are
        none, and no depth to extend."""
        if not (self.newer or self.older or self.approx):
            return None
        now = self.clock()
        self.purge(now)
        return now

    def workers(self) -> set[str]:
        """The workers with predicted blocks."""
        return {*self.newer, *self.older, *self.approx}

    def depth(self, block_hashes: Sequence[int], now: float, worker: str, depth: int) -> int:
        """``extended_depth`` for ``worker`` (the request's arguments first, for ``partial``)."""
        return extended_depth(
            block_hashes,
            depth,
            now,
            self.newer.get(worker),
            self.older.get(worker),
            self.approx.get(worker),
        )

    def predict(self, worker: str, block_hashes: Sequence[int]) -> None:
        """``worker`` holds ``block_hashes`` (a chain from the root) for the TTL."""
        if self.predict_ttl_s <= 0:
            return
        self.purge(self.clock())  # into the generation of now
        generation = self.newer.get(worker)
        if generation is None:
            generation = self.newer[worker] = Generation()
        generation.add(block_hashes)

    def predict_approximate(
        self, worker: str, capacity_blocks: int, block_hashes: Sequence[int]
    ) -> None:
        """An approximate worker holds ``block_hashes`` for ``approx_ttl_s``, within its
        capacity."""
        if self.approx_ttl_s <= 0:
            return
        expiry = self.clock() + self.approx_ttl_s
        predicted = self.approx.get(worker)
        if predicted is None:
            predicted = self.approx[worker] = OrderedDict()
        # Most recent last, and within one prompt its root last: over capacity, the least
        # recently sent go first, and of one chain its leaves before its root (a prefix is
        # only ever matched from the root).
        for block_hash in reversed(block_hashes):
            predicted[block_hash] = expiry
            predicted.move_to_end(block_hash)
        if capacity_blocks > 0:
            while len(predicted) > capacity_blocks:
                predicted.popitem(last=False)
        self.approx_expiries.append((expiry, worker, block_hashes))

    def unpredict(self, worker: str, block_hashes: Sequence[int]) -> None:
        """Forget that ``worker`` holds ``block_hashes``: the request never reached it."""
        for generations in (self.newer, self.older):
            generation = generations.get(worker)
            if generation is not None:
                generation.discard(block_hashes)
        approx = self.approx.get(worker)
        if approx:
            for block_hash in block_hashes:
                approx.pop(block_hash, None)

    def forget(self, worker: str) -> None:
        for predictions in (self.newer, self.older, self.approx):
            predictions.pop(worker, None)

    def num_predicted(self, worker: str) -> int:
        now = self.clock()
        self.purge(now)
        held: set[int] = set()
        for generations in (self.newer, self.older):
            generation = generations.get(worker)
            if generation is not None:
                held |= generation.blocks
        approx: dict[int, float] = self.approx.get(worker, {})
        return len(held) + sum(1 for h, expiry in approx.items() if expiry > now and h not in held)

    def purge(self, now: float) -> None:
        """Turn the generations when due (the older one forgotten), and forget approximate
        workers' predictions whose ``approx_ttl_s`` passed.

        Predictions are not timed one by one (a dict write and a delete per block, 256 of
        each for a proxied 4,096-token prompt): they go into the newer of two generations,
        and every ``predict_ttl_s`` the newer becomes the older and the older is dropped
        whole, on a fixed beat. A prediction so lasts more than its TTL and at most twice
        that; a lookup reads two sets. An approximate worker's predictions (``approx_ttl_s``,
        ordered by recency) are timed one by one, from their expiry queue."""
        if now >= self.rotate_at:
            if now < self.rotate_at + self.predict_ttl_s:  # on time: the newer ages
                self.older = self.newer
                self.rotate_at += self.predict_ttl_s
            else:  # none since a whole generation: all that was made has expired
                self.older = {}
                self.rotate_at = now + self.predict_ttl_s
            self.newer = {}
        expiries = self.approx_expiries
        while expiries and expiries[0][0] <= now:
            _, worker, hashes = expiries.popleft()
            predicted = self.approx.get(worker)
            if predicted is None:
                continue
            for block_hash in hashes:
                if predicted.get(block_hash, now + 1.0) <= now:
                    del predicted[block_hash]
            if not predicted:
                del self.approx[worker]
