"""A Hypothesis state machine over KVCacheManager, with invariants checked after every step.

One window, 12 primary + 4 secondary blocks of 4 tokens, events on (a buffer that never drops)
and a clock the machine advances. Prompts are prefixes of three documents that share their
openings, sometimes with a short private tail, so full reuse, partial reuse (copy and private
take-over), eviction, offload, onboard, priorities and their expiry all happen. After every step:

* the pools add up: free + referenced == total, per level; each block's ref count is exactly the
  number of live sequences holding it plus the number of pins on it;
* the free queues are intact (`verify_queue_integrity`) and live sequences hold primary blocks;
* the reuse tree is well formed: each child is indexed under its own hash, points back to its
  parent and has hash == block_key_hash(key, parent hash);
* the event stream replays into the tree: ids are consecutive, stored blocks hash to their
  tokens under their parent, and applying stored / removed / updated(cache level) to a
  hash -> cache level map gives exactly the tree's blocks and levels. The one exception is the
  seed's documented silent take-over of a free leaf for partial reuse (TRTLLM_EVENTS.md section
  3, rule 3), which the machine checks where it happens and then accounts for.

A refused call (OutOfBlocksError) must change nothing observable, and add_sequence may refuse
only when the seed would run out of blocks half way, or when it would onboard (where the port
plans an upper bound, see WindowBlockManager.count_blocks_needed): the machine replays its
history into a second manager, lets that one allocate without the room check and expects it to
run out.

Usage the machine keeps to, as TensorRT-LLM does: request tokens only grow, except that a
rewind takes back tokens no store has put in the tree yet (speculative tokens); a sequence whose
partial last block went into the tree through store_blocks_for_reuse is only removed after.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cache import (
    BlockKey,
    CreatedData,
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
from cache.window import WindowBlockManager
from tests.cache.factories import make_manager
from tests.cache.test_rollback import observe, request_state

TPB = 4
PRIMARY = 12
SECONDARY = 4
EVENT_BUFFER = 100_000
WINDOW = 1024  # make_manager's default window: full attention, no detaching

# Prompts are prefixes of a few documents that share their openings, sometimes with a short
# private tail: requests repeat each other's prefixes in full and in part, at every depth.
DOCUMENTS = (
    (1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3),
    (1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 1, 1),
    (7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7),
)
ALPHABET = (1, 2, 3, 7, 9)


@st.composite
def prompts(draw: st.DrawFn) -> list[int]:
    document = draw(st.sampled_from(DOCUMENTS))
    length = draw(st.integers(1, len(document)))
    return [*document[:length], *draw(st.lists(st.sampled_from(ALPHABET), max_size=3))]


durations = st.sampled_from([None, 0.5, 2.0, 10.0])


@st.composite
def retentions(draw: st.DrawFn) -> RetentionConfig:
    """One range over the whole prompt, or up to two sorted, non-overlapping token ranges; with
    priorities 0..100 (below 30 a block is dropped rather than offloaded) and durations."""
    if draw(st.booleans()):
        ranges = [TokenRangeRetention(0, None, draw(st.integers(0, 100)), draw(durations))]
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
                    draw(st.integers(0, 100)),
                    draw(durations),
                )
            )
    return RetentionConfig(
        ranges=ranges,
        decode_priority=draw(st.integers(0, 100)),
        decode_duration_s=draw(durations),
    )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


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


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.mgr = make_manager(
            PRIMARY, SECONDARY, tokens_per_block=TPB, events=EVENT_BUFFER, clock=self.clock
        )
        self.wm: WindowBlockManager = self.mgr.windows[WINDOW]
        self.live: dict[int, Live] = {}
        self.pins: list[list[int]] = []
        self.next_rid = 0
        self.log: list[tuple[float, Op]] = []
        # the event replay: hash -> cache level, and hashes a silent take-over left behind
        self.replay: dict[int, int] = {}
        self.ghosts: set[int] = set()
        self.next_event_id = 0

    def clock(self) -> float:
        return self.now

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
        return {b.hash: (0 if b.is_primary else 1) for b in self.wm.tree_blocks()}

    def drain(self) -> list[Any]:
        """Take this step's events and apply them to the replay."""
        self.mgr.flush_iteration_events()
        events = self.mgr.get_latest_events()
        for event in events:
            assert event.event_id == self.next_event_id
            self.next_event_id += 1
            assert event.window_size == WINDOW
            self.apply_event(event.data)
        return events

    def apply_event(self, data: Any) -> None:
        replay = self.replay
        if isinstance(data, CreatedData):
            assert self.next_event_id == 1
            assert data.num_blocks_per_cache_level == [PRIMARY, SECONDARY]
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
                parent_hash = block.block_hash
        elif isinstance(data, RemovedData):
            for block_hash in data.block_hashes:
                assert block_hash in replay and block_hash not in self.ghosts
                del replay[block_hash]
        elif isinstance(data, UpdatedData):
            assert data.block_hash in replay
            assert (data.cache_level is None) != (data.priority is None)
            if data.cache_level is not None:
                old, new = data.cache_level.old_value, data.cache_level.new_value
                assert replay[data.block_hash] == old != new
                replay[data.block_hash] = new
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

    def check_refusal_is_real(self, request: LlmRequest) -> None:
        """Rebuild this manager from the log, let the copy allocate `request` without its room
        check, and expect it to run out of blocks half way, as the seed does (unless the
        allocation onboards, where the port's plan is an upper bound)."""
        now = [0.0]
        copy = make_manager(
            PRIMARY, SECONDARY, tokens_per_block=TPB, events=EVENT_BUFFER, clock=lambda: now[0]
        )
        requests: dict[int, LlmRequest] = {}
        for at, op in self.log:
            now[0] = at
            apply_op(copy, requests, op)
        now[0] = self.now
        assert observe(copy, self.live) == self.snapshot()
        onboards: list[bool] = []
        for wm in copy.windows.values():
            planned = wm.count_blocks_needed

            def no_room_check(*args: Any, _planned: Any = planned) -> tuple[int, int, bool]:
                _, matched, onboarded = _planned(*args)
                onboards.append(onboarded)
                return 0, matched, onboarded

            wm.count_blocks_needed = no_room_check  # type: ignore[method-assign,assignment]
        twin = LlmRequest(request.request_id, list(request.tokens), retention=request.retention)
        try:
            copy.add_sequence(twin)
        except OutOfBlocksError:
            assert onboards  # the room check was asked, and skipped
            return
        assert onboards
        assert any(onboards), f"refused {request}, which fits and onboards nothing"

    def check_pinned_chain(self, pinned: list[int], request: LlmRequest) -> None:
        """Pinned ids of a store: the tree blocks of the request's keys, root first."""
        keys = request.block_keys(TPB, request.num_tokens - 1, True)
        hashes = request.block_hashes(TPB, request.num_tokens - 1, True)
        assert len(pinned) == len(keys)
        parent = self.wm.root
        for block_id, key, key_hash in zip(pinned, keys, hashes, strict=True):
            block = self.wm.blocks[block_id]
            assert block.prev_block is parent
            assert block.key == key and block.hash == key_hash
            parent = block

    def mark_sealed(self, rid: int) -> None:
        live = self.live[rid]
        live.sealed = live.request.num_tokens

    # -- rules ---------------------------------------------------------------------------------

    # Adding and removing get two rules each, so that they make up a good share of the steps.
    @rule(tokens=prompts())
    def add_sequence(self, tokens: list[int]) -> None:
        self.add(tokens, None)

    @rule(tokens=prompts(), retention=retentions())
    def add_sequence_with_retention(self, tokens: list[int], retention: RetentionConfig) -> None:
        self.add(tokens, retention)

    def add(self, tokens: list[int], retention: RetentionConfig | None) -> None:
        rid = self.next_rid
        self.next_rid += 1
        request = LlmRequest(rid, list(tokens), retention=retention)
        tree_before = {b.hash: b.block_id for b in self.wm.tree_blocks()}
        stats_before = self.mgr.get_kv_cache_stats()
        state_before = request_state(request)
        refused = self.refused_without_trace(lambda: self.mgr.add_sequence(request))
        if refused:
            assert request_state(request) == state_before
            self.check_refusal_is_real(request)
            return
        self.record(("add", rid, tuple(tokens), retention))
        self.live[rid] = Live(request, request.num_tokens)
        reused = request.prepopulated_prompt_len
        assert 0 <= reused <= len(tokens) - 1
        assert request.context_current_position == reused
        block_ids = self.mgr.get_cache_block_ids(rid)[0]
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
            block = self.wm.blocks[tree_before[block_hash]]
            position = block_ids.index(block.block_id)
            assert position * TPB < reused <= (position + 1) * TPB
            assert block.prev_block is None and block.ref_count >= 1
            self.ghosts.add(block_hash)

    @precondition(lambda self: self.has_growing())
    @rule(index=st.integers(0, 15), token=st.sampled_from(ALPHABET))
    def add_token(self, index: int, token: int) -> None:
        rid = self.pick(index, growing=True)
        request = self.live[rid].request
        num_tokens = self.mgr.get_num_tokens(rid)
        request.add_new_token(token)
        if self.refused_without_trace(lambda: self.mgr.add_token(rid)):
            request.tokens.pop()
            assert num_tokens % TPB == 0 and self.wm.get_num_free_blocks() == 0
            return
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
        # the blocks past the new end are released; those nobody else holds become free
        freed = sum(self.wm.blocks[i].ref_count == 1 for i in block_ids[kept:])
        free = self.wm.get_num_free_blocks()
        self.mgr.rewind_kv_cache(rid, n)
        del live.request.tokens[-n:]
        self.record(("rewind", rid, n))
        assert self.mgr.get_num_tokens(rid) == num_tokens - n
        assert self.mgr.get_cache_block_ids(rid)[0] == block_ids[:kept]
        assert self.wm.get_num_free_blocks() == free + freed

    @precondition(lambda self: self.has_growing())
    @rule(index=st.integers(0, 15))
    def store_context_blocks(self, index: int) -> None:
        rid = self.pick(index, growing=True)
        self.mgr.store_context_blocks(self.live[rid].request)
        self.record(("store_context", rid))
        self.mark_sealed(rid)

    @precondition(lambda self: self.has_growing())
    @rule(index=st.integers(0, 15))
    def store_new_block(self, index: int) -> None:
        rid = self.pick(index, growing=True)
        self.mgr.store_new_block(self.live[rid].request)
        self.record(("store_new", rid))
        self.mark_sealed(rid)

    @precondition(lambda self: self.has_growing())
    @rule(index=st.integers(0, 15), pin=st.booleans())
    def store_blocks_for_reuse(self, index: int, pin: bool) -> None:
        rid = self.pick(index, growing=True)
        live = self.live[rid]
        pinned = self.mgr.store_blocks_for_reuse(rid, live.request, pin_blocks=pin)
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
        stores = with_request and self.wm.is_sequence_valid_for_store_for_reuse(rid)
        pinned = self.mgr.remove_sequence(rid, request if with_request else None, pin_blocks=pin)
        self.record(("remove", rid, with_request, pin))
        del self.live[rid]
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
            keys = request.block_keys(TPB, request.num_tokens - 1, True)
            hashes = request.block_hashes(TPB, request.num_tokens - 1, True)
            node = self.wm.root
            for key, key_hash in zip(keys, hashes, strict=True):
                child = node.next_blocks.get(key_hash)
                assert child is not None and child.key == key
                node = child

    @precondition(lambda self: bool(self.live))
    @rule(index=st.integers(0, 15))
    def pin_blocks(self, index: int) -> None:
        rid = self.pick(index)
        block_ids = self.mgr.get_cache_block_ids(rid)[0]
        refs = [self.wm.blocks[i].ref_count for i in block_ids]
        self.mgr.pin_blocks(rid)
        self.record(("pin", rid))
        assert [self.wm.blocks[i].ref_count for i in block_ids] == [n + 1 for n in refs]
        self.pins.append(block_ids)

    @precondition(lambda self: bool(self.pins))
    @rule(index=st.integers(0, 15))
    def unpin_blocks_by_id(self, index: int) -> None:
        block_ids = self.pins.pop(index % len(self.pins))
        self.mgr.unpin_blocks_by_id(block_ids)
        self.record(("unpin", 0, tuple(block_ids)))

    @rule(dt=st.sampled_from([0.0, 0.25, 1.0, 3.0, 30.0]))
    def advance_clock_and_refresh(self, dt: float) -> None:
        self.now += dt
        assert self.drain() == []
        before = self.snapshot()
        self.mgr.refresh_blocks()
        self.record(("refresh", 0))
        after = self.snapshot()
        # expiry only demotes free blocks to the default priority: no event, nothing moves level
        assert self.drain() == []
        assert after[f"free/{WINDOW}"] == before[f"free/{WINDOW}"]
        assert after[f"tree/{WINDOW}"] == before[f"tree/{WINDOW}"]
        assert after["sequences"] == before["sequences"]
        for old, new in zip(before[f"blocks/{WINDOW}"], after[f"blocks/{WINDOW}"], strict=True):
            assert new[:4] == old[:4] and new[6:] == old[6:]
            if new[4:6] != old[4:6]:  # (priority, duration): a free block's retention expired
                assert old[1] == 0 and old[5] is not None and new[4:6] == (35, None)

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def everything_adds_up(self) -> None:
        self.drain()
        mgr, wm = self.mgr, self.wm
        for window_manager in mgr.windows.values():
            assert window_manager is wm
        blocks = wm.blocks
        assert all(b.ref_count >= 0 for b in blocks)
        primary = [b for b in blocks if b.is_primary]
        secondary = [b for b in blocks if not b.is_primary]
        assert (len(primary), len(secondary)) == (PRIMARY, SECONDARY)
        assert wm.get_num_free_blocks() + sum(b.ref_count > 0 for b in primary) == PRIMARY
        assert (
            wm.get_num_free_secondary_blocks() + sum(b.ref_count > 0 for b in secondary)
            == SECONDARY
        )
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
        # the reuse tree
        root = wm.root
        assert root.prev_block is None and root.hash == 0
        seen: set[int] = set()
        stack = [root]
        while stack:
            parent = stack.pop()
            parent_hash = 0 if parent is root else parent.hash
            for child_hash, child in parent.next_blocks.items():
                assert child.prev_block is parent
                assert child_hash == child.hash
                assert child.hash == block_key_hash(child.key, parent_hash)
                assert 1 <= len(child.key.tokens) <= TPB
                assert child.block_id not in seen
                seen.add(child.block_id)
                stack.append(child)
        # the event replay
        tree = self.tree_map()
        assert len(tree) == len(seen)
        assert self.ghosts <= set(self.replay) and not self.ghosts & set(tree)
        assert {h: level for h, level in self.replay.items() if h not in self.ghosts} == tree


KVCacheMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestKVCacheStateMachine = KVCacheMachine.TestCase


# -- cases the machine found or must accept, replayed step by step ----------------------------


def run_step(machine: KVCacheMachine, name: str, **arguments: Any) -> None:
    """One rule, then the invariants, as Hypothesis runs them."""
    getattr(machine, name)(**arguments)
    machine.everything_adds_up()


def new_machine() -> KVCacheMachine:
    machine = KVCacheMachine()
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
    assert machine.wm.get_num_free_blocks() == PRIMARY - 5
    machine.teardown()


def test_the_silent_take_over_of_a_free_leaf_is_the_only_replay_gap() -> None:
    """Partial reuse of an unreferenced leaf detaches it without a Removed event, as the seed
    does (TRTLLM_EVENTS.md section 3, rule 3): a consumer of the events keeps its hash."""
    machine = new_machine()
    run_step(machine, "add_sequence", tokens=[1, 2, 3, 4, 5, 6, 7])
    run_step(machine, "remove_sequence", index=0, pin=False)  # stores [1-4] and the leaf [5, 6]
    leaf = next(b for b in machine.wm.tree_blocks() if b.key.tokens == (5, 6))
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
