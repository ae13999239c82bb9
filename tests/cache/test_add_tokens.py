"""KVCacheManager.add_tokens against repeated add_token on a twin manager: the same blocks in
the same order, the same events, and on refusal the same error with nothing changed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache import KVCacheManager, OutOfBlocksError
from tests.cache.factories import drain, make_manager, req


def state(mgr: KVCacheManager) -> tuple[Any, ...]:
    """Everything add_token may change: per window and sequence, tokens, block ids, free
    blocks, detached front blocks, counters; and the events."""
    windows = {
        w: (
            wm.get_num_free_blocks(),
            wm.alloc_total_blocks,
            wm.alloc_new_blocks,
            {rid: mgr.get_cache_block_ids(rid, w) for rid in mgr.sequences},
        )
        for w, wm in mgr.windows.items()
    }
    seqs = {
        rid: (s.num_tokens, dict(s.num_front_blocks_removed)) for rid, s in mgr.sequences.items()
    }
    return windows, seqs, drain(mgr)


def twins(
    factory: Callable[[], KVCacheManager], setup: Callable[[KVCacheManager], None]
) -> tuple[KVCacheManager, KVCacheManager]:
    a, b = factory(), factory()
    setup(a)
    setup(b)
    assert state(a) == state(b)
    return a, b


def per_token(mgr: KVCacheManager, request_id: int, num_tokens: int) -> None:
    for _ in range(num_tokens):
        mgr.add_token(request_id)


def cached_then_live(prompt: int) -> Callable[[KVCacheManager], None]:
    """A stored chain of 3 blocks in the free queue (so growth evicts it, with Removed events),
    then request 1 live with a `prompt`-token prompt."""

    def setup(mgr: KVCacheManager) -> None:
        old = req(0, range(100, 113))
        mgr.add_sequence(old)
        mgr.remove_sequence(0, old)
        mgr.add_sequence(req(1, range(prompt)))

    return setup


@pytest.mark.parametrize("prompt", [1, 3, 4, 5, 8])
@pytest.mark.parametrize("num_tokens", [0, 1, 2, 3, 4, 5, 9, 16, 17])
def test_same_blocks_and_events_as_add_token(prompt: int, num_tokens: int) -> None:
    a, b = twins(lambda: make_manager(12, events=64), cached_then_live(prompt))
    a.add_tokens(1, num_tokens)
    per_token(b, 1, num_tokens)
    assert state(a) == state(b)


def test_growth_evicts_cached_blocks_with_the_same_removed_events() -> None:
    a, b = twins(lambda: make_manager(6, events=64), cached_then_live(4))
    a.add_tokens(1, 20)  # 1 prompt block + 5 new: 2 never used, then the cached chain
    per_token(b, 1, 20)
    after = state(a)
    assert after == state(b)
    removed = [h for e in after[2] for h in e["data"]["block_hashes"]]
    assert len(removed) == 3
    assert a.get_num_free_blocks() == 0


def test_refused_for_blocks_changes_nothing() -> None:
    a, b = twins(lambda: make_manager(4, events=64), cached_then_live(4))
    before = state(a)
    with pytest.raises(OutOfBlocksError):
        a.add_tokens(1, 13)  # needs 4 new blocks, 3 can be had
    assert state(a) == before
    with pytest.raises(OutOfBlocksError):
        per_token(b, 1, 13)  # the per-token loop fails at the same point, half way
    a.add_tokens(1, 12)  # what does fit still goes through
    assert state(a) == state(b)


def test_refused_for_length_changes_nothing() -> None:
    a, _ = twins(lambda: make_manager(64, max_sequence_length=16, events=64), cached_then_live(4))
    before = state(a)
    # A full-attention window holds up to window + tokens_per_block - 1 tokens (as add_token).
    with pytest.raises(ValueError, match="20 tokens exceed what window 16 holds"):
        a.add_tokens(1, 16)
    assert state(a) == before
    a.add_tokens(1, 15)
    assert a.get_num_tokens(1) == 19


def test_length_error_comes_before_a_later_block_shortage() -> None:
    mgr = make_manager(5, max_sequence_length=16)
    mgr.add_sequence(req(1, range(4)))  # 1 block, 4 free: growth to 20 tokens fits
    with pytest.raises(ValueError, match="20 tokens"):
        mgr.add_tokens(1, 20)  # blocks run out at token 21, the length at token 20


def test_negative_and_unknown() -> None:
    mgr = make_manager(8)
    mgr.add_sequence(req(1, range(4)))
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        mgr.add_tokens(1, -1)
    with pytest.raises(KeyError):
        mgr.add_tokens(2, 1)


def beams() -> KVCacheManager:
    return make_manager(32, max_beam_width=2, events=64)


def test_beam_search_allocates_one_block_per_beam() -> None:
    def setup(mgr: KVCacheManager) -> None:
        mgr.add_sequence(req(1, range(6), beam_width=2))

    a, b = twins(beams, setup)
    a.add_tokens(1, 11)
    per_token(b, 1, 11)
    assert state(a) == state(b)
    assert a.get_cache_block_ids(1) == [[0, 1, 3, 5, 7], [0, 2, 4, 6, 8]]


def swa() -> KVCacheManager:
    return make_manager(6, window=8, max_sequence_length=64, events=64)


def test_sliding_window_reuses_the_blocks_that_leave_it() -> None:
    def setup(mgr: KVCacheManager) -> None:
        mgr.add_sequence(req(1, range(5)))

    a, b = twins(swa, setup)
    a.add_tokens(1, 40)  # 6 blocks could never hold 45 tokens without the detached ones
    per_token(b, 1, 40)
    assert state(a) == state(b)


def test_sliding_window_refusal_changes_nothing() -> None:
    def setup(mgr: KVCacheManager) -> None:
        mgr.add_sequence(req(1, range(4)))
        mgr.add_sequence(req(2, range(4)))
        mgr.add_sequence(req(3, range(4)))
        mgr.add_sequence(req(4, range(4)))
        mgr.add_sequence(req(5, range(4)))

    a, b = twins(swa, setup)
    before = state(a)
    with pytest.raises(OutOfBlocksError, match="at token 9, 0 free"):
        a.add_tokens(1, 9)  # 1 free, 2 boundaries before the first block leaves the window
    assert state(a) == before
    with pytest.raises(OutOfBlocksError):
        per_token(b, 1, 9)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 4),
    st.lists(st.tuples(st.integers(1, 3), st.integers(0, 14)), min_size=1, max_size=8),
)
def test_any_growth_matches_add_token(prompt_blocks: int, steps: list[tuple[int, int]]) -> None:
    """Three live sequences grown in any order and amounts; refusals included."""

    def setup(mgr: KVCacheManager) -> None:
        for rid in (1, 2, 3):
            mgr.add_sequence(req(rid, range(rid * 1000, rid * 1000 + prompt_blocks * 4 - rid)))

    a, b = twins(lambda: make_manager(20, max_sequence_length=48, events=256), setup)
    for rid, num_tokens in steps:
        before = state(a)
        try:
            a.add_tokens(rid, num_tokens)
        except (OutOfBlocksError, ValueError) as exc:
            assert state(a) == before
            with pytest.raises(type(exc)):
                per_token(b, rid, num_tokens)
            return
        per_token(b, rid, num_tokens)
        assert state(a) == state(b)
