"""Requests as the block manager sees them.

`LlmRequest` keeps what the manager reads from TensorRT-LLM's LlmRequest (tokens, beam width,
LoRA id, cache salt, multimodal items, retention) plus the per-request statistics it writes. It
caches the chained hashes of its full blocks, so a prompt is hashed once however often it is
matched and stored. `GenerationRequest` is the manager's own per-sequence state.
"""

from __future__ import annotations

import warnings
from array import array
from collections.abc import Mapping, Sequence
from enum import Enum
from functools import partial
from itertools import takewhile
from operator import attrgetter, is_not
from typing import Any, Protocol, cast

import numpy as np
import numpy.typing as npt

from cache.hashing import (
    BlockHash,
    BlockKey,
    MultimodalItem,
    as_token_array,
    block_extra_keys,
    hash_token_blocks,
    multimodal_arrays,
)
from cache.retention import DEFAULT_RETENTION, RetentionConfig, TransferMode

INT_MAX = 2**31 - 1
_key = attrgetter("key")
_is_block = partial(is_not, None)


class _HasKey(Protocol):
    @property
    def key(self) -> BlockKey: ...


def chop_vector_into_blocks(
    items: Sequence[int], usable: int, tokens_per_block: int, allow_partial: bool
) -> list[list[int]]:
    """chopVectorIntoBlocks: the first `usable` items in blocks, partial tail if allowed."""
    usable = max(0, min(usable, len(items)))
    end = usable if allow_partial else usable - usable % tokens_per_block
    return [
        list(items[i : min(i + tokens_per_block, end)]) for i in range(0, end, tokens_per_block)
    ]


def _plain_keys_hold(
    keys: list[BlockKey],
    tokens: list[int],
    start: int,
    stop: int,
    lora: int | None,
    salt: int | None,
) -> bool:
    """Whether `keys` are plain keys of a request with this LoRA id and salt (no extra ids,
    no multimodal keys) holding, one after the other, exactly tokens[start:stop].

    Keys hold at most tokens_per_block tokens each, so with stop - start equal to
    len(keys) * tokens_per_block, equal concatenations mean equal blocks. Written for the
    compiled build (native field reads, tokens compared in place, nothing allocated); the
    sources run the same loop, slower.
    """
    pos = start
    for key in keys:
        if (
            key.lora_task_id != lora
            or key.cache_salt_id != salt
            or key.extra_ids is not None
            or key.uses_extra_ids
            or key.extra_keys
        ):
            return False
        for token in key.tokens:
            if pos >= stop or token != tokens[pos]:
                return False
            pos += 1
    return pos == stop


def _is_u32_buffer(value: Any) -> bool:
    """An ``array("I")`` of 4-byte items (the uint32 words ``token_words`` takes)."""
    return isinstance(value, array) and value.typecode == "I" and value.itemsize == 4


def _python_ints(values: list[Any]) -> list[int]:
    """`values`, or its items as Python ints where some are not (numpy's integers, say): the
    compiled modules read tokens as native ints, and would refuse them. Both builds convert,
    so that a request's tokens (and the keys and events made of them) are the same in both."""
    for value in values:
        if not isinstance(value, int):
            return [int(v) for v in values]
    return values


class RequestState(Enum):
    CONTEXT_INIT = "context_init"
    DISAGG_GENERATION_INIT = "disagg_generation_init"
    GENERATION_IN_PROGRESS = "generation_in_progress"
    GENERATION_COMPLETE = "generation_complete"


class LlmRequest:
    def __init__(
        self,
        request_id: int,
        tokens: Sequence[int] | npt.NDArray[Any],
        beam_width: int = 1,
        max_new_tokens: int = 0,
        extra_ids: Sequence[int] | None = None,
        lora_task_id: int | None = None,
        cache_salt_id: int | None = None,
        multimodal: Sequence[MultimodalItem] = (),
        retention: RetentionConfig | None = None,
        state: RequestState = RequestState.CONTEXT_INIT,
        num_draft_tokens: int = 0,
        cache_salt: str | None = None,
        encoder_tokens: Sequence[int] | None = None,
        is_dummy: bool = False,
        token_words: Any = None,
    ) -> None:
        if beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {beam_width}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        self.request_id = request_id
        # A copy: generated tokens are appended here, never to the caller's prompt list.
        self.tokens: list[int] = (
            _python_ints(list(tokens)) if isinstance(tokens, list) else [int(t) for t in tokens]
        )
        if extra_ids is not None and len(extra_ids) != len(self.tokens):
            raise ValueError(
                f"request {request_id}: extra_ids has {len(extra_ids)} entries "
                f"for {len(self.tokens)} tokens"
            )
        self.extra_ids: list[int] | None = (
            _python_ints(list(extra_ids)) if extra_ids is not None else None
        )
        self.prompt_len = len(self.tokens)
        # The first ids as uint32 words (a uint32 array or an array("I")), where the caller made
        # them already (a worker checks a prompt's ids that way): the hasher reads them instead
        # of converting the list again (~25 µs for 4,096 ids).
        self._words: Any = None if token_words is None else self._check_words(token_words)
        self.max_new_tokens = max_new_tokens
        self.beam_width = beam_width
        self.lora_task_id = lora_task_id
        self.cache_salt_id = cache_salt_id
        self.cache_salt = cache_salt
        self.multimodal: tuple[MultimodalItem, ...] = tuple(multimodal)
        self.retention = retention
        self.state = state
        self.num_draft_tokens = num_draft_tokens
        self.encoder_tokens: list[int] | None = (
            _python_ints(list(encoder_tokens)) if encoder_tokens is not None else None
        )
        self.is_dummy = is_dummy
        self.is_first_context_chunk = True
        self.prepopulated_prompt_len = 0
        self.context_current_position = 0
        self.alloc_total_blocks = 0
        self.alloc_new_blocks = 0
        self.reused_blocks = 0
        self.missed_blocks = 0
        # Chained hashes of full blocks, per tokens_per_block (and source of tokens).
        self._hash_cache: dict[tuple[int, bool], list[BlockHash]] = {}
        self._key_cache: dict[tuple[int, bool], list[BlockKey]] = {}
        # (tokens_per_block, encoder) -> (usable tokens, partial tail key, its hash)
        self._tail_cache: dict[tuple[int, bool], tuple[int, BlockKey, int]] = {}
        self._mm_arrays: Any = None

    def _check_words(self, token_words: Any) -> Any:
        """``token_words`` as a uint32 array, if it is one (or an ``array("I")``) no longer
        than the tokens, with their first and last ids (a cheap check, not a proof)."""
        words = (
            np.frombuffer(token_words, dtype=np.uint32)
            if _is_u32_buffer(token_words)
            else token_words
        )
        if not isinstance(words, np.ndarray) or words.dtype != np.uint32 or words.ndim != 1:
            raise ValueError(
                f"request {self.request_id}: token_words must be a uint32 array or an "
                f"array('I'), got {type(token_words).__name__}"
            )
        count = len(words)
        tokens = self.tokens
        if count > len(tokens) or (
            count and (int(words[0]) != tokens[0] or int(words[-1]) != tokens[count - 1])
        ):
            raise ValueError(
                f"request {self.request_id}: token_words ({count}) are not the first of its "
                f"{len(tokens)} tokens"
            )
        return words

    @property
    def uses_extra_ids(self) -> bool:
        return self.extra_ids is not None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def encoder_output_len(self) -> int:
        return len(self.encoder_tokens) if self.encoder_tokens is not None else 0

    def add_new_token(self, token: int) -> None:
        """Append a generated token (extra id 0 when the request uses extra ids)."""
        self.tokens.append(int(token))
        if self.extra_ids is not None:
            self.extra_ids.append(0)

    def remove_tokens(self, num_tokens: int) -> None:
        """Drop the last `num_tokens` tokens (speculative decoding rejected them).

        Tokens are otherwise append-only: the keys and hashes cached for full blocks rely on it,
        so shortening the token list any other way must be followed by this call's cache trim.
        """
        if not 0 <= num_tokens <= len(self.tokens):
            raise ValueError(
                f"request {self.request_id}: cannot remove {num_tokens} "
                f"of {len(self.tokens)} tokens"
            )
        del self.tokens[len(self.tokens) - num_tokens :]
        if self.extra_ids is not None:
            del self.extra_ids[len(self.extra_ids) - num_tokens :]
        self._trim_caches()

    def _trim_caches(self) -> None:
        """Forget cached keys and hashes of blocks the token list no longer fills."""
        self._tail_cache.clear()
        if self._words is not None and len(self._words) > len(self.tokens):
            self._words = self._words[: len(self.tokens)]  # the ids after are not the words'
        for (tokens_per_block, encoder), cache in self._key_cache.items():
            del cache[len(self._source(encoder)[0]) // tokens_per_block :]
        for (tokens_per_block, encoder), hashes in self._hash_cache.items():
            del hashes[len(self._source(encoder)[0]) // tokens_per_block :]

    def set_prepopulated_prompt_len(self, length: int) -> None:
        self.prepopulated_prompt_len = length
        self.context_current_position = length

    # -- block keys and hashes -----------------------------------------------------------------

    def _source(self, encoder: bool) -> tuple[list[int], list[int] | None]:
        if encoder:
            assert self.encoder_tokens is not None
            return self.encoder_tokens, None
        return self.tokens, self.extra_ids

    def block_keys(
        self,
        tokens_per_block: int,
        usable: int,
        allow_partial: bool,
        encoder: bool = False,
        known: Mapping[int, _HasKey] | None = None,
    ) -> list[BlockKey]:
        """chopVectorIntoBlocks + buildBlockKeys over the first `usable` tokens.

        Keys of full blocks are cached: tokens are append-only, so they never change. `known`
        (a reuse tree's blocks by chained hash) lends its equal keys instead of new ones, so
        that matching them against the tree compares by identity.
        """
        tokens = self._source(encoder)[0]
        usable = max(0, min(usable, len(tokens)))
        num_full = usable // tokens_per_block
        cache = self._key_cache.setdefault((tokens_per_block, encoder), [])
        if len(cache) * tokens_per_block > len(tokens):
            self._trim_caches()  # the token list was shortened behind our back
        if len(cache) < num_full:
            start = len(cache)
            lent: list[_HasKey] = []
            if known:
                hashes = self.block_hashes(
                    tokens_per_block, num_full * tokens_per_block, False, encoder
                )
                # Up to the first hash the flat map lacks, where the match's flat walk stops
                # too; a block past it (found, if at all, by the per-node walk) is compared by
                # value.
                found = takewhile(_is_block, map(known.get, hashes[start:num_full]))
                lent = cast(list[_HasKey], list(found))
            cache.extend(
                self._make_keys(
                    start * tokens_per_block,
                    num_full * tokens_per_block,
                    tokens_per_block,
                    encoder,
                    lent,
                )
            )
        keys = cache[:num_full]
        if allow_partial and usable % tokens_per_block:
            keys.append(self._tail(tokens_per_block, usable, encoder)[0])
        return keys

    def share_block_keys(
        self, tokens_per_block: int, keys: Sequence[BlockKey], encoder: bool = False
    ) -> None:
        """Keep `keys` (equal to what `block_keys` returned, position by position, some of
        them the reuse tree's own objects) as the cached keys of the full blocks, so that the
        next walk of the tree compares them by identity."""
        cache = self._key_cache.get((tokens_per_block, encoder))
        if cache:
            n = min(len(cache), len(keys))
            cache[:n] = keys[:n]

    def _tail(self, tokens_per_block: int, usable: int, encoder: bool) -> tuple[BlockKey, int]:
        """The key of the partial block after the full ones, and its hash below them (the hash
        is cached: a request is added and released with the same partial tail)."""
        num_full = usable // tokens_per_block
        start = num_full * tokens_per_block
        cached = self._tail_cache.get((tokens_per_block, encoder))
        # The same key below the same full blocks (whose cached hashes stay valid) has the
        # same hash; tokens may have been rewritten in place, so the key is compared. Without
        # extra ids only the tokens can differ (the rest is the request's, or the position's).
        if cached is not None and cached[0] == usable:
            tokens, extra = self._source(encoder)
            if extra is None and cached[1].tokens == tuple(tokens[start:usable]):
                return cached[1], cached[2]
        key = self._make_keys(start, usable, tokens_per_block, encoder)[0]
        if cached is not None and cached[0] == usable and cached[1] == key:
            return cached[1], cached[2]
        hashes = self.block_hashes(tokens_per_block, start, False, encoder)
        key_hash = int(
            self._hash_blocks(
                start, usable, tokens_per_block, encoder, hashes[-1] if hashes else 0
            )[0]
        )
        self._tail_cache[(tokens_per_block, encoder)] = (usable, key, key_hash)
        return key, key_hash

    def _make_keys(
        self,
        start: int,
        stop: int,
        tokens_per_block: int,
        encoder: bool,
        lent: Sequence[_HasKey] = (),
    ) -> list[BlockKey]:
        """Keys of the blocks of tokens [start, stop); `start` lies on a block boundary.

        `lent[i]` is a block whose key is used for block i if it is equal (the same tokens in
        the same namespace) instead of a new one."""
        tokens, extra = self._source(encoder)
        make = BlockKey._make
        lora, salt = self.lora_task_id, self.cache_salt_id
        starts = range(start, stop, tokens_per_block)
        if extra is None and not self.multimodal:
            out: list[BlockKey] = []
            if lent:
                # The leading run of lent blocks (the shared prefix, usually) checked at once,
                # with no tuple made per block.
                run = min(len(lent), (stop - start) // tokens_per_block)
                if run:
                    run_keys: list[BlockKey] = list(map(_key, lent[:run]))
                    run_stop = start + run * tokens_per_block
                    if _plain_keys_hold(run_keys, tokens, start, run_stop, lora, salt):
                        out = run_keys
                        lent = lent[run:]
                        start = run_stop
            full_stop = start + (stop - start) // tokens_per_block * tokens_per_block
            # Full blocks as tuples in one C-level pass (zip over one iterator, tpb at a time).
            chunks: list[tuple[int, ...]] = list(
                zip(*[iter(tokens[start:full_stop])] * tokens_per_block, strict=False)
            )
            if full_stop < stop:
                chunks.append(tuple(tokens[full_stop:stop]))
            # Compiled, the constructor is a C call (and the only way to make a native key).
            made = [BlockKey(chunk, None, False, lora, (), salt) for chunk in chunks]
            if lent:  # the run did not hold (rare): compared one at a time
                for i, block in enumerate(lent[: len(made)]):
                    if block.key == made[i]:
                        made[i] = block.key
            out.extend(made)
            return out
        uses_extra = extra is not None
        keys = []
        for b in starts:
            e = min(b + tokens_per_block, stop)
            ext = None
            if extra is not None:
                ext_t = tuple(extra[b:e])
                ext = ext_t if any(ext_t) else None
            mm = block_extra_keys(self.multimodal, b, e) if self.multimodal else ()
            keys.append(make(tuple(tokens[b:e]), ext, uses_extra, lora, mm, salt))
        return keys

    def empty_key(self, start: int) -> BlockKey:
        """The key of the block after the last full one when only one token lies past it."""
        return BlockKey._make(
            (),
            None,
            self.extra_ids is not None,
            self.lora_task_id,
            block_extra_keys(self.multimodal, start, start) if self.multimodal else (),
            self.cache_salt_id,
        )

    def block_hashes(
        self, tokens_per_block: int, usable: int, allow_partial: bool, encoder: bool = False
    ) -> list[BlockHash]:
        """Chained hashes of the keys `block_keys` returns, full blocks cached on the request."""
        tokens = self._source(encoder)[0]
        usable = max(0, min(usable, len(tokens)))
        num_full = usable // tokens_per_block
        cache = self._hash_cache.setdefault((tokens_per_block, encoder), [])
        if len(cache) * tokens_per_block > len(tokens):
            self._trim_caches()
        if len(cache) < num_full:
            start = len(cache) * tokens_per_block
            stop = num_full * tokens_per_block
            # A partial tail, when asked for and not known yet, is hashed in the same call.
            with_tail = (
                allow_partial
                and usable > stop
                and (self._tail_cache.get((tokens_per_block, encoder)) or (-1,))[0] != usable
            )
            new = self._hash_blocks(
                start,
                usable if with_tail else stop,
                tokens_per_block,
                encoder,
                cache[-1] if cache else 0,
            )
            if with_tail:
                key = self._make_keys(stop, usable, tokens_per_block, encoder)[0]
                self._tail_cache[(tokens_per_block, encoder)] = (usable, key, int(new[-1]))
                new = new[:-1]
            cache.extend(cast(list[BlockHash], new.tolist()))
        hashes = cache[:num_full]
        if allow_partial and usable % tokens_per_block:
            hashes.append(BlockHash(self._tail(tokens_per_block, usable, encoder)[1]))
        return hashes

    def _hash_blocks(
        self, start: int, stop: int, tokens_per_block: int, encoder: bool, parent_hash: int
    ) -> Any:
        """The chained hashes of the blocks of tokens [start, stop) (the last may be partial),
        below `parent_hash`, as a uint64 array: one kernel call."""
        tokens, extra = self._source(encoder)
        known = None if encoder else self._words
        if known is not None and stop <= len(known):
            words = known[start:stop]
        else:  # converting the whole list and slicing the array saves copying the list first
            words = (
                as_token_array(tokens)[start:stop]
                if start == 0
                else as_token_array(tokens[start:stop])
            )
        return hash_token_blocks(
            words,
            tokens_per_block,
            -(-(stop - start) // tokens_per_block),
            parent_hash=parent_hash,
            token_offset=start,
            extra_ids=(
                np.asarray(extra[start:stop], dtype=np.uint64)
                if extra is not None and not encoder
                else None
            ),
            lora_task_id=self.lora_task_id,
            cache_salt_id=self.cache_salt_id,
            mm=self._multimodal_arrays() if self.multimodal else None,
        )

    def _multimodal_arrays(self) -> Any:
        if self._mm_arrays is None:
            self._mm_arrays = multimodal_arrays(self.multimodal)
        return self._mm_arrays

    def __repr__(self) -> str:
        return (
            f"LlmRequest(id={self.request_id}, tokens={len(self.tokens)}, beam={self.beam_width})"
        )


class GenerationRequest:
    """The manager's per-sequence state (TensorRT-LLM's GenerationRequest)."""

    __slots__ = (
        "beam_width",
        "cache_block_ids",
        "current_prepopulated_prompt_len",
        "num_front_blocks_removed",
        "num_tokens",
        "request_id",
        "retention",
        "transfer_directory",
    )

    def __init__(
        self,
        request_id: int,
        num_tokens: int,
        beam_width: int,
        window_sizes: Sequence[int],
        retention: RetentionConfig | None,
    ) -> None:
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.beam_width = beam_width
        self.retention = retention or DEFAULT_RETENTION
        self.cache_block_ids: dict[int, list[list[int]]] = {
            w: [[] for _ in range(beam_width)] for w in window_sizes
        }
        self.num_front_blocks_removed: dict[int, int] = dict.fromkeys(window_sizes, 0)
        self.current_prepopulated_prompt_len = INT_MAX
        # Offloads of this sequence go to files here (GDS / POSIX modes), else to host memory.
        self.transfer_directory: str | None = None
        if self.retention.transfer_mode is not TransferMode.DRAM:
            if self.retention.directory:
                self.transfer_directory = self.retention.directory
            else:
                warnings.warn(
                    f"request {request_id}: transfer mode {self.retention.transfer_mode.value} "
                    "without a directory, falling back to DRAM",
                    stacklevel=3,
                )

    @property
    def decode_retention_priority(self) -> int:
        return self.retention.decode_priority

    @property
    def decode_duration_s(self) -> float | None:
        return self.retention.decode_duration_s
