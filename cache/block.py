"""KVCacheBlock: one block of KV memory and its place in the reuse tree.

Every block object is made once, when its window manager is built, and is indexed by id. A block
carries three sets of links:

* its *memory slot* (`memory_index`, `is_primary`), swapped with another block on offload/onboard;
* its place in the reuse (radix) tree (`cache.radix`): `prev_block` (tree parent; None when not
  in the tree) and `next_blocks` (children by chained hash);
* intrusive free-queue links (`q_prev`, `q_next`, `q_level`, `q_priority`) owned by the eviction
  policy, so that claiming a block from the middle of a queue is O(1) and allocates nothing.

Also `stored_rows`, a Stored event's rows read off its blocks (compiled with the block).
"""

from __future__ import annotations

from collections.abc import Sequence

from cache.hashing import BlockHash, BlockKey
from cache.retention import DEFAULT_PRIORITY

ROOT_BLOCK_ID = -1
EMPTY_KEY = BlockKey()  # the key of a block that holds nothing


class KVCacheBlock:
    __slots__ = (
        "block_id",
        "cache_salt",
        "duration_s",
        "expiry_token",
        "hash",
        "is_full",
        "is_primary",
        "key",
        "memory_index",
        "next_blocks",
        "owner",
        "prev_block",
        "prev_block_in_seq",
        "priority",
        "q_level",
        "q_next",
        "q_prev",
        "q_priority",
        "ref_count",
        "scheduling_ref_count",
    )

    def __init__(self, block_id: int, memory_index: int, is_primary: bool) -> None:
        self.block_id = block_id
        self.memory_index = memory_index
        self.is_primary = is_primary
        self.ref_count = 0
        self.scheduling_ref_count = 0
        self.key: BlockKey = EMPTY_KEY
        self.is_full = False
        # The chained hash (a BlockHash); typed int so that callers' collections of it stay
        # plain ints.
        self.hash: int = BlockHash(0)
        self.cache_salt: str | None = None
        self.priority = DEFAULT_PRIORITY
        self.duration_s: float | None = None
        # Bumped whenever a pending expiry becomes stale (see LRUEvictionPolicy.refresh).
        self.expiry_token = 0
        self.prev_block: KVCacheBlock | None = None
        self.prev_block_in_seq: KVCacheBlock | None = None
        self.next_blocks: dict[int, KVCacheBlock] = {}
        # The request id of the sequence that last took this block (the seed's
        # mBlockToSequence), None before any has.
        self.owner: int | None = None
        # Free-queue membership: q_level is -1 while the block is not queued.
        self.q_prev: KVCacheBlock | None = None
        self.q_next: KVCacheBlock | None = None
        self.q_level = -1
        self.q_priority = DEFAULT_PRIORITY

    # The seed's accessors, where a name says more than the attribute.
    @property
    def has_refs(self) -> bool:
        return self.ref_count > 0

    @property
    def is_leaf(self) -> bool:
        return not self.next_blocks

    @property
    def is_shared(self) -> bool:
        """Ready for reuse or held by several sequences (KVCacheBlock::isShared)."""
        return self.ref_count > 1 or self.prev_block is not None

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.key.tokens

    @property
    def in_radix_tree(self) -> bool:
        """blockInRadixTree: holds tokens and hangs below a parent."""
        return bool(self.key.tokens) and self.prev_block is not None

    def set_block_key(self, key: BlockKey, is_full: bool) -> None:
        self.key = key
        self.is_full = is_full

    def forget_key(self) -> None:
        """Hold nothing any more (a block dropped from the tree on purpose)."""
        self.key = EMPTY_KEY
        self.is_full = False
        self.hash = BlockHash(0)

    def swap_memory_pool_block_offset(self, other: KVCacheBlock) -> None:
        self.memory_index, other.memory_index = other.memory_index, self.memory_index
        self.is_primary, other.is_primary = other.is_primary, self.is_primary

    def dec_ref_count(self) -> None:
        if self.ref_count <= 0:
            raise RuntimeError(f"can't remove a reference from block {self.block_id}: it has none")
        self.ref_count -= 1

    def __repr__(self) -> str:
        return (
            f"KVCacheBlock(id={self.block_id}, ref={self.ref_count}, "
            f"{'P' if self.is_primary else 'S'}{self.memory_index}, tokens={len(self.key.tokens)})"
        )


# A stored block's fields in the order of cache.events.StoredBlock (and of the wire), as one tuple.
StoredBlockRow = tuple[
    int,
    tuple[int, ...],
    tuple[int, ...] | None,
    int,
    int,
    tuple[tuple[bytes | str, int], ...],
    str | None,
    int | None,
]


def stored_rows(blocks: Sequence[KVCacheBlock]) -> list[StoredBlockRow]:
    """The rows of a Stored event for `blocks` (here, so that it is compiled with the block:
    native attribute reads in a C loop; the sources run the same loop, slower)."""
    rows: list[StoredBlockRow] = []
    for block in blocks:
        key = block.key
        rows.append(
            (
                block.hash,
                key.tokens,
                key.extra_ids,
                0 if block.is_primary else 1,
                block.priority,
                key.extra_keys,
                block.cache_salt,
                key.lora_task_id,
            )
        )
    return rows
