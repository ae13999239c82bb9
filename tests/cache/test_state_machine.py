"""A Hypothesis state machine over KVCacheManager, checked against a model after every step.

One window, 8 primary + 8 secondary blocks of 4 tokens, events on (a buffer that never drops)
and a clock the machine advances. Prompts are prefixes of five documents, three of which share
their openings, sometimes with a short private tail; a run starts by serving each document once
(a full cache), repeats earlier requests (the next turn of a conversation, often from the host
tier), and keeps at most three sequences or pins live. So most adds find room, and full reuse,
partial reuse (copy and private take-over), eviction, offload, onboard, priorities on both
sides of the offload threshold and their expiry all happen (`measure_strategies` counts them).

Every operation is also applied to `tests.cache.model.Model`, a plain reference model of one
window (free queues as lists per level and priority, the tree as dicts). After every step:

* the model: the free order of each level (which block is handed out next, which is offloaded,
  which secondary block is dropped) equals the manager's; so do each live sequence's block ids,
  every block's priority, the reuse tree (hash -> block id, level, parent) and the step's events,
  atom by atom; the tokens an add reuses equal the model tree's longest match (less only when an
  onboard evicted the rest of the match on the way);
* the pools add up: free + referenced == total, per level; each block's ref count is exactly the
  number of live sequences holding it plus the number of pins on it;
* the reuse tree is well formed: each child is indexed under its own hash, points back to its
  parent and has hash == block_key_hash(key, parent hash);
* the event stream replays: ids are consecutive, stored blocks hash to their tokens under their
  parent, and applying stored / removed / updated to a hash -> (cache level, priority) map gives
  exactly the tree's blocks, levels and priorities; every Updated event changes something (old
  == the replayed value, old != new). The gaps are the seed's: the silent take-over of a free
  leaf for partial reuse (TRTLLM_EVENTS.md section 3, rule 3), a Priority event for a matched
  block that only its copy acts on, and the silent demotion of an expired block; the machine
  checks each where it happens and accounts for it;
* retention: a refresh demotes exactly the free blocks whose duration ran out, to the default
  priority at the tail of its queue, with no event.

A refused call (OutOfBlocksError) must change nothing observable, and add_sequence's dry run
(`KVCacheManager._check_room`) may refuse only what the seed refuses: the model, and a copy of
the manager rebuilt from the machine's log with the dry run switched off, must both run out of
blocks half way.

Usage the machine keeps to, as TensorRT-LLM does: request tokens only grow, except that a
rewind takes back tokens no store has put in the tree yet (speculative tokens); a sequence whose
partial last block went into the tree through store_blocks_for_reuse is only removed after.

Profiles: CI runs 100 derandomized runs of 60 steps (HYPOTHESIS_PROFILE=ci; about 30 s on a
loaded 2-core machine); ``make test-long`` (KVMESH_HYPOTHESIS=long) draws random ones, 1,000 runs
of 80 steps by default (KVMESH_HYPOTHESIS_EXAMPLES=N).
"""

from __future__ import annotations

import copy
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cache import (
    BlockKey,
    CreatedData,
    KVCacheBlock,
    KVCacheEvent,
    KVCacheManager,
    LlmRequest,
    OutOfBlocksError,
    RemovedData,
    RetentionConfig,
    StoredData,
    TokenRangeRetention,
    UpdatedData,
    block_key_hash,
)
from cache.eviction import PRIMARY_LEVEL, SECONDARY_LEVEL
from cache.window import WindowBlockManager
from tests.cache.factories import make_manager
from tests.cache.model import DEFAULT_PRIORITY, Atom, Model
from tests.cache.test_rollback import observe, request_state

TPB = 4
PRIMARY = 8
SECONDARY = 8
EVENT_BUFFER = 100_000
MAX_HOLDERS = 3  # live sequences + pins: most adds find room
WINDOW = 1024  # make_manager's default window: full attention, no detaching

# What the strategies produce, counted over a run (see `measure_strategies` at the bottom).
STATS: Counter[str] = Counter()

# Prompts are prefixes of a few documents that share their openings, sometimes with a short
# private tail: requests repeat each other's prefixes in full and in part, at every depth.
DOCUMENTS = (
    (1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3),
    (1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 1, 1),
    (7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7),
    (2, 3, 1, 9, 2, 3, 1, 9, 7, 7, 1, 2),
    (9, 9, 1, 1, 2, 2, 3, 3, 7, 7, 9, 9),
)
ALPHABET = (1, 2, 3, 7, 9)


@st.composite
def prompts(draw: st.DrawFn) -> list[int]:
    document = draw(st.sampled_from(DOCUMENTS))
    length = draw(st.integers(1, len(document)))
    return [*document[:length], *draw(st.lists(st.sampled_from(ALPHABET), max_size=3))]


SAME = object()  # add_again: the retention of the request it repeats
durations = st.sampled_from([None, 0.5, 2.0, 10.0])
# Both sides of the offload threshold (30) and the default (35), often.
priorities = st.one_of(
    st.sampled_from([30, 35]), st.sampled_from([0, 29, 31, 36, 100]), st.integers(0, 100)
)


@st.composite
def retentions(draw: st.DrawFn) -> RetentionConfig:
    """One range over the whole prompt, or up to two sorted, non-overlapping token ranges; with
    priorities 0..100 (below 30 a block is dropped rather than offloaded) and durations."""
    if draw(st.booleans()):
        ranges = [TokenRangeRetention(0, None, draw(priorities), draw(durations))]
    else:
        n = draw(st.integers(1, 2))
        cuts = sorted(draw(st.lists(st.integers(0, 20), min_size=2 * n, max_size=2 * n)))
        ranges = []
        for i in range(n):
            open_ended = i == n - 1 and draw(st.booleans())
            ranges.append(
                TokenRangeRetention(
                    cuts[2 * i],
                    None if open_ended else cuts[2 * i + 1],
                    draw(priorities),
                    draw(durations),
                )
            )
    return RetentionConfig(
        ranges=ranges,
        decode_priority=draw(priorities),
        decode_duration_s=draw(durations),
    )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# -- what the machine reads of the manager beyond its public API -----------------------------------


def free_order(mgr: KVCacheManager, level: int) -> list[int]:
    """Ids of the free blocks of `level` in the order the manager hands them out."""
    return mgr.windows[WINDOW].policy.free_order(level)


def atoms(events: list[KVCacheEvent]) -> list[Atom]:
    """Events as the model's atoms (a removal joined to the one before it is split again)."""
    out: list[Atom] = []
    for event in events:
        data = event.data
        if isinstance(data, StoredData):
            blocks = tuple(
                (b.block_hash, tuple(b.tokens), b.cache_level, b.priority) for b in data.blocks
            )
            out.append(("stored", data.parent_hash, blocks))
        elif isinstance(data, RemovedData):
            out.extend(("removed", h) for h in data.block_hashes)
        elif isinstance(data, UpdatedData):
            if data.cache_level is not None:
                diff = data.cache_level
                out.append(("level", data.block_hash, diff.old_value, diff.new_value))
            if data.priority is not None:
                diff = data.priority
                out.append(("priority", data.block_hash, diff.old_value, diff.new_value))
    return out


# -- a log of what succeeded, to rebuild the same manager ------------------------------------------

Op = tuple[Any, ...]


def apply_op(mgr: KVCacheManager, requests: dict[int, LlmRequest], op: Op) -> None:
    kind, rid = op[0], op[1]
    if kind == "add":
        requests[rid] = LlmRequest(rid, list(op[2]), retention=op[3])
        mgr.add_sequence(requests[rid])
    elif kind == "token":
        requests[rid].add_new_token(op[2])
        mgr.add_token(rid)
    elif kind == "rewind":
        mgr.rewind_kv_cache(rid, op[2])
        del requests[rid].tokens[-op[2] :]
    elif kind == "store_context":
        mgr.store_context_blocks(requests[rid])
    elif kind == "store_new":
        mgr.store_new_block(requests[rid])
    elif kind == "store_for_reuse":
        mgr.store_blocks_for_reuse(rid, requests[rid], pin_blocks=op[2])
    elif kind == "remove":
        mgr.remove_sequence(rid, requests.pop(rid) if op[2] else None, pin_blocks=op[3])
        requests.pop(rid, None)
    elif kind == "pin":
        mgr.pin_blocks(rid)
    elif kind == "unpin":
        mgr.unpin_blocks_by_id(op[2])
    elif kind == "refresh":
        mgr.refresh_blocks()
    else:  # pragma: no cover
        raise AssertionError(f"unknown op {kind}")


@dataclass
class Live:
    request: LlmRequest
    # Tokens that must not be rewound: the prompt, and everything a store has hashed and put in
    # the tree (a rewind only takes back speculative tokens, as in TensorRT-LLM).
    sealed: int
    # Its partial last block went into the tree (store_blocks_for_reuse): it may only be removed.
    finished: bool = False


class Clock:
    """The machine's clock; a plain object, so that a manager holding it can be rebuilt."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self, num_primary: int = PRIMARY, num_secondary: int = SECONDARY) -> None:
        super().__init__()
        self.pool = (num_primary, num_secondary)
        self.clock = Clock()
        self.mgr = make_manager(
            *self.pool, tokens_per_block=TPB, events=EVENT_BUFFER, clock=self.clock
        )
        self.wm: WindowBlockManager = self.mgr.windows[WINDOW]
        self.model = Model(*self.pool, TPB)
        self.live: dict[int, Live] = {}
        # the tokens and retention of removed sequences
        self.history: list[tuple[list[int], RetentionConfig | None]] = []
        self.pins: list[list[int]] = []
        self.next_rid = 0
        self.log: list[tuple[float, Op]] = []
        # the event replay: hash -> cache level and priority, and hashes a silent take-over
        # left behind
        self.replay: dict[int, int] = {}
        self.replay_priority: dict[int, int] = {}
        self.ghosts: set[int] = set()
        self.next_event_id = 0
        STATS["runs"] += 1
        self.drain()  # the Created event

    @property
    def now(self) -> float:
        return self.clock.now

    # -- helpers -------------------------------------------------------------------------------

    def record(self, op: Op) -> None:
        self.log.append((self.now, op))

    def pick(self, index: int, *, growing: bool = False) -> int:
        rids = sorted(r for r, s in self.live.items() if not (growing and s.finished))
        return rids[index % len(rids)]

    def has_growing(self) -> bool:
        return any(not s.finished for s in self.live.values())

    def snapshot(self) -> dict[str, Any]:
        return observe(self.mgr, self.live)

    def tree_map(self) -> dict[int, int]:
        return {b.hash: (0 if b.is_primary else 1) for b in self.mgr.tree_blocks()}

    def drain(self) -> list[KVCacheEvent]:
        """Take this step's events, compare them with the model's and apply them to the replay."""
        self.mgr.flush_iteration_events()
        events = self.mgr.get_latest_events()
        for event in events:
            assert event.event_id == self.next_event_id
            self.next_event_id += 1
            assert event.window_size == WINDOW
            self.apply_event(event.data)
        expected = self.model.take_atoms()
        got = atoms(events)
        assert got == expected, f"events {got} != model {expected}"
        if any(a[0] == "level" and a[3] == 0 for a in got):
            STATS["steps with an onboard"] += 1
        if any(a[0] == "level" and a[3] == 1 for a in got):
            STATS["steps with an offload"] += 1
        return events

    def apply_event(self, data: Any) -> None:
        replay = self.replay
        if isinstance(data, CreatedData):
            assert self.next_event_id == 1
            assert data.num_blocks_per_cache_level == list(self.pool)
        elif isinstance(data, StoredData):
            parent = data.parent_hash
            assert data.blocks
            assert parent is None or (parent in replay and parent not in self.ghosts)
            parent_hash = 0 if parent is None else parent
            for block in data.blocks:
                assert 1 <= len(block.tokens) <= TPB
                assert block.block_hash == block_key_hash(BlockKey(block.tokens), parent_hash)
                if block.block_hash in replay:  # only a taken-over block's hash comes back
                    assert block.block_hash in self.ghosts
                    self.ghosts.discard(block.block_hash)
                replay[block.block_hash] = block.cache_level
                self.replay_priority[block.block_hash] = block.priority
                parent_hash = block.block_hash
        elif isinstance(data, RemovedData):
            for block_hash in data.block_hashes:
                assert block_hash in replay and block_hash not in self.ghosts
                del replay[block_hash]
                del self.replay_priority[block_hash]
        elif isinstance(data, UpdatedData):
            assert data.block_hash in replay
            assert (data.cache_level is None) != (data.priority is None)
            diff = data.cache_level or data.priority
            assert diff is not None and diff.old_value != diff.new_value, f"no change: {data}"
            if data.cache_level is not None:
                assert replay[data.block_hash] == diff.old_value
                replay[data.block_hash] = diff.new_value
            else:
                assert self.replay_priority[data.block_hash] == diff.old_value, data
                self.replay_priority[data.block_hash] = diff.new_value
        else:  # pragma: no cover
            raise AssertionError(f"unexpected event {data}")

    def refused_without_trace(self, call: Callable[[], object]) -> bool:
        """Run `call`; if it raises OutOfBlocksError, check it changed nothing."""
        assert self.drain() == []
        before = self.snapshot()
        try:
            call()
        except OutOfBlocksError:
            assert self.snapshot() == before
            assert self.drain() == []
            return True
        return False

    def rebuild(self) -> KVCacheManager:
        """A second manager, fed the machine's log: the same state, reached the same way."""
        clock = Clock()
        twin = make_manager(*self.pool, tokens_per_block=TPB, events=EVENT_BUFFER, clock=clock)
        requests: dict[int, LlmRequest] = {}
        for at, op in self.log:
            clock.now = at
            apply_op(twin, requests, op)
        clock.now = self.now
        assert observe(twin, self.live) == self.snapshot()
        return twin

    def check_refusal_is_real(self, request: LlmRequest) -> None:
        """The dry run refused `request`: the seed must run out of blocks half way too. Ask the
        model, and a copy of the manager with the dry run switched off."""
        model = copy.deepcopy(self.model)
        try:
            model.add(request.request_id, request.tokens, request.retention)
            model_admits = True
        except OutOfBlocksError:
            model_admits = False
        twin = self.rebuild()
        assert hasattr(twin, "_check_room"), "the dry run moved: update the machine"
        twin._check_room = lambda *args, **kwargs: None  # type: ignore[method-assign]
        request_copy = LlmRequest(
            request.request_id, list(request.tokens), retention=request.retention
        )
        try:
            twin.add_sequence(request_copy)
            twin_admits = True
        except OutOfBlocksError:
            twin_admits = False
        assert not (model_admits or twin_admits), (
            f"the dry run refused {request} (tokens {request.tokens}, {request.retention}), "
            f"which the model {'admits' if model_admits else 'refuses'} and the manager "
            f"{'admits' if twin_admits else 'refuses'} without its dry run"
        )

    def check_pinned_chain(self, pinned: list[int], request: LlmRequest) -> None:
        """Pinned ids of a store: the tree blocks of the request's keys, root first."""
        keys = request.block_keys(TPB, request.num_tokens - 1, True)
        hashes = request.block_hashes(TPB, request.num_tokens - 1, True)
        assert len(pinned) == len(keys)
        tree: dict[int, KVCacheBlock] = {b.block_id: b for b in self.mgr.tree_blocks()}
        parent_id = -1  # the root's
        for block_id, key, key_hash in zip(pinned, keys, hashes, strict=True):
            block = tree[block_id]
            parent = block.prev_block
            assert parent is not None and max(parent.block_id, -1) == parent_id
            assert block.key == key and block.hash == key_hash
            parent_id = block_id

    def mark_sealed(self, rid: int) -> None:
        live = self.live[rid]
        live.sealed = live.request.num_tokens

    # -- rules ---------------------------------------------------------------------------------

    def has_room_to_add(self) -> bool:
        return len(self.live) + len(self.pins) < MAX_HOLDERS

    @initialize(
        order=st.permutations(range(len(DOCUMENTS))),
        lengths=st.lists(st.integers(5, 13), min_size=len(DOCUMENTS), max_size=len(DOCUMENTS)),
    )
    def warm_up(self, order: list[int], lengths: list[int]) -> None:
        """Serve each document once, so that the run starts with a full cache: its first
        requests evict, offload and onboard at once."""
        for i, length in zip(order, lengths, strict=True):
            self.add(list((DOCUMENTS[i] + DOCUMENTS[i])[:length]), None)
            self.remove(len(self.live) - 1, True, False)
        self.matches_the_model()
        self.everything_adds_up()

    # Adding and removing get two rules each, so that they make up a good share of the steps.
    @precondition(lambda self: self.has_room_to_add())
    @rule(tokens=prompts(), retention=st.none() | retentions())
    def add_sequence(self, tokens: list[int], retention: RetentionConfig | None = None) -> None:
        self.add(tokens, retention)

    @precondition(lambda self: self.has_room_to_add())
    @rule(tokens=prompts(), retention=retentions())
    def add_sequence_with_retention(self, tokens: list[int], retention: RetentionConfig) -> None:
        self.add(tokens, retention)

    @precondition(lambda self: self.has_room_to_add() and bool(self.history))
    @rule(
        index=st.integers(0, 15),
        more=st.lists(st.sampled_from(ALPHABET), max_size=2),
        retention=st.none() | st.just(SAME) | retentions(),
    )
    def add_again(self, index: int, more: list[int], retention: Any) -> None:
        """A request for what an earlier one held (the next turn of a conversation): its
        blocks are cached, often on the host tier by now, and are onboarded. With the same
        retention, the blocks it matches keep their priority (and no event says otherwise)."""
        tokens, before = self.history[index % len(self.history)]
        self.add([*tokens, *more], before if retention is SAME else retention)

    @precondition(
        lambda self: (
            not self.has_room_to_add() and len(self.live) <= MAX_HOLDERS and bool(self.history)
        )
    )
    @rule(index=st.integers(0, 15), retention=st.none() | st.just(SAME))
    def add_again_under_pressure(self, index: int, retention: Any) -> None:
        """The same, when the pool is nearly full: the dry run decides, often with onboards."""
        tokens, before = self.history[index % len(self.history)]
        self.add(list(tokens), before if retention is SAME else retention)

    def add(self, tokens: list[int], retention: RetentionConfig | None) -> None:
        rid = self.next_rid
        self.next_rid += 1
        request = LlmRequest(rid, list(tokens), retention=retention)
        tree_before = {b.hash: b.block_id for b in self.mgr.tree_blocks()}
        longest = self.model.longest_match(tokens)
        stats_before = self.mgr.get_kv_cache_stats()
        state_before = request_state(request)
        STATS["adds"] += 1
        refused = self.refused_without_trace(lambda: self.mgr.add_sequence(request))
        if refused:
            assert request_state(request) == state_before
            self.check_refusal_is_real(request)
            return
        STATS["adds admitted"] += 1
        expected = self.model.add(rid, tokens, retention)
        STATS["adds that onboard"] += expected.onboards > 0
        STATS["adds that reuse"] += expected.reused > 0
        self.record(("add", rid, tuple(tokens), retention))
        self.live[rid] = Live(request, request.num_tokens)
        reused = request.prepopulated_prompt_len
        assert reused == expected.reused
        assert reused == longest or (expected.onboards and reused < longest)
        assert 0 <= reused <= len(tokens) - 1
        assert request.context_current_position == reused
        block_ids = self.mgr.get_cache_block_ids(rid)[0]
        assert block_ids == expected.block_ids
        assert len(block_ids) == _ceil_div(len(tokens), TPB)
        stats = self.mgr.get_kv_cache_stats()
        assert (
            request.alloc_total_blocks,
            request.alloc_new_blocks,
            request.reused_blocks,
            request.missed_blocks,
        ) == (
            stats.alloc_total_blocks - stats_before.alloc_total_blocks,
            stats.alloc_new_blocks - stats_before.alloc_new_blocks,
            stats.reused_blocks - stats_before.reused_blocks,
            stats.missed_blocks - stats_before.missed_blocks,
        )
        assert request.reused_blocks + request.missed_blocks == len(block_ids)
        # A tree block that left without a Removed event was a free leaf this request matched
        # partially and took over (TRTLLM_EVENTS.md section 3, rule 3): it is the request's own
        # block at the position where its reuse ends.
        removed = {
            h for e in self.drain() if isinstance(e.data, RemovedData) for h in e.data.block_hashes
        }
        silent = set(tree_before) - set(self.tree_map()) - removed
        assert len(silent) <= 1
        for block_hash in silent:
            block_id = tree_before[block_hash]
            position = block_ids.index(block_id)
            assert position * TPB < reused <= (position + 1) * TPB
            assert self.wm.blocks[block_id].ref_count >= 1
            self.ghosts.add(block_hash)
        # A Priority event for a block in use that the request matched partially: the copy takes
        # the block's priority, the block keeps it (the seed reports the matched block anyway).
        tree: dict[int, int] = {b.hash: b.block_id for b in self.mgr.tree_blocks()}
        for copied_hash in expected.unapplied_priority:
            if copied_hash in tree:
                priority = self.mgr.get_priority_by_block_id(tree[copied_hash])
                self.replay_priority[copied_hash] = priority

    @precondition(lambda self: self.has_growing())
    @rule(index=st.integers(0, 15), token=st.sampled_from(ALPHABET))
    def add_token(self, index: int, token: int) -> None:
        rid = self.pick(index, growing=True)
        request = self.live[rid].request
        num_tokens = self.mgr.get_num_tokens(rid)
        request.add_new_token(token)
        if self.refused_without_trace(lambda: self.mgr.add_token(rid)):
            request.tokens.pop()
            assert num_tokens % TPB == 0 and self.mgr.get_num_free_blocks() == 0
            return
        self.model.add_token(rid)
        self.record(("token", rid, token))
        assert self.mgr.get_num_tokens(rid) == num_tokens + 1

    @precondition(lambda self: any(s.request.num_tokens > s.sealed for s in self.live.values()))
    @rule(index=st.integers(0, 15), data=st.data())
    def rewind(self, index: int, data: st.DataObject) -> None:
        rids = sorted(r for r, s in self.live.items() if s.request.num_tokens > s.sealed)
        rid = rids[index % len(rids)]
        live = self.live[rid]
        n = data.draw(st.integers(1, live.request.num_tokens - live.sealed), label="rewind")
        num_tokens = live.request.num_tokens
        block_ids = self.mgr.get_cache_block_ids(rid)[0]
        kept = _ceil_div(num_tokens - n, TPB)
        self.mgr.rewind_kv_cache(rid, n)
        self.model.rewind(rid, n)
        del live.request.tokens[-n:]
        self.record(("rewind", rid, n))
        assert self.mgr.get_num_tokens(rid) == num_tokens - n
        assert self.mgr.get_cache_block_ids(rid)[0] == block_ids[:kept]

    @precondition(lambda self: self.has_growing())
    @rule(index=st.integers(0, 15))
    def store_context_blocks(self, index: int) -> None:
        rid = self.pick(index, growing=True)
        request = self.live[rid].request
        self.mgr.store_context_blocks(request)
        self.model.store_context_blocks(rid, request.tokens)
        self.record(("store_context", rid))
        self.mark_sealed(rid)

    @precondition(lambda self: self.has_growing())
    @rule(index=st.integers(0, 15))
    def store_new_block(self, index: int) -> None:
        rid = self.pick(index, growing=True)
        request = self.live[rid].request
        self.mgr.store_new_block(request)
        self.model.store_new_block(rid, request.tokens)
        self.record(("store_new", rid))
        self.mark_sealed(rid)

    @precondition(lambda self: self.has_growing())
    @rule(index=st.integers(0, 15), pin=st.booleans())
    def store_blocks_for_reuse(self, index: int, pin: bool) -> None:
        rid = self.pick(index, growing=True)
        live = self.live[rid]
        pinned = self.mgr.store_blocks_for_reuse(rid, live.request, pin_blocks=pin)
        assert pinned == self.model.store_for_reuse(rid, live.request.tokens, pin)
        self.record(("store_for_reuse", rid, pin))
        self.mark_sealed(rid)
        if (live.request.num_tokens - 1) % TPB:
            live.finished = True
        if pin:
            self.check_pinned_chain(pinned, live.request)
            self.pins.append(pinned)
        else:
            assert pinned == []

    @precondition(lambda self: bool(self.live))
    @rule(index=st.integers(0, 15), pin=st.booleans())
    def remove_sequence(self, index: int, pin: bool) -> None:
        """Release with the request: its blocks are stored for reuse (and maybe pinned)."""
        self.remove(index, True, pin)

    @precondition(lambda self: bool(self.live))
    @rule(index=st.integers(0, 15), pin=st.booleans())
    def remove_sequence_without_request(self, index: int, pin: bool) -> None:
        self.remove(index, False, pin)

    def remove(self, index: int, with_request: bool, pin: bool) -> None:
        rid = self.pick(index)
        request = self.live[rid].request
        stores = with_request and self.model.valid_store(rid)
        pinned = self.mgr.remove_sequence(rid, request if with_request else None, pin_blocks=pin)
        assert pinned == self.model.remove(rid, request.tokens if with_request else None, pin)
        self.record(("remove", rid, with_request, pin))
        del self.live[rid]
        self.history.append((list(request.tokens), request.retention))
        if stores and pin:
            self.check_pinned_chain(pinned, request)
            self.pins.append(pinned)
        else:
            assert pinned == []
        events = self.drain()
        if not stores:
            assert not [e for e in events if isinstance(e.data, StoredData)]
        else:
            # the request's whole chain is in the tree now
            hashes = request.block_hashes(TPB, request.num_tokens - 1, True)
            assert set(hashes) <= set(self.tree_map())

    @precondition(lambda self: bool(self.live))
    @rule(index=st.integers(0, 15))
    def pin_blocks(self, index: int) -> None:
        rid = self.pick(index)
        block_ids = self.mgr.get_cache_block_ids(rid)[0]
        self.mgr.pin_blocks(rid)
        self.model.pin_blocks(rid)
        self.record(("pin", rid))
        self.pins.append(block_ids)

    @precondition(lambda self: bool(self.pins))
    @rule(index=st.integers(0, 15))
    def unpin_blocks_by_id(self, index: int) -> None:
        block_ids = self.pins.pop(index % len(self.pins))
        self.mgr.unpin_blocks_by_id(block_ids)
        self.model.unpin(block_ids)
        self.record(("unpin", 0, tuple(block_ids)))

    @precondition(lambda self: bool(self.pins))
    @rule(index=st.integers(0, 15), keep=st.lists(st.booleans(), min_size=1, max_size=4))
    def unpin_some_blocks(self, index: int, keep: list[bool]) -> None:
        """Undo a pin on some of its blocks only (an ancestor free, a descendant still held)."""
        block_ids = self.pins.pop(index % len(self.pins))
        kept = [b for i, b in enumerate(block_ids) if keep[i % len(keep)]]
        dropped = [b for i, b in enumerate(block_ids) if not keep[i % len(keep)]]
        self.mgr.unpin_blocks_by_id(dropped)
        self.model.unpin(dropped)
        self.record(("unpin", 0, tuple(dropped)))
        if kept:
            self.pins.append(kept)

    # Steps that are the durations themselves: a retention often ends exactly at a refresh.
    @rule(dt=st.sampled_from([0.0, 0.5, 2.0, 10.0, 30.0]))
    def advance_clock_and_refresh(self, dt: float) -> None:
        self.clock.now += dt
        assert self.drain() == []
        before = self.snapshot()
        self.mgr.refresh_blocks()
        expired = self.model.refresh(self.now)
        self.record(("refresh", 0))
        after = self.snapshot()
        # expiry only demotes free blocks to the default priority: no event, nothing moves level
        assert self.drain() == []
        assert after[f"free/{WINDOW}"] == before[f"free/{WINDOW}"]
        assert after[f"tree/{WINDOW}"] == before[f"tree/{WINDOW}"]
        assert after["sequences"] == before["sequences"]
        changed = set()
        for old, new in zip(before[f"blocks/{WINDOW}"], after[f"blocks/{WINDOW}"], strict=True):
            assert new[:4] == old[:4] and new[6:] == old[6:]
            if new[4:6] != old[4:6]:  # (priority, duration): a free block's retention expired
                assert old[1] == 0 and old[5] is not None and new[4:6] == (DEFAULT_PRIORITY, None)
                changed.add(new[0])
        # exactly the blocks whose retention ran out are demoted (one already at the default
        # priority is only moved to the tail of its queue)
        assert changed <= {b.block_id for b in expired}
        tree: dict[int, int] = {b.block_id: b.hash for b in self.mgr.tree_blocks()}
        for block in expired:
            assert self.mgr.get_priority_by_block_id(block.block_id) == DEFAULT_PRIORITY
            if block.block_id in tree:  # the seed demotes silently: the replay learns it here
                self.replay_priority[tree[block.block_id]] = DEFAULT_PRIORITY
        STATS["refreshes"] += 1
        if expired:
            STATS["refreshes that demote"] += 1

    def teardown(self) -> None:
        STATS.update(self.model.counts)

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def matches_the_model(self) -> None:
        self.drain()
        mgr, model = self.mgr, self.model
        STATS["steps"] += 1
        # the free queues: which block is handed out, offloaded to or dropped from the host next
        assert free_order(mgr, PRIMARY_LEVEL) == model.free_order(0)
        assert free_order(mgr, SECONDARY_LEVEL) == model.free_order(1)
        for rid in self.live:
            assert mgr.get_cache_block_ids(rid)[0] == [
                b.block_id for b in model.sequences[rid].blocks
            ]
        assert set(model.sequences) == set(self.live)
        assert [mgr.get_priority_by_block_id(b.block_id) for b in model.blocks] == [
            b.priority for b in model.blocks
        ]
        tree = {
            b.hash: (
                b.block_id,
                0 if b.is_primary else 1,
                None if b.prev_block is None or b.prev_block.block_id < 0 else b.prev_block.hash,
            )
            for b in mgr.tree_blocks()
        }
        assert tree == model.tree()
        assert [b.ref_count for b in self.wm.blocks] == [b.ref_count for b in model.blocks]

    @invariant()
    def everything_adds_up(self) -> None:
        self.drain()
        mgr, wm = self.mgr, self.wm
        blocks = wm.blocks
        assert all(b.ref_count >= 0 for b in blocks)
        primary = [b for b in blocks if b.is_primary]
        secondary = [b for b in blocks if not b.is_primary]
        num_primary, num_secondary = self.pool
        assert (len(primary), len(secondary)) == self.pool
        capacity = mgr.window_capacity(WINDOW)
        assert capacity.free_primary + sum(b.ref_count > 0 for b in primary) == num_primary
        assert capacity.free_secondary + sum(b.ref_count > 0 for b in secondary) == num_secondary
        assert mgr.verify_queue_integrity()
        # ref counts: one per live sequence holding the block, one per pin
        expected: Counter[int] = Counter()
        for rid, live in self.live.items():
            block_ids = mgr.get_cache_block_ids(rid)[0]
            assert mgr.get_num_tokens(rid) == live.request.num_tokens
            assert len(block_ids) == _ceil_div(live.request.num_tokens, TPB)
            assert all(blocks[i].is_primary for i in block_ids)
            expected.update(block_ids)
        for pinned in self.pins:
            expected.update(pinned)
        assert {b.block_id: b.ref_count for b in blocks} == {
            b.block_id: expected[b.block_id] for b in blocks
        }
        # the reuse tree: each block indexed under its hash below its parent
        tree_blocks = mgr.tree_blocks()
        by_id = {b.block_id: b for b in tree_blocks}
        assert len(by_id) == len(tree_blocks)
        for block in tree_blocks:
            parent = block.prev_block
            assert parent is not None
            parent_hash = 0 if parent.block_id < 0 else parent.hash
            assert parent.block_id < 0 or by_id.get(parent.block_id) is parent
            assert parent.next_blocks.get(block.hash) is block
            assert block.hash == block_key_hash(block.key, parent_hash)
            assert 1 <= len(block.key.tokens) <= TPB
        # the event replay: levels and priorities
        tree = self.tree_map()
        assert self.ghosts <= set(self.replay) and not self.ghosts & set(tree)
        assert {h: level for h, level in self.replay.items() if h not in self.ghosts} == tree
        assert {h: p for h, p in self.replay_priority.items() if h not in self.ghosts} == {
            b.hash: mgr.get_priority_by_block_id(b.block_id) for b in tree_blocks
        }


# CI (HYPOTHESIS_PROFILE=ci, tests/conftest.py): derandomized, so a failure reproduces locally;
# bounded, so the file runs in about half a minute on a loaded 2-core machine. The long profile
# (`make test-long`, KVMESH_HYPOTHESIS=long) draws random runs, more and longer ones.
# No explain phase: it traces every line, and a failing machine then takes minutes to report.
PHASES = tuple(phase for phase in Phase if phase is not Phase.explain)
if os.environ.get("KVMESH_HYPOTHESIS") == "long":
    KVCacheMachine.TestCase.settings = settings(deadline=None, phases=PHASES)  # the profile's
else:
    KVCacheMachine.TestCase.settings = settings(
        max_examples=100, stateful_step_count=60, deadline=None, phases=PHASES
    )
TestKVCacheStateMachine = KVCacheMachine.TestCase


def measure_strategies() -> dict[str, float]:
    """Run the machine as CI does and say what its strategies produced: the share of adds
    admitted, of admitted adds that onboard, of steps that onboard, and the raw counts.

    ``python -c "from tests.cache.test_state_machine import measure_strategies as m; print(m())"``
    """
    STATS.clear()
    run_state_machine_as_test(
        KVCacheMachine, settings=settings(KVCacheMachine.TestCase.settings, derandomize=True)
    )
    counts = dict(STATS)
    return {
        "share of adds admitted": STATS["adds admitted"] / STATS["adds"],
        "share of admitted adds that onboard": STATS["adds that onboard"] / STATS["adds admitted"],
        "share of steps that onboard": STATS["steps with an onboard"] / STATS["steps"],
        **counts,
    }


# -- cases the machine found or must accept, replayed step by step ----------------------------


def run_step(machine: KVCacheMachine, name: str, **arguments: Any) -> None:
    """One rule, then the invariants, as Hypothesis runs them."""
    getattr(machine, name)(**arguments)
    machine.matches_the_model()
    machine.everything_adds_up()


def new_machine(num_primary: int = 12, num_secondary: int = 4) -> KVCacheMachine:
    machine = KVCacheMachine(num_primary, num_secondary)
    machine.matches_the_model()
    machine.everything_adds_up()
    return machine


def test_a_store_that_pins_a_cached_block_takes_it_out_of_the_free_queue() -> None:
    """Found by the machine. A pinned block must not stay in the free queue, where it is counted
    free and can be handed out (TensorRT-LLM's StoreBlocksForReuseWithPinDoesNotCreateGhostFree
    Blocks; the seed has the bug)."""
    machine = new_machine()
    run_step(machine, "add_sequence", tokens=[1, 2, 3, 4, 5, 6, 7, 8])
    run_step(machine, "remove_sequence", index=0, pin=True)  # stores, pins [1-4], [5, 6, 7]
    run_step(machine, "add_sequence", tokens=[1, 2, 3, 4, 5, 6, 7, 8])  # copies [5, 6, 7]
    run_step(machine, "unpin_blocks_by_id", index=0)  # [5, 6, 7] is cached and free again
    run_step(machine, "store_blocks_for_reuse", index=0, pin=True)  # pins the cached [5, 6, 7]
    # the same through remove_sequence: request 3's blocks duplicate request 2's, stored first
    run_step(machine, "add_sequence", tokens=[7, 7, 7, 7, 7, 7])
    run_step(machine, "add_sequence", tokens=[7, 7, 7, 7, 7, 7])
    run_step(machine, "remove_sequence", index=1, pin=False)  # request 2 stores [7 x 4], [7]
    run_step(machine, "remove_sequence", index=1, pin=True)  # request 3 pins those blocks
    assert sorted(machine.live) == [1]
    assert [len(pinned) for pinned in machine.pins] == [2, 2]
    # request 1 holds [1-4] (also pinned) and its copy of [5, 6, 7]; the cached [5, 6, 7] and
    # request 2's two blocks are pinned
    assert machine.mgr.get_num_free_blocks() == 12 - 5
    machine.teardown()


def test_the_silent_take_over_of_a_free_leaf_is_the_only_replay_gap() -> None:
    """Partial reuse of an unreferenced leaf detaches it without a Removed event, as the seed
    does (TRTLLM_EVENTS.md section 3, rule 3): a consumer of the events keeps its hash."""
    machine = new_machine()
    run_step(machine, "add_sequence", tokens=[1, 2, 3, 4, 5, 6, 7])
    run_step(machine, "remove_sequence", index=0, pin=False)  # stores [1-4] and the leaf [5, 6]
    leaf = next(b for b in machine.mgr.tree_blocks() if b.key.tokens == (5, 6))
    leaf_hash = leaf.hash
    run_step(machine, "add_sequence", tokens=[1, 2, 3, 4, 5, 9, 9])  # [5, 9] takes the leaf over
    assert machine.ghosts == {leaf_hash}
    assert machine.mgr.get_cache_block_ids(1)[0][1] == leaf.block_id
    assert leaf_hash not in machine.tree_map() and leaf_hash in machine.replay
    run_step(machine, "remove_sequence", index=0, pin=False)  # stores [5, 9] in the leaf's block
    assert machine.ghosts == {leaf_hash}
    assert leaf.key.tokens == (5, 9) and leaf.hash in machine.tree_map()
    stored_hash = leaf.hash
    # [5, 6] takes the [5, 9] leaf over in turn, and stores [5, 6] in it again: that hash is
    # back in the tree, the other one is left behind
    run_step(machine, "add_sequence", tokens=[1, 2, 3, 4, 5, 6, 7])
    run_step(machine, "remove_sequence", index=0, pin=False)
    assert machine.ghosts == {stored_hash}
    assert machine.tree_map() == {machine.wm.blocks[0].hash: 0, leaf_hash: 0}
    machine.teardown()


def test_the_dry_run_admits_an_onboard_before_a_pinned_block() -> None:
    """Issue 14's fidelity defect: the dry run counted the pinned b1 as needing a free block once
    b0 had to be onboarded. The seed needs 2 (one to onboard b0, one for the tail) and admits."""
    machine = new_machine(6, 2)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    run_step(machine, "add_sequence", tokens=a)
    run_step(machine, "remove_sequence", index=0, pin=True)  # stores and pins b0, b1
    b0, b1 = machine.pins.pop()
    machine.mgr.unpin_blocks_by_id([b0])  # b1 stays pinned
    machine.model.unpin([b0])
    machine.record(("unpin", 0, (b0,)))
    machine.pins.append([b1])
    low = RetentionConfig([TokenRangeRetention(0, None, 0)])
    run_step(machine, "add_sequence_with_retention", tokens=list(range(20, 40)), retention=low)
    assert machine.replay[machine.mgr.tree_blocks()[0].hash] == 1  # b0 is on the host tier
    run_step(machine, "remove_sequence_without_request", index=0, pin=False)
    run_step(machine, "add_sequence", tokens=list(range(40, 52)))
    assert machine.mgr.get_num_free_blocks() == 2
    run_step(machine, "add_sequence", tokens=a)
    assert machine.live[3].request.prepopulated_prompt_len == 8
    machine.teardown()
