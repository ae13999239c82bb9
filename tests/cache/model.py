"""A reference model of one window of KVCacheManager, for the state machine to compare against.

Written from the seed (WindowBlockManager in kvCacheManager.cpp, LRUEvictionPolicy) and the port's
documented departures (a pinned block leaves its free queue; a block stored under a new key drops
its stale tree entry; every onboard is reported), with plain data: each free queue is a list of
block ids per (level, priority), the reuse tree is dicts of children by chained hash. It covers
what the machine drives: one full-attention window, beam width 1, reuse with partial reuse and
copy on partial reuse, onboarding on, events on without the leaf take-over report.

Every operation returns nothing but records what the manager must have emitted, as event atoms:
``("stored", parent_hash, ((hash, tokens, level, priority), ...))``, ``("removed", hash)``,
``("level", hash, old, new)`` and ``("priority", hash, old, new)``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cache import BlockKey, OutOfBlocksError, RetentionConfig, block_key_hash

PRIMARY, SECONDARY = 0, 1
DEFAULT_PRIORITY = 35
OFFLOAD_MIN_PRIORITY = 30
NUM_PRIORITIES = 101

Atom = tuple[Any, ...]


@dataclass(eq=False)
class Block:
    block_id: int
    primary: bool
    ref_count: int = 0
    priority: int = DEFAULT_PRIORITY
    duration: float | None = None
    tokens: tuple[int, ...] = ()
    full: bool = False
    hash: int = 0
    parent: Block | None = None
    children: dict[int, Block] = field(default_factory=dict)
    queued: tuple[int, int] | None = None  # (level, priority) while free
    expiry: tuple[float, int] | None = None  # (time, order) while a retention runs
    owner: int | None = None  # the last sequence getFreeBlock handed it to

    @property
    def level(self) -> int:
        return PRIMARY if self.primary else SECONDARY

    @property
    def in_tree(self) -> bool:
        return bool(self.tokens) and self.parent is not None


@dataclass
class Sequence_:
    blocks: list[Block]
    num_tokens: int
    decode_priority: int
    decode_duration: float | None
    valid_store: bool = True


@dataclass
class AddResult:
    block_ids: list[int]
    reused: int
    onboards: int
    # hashes a Priority event named although their block kept its priority (the copy for partial
    # reuse of a block in use: the seed reports the matched block, the copy takes its priority)
    unapplied_priority: list[int]
    # a block the walk would have matched next was evicted during the walk (by an onboard)
    cut_short: bool


def chained_keys(tokens: Sequence[int], tpb: int, usable: int) -> list[tuple[int, ...]]:
    """The first `usable` tokens in blocks of `tpb`, the last one partial."""
    return [tuple(tokens[i : min(i + tpb, usable)]) for i in range(0, usable, tpb)]


def chained_hashes(keys: Sequence[tuple[int, ...]]) -> list[int]:
    hashes: list[int] = []
    for key in keys:
        hashes.append(block_key_hash(BlockKey(key), hashes[-1] if hashes else 0))
    return hashes


def per_block_retention(
    retention: RetentionConfig | None, tpb: int, num_tokens: int
) -> list[tuple[int | None, float | None]]:
    """A block takes the range that holds its first token; unset without ranges."""
    num_blocks = -(-num_tokens // tpb)
    ranges = sorted(retention.ranges, key=lambda r: r.start) if retention is not None else []
    out: list[tuple[int | None, float | None]] = []
    for b in range(num_blocks):
        first = b * tpb
        chosen: tuple[int | None, float | None] = (None, None)
        for r in ranges:
            if r.start <= first and (r.end is None or first < r.end):
                chosen = (r.priority, r.duration_s)
                break
        out.append(chosen)
    return out


class Model:
    def __init__(self, num_primary: int, num_secondary: int, tokens_per_block: int) -> None:
        self.tpb = tokens_per_block
        self.blocks = [Block(i, True) for i in range(num_primary)] + [
            Block(num_primary + i, False) for i in range(num_secondary)
        ]
        self.root = Block(-1, True)
        self.queues: dict[tuple[int, int], list[int]] = {}
        self.sequences: dict[int, Sequence_] = {}
        self.pins: dict[int, int] = {}
        self.atoms: list[Atom] = []
        self.counts: Counter[str] = Counter()  # what happened, for tuning the strategies
        self.now = 0.0
        self.expiry_order = 0
        for block in self.blocks:
            self._enqueue(block, front=False)

    # -- the free queues (LRUEvictionPolicy) -------------------------------------------------------

    def _enqueue(self, block: Block, front: bool) -> None:
        assert block.queued is None and block.ref_count == 0
        where = (block.level, block.priority)
        queue = self.queues.setdefault(where, [])
        queue.insert(0, block.block_id) if front else queue.append(block.block_id)
        block.queued = where

    def _dequeue(self, block: Block) -> None:
        assert block.queued is not None
        self.queues[block.queued].remove(block.block_id)
        block.queued = None

    def free_order(self, level: int) -> list[int]:
        """Free block ids of `level` in the order they are handed out: priority, then LRU."""
        return [i for p in range(NUM_PRIORITIES) for i in self.queues.get((level, p), [])]

    def num_free(self, level: int) -> int:
        return len(self.free_order(level))

    def _head(self, level: int) -> Block:
        order = self.free_order(level)
        if not order:
            raise OutOfBlocksError(f"model: no free block at level {level}")
        return self.blocks[order[0]]

    def claim(
        self, block: Block, priority: int | None = None, duration: float | None = None
    ) -> None:
        """Out of its free queue; the priority set when given, the duration always."""
        if block.queued is not None:
            self._dequeue(block)
        block.expiry = None
        if priority is not None:
            block.priority = priority
        block.duration = duration

    def release(self, block: Block, front: bool = False) -> None:
        self._enqueue(block, front)
        if block.duration is not None and block.priority != DEFAULT_PRIORITY:
            self.expiry_order += 1
            block.expiry = (self.now + block.duration, self.expiry_order)

    def refresh(self, now: float) -> list[Block]:
        """Free blocks whose retention expired go back to the default priority, at the tail;
        returns them in the order they moved."""
        self.now = now
        expired = sorted(
            (b for b in self.blocks if b.queued is not None and b.expiry and b.expiry[0] <= now),
            key=lambda b: b.expiry or (0.0, 0),
        )
        for block in expired:
            self._dequeue(block)
            block.priority, block.duration, block.expiry = DEFAULT_PRIORITY, None, None
            self._enqueue(block, front=False)
        return expired

    # -- the tree ---------------------------------------------------------------------------------

    def _detach(self, block: Block) -> None:
        parent = block.parent
        if parent is not None and parent.children.get(block.hash) is block:
            del parent.children[block.hash]
        block.parent = None

    def _drop_subtree(self, block: Block) -> None:
        """freeChildren: the block and everything below it leave the tree, leaves first."""
        for child in list(block.children.values()):
            self._drop_subtree(child)
        if block.in_tree:
            self.atoms.append(("removed", block.hash))
        self._detach(block)

    def tree(self) -> dict[int, tuple[int, int, int | None]]:
        """hash -> (block id, level, parent hash or None at the root)."""
        out: dict[int, tuple[int, int, int | None]] = {}
        stack = list(self.root.children.values())
        while stack:
            block = stack.pop()
            parent = block.parent
            assert parent is not None
            out[block.hash] = (
                block.block_id,
                block.level,
                None if parent is self.root else parent.hash,
            )
            stack.extend(block.children.values())
        return out

    def longest_match(self, tokens: Sequence[int]) -> int:
        """Tokens a request for `tokens` finds in the tree: full blocks by key, then the longest
        common prefix with one child (partial reuse), never the last token."""
        keys = chained_keys(tokens, self.tpb, len(tokens) - 1)
        node = self.root
        matched = 0
        for key in keys:
            child = next((c for c in node.children.values() if c.tokens == key), None)
            if child is not None and child.full:
                matched += len(key)
                node = child
                continue
            best = max((_common(c.tokens, key) for c in node.children.values()), default=0)
            return matched + best
        return matched

    # -- getting blocks ---------------------------------------------------------------------------

    def get_free_block(self, rid: int, priority: int, duration: float | None) -> Block:
        """getFreeBlock: the head of the lowest primary queue; a cached one is offloaded to the
        head of the secondary queues when its priority allows and one is free."""
        victim = self._head(PRIMARY)
        assert victim.queued is not None
        if victim.tokens:
            self.counts[f"cached victims at priority {victim.queued[1]}"] += 1
        block = victim
        if (
            victim.tokens
            and victim.queued[1] >= OFFLOAD_MIN_PRIORITY
            and self.num_free(SECONDARY) > 0
        ):
            target = self._head(SECONDARY)
            victim.primary, target.primary = False, True
            if victim.in_tree:
                self.atoms.append(("level", victim.hash, PRIMARY, SECONDARY))
            self.claim(victim)
            self.release(victim)
            block = target
        if block.parent is not None or block.children:
            self._drop_subtree(block)
        self.claim(block, priority, duration)
        owner = block.owner
        if owner is not None and owner != rid and owner in self.sequences:
            self.sequences[owner].valid_store = False
        block.owner = rid
        return block

    def _onboard(self, rid: int, block: Block) -> None:
        target = self.get_free_block(rid, DEFAULT_PRIORITY, None)
        block.primary, target.primary = True, False
        self.atoms.append(("level", block.hash, SECONDARY, PRIMARY))
        self.release(target)

    def add(self, rid: int, tokens: Sequence[int], retention: RetentionConfig | None) -> AddResult:
        """addSequence with reuse (loadOrAllocateBlocks). Raises OutOfBlocksError half way, as
        the seed does: use it on a copy to ask whether a request fits."""
        tpb = self.tpb
        length = len(tokens)
        num_blocks = -(-length // tpb)
        keys = chained_keys(tokens, tpb, length - 1)
        if length % tpb == 1:
            keys.append(())
        hashes = chained_hashes(keys)
        assert len(keys) == num_blocks
        retentions = per_block_retention(retention, tpb, length)
        decode = (
            (retention.decode_priority, retention.decode_duration_s)
            if retention is not None
            else (DEFAULT_PRIORITY, None)
        )
        sequence = Sequence_([], length, *decode)
        self.sequences[rid] = sequence
        result = AddResult([], 0, 0, [], False)
        node: Block | None = self.root
        for bi in range(num_blocks):
            priority, duration = retentions[bi]
            key = keys[bi]
            match, partial, num_matched = self._find(node, key, hashes[bi])
            if match is not None:
                result.reused += num_matched
                if priority is not None:
                    same = "same" if match.priority == priority else "new"
                    self.counts[f"matches with a retention, {same} priority"] += 1
                if priority is not None and match.priority != priority:
                    self.atoms.append(("priority", match.hash, match.priority, priority))
                if partial:
                    if match.ref_count > 0 or match.children:
                        if priority is not None and match.priority != priority:
                            result.unapplied_priority.append(match.hash)
                        copy = self.get_free_block(rid, match.priority, match.duration)
                        copy.tokens, copy.full, copy.hash = key, len(key) == tpb, hashes[bi]
                        match = copy
                    else:  # a free leaf: taken over privately, silently
                        self._detach(match)
                        self.claim(match, priority, duration)
                    node = None
                else:
                    self.claim(match, priority, duration)
                    node = match
                if not match.primary:
                    self._onboard(rid, match)
                    result.onboards += 1
                    if node is not None and key and len(keys) > bi + 1:
                        nxt = keys[bi + 1]
                        if nxt and hashes[bi + 1] not in node.children:
                            result.cut_short = True
                block = match
            else:
                block = self.get_free_block(
                    rid, DEFAULT_PRIORITY if priority is None else priority, duration
                )
                node = None
                block.tokens, block.full, block.hash = key, len(key) == tpb, hashes[bi]
            block.ref_count += 1
            sequence.blocks.append(block)
        result.block_ids = [b.block_id for b in sequence.blocks]
        return result

    def _find(
        self, node: Block | None, key: tuple[int, ...], key_hash: int
    ) -> tuple[Block | None, bool, int]:
        """findMatchingBlock: (block, partial?, tokens matched)."""
        if node is None or not key or not node.children:
            return None, False, 0
        child = node.children.get(key_hash)
        if child is not None and child.tokens == key:
            return child, not child.full, len(key)
        best, best_matched = None, 0
        for child in node.children.values():
            matched = _common(child.tokens, key)
            if matched > best_matched:
                best, best_matched = child, matched
        return best, best is not None, best_matched

    def add_token(self, rid: int) -> None:
        """A token at a block boundary takes a block with the decode retention (its key is
        whatever the block held before, until a store gives it one)."""
        sequence = self.sequences[rid]
        if sequence.num_tokens % self.tpb == 0 and self.num_free(PRIMARY) == 0:
            raise OutOfBlocksError("model: no free block for the next token")
        sequence.num_tokens += 1
        if (sequence.num_tokens - 1) % self.tpb == 0:
            block = self.get_free_block(rid, sequence.decode_priority, sequence.decode_duration)
            block.ref_count += 1
            sequence.blocks.append(block)

    def rewind(self, rid: int, n: int) -> None:
        sequence = self.sequences[rid]
        for _ in range(n):
            sequence.num_tokens -= 1
            if sequence.num_tokens % self.tpb == 0:
                block = sequence.blocks.pop()
                block.ref_count -= 1
                if block.ref_count == 0:
                    self.release(block, front=True)

    # -- storing ----------------------------------------------------------------------------------

    def _pin(self, block: Block) -> None:
        if block.ref_count == 0 and block.queued is not None:
            self.claim(block, block.priority, block.duration)
        block.ref_count += 1
        self.pins[block.block_id] = self.pins.get(block.block_id, 0) + 1

    def store(
        self,
        keys: Sequence[tuple[int, ...]],
        hashes: Sequence[int],
        blocks: Sequence[Block],
        pin: bool,
        root: Block | None = None,
    ) -> list[int]:
        """storeBlocks: walk the matching prefix, hang the rest below it; one Stored atom."""
        node = self.root if root is None else root
        matching = True
        stored: list[Block] = []
        pinned: list[int] = []
        for key, key_hash, block in zip(keys, hashes, blocks, strict=False):
            if matching:
                child = node.children.get(key_hash)
                if child is not None and key and child.tokens == key:
                    node = child
                    if pin:
                        self._pin(child)
                        pinned.append(child.block_id)
                    continue
                matching = False
            if block.parent is not None or block.children:
                self._drop_subtree(block)
            block.tokens, block.full, block.hash = key, len(key) == self.tpb, key_hash
            block.parent = node
            node.children.setdefault(key_hash, block)
            stored.append(block)
            node = block
            if pin:
                self._pin(block)
                pinned.append(block.block_id)
        if stored:
            first_parent = stored[0].parent
            self.atoms.append(
                (
                    "stored",
                    None
                    if first_parent is self.root or first_parent is None
                    else first_parent.hash,
                    tuple((b.hash, b.tokens, b.level, b.priority) for b in stored),
                )
            )
        return pinned

    def _keys(
        self, tokens: Sequence[int], full_only: bool
    ) -> tuple[list[tuple[int, ...]], list[int]]:
        usable = len(tokens) - 1
        if full_only:
            usable -= usable % self.tpb
        keys = chained_keys(tokens, self.tpb, usable)
        return keys, chained_hashes(keys)

    def store_context_blocks(self, rid: int, tokens: Sequence[int]) -> None:
        keys, hashes = self._keys(tokens, full_only=True)
        self.store(keys, hashes, self.sequences[rid].blocks, pin=False)

    def store_new_block(self, rid: int, tokens: Sequence[int]) -> None:
        usable = len(tokens) - 1
        if not tokens or usable % self.tpb:
            return
        keys, hashes = self._keys(tokens, full_only=True)
        blocks = self.sequences[rid].blocks
        n = len(keys)
        if n >= 2 and len(blocks) >= n:
            prev, last = blocks[n - 2], blocks[n - 1]
            if prev.parent is not None and last.parent is not None:
                return
            if prev.parent is not None and prev.hash == hashes[n - 2]:
                self.store(keys[-1:], hashes[-1:], [last], pin=False, root=prev)
                return
        self.store(keys, hashes, blocks, pin=False)

    def store_for_reuse(self, rid: int, tokens: Sequence[int], pin: bool) -> list[int]:
        keys, hashes = self._keys(tokens, full_only=False)
        return self.store(keys, hashes, self.sequences[rid].blocks, pin)

    def remove(self, rid: int, tokens: Sequence[int] | None, pin: bool) -> list[int]:
        """releaseBlocks: store for reuse (when the request is given and nobody took a block
        from under the sequence), then release last to first."""
        sequence = self.sequences.pop(rid)
        pinned: list[int] = []
        if tokens is not None and sequence.valid_store:
            keys, hashes = self._keys(tokens, full_only=False)
            pinned = self.store(keys, hashes, sequence.blocks, pin)
        for block in reversed(sequence.blocks):
            block.ref_count -= 1
            if block.ref_count == 0:
                self.release(block)
        return pinned

    def valid_store(self, rid: int) -> bool:
        return self.sequences[rid].valid_store

    # -- pins -------------------------------------------------------------------------------------

    def pin_blocks(self, rid: int) -> None:
        for block in self.sequences[rid].blocks:
            self._pin(block)

    def unpin(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            block = self.blocks[block_id]
            self.pins[block_id] -= 1
            block.ref_count -= 1
            if block.ref_count == 0:
                self.release(block)

    def take_atoms(self) -> list[Atom]:
        atoms, self.atoms = self.atoms, []
        return atoms


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
