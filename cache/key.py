"""BlockKey, what makes two blocks interchangeable, and its pure-Python chained hash.

Its own module so that mypyc can compile it with the hot paths (`cache._native`); everything
else about hashing, the numba kernels included, stays in `cache.hashing`, which re-exports these.
"""

from __future__ import annotations

from collections.abc import Sequence

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
_MUL_A = 0xBF58476D1CE4E5B9
_MUL_B = 0x94D049BB133111EB
_MUL_32 = 0x45D9F3B
_GOLDEN = 0x9E3779B9

ExtraKey = tuple[bytes, int]  # (32-byte multimodal hash, start offset of the block within the item)


# Compiled by mypyc, BlockKey is a native class: made by its constructor (a C call), never by
# object.__new__, which refuses it.
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
        self.tokens: tuple[int, ...] = tokens if type(tokens) is tuple else tuple(tokens)
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
        self.extra_keys: tuple[ExtraKey, ...] = (
            tuple((bytes(h), int(o)) for h, o in extra_keys) if extra_keys else ()
        )
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
        """A key from fields already in canonical form (what the constructor would make)."""
        return BlockKey(tokens, extra_ids, uses_extra_ids, lora_task_id, extra_keys, cache_salt_id)

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
