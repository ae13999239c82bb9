"""Block identity: `BlockKey` and the seed's `BlockKeyHasher`, bit for bit.

A block's hash chains its key onto its parent's hash, so one hash names a whole prefix. Two
implementations compute it and both are checked against the C++ golden vectors:

* `block_key_hash` — pure Python, one key at a time (the reference; also the fallback);
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

BlockHash = NewType("BlockHash", int)

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
_MUL_A = 0xBF58476D1CE4E5B9
_MUL_B = 0x94D049BB133111EB
_MUL_32 = 0x45D9F3B
_GOLDEN = 0x9E3779B9


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


ExtraKey = tuple[bytes, int]  # (32-byte multimodal hash, start offset of the block within the item)


class BlockKey:
    """The seed's BlockKey: what makes two blocks interchangeable.

    Equality covers the uses-extra-ids flag, the LoRA task id (None and 0 differ), the tokens with
    their extra ids, the multimodal extra keys and the cache salt id.
    """

    __slots__ = (
        "cache_salt_id",
        "extra_ids",
        "extra_keys",
        "lora_task_id",
        "tokens",
        "uses_extra_ids",
    )

    def __init__(
        self,
        tokens: Sequence[int] = (),
        extra_ids: Sequence[int] | None = None,
        uses_extra_ids: bool = False,
        lora_task_id: int | None = None,
        extra_keys: Sequence[ExtraKey] = (),
        cache_salt_id: int | None = None,
    ) -> None:
        self.tokens: tuple[int, ...] = tuple(tokens)
        # Without extra ids every token's extra id is 0, as in the seed's UniqueToken.
        self.extra_ids: tuple[int, ...] | None = (
            tuple(extra_ids) if extra_ids is not None and any(extra_ids) else None
        )
        if self.extra_ids is not None and len(self.extra_ids) != len(self.tokens):
            raise ValueError(
                f"extra_ids has {len(self.extra_ids)} entries for {len(self.tokens)} tokens"
            )
        self.uses_extra_ids = uses_extra_ids
        self.lora_task_id = lora_task_id
        self.extra_keys: tuple[ExtraKey, ...] = tuple((bytes(h), int(o)) for h, o in extra_keys)
        self.cache_salt_id = cache_salt_id

    @classmethod
    def _make(
        cls,
        tokens: tuple[int, ...],
        extra_ids: tuple[int, ...] | None,
        uses_extra_ids: bool,
        lora_task_id: int | None,
        extra_keys: tuple[ExtraKey, ...],
        cache_salt_id: int | None,
    ) -> BlockKey:
        """Trusted constructor for the hot path: no copies, no validation."""
        key = cls.__new__(cls)
        key.tokens = tokens
        key.extra_ids = extra_ids
        key.uses_extra_ids = uses_extra_ids
        key.lora_task_id = lora_task_id
        key.extra_keys = extra_keys
        key.cache_salt_id = cache_salt_id
        return key

    def token_extra_ids(self) -> tuple[int, ...]:
        return self.extra_ids if self.extra_ids is not None else (0,) * len(self.tokens)

    def same_namespace(self, other: BlockKey) -> bool:
        """Equal on everything but the tokens (what partial matching requires)."""
        return (
            self.lora_task_id == other.lora_task_id
            and self.extra_keys == other.extra_keys
            and self.cache_salt_id == other.cache_salt_id
        )

    def partial_match(self, other: BlockKey) -> int:
        """Number of leading (token, extra id) pairs shared with `other`; 0 across namespaces."""
        if not self.same_namespace(other):
            return 0
        a, b = self.tokens, other.tokens
        n = min(len(a), len(b))
        i = 0
        while i < n and a[i] == b[i]:
            i += 1
        if self.extra_ids is not None or other.extra_ids is not None:
            ea, eb = self.token_extra_ids(), other.token_extra_ids()
            j = 0
            while j < i and ea[j] == eb[j]:
                j += 1
            i = j
        return i

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockKey):
            return NotImplemented
        return (
            self.tokens == other.tokens
            and self.extra_ids == other.extra_ids
            and self.uses_extra_ids == other.uses_extra_ids
            and self.lora_task_id == other.lora_task_id
            and self.extra_keys == other.extra_keys
            and self.cache_salt_id == other.cache_salt_id
        )

    def __hash__(self) -> int:
        return block_key_hash(self, 0)

    def __repr__(self) -> str:
        return (
            f"BlockKey(tokens={list(self.tokens)}, lora_task_id={self.lora_task_id}, "
            f"extra_keys={len(self.extra_keys)}, cache_salt_id={self.cache_salt_id})"
        )


def _mix64(x: int) -> int:
    x = ((x ^ (x >> 30)) * _MUL_A) & _M64
    x = ((x ^ (x >> 27)) * _MUL_B) & _M64
    return x ^ (x >> 31)


def _mix32(a: int) -> int:
    a = (((a >> 16) ^ a) * _MUL_32) & _M32
    a = (((a >> 16) ^ a) * _MUL_32) & _M32
    return (a >> 16) ^ a


def _combine(seed: int, value: int) -> int:
    return seed ^ ((value + ((seed << 6) & _M64) + (seed >> 2)) & _M64)


def block_key_hash(key: BlockKey, parent_hash: int) -> int:
    """The seed's BlockKeyHasher::hash(blockKey, parentHash), pure Python."""
    seed = len(key.tokens) ^ ((parent_hash * _MUL_A) & _M64)
    if parent_hash == 0 and key.cache_salt_id is not None:
        seed = _combine(seed, _mix64(key.cache_salt_id & _M64) + _GOLDEN)
    extra = key.token_extra_ids() if key.uses_extra_ids else None
    for i, token in enumerate(key.tokens):
        seed = _combine(seed, (_mix32(token & _M32) + _GOLDEN) & _M32)
        if extra is not None:
            seed = _combine(seed, _mix64(extra[i] & _M64) + _GOLDEN)
    if key.lora_task_id is not None:
        seed = _combine(seed, _mix64(key.lora_task_id & _M64) + _GOLDEN)
    for mm_hash, offset in key.extra_keys:
        for i in range(0, 32, 4):
            word = int.from_bytes(mm_hash[i : i + 4], "little")
            seed = _combine(seed, (_mix32(word) + _GOLDEN) & _M32)
        seed = _combine(seed, _mix64(offset & _M64) + _GOLDEN)
    return seed


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
