"""The pieces of ``RouterCore``'s predicted cache (see ``app.router.core``): a generation of the
blocks predicted to a worker, and a worker's match extended by what was predicted to it."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Generation", "approximate_depth", "extended_depth", "predicted_depth"]


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
    """The blocks predicted to one worker during one generation (``RouterCore._purge``), and
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
