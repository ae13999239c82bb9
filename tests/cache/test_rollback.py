"""A refused call leaves no trace: when a request cannot get its blocks, the manager is exactly
as it was before the call.

The seed throws half way through an allocation; the port checks first and rolls nothing back
because it changed nothing. These tests refuse calls in states built with reuse, partial reuse,
priorities and offload in play, and compare everything the manager lets one observe before and
after: free counts and free order per level, statistics, every block's state, the reuse tree,
the live sequences' block tables, the per-request statistics and the event stream.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache import (
    DuplicateRequestError,
    KVCacheBlock,
    KVCacheManager,
    LlmRequest,
    OutOfBlocksError,
    RetentionConfig,
    TokenRangeRetention,
    UnknownRequestError,
)
from cache.eviction import PRIMARY_LEVEL, SECONDARY_LEVEL
from tests.cache.factories import drain, ids, make_manager, req

TPB = 4
FRESH = 1000  # token ids from here on never occur in a history
PREFIXES = ((1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9), (5, 5, 5, 5), (1, 2))
ALPHABET = (1, 2, 3, 5, 9)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def block_state(block: KVCacheBlock) -> tuple[Any, ...]:
    parent = block.prev_block
    return (
        block.block_id,
        block.ref_count,
        block.is_primary,
        block.memory_index,
        block.priority,
        block.duration_s,
        block.hash,
        block.key.tokens,
        block.is_full,
        None if parent is None else parent.block_id,
    )


def observe(mgr: KVCacheManager, live: Iterable[int]) -> dict[str, Any]:
    """Everything a caller can see of the manager; `live`: the request ids of live sequences."""
    seen: dict[str, Any] = {
        "stats": mgr.get_kv_cache_stats(),
        "free": mgr.get_num_free_blocks(),
        "sequences": {
            rid: (
                mgr.get_num_tokens(rid),
                {w: mgr.get_cache_block_ids(rid, w) for w in mgr.windows},
            )
            for rid in sorted(live)
        },
    }
    for window, wm in mgr.windows.items():
        seen[f"free/{window}"] = (wm.get_num_free_blocks(), wm.get_num_free_secondary_blocks())
        seen[f"free_order/{window}"] = (
            wm.policy.free_order(PRIMARY_LEVEL),
            wm.policy.free_order(SECONDARY_LEVEL),
        )
        seen[f"tree/{window}"] = frozenset((b.block_id, b.hash) for b in wm.tree_blocks())
        seen[f"blocks/{window}"] = tuple(block_state(b) for b in wm.blocks)
    return seen


def request_state(request: LlmRequest) -> tuple[Any, ...]:
    return (
        list(request.tokens),
        request.prepopulated_prompt_len,
        request.context_current_position,
        request.alloc_total_blocks,
        request.alloc_new_blocks,
        request.reused_blocks,
        request.missed_blocks,
    )


def names_id(message: str, request_id: int) -> bool:
    """`message` mentions `request_id` as a whole number (not as part of a longer one)."""
    return re.search(rf"(?<![\d-]){re.escape(str(request_id))}(?!\d)", message) is not None


# -- histories: reuse, partial reuse, priorities (offload at >= 30) and live sequences -----------


@st.composite
def prompts(draw: st.DrawFn) -> list[int]:
    prefix = draw(st.sampled_from(PREFIXES))
    return [*prefix, *draw(st.lists(st.sampled_from(ALPHABET), max_size=7))]


history_steps = st.lists(
    st.tuples(prompts(), st.integers(0, 100), st.booleans()),  # tokens, priority, stays live
    max_size=12,
)


def run_history(
    mgr: KVCacheManager, steps: list[tuple[list[int], int, bool]]
) -> dict[int, LlmRequest]:
    """Add each prompt with its priority; finished ones are released and stored for reuse.

    A refusal on the way must change nothing either. Returns the live requests.
    """
    live: dict[int, LlmRequest] = {}
    for rid, (tokens, priority, stays) in enumerate(steps):
        r = req(rid, tokens, retention=RetentionConfig([TokenRangeRetention(0, None, priority)]))
        before, before_request = observe(mgr, live), request_state(r)
        try:
            mgr.add_sequence(r)
        except OutOfBlocksError:
            assert observe(mgr, live) == before
            assert request_state(r) == before_request
            continue
        if stays:
            mgr.store_context_blocks(r)
            live[rid] = r
        else:
            mgr.remove_sequence(rid, r)
    drain(mgr)
    return live


def assert_refused_without_trace(
    mgr: KVCacheManager, live: dict[int, LlmRequest], request: LlmRequest
) -> None:
    assert drain(mgr) == []
    before, before_request = observe(mgr, live), request_state(request)
    with pytest.raises(OutOfBlocksError):
        mgr.add_sequence(request)
    assert observe(mgr, live) == before
    assert request_state(request) == before_request
    assert drain(mgr) == []
    assert mgr.verify_queue_integrity()


# -- OutOfBlocksError --------------------------------------------------------------------------


@settings(max_examples=60)
@given(
    primary=st.integers(1, 8),
    secondary=st.integers(0, 3),
    steps=history_steps,
    data=st.data(),
)
def test_prompt_longer_than_the_pool_is_refused_without_trace(
    primary: int,
    secondary: int,
    steps: list[tuple[list[int], int, bool]],
    data: st.DataObject,
) -> None:
    mgr = make_manager(primary, secondary, tokens_per_block=TPB, events=100_000)
    finished = [(tokens, priority, False) for tokens, priority, _ in steps]
    run_history(mgr, finished)  # a tree of cached blocks, some offloaded; nothing live
    assert mgr.get_num_free_blocks() == primary
    # a cached prefix (reused, maybe onboarded) followed by more blocks than the pool has
    prefix = data.draw(st.sampled_from([[], *(tokens for tokens, _, _ in steps)]))
    length = data.draw(st.integers(primary * TPB + 1, primary * TPB + 2 * TPB))
    tokens = (prefix + [FRESH + i for i in range(length)])[:length]
    request = req(len(steps), tokens)
    assert_refused_without_trace(mgr, {}, request)
    assert mgr.get_num_free_blocks() == primary


@settings(max_examples=60)
@given(
    primary=st.integers(4, 10),
    secondary=st.integers(0, 4),
    steps=history_steps,
    extra=st.integers(0, 2),
    data=st.data(),
)
def test_pool_filled_by_live_sequences_is_refused_without_trace(
    primary: int,
    secondary: int,
    steps: list[tuple[list[int], int, bool]],
    extra: int,
    data: st.DataObject,
) -> None:
    mgr = make_manager(primary, secondary, tokens_per_block=TPB, events=100_000)
    live = run_history(mgr, steps)
    free = mgr.get_num_free_blocks()
    # A prefix taken from the history (matched against live or cached blocks, maybe partially,
    # maybe needing an onboard), then a fresh tail. Every block that starts inside the tail is a
    # miss and takes one free primary block (free primary blocks only ever decrease while a
    # sequence is added), so `free + 1 + extra` such blocks cannot fit, in the seed either.
    source = data.draw(st.sampled_from([[], *(tokens for tokens, _, _ in steps)]))
    cut = data.draw(st.integers(0, len(source)))
    prefix = source[:cut]
    num_blocks = _ceil_div(cut, TPB) + free + 1 + extra
    length = (num_blocks - 1) * TPB + data.draw(st.integers(1, TPB))
    tokens = prefix + [FRESH + i for i in range(length - cut)]
    priority = data.draw(st.integers(0, 100))
    request = req(
        len(steps), tokens, retention=RetentionConfig([TokenRangeRetention(0, None, priority)])
    )
    assert_refused_without_trace(mgr, live, request)


@settings(max_examples=60)
@given(
    primary=st.integers(2, 8),
    shared_blocks=st.integers(0, 3),
    tail=st.integers(1, 40),
    stored=st.booleans(),
)
def test_refusal_is_exact_when_the_need_is_known(
    primary: int, shared_blocks: int, tail: int, stored: bool
) -> None:
    """A live sequence holds `shared_blocks` full blocks that a new request repeats (free to
    reuse when stored, else allocated again), followed by fresh tokens. The request fits exactly
    when its other blocks fit in the free pool: it is refused then and only then."""
    mgr = make_manager(primary, 2, tokens_per_block=TPB, events=100_000)
    drain(mgr)
    holder = req(0, range(shared_blocks * TPB + 1))
    if _ceil_div(holder.num_tokens, TPB) > primary:
        assert_refused_without_trace(mgr, {}, holder)
        return
    mgr.add_sequence(holder)
    if stored:
        mgr.store_context_blocks(holder)
    drain(mgr)
    free = mgr.get_num_free_blocks()
    tokens = [*range(shared_blocks * TPB), *range(FRESH, FRESH + tail)]
    request = req(1, tokens)
    need = _ceil_div(len(tokens), TPB) - (shared_blocks if stored else 0)
    if need > free:
        assert_refused_without_trace(mgr, {0: holder}, request)
        return
    assert mgr.add_sequence(request) == (shared_blocks * TPB if stored else 0)
    assert mgr.get_num_free_blocks() == free - need
    reused = shared_blocks if stored else 0
    assert ids(mgr, 1)[:reused] == ids(mgr, 0)[:reused]
    assert not set(ids(mgr, 1)[reused:]) & set(ids(mgr, 0))
    assert mgr.verify_queue_integrity()


def test_refusal_that_would_onboard_leaves_the_offloaded_blocks_where_they_are() -> None:
    mgr = make_manager(4, 2, tokens_per_block=TPB, events=100_000)
    wm = mgr.windows[1024]
    keep = RetentionConfig([TokenRangeRetention(0, None, 80)])  # >= 30: offloaded, not dropped
    a = req(0, range(10), retention=keep)
    mgr.add_sequence(a)
    mgr.remove_sequence(0, a)  # stores [0-3], [4-7], [8] (the last token is never stored)
    tree = {b.block_id: b.hash for b in wm.tree_blocks()}
    assert sorted(tree) == [0, 1, 2]
    drain(mgr)
    b = req(1, range(FRESH, FRESH + 12))
    mgr.add_sequence(b)  # takes block 3, then offloads the [8] leaf and [4-7]
    assert ids(mgr, 1) == [3, 4, 5]
    assert [wm.blocks[i].is_primary for i in (0, 1, 2)] == [True, False, False]
    events = drain(mgr)
    assert [(e["data"]["type"], e["data"]["block_hash"]) for e in events] == [
        ("updated", tree[2]),
        ("updated", tree[1]),
    ]
    # [0-3] is cached in primary (free), [4-7] is in secondary: reuse needs 1 + 1 (onboard),
    # and the empty key one more; 1 block is free.
    c = req(2, range(9))
    assert mgr.get_num_free_blocks() == 1
    assert_refused_without_trace(mgr, {1: b}, c)
    assert [wm.blocks[i].is_primary for i in (0, 1, 2)] == [True, False, False]
    # with the stranger gone the same request onboards [4-7] and reuses 8 tokens
    mgr.remove_sequence(1)
    assert mgr.add_sequence(c) == 8
    assert ids(mgr, 2)[:2] == [0, 1]
    assert wm.blocks[1].is_primary
    onboards = [
        e["data"]["block_hash"]
        for e in drain(mgr)
        if e["data"]["type"] == "updated" and e["data"]["cache_level"]["new_value"] == 0
    ]
    assert onboards == [tree[1]]


@settings(max_examples=40)
@given(
    primary=st.integers(1, 6),
    prompt=st.integers(1, 24),
    new_token=st.sampled_from(ALPHABET),
)
def test_add_token_without_a_free_block_is_refused_without_trace(
    primary: int, prompt: int, new_token: int
) -> None:
    mgr = make_manager(primary, 1, tokens_per_block=TPB, events=100_000)
    # grow one sequence until the pool is full and its last block is full
    r = req(0, range(min(prompt, primary * TPB)))
    mgr.add_sequence(r)
    while r.num_tokens < primary * TPB:
        r.add_new_token(new_token)
        mgr.add_token(0)
    assert mgr.get_num_free_blocks() == 0
    drain(mgr)
    before, before_request = observe(mgr, {0}), request_state(r)
    r.add_new_token(new_token)
    with pytest.raises(OutOfBlocksError):
        mgr.add_token(0)
    assert mgr.get_num_tokens(0) == primary * TPB
    r.tokens.pop()
    assert observe(mgr, {0}) == before
    assert request_state(r) == before_request
    assert drain(mgr) == []
    # the sequence is intact: releasing it stores its blocks and frees the pool
    mgr.remove_sequence(0, r)
    assert mgr.get_num_free_blocks() == primary
    assert mgr.verify_queue_integrity()


# -- DuplicateRequestError, UnknownRequestError ---------------------------------------------


@settings(max_examples=40)
@given(
    steps=history_steps,
    again=prompts(),
    huge=st.booleans(),
    data=st.data(),
)
def test_duplicate_request_id_is_refused_without_trace(
    steps: list[tuple[list[int], int, bool]], again: list[int], huge: bool, data: st.DataObject
) -> None:
    mgr = make_manager(8, 2, tokens_per_block=TPB, events=100_000)
    live = run_history(mgr, steps)
    rid = data.draw(st.sampled_from(sorted(live))) if live else len(steps)
    if not live:
        mgr.add_sequence(req(rid, again))
        live[rid] = req(rid, again)
        drain(mgr)
    # the duplicate check comes first: a duplicate that would not fit is still a duplicate
    tokens = list(range(FRESH, FRESH + 100 * TPB)) if huge else again
    duplicate = req(rid, tokens)
    before, before_request = observe(mgr, live), request_state(duplicate)
    with pytest.raises(DuplicateRequestError) as excinfo:
        mgr.add_sequence(duplicate)
    assert names_id(str(excinfo.value), rid)
    assert observe(mgr, live) == before
    assert request_state(duplicate) == before_request
    assert drain(mgr) == []


@settings(max_examples=40)
@given(
    steps=history_steps,
    unknown=st.integers(-(2**63), 2**63 - 1),
    removed=st.booleans(),
)
def test_unknown_request_id_is_refused_by_name_without_trace(
    steps: list[tuple[list[int], int, bool]], unknown: int, removed: bool
) -> None:
    mgr = make_manager(8, 2, tokens_per_block=TPB, events=100_000)
    live = run_history(mgr, steps)
    if removed and live:
        unknown = max(live)  # a sequence that was live and is gone
        mgr.remove_sequence(unknown, live.pop(unknown))
        drain(mgr)
    elif unknown in live or 0 <= unknown < len(steps):
        unknown = -1 - abs(unknown)  # history ids are 0..len(steps)-1
    before = observe(mgr, live)
    calls = (
        lambda: mgr.add_token(unknown),
        lambda: mgr.remove_sequence(unknown),
        lambda: mgr.remove_sequence(unknown, req(unknown, [1, 2, 3]), pin_blocks=True),
        lambda: mgr.pin_blocks(unknown),
    )
    for call in calls:
        with pytest.raises(UnknownRequestError) as excinfo:
            call()
        assert names_id(str(excinfo.value), unknown), str(excinfo.value)
        assert isinstance(excinfo.value, KeyError)
        assert observe(mgr, live) == before
        assert drain(mgr) == []


# -- the dry run refuses exactly what the seed cannot allocate --------------------------------


def _two_windows(primary: int, secondary: int, partial: bool) -> KVCacheManager:
    return KVCacheManager(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        tokens_per_block=TPB,
        blocks_per_window={16: (primary, secondary), 32: (primary + 1, secondary)},
        max_attention_window=[16, 32],
        max_sequence_length=32,
        event_buffer_max_size=100_000,
        allocate_pools=False,
        enable_partial_reuse=partial,
    )


def _history_with_pins(
    mgr: KVCacheManager, steps: list[tuple[list[int], int, int, int | None]]
) -> dict[int, LlmRequest]:
    """Like `run_history`, but a step may also end pinned (end 0: live, 1: finished, 2:
    pinned), and may then unpin one pinned block (by index into the pinned ids). That leaves
    held blocks below free ones, which later steps evict or offload."""
    live: dict[int, LlmRequest] = {}
    for rid, (tokens, priority, end, unpin) in enumerate(steps):
        r = req(rid, tokens, retention=RetentionConfig([TokenRangeRetention(0, None, priority)]))
        try:
            mgr.add_sequence(r)
        except OutOfBlocksError:
            continue
        if end == 0:
            live[rid] = r
        else:
            mgr.remove_sequence(rid, r, pin_blocks=end == 2)
        # unpin_blocks_by_id unpins in the first window (the ids returned are the last window's)
        pins = next(iter(mgr.windows.values())).pins
        pinned = sorted(pins)
        if unpin is not None and pinned:
            mgr.unpin_blocks_by_id([pinned[unpin % len(pinned)]])
    drain(mgr)
    return live


@settings(max_examples=80, deadline=None)
@given(
    primary=st.integers(3, 8),
    secondary=st.integers(1, 4),
    steps=st.lists(
        st.tuples(
            prompts(),
            st.sampled_from([0, 35, 35, 80]),
            st.sampled_from([0, 1, 2, 2]),
            st.none() | st.integers(0, 50),
        ),
        min_size=2,
        max_size=14,
    ),
    two_windows=st.booleans(),
    partial=st.booleans(),
    data=st.data(),
)
def test_the_dry_run_refuses_exactly_what_the_allocation_cannot_do(
    primary: int,
    secondary: int,
    steps: list[tuple[list[int], int, int, int | None]],
    two_windows: bool,
    partial: bool,
    data: st.DataObject,
) -> None:
    """The same history twice; the second manager allocates without its dry run (as the seed
    does, throwing half way). The dry run must refuse exactly when that allocation fails, and
    an admitted request must end the same in both."""

    def build() -> tuple[KVCacheManager, dict[int, LlmRequest]]:
        if two_windows:
            mgr = _two_windows(primary, secondary, partial)
        else:
            mgr = make_manager(
                primary,
                secondary,
                tokens_per_block=TPB,
                events=100_000,
                enable_partial_reuse=partial,
            )
        return mgr, _history_with_pins(mgr, steps)

    # A prefix of a cached chain, preferably one through an offloaded block (onboards), else
    # of a prompt of the history.
    mgr, _ = build()
    window = next(iter(mgr.windows.values()))
    chains = [window.tree.chain(block) for block in window.tree_blocks()]
    onboarding = [chain for chain in chains if not all(b.is_primary for b in chain)]
    # best: an onboard next to a held block (the walk must not count the held one)
    mixed = [chain for chain in onboarding if any(b.ref_count for b in chain)]
    sources = [[t for b in chain for t in b.key.tokens] for chain in mixed or onboarding or chains]
    source = data.draw(st.sampled_from([*sources, *(step[0] for step in steps)]))
    prefix = source[: data.draw(st.integers(0, len(source)))]
    if data.draw(st.booleans()):
        prefix = source
    retention = RetentionConfig([TokenRangeRetention(0, None, data.draw(st.integers(0, 100)))])

    def add(tail: int, dry_run: bool) -> tuple[KVCacheManager, dict[int, LlmRequest], LlmRequest]:
        """Add the prefix and `tail` fresh tokens after the history; raises OutOfBlocksError."""
        mgr, live = build()
        if not dry_run:
            mgr._check_room = lambda *args, **kwargs: None  # type: ignore[method-assign]
        request = req(len(steps), prefix + [FRESH + i for i in range(tail)], retention=retention)
        mgr.add_sequence(request)
        live[len(steps)] = request
        return mgr, live, request

    def fits(tail: int) -> bool:
        try:
            add(tail, dry_run=False)
        except OutOfBlocksError:
            return False
        return True

    # The shortest tail the allocation (without dry run) cannot take, and the one before it:
    # the dry run must admit the one and refuse the other.
    limit = (primary + 3) * TPB
    first_failing = next((tail for tail in range(1, limit) if not fits(tail)), limit)
    for tail in (first_failing - 1, first_failing):
        if not 1 <= tail < limit:
            continue
        if tail == first_failing:  # refused by the dry run, without a trace
            mgr, live = build()
            request = req(
                len(steps), prefix + [FRESH + i for i in range(tail)], retention=retention
            )
            assert_refused_without_trace(mgr, live, request)
            continue
        mgr, live, request = add(tail, dry_run=True)
        seed, _, twin = add(tail, dry_run=False)
        assert observe(mgr, live) == observe(seed, live)
        assert request_state(request) == request_state(twin)
        assert drain(mgr) == drain(seed)
