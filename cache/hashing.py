"""Block identity: `BlockKey` and the seed's `BlockKeyHasher`, bit for bit.

A block's hash chains its key onto its parent's hash, so one hash names a whole prefix. Two
implementations compute it and both are checked against the C++ golden vectors:

* `block_key_hash` — pure Python, one key at a time (the reference; also the fallback; it lives
  with `BlockKey` in `cache.key`, which mypyc compiles, and is re-exported here);
* a numba kernel that hashes every block of a token sequence in one call. The manager and the
  router use it through `hash_token_blocks` / `block_hashes_for_tokens`, so no request pays a
  per-token Python loop. A prompt with no extra ids, LoRA, salt or multimodal items takes a
  shorter kernel of three arguments (`block_hash_array`, which also leaves the hashes in a
  uint64 array, as `PrefixIndex.find_matches` takes them, instead of a Python int each).

C++ arithmetic to mirror: token ids and multimodal words are mixed as uint32, and
`a + 0x9e3779b9` wraps at 32 bits *before* it is widened into the 64-bit seed; 64-bit values
(extra ids, LoRA id, salt id, start offsets) are mixed as uint64.
"""

from __future__ import annotations

import array
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NewType

import numpy as np
import numpy.typing as npt

from cache.key import (
    _GOLDEN,
    _M32,
    _M64,
    _MUL_32,
    _MUL_A,
    _MUL_B,
)
from cache.key import (
    BlockKey as BlockKey,
)
from cache.key import (
    ExtraKey as ExtraKey,
)
from cache.key import (
    block_key_hash as block_key_hash,
)

BlockHash = NewType("BlockHash", int)


@dataclass(frozen=True, slots=True)
class MultimodalItem:
    """One multimodal input: its 32-byte content hash and the token range it occupies."""

    hash: bytes
    start: int
    length: int

    def __post_init__(self) -> None:
        if len(self.hash) != 32:
            raise ValueError(f"multimodal hash must be 32 bytes, got {len(self.hash)}")
        if self.start < 0 or self.length < 0:
            raise ValueError(
                f"multimodal item range must be non-negative: {self.start}+{self.length}"
            )


def block_extra_keys(
    multimodal: Sequence[MultimodalItem], start: int, end: int
) -> tuple[ExtraKey, ...]:
    """generateBlockHashExtraKeys: the items overlapping tokens [start, end), with offsets."""
    keys: list[ExtraKey] = []
    for item in multimodal:
        if end > item.start and start < item.start + item.length:
            keys.append((item.hash, 0 if item.start >= start else start - item.start))
    return tuple(keys)


# --------------------------------------------------------------------------------------------
# Vectorised hashing of a whole token sequence.

U32Array = npt.NDArray[np.uint32]
U64Array = npt.NDArray[np.uint64]


def _hash_blocks_py(
    tokens: U32Array,
    extra: U64Array,
    uses_extra: bool,
    tokens_per_block: int,
    token_offset: int,
    parent: int,
    lora_on: bool,
    lora: int,
    salt_on: bool,
    salt: int,
    mm_words: U32Array,
    mm_pos: npt.NDArray[np.int64],
    mm_len: npt.NDArray[np.int64],
    out: U64Array,
) -> None:
    """Reference implementation of the kernel below (and its fallback without numba)."""
    n_tokens = len(tokens)
    items = [
        (bytes(mm_words[k].astype("<u4").tobytes()), int(mm_pos[k]), int(mm_len[k]))
        for k in range(len(mm_pos))
    ]
    mm = [MultimodalItem(h, p, n) for h, p, n in items]
    parent = int(parent)
    lora, salt = int(lora), int(salt)
    tok = tokens.tolist()
    ext = extra.tolist() if uses_extra else None
    for b in range(len(out)):
        start = b * tokens_per_block
        end = min(start + tokens_per_block, n_tokens)
        key = BlockKey._make(
            tuple(tok[start:end]),
            tuple(ext[start:end]) if ext is not None else None,
            uses_extra,
            lora if lora_on else None,
            block_extra_keys(mm, token_offset + start, token_offset + end),
            salt if salt_on else None,
        )
        parent = block_key_hash(key, parent)
        out[b] = parent


try:  # numba is a declared dependency; without it (or with KVMESH_NO_NUMBA) Python hashes
    import numba

    _HAVE_NUMBA = True
except ImportError:  # pragma: no cover
    _HAVE_NUMBA = False

_KERNEL: Any = None
_PLAIN_KERNEL: Any = None

if _HAVE_NUMBA and not os.environ.get("KVMESH_NO_NUMBA"):
    # Module-level functions, so that numba's on-disk cache (cache=True) is reused by every
    # process; the constants are uint64 so that numba never promotes the arithmetic to float.
    _U_MUL_A = np.uint64(_MUL_A)
    _U_MUL_B = np.uint64(_MUL_B)
    _U_MUL_32 = np.uint64(_MUL_32)
    _U_GOLDEN = np.uint64(_GOLDEN)
    _U_M32 = np.uint64(_M32)
    _U_ZERO = np.uint64(0)
    _S2, _S6, _S16 = np.uint64(2), np.uint64(6), np.uint64(16)
    _S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)

    @numba.njit(cache=True, nogil=True, inline="always")
    def _nb_mix64(x):  # type: ignore[no-untyped-def]
        x = (x ^ (x >> _S30)) * _U_MUL_A
        x = (x ^ (x >> _S27)) * _U_MUL_B
        return x ^ (x >> _S31)

    @numba.njit(cache=True, nogil=True, inline="always")
    def _nb_mix32(a):  # type: ignore[no-untyped-def]
        # uint32 semantics in uint64 registers: mask back to 32 bits after every multiply.
        a = (((a >> _S16) ^ a) * _U_MUL_32) & _U_M32
        a = (((a >> _S16) ^ a) * _U_MUL_32) & _U_M32
        return (a >> _S16) ^ a

    @numba.njit(cache=True, nogil=True, inline="always")
    def _nb_combine(seed, value):  # type: ignore[no-untyped-def]
        return seed ^ (value + (seed << _S6) + (seed >> _S2))

    @numba.njit(cache=True, nogil=True)
    def _nb_hash_blocks(  # type: ignore[no-untyped-def]
        tokens,
        extra,
        uses_extra,
        tokens_per_block,
        token_offset,
        parent,
        lora_on,
        lora,
        salt_on,
        salt,
        mm_words,
        mm_pos,
        mm_len,
        out,
    ):
        n_tokens = tokens.shape[0]
        for b in range(out.shape[0]):
            start = b * tokens_per_block
            end = min(start + tokens_per_block, n_tokens)
            seed = np.uint64(end - start) ^ (parent * _U_MUL_A)
            if parent == _U_ZERO and salt_on:
                seed = _nb_combine(seed, _nb_mix64(salt) + _U_GOLDEN)
            for t in range(start, end):
                seed = _nb_combine(seed, (_nb_mix32(np.uint64(tokens[t])) + _U_GOLDEN) & _U_M32)
                if uses_extra:
                    seed = _nb_combine(seed, _nb_mix64(np.uint64(extra[t])) + _U_GOLDEN)
            if lora_on:
                seed = _nb_combine(seed, _nb_mix64(lora) + _U_GOLDEN)
            abs_start = token_offset + start
            abs_end = token_offset + end
            for k in range(mm_pos.shape[0]):
                if abs_end > mm_pos[k] and abs_start < mm_pos[k] + mm_len[k]:
                    for w in range(8):
                        word = np.uint64(mm_words[k, w])
                        seed = _nb_combine(seed, (_nb_mix32(word) + _U_GOLDEN) & _U_M32)
                    offset = 0 if mm_pos[k] >= abs_start else abs_start - mm_pos[k]
                    seed = _nb_combine(seed, _nb_mix64(np.uint64(offset)) + _U_GOLDEN)
            out[b] = seed
            parent = seed

    @numba.njit(cache=True, nogil=True)
    def _nb_hash_plain(tokens, tokens_per_block, out):  # type: ignore[no-untyped-def]
        """`_nb_hash_blocks` for full blocks of plain tokens from the root: no extra ids, LoRA,
        salt or multimodal items, so a router's hash of a prompt is one short dispatch."""
        parent = _U_ZERO
        length = np.uint64(tokens_per_block)
        for b in range(out.shape[0]):
            seed = length ^ (parent * _U_MUL_A)
            for t in range(b * tokens_per_block, (b + 1) * tokens_per_block):
                seed = _nb_combine(seed, (_nb_mix32(np.uint64(tokens[t])) + _U_GOLDEN) & _U_M32)
            out[b] = seed
            parent = seed

    _KERNEL = _nb_hash_blocks
    _PLAIN_KERNEL = _nb_hash_plain

HASH_IMPL = "numba" if _KERNEL is not None else "python"
_EMPTY_U64 = np.zeros(0, dtype=np.uint64)
_EMPTY_WORDS = np.zeros((0, 8), dtype=np.uint32)
_EMPTY_I64 = np.zeros(0, dtype=np.int64)


def as_token_array(tokens: Sequence[int] | npt.NDArray[Any]) -> U32Array:
    """Token ids as the uint32 words the hasher mixes (negative int32 ids wrap as in C++)."""
    if isinstance(tokens, np.ndarray):
        return tokens if tokens.dtype == np.uint32 else tokens.astype(np.int64).astype(np.uint32)
    try:  # one C-level conversion; "I" is three times faster than "i" on CPython 3.11
        return np.frombuffer(array.array("I", tokens), dtype=np.uint32)
    except OverflowError:
        pass
    try:  # negative int32 ids, reinterpreted as uint32
        return np.frombuffer(array.array("i", tokens), dtype=np.uint32)
    except OverflowError:
        return np.asarray(tokens, dtype=np.int64).astype(np.uint32)


def multimodal_arrays(
    multimodal: Sequence[MultimodalItem],
) -> tuple[U32Array, npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    if not multimodal:
        return _EMPTY_WORDS, _EMPTY_I64, _EMPTY_I64
    words = np.frombuffer(b"".join(m.hash for m in multimodal), dtype="<u4").reshape(-1, 8)
    pos = np.array([m.start for m in multimodal], dtype=np.int64)
    lengths = np.array([m.length for m in multimodal], dtype=np.int64)
    return words.astype(np.uint32), pos, lengths


def hash_token_blocks(
    tokens: U32Array,
    tokens_per_block: int,
    num_blocks: int,
    *,
    parent_hash: int = 0,
    token_offset: int = 0,
    extra_ids: U64Array | None = None,
    lora_task_id: int | None = None,
    cache_salt_id: int | None = None,
    mm: tuple[U32Array, npt.NDArray[np.int64], npt.NDArray[np.int64]] | None = None,
    use_numba: bool = True,
) -> U64Array:
    """Chained hashes of `num_blocks` consecutive blocks of `tokens` (the last may be partial).

    `tokens` start at absolute position `token_offset` of the request (for multimodal offsets) and
    the first block hangs below `parent_hash`.
    """
    out = np.empty(num_blocks, dtype=np.uint64)
    if num_blocks == 0:
        return out
    words, pos, lengths = mm if mm is not None else (_EMPTY_WORDS, _EMPTY_I64, _EMPTY_I64)
    uses_extra = extra_ids is not None
    args: tuple[Any, ...] = (
        tokens,
        extra_ids if extra_ids is not None else _EMPTY_U64,
        uses_extra,
        tokens_per_block,
        token_offset,
        np.uint64(parent_hash),
        lora_task_id is not None,
        np.uint64((lora_task_id or 0) & _M64),
        cache_salt_id is not None,
        np.uint64((cache_salt_id or 0) & _M64),
        words,
        pos,
        lengths,
        out,
    )
    if use_numba and _KERNEL is not None:
        _KERNEL(*args)
    else:
        _hash_blocks_py(*args)
    return out


def block_hash_array(
    tokens: Sequence[int] | npt.NDArray[Any],
    tokens_per_block: int,
    *,
    extra_ids: Sequence[int] | None = None,
    lora_task_id: int | None = None,
    cache_salt_id: int | None = None,
    multimodal: Sequence[MultimodalItem] = (),
    use_numba: bool = True,
) -> U64Array:
    """`block_hashes_for_tokens` as a uint64 array, with no Python int made per block (what
    `PrefixIndex.find_matches` takes fastest)."""
    if tokens_per_block <= 0:
        raise ValueError(f"tokens_per_block must be positive, got {tokens_per_block}")
    arr = as_token_array(tokens)
    num_full = len(arr) // tokens_per_block
    if (
        extra_ids is None
        and lora_task_id is None
        and cache_salt_id is None
        and not multimodal
        and use_numba
        and _PLAIN_KERNEL is not None
    ):
        out = np.empty(num_full, dtype=np.uint64)
        _PLAIN_KERNEL(arr, tokens_per_block, out)
        return out
    extra = None
    if extra_ids is not None:
        if len(extra_ids) != len(arr):
            raise ValueError(f"extra_ids has {len(extra_ids)} entries for {len(arr)} tokens")
        extra = np.asarray(extra_ids, dtype=np.uint64)
    return hash_token_blocks(
        arr[: num_full * tokens_per_block],
        tokens_per_block,
        num_full,
        extra_ids=extra,
        lora_task_id=lora_task_id,
        cache_salt_id=cache_salt_id,
        mm=multimodal_arrays(multimodal) if multimodal else None,
        use_numba=use_numba,
    )


def block_hashes_for_tokens(
    tokens: Sequence[int] | npt.NDArray[Any],
    tokens_per_block: int,
    *,
    extra_ids: Sequence[int] | None = None,
    lora_task_id: int | None = None,
    cache_salt_id: int | None = None,
    multimodal: Sequence[MultimodalItem] = (),
) -> list[int]:
    """Chained hashes of the full blocks of `tokens` (a partial tail is ignored).

    These are exactly the hashes the manager gives those blocks when it stores them, so a router
    can match a request against the events of any worker.
    """
    hashes = block_hash_array(
        tokens,
        tokens_per_block,
        extra_ids=extra_ids,
        lora_task_id=lora_task_id,
        cache_salt_id=cache_salt_id,
        multimodal=multimodal,
    )
    result: list[int] = hashes.tolist()
    return result


def cache_salt_id(salt: str) -> int:
    """The 64-bit id a cache salt string enters block keys as (its BLAKE2b-64, little-endian).

    Workers and routers must agree on it, so it lives here rather than in either of them.
    """
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little")
