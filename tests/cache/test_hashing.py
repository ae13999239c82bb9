"""Block hashes, bit for bit against the seed's C++ hasher (tests/data/block_hash_golden.json)."""

from __future__ import annotations

import json
import random
from array import array
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cache import (
    HASH_IMPL,
    BlockKey,
    LlmRequest,
    MultimodalItem,
    block_hashes_for_tokens,
    block_key_hash,
)
from cache.hashing import (
    as_token_array,
    block_hash_array,
    hash_token_blocks,
    multimodal_arrays,
)

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "block_hash_golden.json"
VECTORS: list[dict[str, Any]] = json.loads(GOLDEN.read_text())


def _key(vector: dict[str, Any], block: dict[str, Any]) -> BlockKey:
    return BlockKey(
        tokens=block["tokens"],
        extra_ids=block["extra_ids"],
        uses_extra_ids=vector["uses_extra_ids"],
        lora_task_id=vector["lora_task_id"],
        extra_keys=[(bytes.fromhex(m["hash"]), m["start_offset"]) for m in block["mm_keys"]],
        cache_salt_id=vector["cache_salt_id"],
    )


def test_golden_file_covers_every_key_field() -> None:
    assert len(VECTORS) == 48
    assert any(v["uses_extra_ids"] for v in VECTORS)
    assert any(v["lora_task_id"] is not None for v in VECTORS)
    assert any(v["cache_salt_id"] is not None for v in VECTORS)
    assert any(b["mm_keys"] for v in VECTORS for b in v["blocks"])


@pytest.mark.parametrize("index", range(len(VECTORS)))
def test_python_hasher_matches_golden(index: int) -> None:
    vector = VECTORS[index]
    for block in vector["blocks"]:
        assert block_key_hash(_key(vector, block), block["parent_hash"]) == block["hash"]


@pytest.mark.parametrize("use_numba", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("index", range(len(VECTORS)))
def test_vectorised_hasher_matches_golden(index: int, use_numba: bool) -> None:
    """Each golden block hashed by the sequence kernel, multimodal keys given as items that
    overlap the block at the recorded offsets."""
    vector = VECTORS[index]
    for block in vector["blocks"]:
        n = len(block["tokens"])
        block_start = 1000  # the block's absolute position inside an imagined request
        items = [
            MultimodalItem(
                bytes.fromhex(m["hash"]),
                block_start - m["start_offset"] if m["start_offset"] else block_start,
                m["start_offset"] + n,
            )
            for m in block["mm_keys"]
        ]
        out = hash_token_blocks(
            as_token_array(block["tokens"]),
            max(n, 1),
            1,
            parent_hash=block["parent_hash"],
            token_offset=block_start,
            extra_ids=(
                np.array(block["extra_ids"], dtype=np.uint64) if vector["uses_extra_ids"] else None
            ),
            lora_task_id=vector["lora_task_id"],
            cache_salt_id=vector["cache_salt_id"],
            mm=multimodal_arrays(items) if items else None,
            use_numba=use_numba,
        )
        assert int(out[0]) == block["hash"]


def test_compiled_hasher_is_in_use() -> None:
    assert HASH_IMPL == "numba"


def test_official_vectors() -> None:
    assert block_key_hash(BlockKey(tokens=[1, 2, 3, 4]), 0) == 924206229973855
    assert block_key_hash(BlockKey(tokens=[5, 6]), 924206229973855) == 6875034662206558884
    salted = BlockKey(tokens=[1, 2, 3, 4], cache_salt_id=123)
    assert block_key_hash(salted, 0) == 6280297290684427985
    child = BlockKey(tokens=[5, 6], cache_salt_id=123)
    assert block_key_hash(child, 6280297290684427985) == 18177682803760873588
    assert block_key_hash(BlockKey(tokens=[0, 1, 2, 3]), 0) == 733356887393045
    assert block_key_hash(BlockKey(tokens=[0, 1, 2, 3], lora_task_id=0), 0) == 46724052516932779
    assert block_key_hash(BlockKey(tokens=[1, 2, 3, 4], lora_task_id=123), 0) == (
        15718075209399076427
    )


def test_block_hashes_for_tokens_chains_full_blocks_and_ignores_the_tail() -> None:
    hashes = block_hashes_for_tokens([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    first = block_key_hash(BlockKey(tokens=[1, 2, 3, 4]), 0)
    assert hashes == [first, block_key_hash(BlockKey(tokens=[5, 6, 7, 8]), first)]
    assert block_hashes_for_tokens([1, 2, 3], 4) == []


def test_block_hashes_for_tokens_respects_every_namespace() -> None:
    tokens = list(range(32))
    plain = block_hashes_for_tokens(tokens, 16)
    assert block_hashes_for_tokens(tokens, 16, lora_task_id=0) != plain
    assert block_hashes_for_tokens(tokens, 16, cache_salt_id=7) != plain
    # a request that uses extra ids mixes them in, zeros included
    assert block_hashes_for_tokens(tokens, 16, extra_ids=[0] * 32) != plain
    item = MultimodalItem(bytes(range(32)), start=10, length=12)
    mm = block_hashes_for_tokens(tokens, 16, multimodal=[item])
    expected_first = block_key_hash(BlockKey(tokens=range(16), extra_keys=[(item.hash, 0)]), 0)
    expected_second = block_key_hash(
        BlockKey(tokens=range(16, 32), extra_keys=[(item.hash, 6)]), expected_first
    )
    assert mm == [expected_first, expected_second]
    # the salt enters only the first block's hash, but it is part of every key
    salted = block_hashes_for_tokens(tokens, 16, cache_salt_id=7)
    assert salted[1] == block_key_hash(BlockKey(tokens=range(16, 32), cache_salt_id=7), salted[0])


def test_negative_and_large_token_ids_wrap_like_int32() -> None:
    tokens = [-1, 2**31 - 1, -(2**31), 0]
    assert block_hashes_for_tokens(tokens, 4) == [block_key_hash(BlockKey(tokens=tokens), 0)]


def test_request_hashes_match_the_manager_and_the_router() -> None:
    """A request's cached hashes (used by the manager) equal block_hashes_for_tokens."""
    tokens = list(range(40))
    extra = [i % 3 for i in range(40)]
    request = LlmRequest(1, tokens, extra_ids=extra, lora_task_id=5, cache_salt_id=9)
    assert request.block_hashes(16, 39, False) == block_hashes_for_tokens(
        tokens[:32], 16, extra_ids=extra[:32], lora_task_id=5, cache_salt_id=9
    )
    # growing the request extends the cache without changing earlier hashes
    first = request.block_hashes(16, 32, False)
    for t in range(40, 49):
        request.add_new_token(t)
    assert request.block_hashes(16, 48, False)[:2] == first


@pytest.mark.parametrize("kind", ["array", "numpy"])
def test_token_words_given_hash_as_the_tokens_do(kind: str) -> None:
    """A request given its prompt's uint32 words (as a worker has them) hashes them instead of
    converting its tokens: the same hashes, partial tail included, and past the words (tokens
    it generated) from its tokens."""
    tokens = [7, 2**32 - 1, *range(1000, 1037), 2**31]
    words = array("I", tokens) if kind == "array" else np.array(tokens, dtype=np.uint32)
    options: dict[str, Any] = {"extra_ids": [i % 3 for i in range(40)], "lora_task_id": 5}
    given = LlmRequest(1, tokens, token_words=words, **options)
    plain = LlmRequest(1, tokens, **options)
    # one block first, then the rest of the prompt with its tail: both within the words
    assert given.block_hashes(16, 20, False) == plain.block_hashes(16, 20, False)
    assert given.block_hashes(16, 39, True) == plain.block_hashes(16, 39, True)
    assert given.block_keys(16, 39, True) == plain.block_keys(16, 39, True)
    for request in (given, plain):
        for t in range(40, 60):
            request.add_new_token(t)
    assert given.block_hashes(16, 59, True) == plain.block_hashes(16, 59, True)
    assert given.block_hashes(16, 59, False) == block_hashes_for_tokens(
        given.tokens[:48], 16, extra_ids=(given.extra_ids or [])[:48], lora_task_id=5
    )


def test_token_words_cut_by_remove_tokens_are_not_read_past_the_cut() -> None:
    """Tokens removed from inside the prompt (a rejected draft) and others appended: the
    words no longer cover them, the tokens are hashed."""
    tokens = list(range(100, 132))
    given = LlmRequest(1, tokens, token_words=array("I", tokens))
    given.remove_tokens(20)
    for t in range(900, 920):
        given.add_new_token(t)
    assert given.block_hashes(16, 32, False) == block_hashes_for_tokens(given.tokens, 16)


def test_token_words_are_what_is_hashed() -> None:
    """The words are read, not the tokens (the check compares only the first and last)."""
    tokens = list(range(100, 132))
    other = array("I", [100, *range(500, 530), 131])
    assert LlmRequest(1, tokens, token_words=other).block_hashes(16, 31, False) == (
        block_hashes_for_tokens(list(other)[:16], 16)
    )


@pytest.mark.parametrize(
    ("words", "message"),
    [
        ([1, 2, 3], "token_words must be a uint32 array or an array\\('I'\\), got list"),
        (np.array([1, 2, 3], dtype=np.int64), "token_words must be .*, got ndarray"),
        (array("i", [1, 2, 3]), "token_words must be .*, got array"),
        (array("I", [1, 2, 3, 4, 5]), r"token_words \(5\) are not the first of its 4 tokens"),
        (array("I", [1, 9]), r"token_words \(2\) are not the first of its 4 tokens"),
        (array("I", [2, 2]), r"token_words \(2\) are not the first of its 4 tokens"),
    ],
)
def test_token_words_that_are_not_the_first_tokens_are_refused(words: Any, message: str) -> None:
    with pytest.raises(ValueError, match=rf"request 3: {message}"):
        LlmRequest(3, [1, 2, 3, 4], token_words=words)


@pytest.mark.parametrize("with_extra", [False, True])
def test_a_partial_tail_hashes_as_its_key_below_the_full_blocks(with_extra: bool) -> None:
    """The tail is hashed in the same kernel call as the full blocks, or on its own once they
    are cached; either way it is block_key_hash of its key, as a Python int."""
    tokens = list(range(100, 139))
    extra = [i % 3 for i in range(39)] if with_extra else None
    full = block_hashes_for_tokens(
        tokens[:32], 16, extra_ids=extra[:32] if extra else None, lora_task_id=5, cache_salt_id=9
    )
    tail_key = BlockKey(
        tokens[32:39],
        extra[32:39] if extra else None,
        uses_extra_ids=with_extra,
        lora_task_id=5,
        cache_salt_id=9,
    )
    expected = [*full, block_key_hash(tail_key, full[-1])]

    at_once = LlmRequest(1, tokens, extra_ids=extra, lora_task_id=5, cache_salt_id=9)
    assert at_once.block_hashes(16, 39, True) == expected
    later = LlmRequest(2, tokens, extra_ids=extra, lora_task_id=5, cache_salt_id=9)
    assert later.block_hashes(16, 32, False) == full
    assert later.block_hashes(16, 39, True) == expected
    for request in (at_once, later):
        assert [type(h) for h in request.block_hashes(16, 39, True)] == [int, int, int]
        assert request.block_keys(16, 39, True)[-1] == tail_key
    # a rewritten tail token (a rewind) gives the new tail's hash
    later.tokens[35] = 7
    tail_key.tokens = (*tokens[32:35], 7, *tokens[36:39])
    assert later.block_hashes(16, 39, True)[-1] == block_key_hash(tail_key, full[-1])


def test_block_key_validation() -> None:
    with pytest.raises(ValueError, match="extra_ids has 1 entries for 2 tokens"):
        BlockKey(tokens=[1, 2], extra_ids=[5])
    with pytest.raises(ValueError, match="32 bytes"):
        MultimodalItem(b"short", 0, 1)
    with pytest.raises(ValueError, match="tokens_per_block must be positive"):
        block_hashes_for_tokens([1], 0)


def test_partial_match_compares_tokens_only_within_a_namespace() -> None:
    a = BlockKey(tokens=[1, 2, 3, 4])
    assert a.partial_match(BlockKey(tokens=[1, 2, 9])) == 2
    assert a.partial_match(BlockKey(tokens=[1, 2, 9], lora_task_id=0)) == 0
    assert a.partial_match(BlockKey(tokens=[1, 2, 3], cache_salt_id=1)) == 0
    with_extra = BlockKey(tokens=[1, 2, 3], extra_ids=[0, 5, 0], uses_extra_ids=True)
    assert a.partial_match(with_extra) == 1


@pytest.mark.parametrize("seed", range(6))
def test_plain_kernel_matches_the_python_hasher(seed: int) -> None:
    """`block_hash_array` takes a short kernel for plain prompts: the same hashes as the Python
    reference on random prompts (lengths, block sizes, ids that wrap, lists and arrays)."""
    rng = random.Random(seed)
    for _ in range(20):
        tokens_per_block = rng.choice([1, 2, 4, 16, 32, 64])
        n = rng.randrange(0, 6 * tokens_per_block + 3)
        tokens = [rng.randrange(-(2**31), 2**32) for _ in range(n)]
        expected = [int(h) for h in block_hash_array(tokens, tokens_per_block, use_numba=False)]
        for given in (tokens, as_token_array(tokens), np.array(tokens, dtype=np.int64)):
            compiled = block_hash_array(given, tokens_per_block)
            assert compiled.dtype == np.uint64
            assert compiled.tolist() == expected
            assert block_hashes_for_tokens(given, tokens_per_block) == expected
        # The general kernel (any namespace) agrees too, and so does the per-key reference.
        num_full = n // tokens_per_block
        arr = as_token_array(tokens)[: num_full * tokens_per_block]
        assert hash_token_blocks(arr, tokens_per_block, num_full).tolist() == expected
        parent = 0
        for b in range(num_full):
            key = BlockKey(tokens=tokens[b * tokens_per_block : (b + 1) * tokens_per_block])
            parent = block_key_hash(key, parent)
            assert expected[b] == parent


def test_block_hash_array_keeps_every_namespace() -> None:
    tokens = list(range(40))
    item = MultimodalItem(bytes(range(32)), start=10, length=12)
    for kwargs in (
        {"lora_task_id": 5},
        {"cache_salt_id": 9},
        {"extra_ids": [i % 3 for i in range(40)]},
        {"multimodal": [item]},
    ):
        expected = block_hashes_for_tokens(tokens, 16, **kwargs)
        assert block_hash_array(tokens, 16, **kwargs).tolist() == expected
        python = block_hash_array(tokens, 16, use_numba=False, **kwargs)
        assert python.tolist() == expected
        assert expected != block_hashes_for_tokens(tokens, 16)
    with pytest.raises(ValueError, match="tokens_per_block must be positive"):
        block_hash_array([1], 0)
