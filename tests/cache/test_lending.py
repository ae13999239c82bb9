"""Keys lent by the reuse tree to a request (LlmRequest.block_keys with `known`): a tree block's
key is used for a block of the request exactly when it is equal, whatever the chained hash says.

tests/cache/test_native.py runs this file on the other build too, so both are held to it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from cache import LlmRequest
from cache.block import KVCacheBlock
from cache.events import StoredData
from cache.hashing import BlockKey
from tests.cache.factories import ids, make_manager

TPB = 4
TOKENS = list(range(12))  # three full blocks: 0-3, 4-7, 8-11


def tree_blocks(request: LlmRequest, keys: Sequence[BlockKey | None]) -> dict[int, KVCacheBlock]:
    """Blocks holding `keys`, named by the request's own chained hashes (None: not in the tree);
    a key other than the request's block under its hash stands for a hash collision."""
    hashes = request.block_hashes(TPB, len(TOKENS), False)
    known: dict[int, KVCacheBlock] = {}
    for i, (key, block_hash) in enumerate(zip(keys, hashes, strict=True)):
        if key is not None:
            block = KVCacheBlock(i, i, True)
            block.set_block_key(key, len(key.tokens) == TPB)
            known[block_hash] = block
    return known


def lend(request: LlmRequest, keys: Sequence[BlockKey | None]) -> tuple[list[BlockKey], list[bool]]:
    """The request's keys and, per key, whether it is the tree block's own object."""
    known = tree_blocks(request, keys)
    made = request.block_keys(TPB, len(TOKENS), False, known=known)
    tree_keys = [block.key for block in known.values()]
    return made, [any(key is tree_key for tree_key in tree_keys) for key in made]


def plain(*tokens: int, lora: int | None = None) -> BlockKey:
    return BlockKey(tokens, lora_task_id=lora)


EXPECTED = [plain(0, 1, 2, 3), plain(4, 5, 6, 7), plain(8, 9, 10, 11)]


def test_equal_keys_the_tree_holds_are_lent_up_to_the_first_block_it_lacks() -> None:
    keys, lent = lend(LlmRequest(0, TOKENS), [plain(0, 1, 2, 3), plain(4, 5, 6, 7), None])
    assert (keys, lent) == (EXPECTED, [True, True, False])
    keys, lent = lend(LlmRequest(1, TOKENS), EXPECTED)
    assert (keys, lent) == (EXPECTED, [True, True, True])
    # past a block the tree lacks, nothing is lent (the match stops there too)
    keys, lent = lend(LlmRequest(2, TOKENS), [None, plain(4, 5, 6, 7), plain(8, 9, 10, 11)])
    assert (keys, lent) == (EXPECTED, [False, False, False])


def test_a_colliding_key_is_not_lent_and_the_equal_ones_around_it_are() -> None:
    keys, lent = lend(LlmRequest(0, TOKENS), [plain(0, 1, 2, 3), plain(4, 5, 6, 9), EXPECTED[2]])
    assert (keys, lent) == (EXPECTED, [True, False, True])


def test_short_keys_whose_tokens_run_on_are_not_lent() -> None:
    """Concatenated, (0, 1, 2) (3, 4, 5, 6) (7, 8, 9, 10) are the request's first 11 tokens, but
    no block is equal: the blocks are cut at other places."""
    keys, lent = lend(
        LlmRequest(0, TOKENS), [plain(0, 1, 2), plain(3, 4, 5, 6), plain(7, 8, 9, 10)]
    )
    assert (keys, lent) == (EXPECTED, [False, False, False])


def test_keys_of_another_namespace_are_not_lent() -> None:
    keys, lent = lend(LlmRequest(0, TOKENS, lora_task_id=5), EXPECTED)
    assert keys == [plain(*key.tokens, lora=5) for key in EXPECTED]
    assert lent == [False, False, False]
    keys, lent = lend(LlmRequest(1, TOKENS, cache_salt_id=9), EXPECTED)
    assert keys == [BlockKey(key.tokens, cache_salt_id=9) for key in EXPECTED]
    assert lent == [False, False, False]
    salted = [BlockKey(key.tokens, cache_salt_id=9) for key in EXPECTED]
    keys, lent = lend(LlmRequest(2, TOKENS, cache_salt_id=9), salted)
    assert (keys, lent) == (salted, [True, True, True])


def test_numpy_integers_as_tokens_are_matched_like_python_ints() -> None:
    """A token list of numpy integers (outside `Sequence[int]`, but easy to pass) is reused,
    lent and partially matched as the same ints would be."""
    mgr = make_manager(16)
    as_numpy: list[Any] = list(np.arange(20, dtype=np.int64))  # not Sequence[int]
    first = LlmRequest(0, as_numpy)
    assert mgr.add_sequence(first) == 0
    stored = ids(mgr, 0)
    mgr.remove_sequence(0, first)
    # 19 tokens are matched: four full blocks and the partial tail (16, 17, 18)
    again = LlmRequest(1, as_numpy)
    assert mgr.add_sequence(again) == 19
    assert ids(mgr, 1) == stored
    mgr.remove_sequence(1, again)
    python = LlmRequest(2, list(range(20)))
    assert mgr.add_sequence(python) == 19
    assert ids(mgr, 2) == stored
    mgr.remove_sequence(2, python)
    # (4, 5) of the stored block (4, 5, 6, 7), which has a child: copied into a new block
    mixed: list[Any] = [*np.arange(6, dtype=np.int64), 9, 9, 9]
    partial = LlmRequest(3, mixed)
    assert mgr.add_sequence(partial) == 6
    assert ids(mgr, 3)[0] == stored[0] and ids(mgr, 3)[1] not in stored


def test_numpy_integers_become_python_ints_through_to_the_stored_event() -> None:
    """Tokens and extra ids given as numpy integers are Python ints in the request, in its keys
    and in the rows of its Stored event (which therefore encode), in either build; the rows carry
    every field of the block, read from the native fields when compiled."""
    mgr = make_manager(8, events=16)
    tokens: list[Any] = list(np.arange(9, dtype=np.int64))
    extra: list[Any] = [np.int32(i % 3) for i in range(9)]
    request = LlmRequest(
        0, tokens, extra_ids=extra, lora_task_id=4, cache_salt_id=6, cache_salt="tenant"
    )
    assert request.extra_ids is not None
    assert {type(t) for t in request.tokens} | {type(e) for e in request.extra_ids} == {int}
    mgr.add_sequence(request)
    mgr.remove_sequence(0, request)
    stored = mgr.take_events()[-1].data
    assert isinstance(stored, StoredData)
    rows = stored.rows()
    assert [row[0] for row in rows] == request.block_hashes(4, 8, False)
    assert [row[1:] for row in rows] == [
        ((0, 1, 2, 3), (0, 1, 2, 0), 0, 35, (), "tenant", 4),
        ((4, 5, 6, 7), (1, 2, 0, 1), 0, 35, (), "tenant", 4),
    ]
    assert {type(v) for row in rows for v in (row[0], *row[1], *(row[2] or ()))} == {int}
    json.dumps(stored.to_dict())  # numpy integers would not serialize
