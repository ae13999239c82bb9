"""Re-keying: vLLM's block events as kvmesh ``KVCacheEvent`` s, keyed by kvmesh's own hashes.

``Rekeyer`` turns the records of ``app.ingest.vllm.wire`` into kvmesh events with consecutive ids;
pure and synchronous, one per stream. vLLM's block hashes are its own, so every stored block is
re-keyed by kvmesh's chained hash of the event's ``token_ids`` (below the parent's kvmesh hash;
the LoRA id -- or, without one, ``lora_name_id(lora_name)`` -- as the key's LoRA task id), and a
map vLLM hash -> kvmesh hash translates removals. Medium ``GPU`` (or none) is level 0, ``CPU``
level 1; a block held on both is on the GPU tier, and losing its GPU copy is an ``updated`` event
to level 1. ``AllBlocksCleared`` removes everything the stream holds. A stored event whose parent
is unknown raises ``UnknownParentError``: the caller reports it as lost (consumers resynchronise
from the snapshot).

Extra keys. vLLM sends, per block, the extra keys it hashed (``generate_block_hash_extra_keys``):
the LoRA name, then ``[mm_identifier, item_start - block_start]`` per multimodal item the block
overlaps, then the cache salt (first block of a request only), then prompt-embedding hashes. They
enter the kvmesh key as the same request's keys would: the LoRA name is already the key's LoRA
id; the salt is ``cache_salt_id(salt)``; a multimodal item is ``MultimodalItem(
multimodal_hash(identifier), start, length)`` (the identifier's own 32 bytes when it is 64 hex
digits, vLLM's default, else its SHA-256). Keys kvmesh requests cannot carry (prompt-embedding
hashes, anything else) key their block as an opaque item of its own: such blocks never match a
kvmesh request, which is right, and never collide with one.

A ``BlockStored`` without token ids (vLLM's CPU offload re-announcing blocks it already
announced) only adds a medium to blocks the stream holds.

Window size: events carry the ingester's ``window_size`` (the engine's attention window, e.g.
vLLM's ``--max-model-len``; 0 when not given), or vLLM's ``kv_cache_spec_sliding_window`` for a
sliding-window group. The router does not read it; ``PrefixIndex.dump_events`` keeps it.

Not mapped: KV cache groups other than ``kv_group`` (hybrid models) are skipped and counted.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

import msgpack  # type: ignore[import-untyped]
import numpy as np
import numpy.typing as npt

from app.ingest.errors import UnknownParentError, VllmDecodeError, VllmIngestError
from app.ingest.vllm.wire import BlockRemoved, BlockStored, ExternalHash, VllmEvent
from cache import KVCacheEvent, RemovedData, StoredBlock, StoredData
from cache.events import EventDiff, UpdatedData
from cache.hashing import U32Array, as_token_array, cache_salt_id, hash_token_blocks

__all__ = ["MEDIUM_LEVELS", "Rekeyer", "lora_name_id", "multimodal_hash"]

MEDIUM_LEVELS = {"GPU": 0, "CPU": 1}
_GPU, _CPU = 1, 2  # bits of the media a vLLM block is held on


def lora_name_id(name: str) -> int:
    """The LoRA task id a vLLM ``lora_name`` enters kvmesh block keys as (BLAKE2b-64, LE); a
    client routing by LoRA name sends this as ``lora_task_id``."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def multimodal_hash(identifier: str) -> bytes:
    """The 32-byte kvmesh multimodal hash (``MultimodalItem.hash``) of a vLLM multimodal
    identifier: its own bytes when it is 64 hex digits (vLLM's default content hash), else its
    SHA-256. A client routing a multimodal request gives the router this hash."""
    if len(identifier) == 64:
        with contextlib.suppress(ValueError):
            return bytes.fromhex(identifier)
    return hashlib.sha256(identifier.encode()).digest()


@dataclass(frozen=True, slots=True)
class _ExtraKeys:
    """What one stored event's ``extra_keys`` add to the kvmesh keys of its blocks."""

    salt: str | None = None
    salt_id: int | None = None
    mm: tuple[U32Array, npt.NDArray[np.int64], npt.NDArray[np.int64]] | None = None
    token_offset: int = 0  # shifts items that began in a parent block to positions >= 0
    block_keys: tuple[tuple[tuple[bytes, int], ...], ...] = ()  # StoredBlock.mm_keys per block


_NO_KEYS = _ExtraKeys()


def _opaque_hash(key: object) -> bytes:
    return hashlib.sha256(b"vllm-extra-key\0" + msgpack.packb(key)).digest()


def _map_extra_keys(ev: BlockStored) -> _ExtraKeys:
    """vLLM's per-block extra keys as kvmesh keys (see the module docstring). Multimodal items
    are rebuilt with positions relative to the event's first token, spanning exactly the blocks
    that name them, so the chained hashes equal those of the same request's
    ``block_hashes_for_tokens(..., multimodal=[MultimodalItem(hash, start, length)])``."""
    assert ev.extra_keys is not None
    size = ev.block_size
    salt: str | None = None
    spans: dict[tuple[bytes, int], list[int]] = {}  # (hash, start) -> [first block, last block]
    for i, block_keys in enumerate(ev.extra_keys):
        if block_keys is None:
            continue
        if not isinstance(block_keys, list):
            raise VllmDecodeError(f"BlockStored.extra_keys[{i}] must be an array or nil")
        for key in block_keys:
            if isinstance(key, str):
                if key == ev.lora_name:  # already the key's LoRA id
                    continue
                if i == 0 and ev.parent_block_hash is None and salt is None:
                    salt = key  # vLLM adds the salt to a request's first block only
                    continue
                item = (_opaque_hash(key), i * size)
            elif type(key) is int and key == ev.lora_id:  # older vLLM: the LoRA int id
                continue
            elif (
                isinstance(key, list)
                and len(key) == 2
                and isinstance(key[0], str)
                and type(key[1]) is int
            ):
                if key[1] >= size:
                    raise VllmDecodeError(
                        f"BlockStored.extra_keys[{i}]: multimodal offset {key[1]} is past the block"
                    )
                item = (multimodal_hash(key[0]), i * size + key[1])
            else:  # prompt-embedding hashes, keys of other versions: this block's own item
                item = (_opaque_hash(key), i * size)
            span = spans.get(item)
            if span is None:
                spans[item] = [i, i]
            else:
                span[1] = i
    if not spans:
        return _NO_KEYS if salt is None else _ExtraKeys(salt, cache_salt_id(salt))
    items = sorted(spans.items(), key=lambda kv: (kv[0][1], kv[0][0]))
    shift = max(0, -min(start for (_, start), _ in items))
    words = np.frombuffer(b"".join(h for (h, _), _ in items), dtype="<u4").reshape(-1, 8)
    starts = np.array([start + shift for (_, start), _ in items], dtype=np.int64)
    lengths = np.array([(last + 1) * size - start for (_, start), (_, last) in items], np.int64)
    per_block: list[tuple[tuple[bytes, int], ...]] = []
    for i in range(len(ev.block_hashes)):
        lo, hi = i * size, (i + 1) * size
        per_block.append(
            tuple(
                (h, 0 if start >= lo else lo - start)
                for (h, start), (_, last) in items
                if hi > start and lo < (last + 1) * size
            )
        )
    return _ExtraKeys(
        salt,
        None if salt is None else cache_salt_id(salt),
        (words.astype(np.uint32), starts, lengths),
        shift,
        tuple(per_block),
    )


class Rekeyer:
    """vLLM events of one stream -> kvmesh events with consecutive ids from ``next_event_id``.

    Invariant: ``_held`` maps exactly the vLLM blocks whose stored events were turned into
    kvmesh events (and not removed since) to ``(kvmesh hash, media bits)``, and ``_refs[k]`` is
    the number of them keyed ``k``. (Tuples, not objects: one is made per block on the hot path.)
    """

    def __init__(
        self, *, block_size: int | None = None, window_size: int = 0, kv_group: int = 0
    ) -> None:
        self.block_size = block_size
        self.window_size = window_size
        self.kv_group = kv_group
        self.next_event_id = 0
        self._held: dict[ExternalHash, tuple[int, int]] = {}
        self._refs: dict[int, int] = {}
        self.num_other_groups = 0
        self.num_unknown_removals = 0

    def kv_hash(self, vllm_hash: ExternalHash) -> int | None:
        held = self._held.get(vllm_hash)
        return None if held is None else held[0]

    def num_blocks(self) -> int:
        return len(self._held)

    def _event(
        self, data: StoredData | RemovedData | UpdatedData, window: int | None = None
    ) -> KVCacheEvent:
        event = KVCacheEvent(
            self.next_event_id, data, self.window_size if window is None else window
        )
        self.next_event_id += 1
        return event

    def apply(self, event: VllmEvent) -> list[KVCacheEvent]:
        """The kvmesh events for one vLLM event (none, one or two). Raises ``VllmDecodeError``
        or ``UnknownParentError`` before changing anything."""
        if isinstance(event, BlockStored):
            return self._stored(event)
        if isinstance(event, BlockRemoved):
            return self._removed(event)
        return self._cleared()

    def apply_all(
        self, events: Sequence[VllmEvent]
    ) -> tuple[list[KVCacheEvent], list[VllmIngestError]]:
        """``apply`` over a batch, in order; a refused event is skipped and its error returned."""
        out: list[KVCacheEvent] = []
        errors: list[VllmIngestError] = []
        apply = self.apply
        for event in events:
            try:
                out.extend(apply(event))
            except VllmIngestError as exc:
                errors.append(exc)
        return out, errors

    def _stored(self, ev: BlockStored) -> list[KVCacheEvent]:
        if (ev.group_idx or 0) != self.kv_group:
            self.num_other_groups += 1
            return []
        if self.block_size is not None and ev.block_size != self.block_size:
            raise VllmDecodeError(
                f"BlockStored.block_size is {ev.block_size}, the ingester's is {self.block_size}"
            )
        level = MEDIUM_LEVELS.get(ev.medium or "GPU")
        if level is None:
            raise VllmDecodeError(f"BlockStored.medium {ev.medium!r} is not GPU or CPU")
        bit = _GPU if level == 0 else _CPU
        if not ev.token_ids:
            return self._stored_again(ev, bit)
        parent_kv: int | None = None
        if ev.parent_block_hash is not None:
            parent_kv = self.kv_hash(ev.parent_block_hash)
            if parent_kv is None:
                raise UnknownParentError(
                    f"stored event below unknown block {ev.parent_block_hash!r}"
                )
        lora = ev.lora_id
        if lora is None and ev.lora_name is not None:
            lora = lora_name_id(ev.lora_name)
        n = len(ev.block_hashes)
        size = ev.block_size
        keys = _NO_KEYS if ev.extra_keys is None else _map_extra_keys(ev)
        kv_hashes: list[int] = hash_token_blocks(
            as_token_array(ev.token_ids),
            size,
            n,
            parent_hash=parent_kv or 0,
            token_offset=keys.token_offset,
            lora_task_id=lora,
            cache_salt_id=keys.salt_id,
            mm=keys.mm,
        ).tolist()
        held_map = self._held
        refs = self._refs
        tokens = ev.token_ids
        window = self.window_size if ev.sliding_window is None else ev.sliding_window
        if (
            keys is _NO_KEYS
            and held_map.keys().isdisjoint(ev.block_hashes)
            and refs.keys().isdisjoint(kv_hashes)
            and len(set(ev.block_hashes)) == n
            and len(set(kv_hashes)) == n
        ):
            # The common case, every block new: the maps grow and the blocks are made in C
            # loops (one Python call per block: StoredBlock's __init__).
            held_map.update(zip(ev.block_hashes, zip(kv_hashes, repeat(bit)), strict=True))
            refs.update(zip(kv_hashes, repeat(1)))
            chunks = zip(*[iter(tokens)] * size, strict=True)
            level = 0 if bit == _GPU else 1
            blocks = list(
                map(
                    StoredBlock,
                    kv_hashes,
                    chunks,
                    repeat(None),
                    repeat(level),
                    repeat(35),
                    repeat(()),
                    repeat(None),
                    repeat(lora),
                )
            )
            return [self._event(StoredData(parent_kv, blocks), window)]
        block_keys = keys.block_keys or repeat((), n)
        blocks = []
        for i, vllm_hash, kv_hash, mm_keys in zip(
            range(0, n * size, size), ev.block_hashes, kv_hashes, block_keys, strict=True
        ):
            held = held_map.get(vllm_hash)
            if held is None:
                media = bit
                refs[kv_hash] = refs.get(kv_hash, 0) + 1
            elif held[0] != kv_hash:  # vLLM reused the hash for other tokens
                self._unref(held[0])
                media = bit
                refs[kv_hash] = refs.get(kv_hash, 0) + 1
            else:
                media = held[1] | bit
            held_map[vllm_hash] = (kv_hash, media)
            level = 0 if media & _GPU else 1
            blocks.append(
                StoredBlock(kv_hash, tokens[i : i + size], None, level, 35, mm_keys, None, lora)
            )
        if keys.salt is not None:
            blocks[0].cache_salt = keys.salt
        return [self._event(StoredData(parent_kv, blocks), window)]

    def _stored_again(self, ev: BlockStored, bit: int) -> list[KVCacheEvent]:
        """A store without tokens: blocks the stream already holds gain a medium."""
        held_map = self._held
        unknown = [h for h in ev.block_hashes if h not in held_map]
        if unknown:
            raise UnknownParentError(f"stored event without tokens, unknown block {unknown[0]!r}")
        out: list[KVCacheEvent] = []
        for vllm_hash in ev.block_hashes:
            kv_hash, media = held_map[vllm_hash]
            if bit == _GPU and media == _CPU:  # back on the GPU: up to the primary tier
                out.append(self._event(UpdatedData(kv_hash, EventDiff(1, 0))))
            held_map[vllm_hash] = (kv_hash, media | bit)
        return out

    def _unref(self, kv_hash: int) -> bool:
        """Drop one reference; True when none is left (the block is gone)."""
        left = self._refs[kv_hash] - 1
        if left:
            self._refs[kv_hash] = left
            return False
        del self._refs[kv_hash]
        return True

    def _removed(self, ev: BlockRemoved) -> list[KVCacheEvent]:
        if (ev.group_idx or 0) != self.kv_group:
            self.num_other_groups += 1
            return []
        level = MEDIUM_LEVELS.get(ev.medium or "GPU")
        if level is None:
            raise VllmDecodeError(f"BlockRemoved.medium {ev.medium!r} is not GPU or CPU")
        bit = _GPU if level == 0 else _CPU
        held_map = self._held
        pop = held_map.pop
        refs = self._refs
        gone: list[int] = []
        out: list[KVCacheEvent] = []
        for vllm_hash in ev.block_hashes:
            held = pop(vllm_hash, None)
            if held is None:
                self.num_unknown_removals += 1
                continue
            kv_hash, media = held
            if media != bit:  # not its only copy (or not on this medium): it stays
                held_map[vllm_hash] = held
                if not media & bit:
                    self.num_unknown_removals += 1
                    continue
                held_map[vllm_hash] = (kv_hash, media & ~bit)
                if bit == _GPU:  # the GPU copy went, the CPU copy stays: down to the host tier
                    out.append(self._event(UpdatedData(kv_hash, EventDiff(0, 1))))
                continue
            left = refs[kv_hash] - 1
            if left:
                refs[kv_hash] = left
            else:
                del refs[kv_hash]
                gone.append(kv_hash)
        if gone:
            out.append(self._event(RemovedData(gone)))
        return out

    def _cleared(self) -> list[KVCacheEvent]:
        gone = list(self._refs)
        self._held.clear()
        self._refs.clear()
        return [self._event(RemovedData(gone))] if gone else []

    def reset(self) -> None:
        """A publisher restart: nothing is held, ids start again."""
        self._held.clear()
        self._refs.clear()
        self.next_event_id = 0
