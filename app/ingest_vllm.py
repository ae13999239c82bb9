"""``kvmesh ingest vllm|sglang``: a vLLM (or SGLang) server's ZMQ KV events, re-keyed for kvmesh.

vLLM's ``ZmqEventPublisher`` sends multipart messages ``(topic, seq, payload)``: ``seq`` an
8-byte big-endian counter from 0, ``payload`` a msgpack ``KVEventBatch`` -- ``{ts, events,
data_parallel_rank}``, a map in current vLLM (msgspec structs with ``omit_defaults``), the
array ``[ts, events, data_parallel_rank]`` in older vLLM and SGLang; both are accepted. Each
event is a map with a ``type`` key or a tagged array (``["BlockStored", ...fields]``):

* ``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size, lora_id, then the
  optional medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window (trailing defaults are omitted on the wire);
* ``BlockRemoved``: block_hashes, then the optional medium, group_idx;
* ``AllBlocksCleared``: no fields.

An optional ROUTER socket replays: a request ``(b"", start_seq)`` is answered with every buffered
``(seq, payload)`` from ``start_seq``, then ``(-1, b"")``. SGLang's publisher speaks the same
protocol.

Three layers, the first two pure and synchronous:

* ``decode_batch`` turns a payload into typed records (``BlockStored``, ``BlockRemoved``,
  ``AllBlocksCleared``). A payload that is not a batch raises ``VllmDecodeError``; a single
  malformed event is skipped and its error (naming the event and the field) returned. With
  ``coalesce=True`` (the ingester's hot path) consecutive removals of one medium become one
  record: vLLM announces every evicted block in an event of its own, and one kvmesh
  ``removed`` event for the run is far cheaper for every consumer than one per block;
* ``Rekeyer`` turns records into kvmesh ``KVCacheEvent`` s. vLLM's block hashes are its own, so
  every stored block is re-keyed by kvmesh's chained hash of the event's ``token_ids`` (below the
  parent's kvmesh hash; the LoRA id -- or, without one, ``lora_name_id(lora_name)`` -- as the
  key's LoRA task id), and a map vLLM hash -> kvmesh hash translates removals. Medium ``GPU``
  (or none) is level 0, ``CPU`` level 1; a block held on both is on the GPU tier, and losing its
  GPU copy is an ``updated`` event to level 1. ``AllBlocksCleared`` removes everything the
  stream holds. A stored event whose parent is unknown raises ``UnknownParentError``: the
  caller reports it as lost (consumers resynchronise from the snapshot);
* ``VllmIngest`` subscribes (pyzmq, asyncio), checks sequence numbers and publishes through an
  ``EventPublisher``. A gap asks the replay endpoint for everything from the first missing
  sequence; what it cannot give back is reported as ``dropped`` (the publisher writes a snapshot
  of what the ingester knows, from its own ``PrefixIndex``). A sequence number back to 0 is a
  publisher restart: a new epoch, an empty index. A sequence at or below the last one is a
  duplicate (replay overlap) and skipped.

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

Data parallelism. Each vLLM data-parallel rank has its own ``ZmqEventPublisher`` on the base port
plus its rank (``offset_endpoint``; replay endpoint likewise), its own sequence numbers and its
own KV cache. With ``data_parallel_size > 1`` the ingester subscribes to every rank's endpoint
and republishes each as its own kvmesh worker ``<worker-id>-dp<rank>`` (as ``ingest trtllm``
names attention-DP ranks), with its own re-keying, epoch, local index and registry entry (which
carries ``data_parallel_rank``). A batch whose ``data_parallel_rank`` disagrees with its
endpoint's rank is applied to the endpoint's stream and counted (``rank_mismatches``).

Window size: events carry the ingester's ``window_size`` (the engine's attention window, e.g.
vLLM's ``--max-model-len``; 0 when not given), or vLLM's ``kv_cache_spec_sliding_window`` for a
sliding-window group. The router does not read it; ``PrefixIndex.dump_events`` keeps it.

Not mapped: KV cache groups other than ``kv_group`` (hybrid models) are skipped and counted.

Errors::

    VllmIngestError
    ├── VllmDecodeError      (also a ValueError) a payload or event not in vLLM's wire format
    └── UnknownParentError   a stored event below (or, without tokens, of) a block this stream
                             never saw
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np
import numpy.typing as npt
import zmq
import zmq.asyncio
from redis.asyncio import Redis

from cache import KVCacheEvent, RemovedData, StoredBlock, StoredData
from cache.events import EventDiff, UpdatedData
from cache.hashing import U32Array, as_token_array, cache_salt_id, hash_token_blocks
from events import keys
from events.index import PrefixIndex
from events.publisher import EventPublisher, PublisherConfig
from events.redis_io import client_for
from events.snapshot import Snapshot

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "DecodedBatch",
    "Rekeyer",
    "UnknownParentError",
    "VllmDecodeError",
    "VllmEvent",
    "VllmIngest",
    "VllmIngestError",
    "decode_batch",
    "lora_name_id",
    "multimodal_hash",
    "offset_endpoint",
    "run_vllm_ingest",
]

logger = logging.getLogger(__name__)

ExternalHash = int | bytes  # vLLM's ExternalBlockHash: an int (builtin hash) or sha256 bytes
END_SEQ = -1
MEDIUM_LEVELS = {"GPU": 0, "CPU": 1}
_GPU, _CPU = 1, 2  # bits of the media a vLLM block is held on


class VllmIngestError(Exception):
    """Base of this module's errors."""


class VllmDecodeError(VllmIngestError, ValueError):
    """A payload or an event that is not in vLLM's wire format; the message names the field."""


class UnknownParentError(VllmIngestError):
    """A stored event hangs below a block the stream never saw (an event was missed)."""


# -- the wire format -------------------------------------------------------------------------


# Records are plain (not frozen) slotted dataclasses: a frozen one's __init__ goes through
# object.__setattr__ per field, three times slower, and the ingester makes one per vLLM event.


@dataclass(slots=True)
class BlockStored:
    block_hashes: tuple[ExternalHash, ...]
    parent_block_hash: ExternalHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    sliding_window: int | None = None  # kv_cache_spec_sliding_window


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: tuple[ExternalHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    pass


VllmEvent = BlockStored | BlockRemoved | AllBlocksCleared

_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_MIN_FIELDS = {"BlockStored": 5, "BlockRemoved": 1, "AllBlocksCleared": 0}
_FIELDS = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS, "AllBlocksCleared": ()}
_REQUIRED = {tag: frozenset(names[: _MIN_FIELDS[tag]]) for tag, names in _FIELDS.items()}


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    ts: float
    events: tuple[VllmEvent, ...]
    data_parallel_rank: int | None
    errors: tuple[str, ...] = ()  # one per malformed event, skipped
    num_events: int = 0  # well-formed vLLM events (more than ``events`` when coalesced)


_HASH_TYPES = frozenset((int, bytes))


def _is_hash(value: object) -> bool:
    return type(value) in _HASH_TYPES


def _opt(value: object, kind: type, name: str) -> Any:
    if value is not None and type(value) is not kind:
        raise VllmDecodeError(f"{name} must be {kind.__name__} or nil, got {type(value).__name__}")
    return value


def _hashes(value: object, name: str) -> tuple[ExternalHash, ...]:
    # map(type, ...) and issuperset run in C: no Python call per hash
    if type(value) is not list or not _HASH_TYPES.issuperset(map(type, value)):
        raise VllmDecodeError(f"{name} must be a list of int or bytes hashes")
    return tuple(value)


def _fields(raw: object) -> tuple[str, dict[str, Any]]:
    """An event's tag and its named fields, from the array-like or the map encoding."""
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise VllmDecodeError("event must start with its tag (a string)")
        tag, values = raw[0], raw[1:]
        names = _FIELDS.get(tag)
        if names is None:
            raise VllmDecodeError(f"unknown event tag {tag!r}")
        if not _MIN_FIELDS[tag] <= len(values) <= len(names):
            raise VllmDecodeError(
                f"{tag} has {len(values)} fields, expected {_MIN_FIELDS[tag]} to {len(names)}"
            )
        return tag, dict(zip(names, values, strict=False))
    if isinstance(raw, dict):
        kind = raw.get("type")
        if not isinstance(kind, str) or kind not in _FIELDS:
            raise VllmDecodeError(f"unknown event tag {kind!r}")
        tag = kind
        if not raw.keys() >= _REQUIRED[tag]:
            missing = [n for n in _FIELDS[tag][: _MIN_FIELDS[tag]] if n not in raw]
            raise VllmDecodeError(f"{tag} lacks {', '.join(missing)}")
        return tag, raw
    raise VllmDecodeError(f"event must be an array or a map, got {type(raw).__name__}")


def decode_event(raw: object) -> VllmEvent:
    """One event of a batch; raises ``VllmDecodeError`` naming what is malformed."""
    tag, f = _fields(raw)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if tag == "BlockRemoved":
        return BlockRemoved(
            _hashes(f["block_hashes"], "BlockRemoved.block_hashes"),
            _opt(f.get("medium"), str, "BlockRemoved.medium"),
            _opt(f.get("group_idx"), int, "BlockRemoved.group_idx"),
        )
    hashes = _hashes(f["block_hashes"], "BlockStored.block_hashes")
    parent = f["parent_block_hash"]
    if parent is not None and not _is_hash(parent):
        raise VllmDecodeError("BlockStored.parent_block_hash must be an int, bytes or nil")
    tokens = f["token_ids"]
    if not isinstance(tokens, list):
        raise VllmDecodeError("BlockStored.token_ids must be a list of ints")
    try:  # one C-level pass over the tokens instead of a Python loop
        array.array("q", tokens)
    except (TypeError, OverflowError) as exc:
        raise VllmDecodeError("BlockStored.token_ids must be a list of ints") from exc
    block_size = f["block_size"]
    if type(block_size) is not int or block_size <= 0:
        raise VllmDecodeError(f"BlockStored.block_size must be a positive int, got {block_size!r}")
    if tokens and len(tokens) != len(hashes) * block_size:
        raise VllmDecodeError(
            f"BlockStored.token_ids has {len(tokens)} tokens for {len(hashes)} blocks "
            f"of {block_size}"
        )
    extra = f.get("extra_keys")
    if extra is not None and (not isinstance(extra, list) or len(extra) != len(hashes)):
        raise VllmDecodeError("BlockStored.extra_keys must be nil or one entry per block")
    return BlockStored(
        hashes,
        parent,
        tuple(tokens),
        block_size,
        _opt(f.get("lora_id"), int, "BlockStored.lora_id"),
        _opt(f.get("medium"), str, "BlockStored.medium"),
        _opt(f.get("lora_name"), str, "BlockStored.lora_name"),
        None if extra is None else tuple(extra),
        _opt(f.get("group_idx"), int, "BlockStored.group_idx"),
        _opt(f.get("kv_cache_spec_sliding_window"), int, "BlockStored.sliding_window"),
    )


def decode_batch(payload: bytes, *, coalesce: bool = False) -> DecodedBatch:
    """A ``KVEventBatch`` payload. Raises ``VllmDecodeError`` when the batch itself is malformed;
    a malformed event is skipped and its error listed in ``errors``. ``coalesce``: consecutive
    well-formed removals of one medium and group become one ``BlockRemoved`` (what the ingester
    uses: one kvmesh ``removed`` event for them, not one per evicted block)."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:  # ExtraData, FormatError, ... too
        raise VllmDecodeError(f"payload is not msgpack: {exc}") from exc
    if isinstance(raw, list):
        if not 2 <= len(raw) <= 3:
            raise VllmDecodeError(f"batch has {len(raw)} fields, expected 2 or 3")
        ts, items, rank = raw[0], raw[1], raw[2] if len(raw) == 3 else None
    elif isinstance(raw, dict):
        if "ts" not in raw or "events" not in raw:
            raise VllmDecodeError("batch map lacks ts or events")
        ts, items, rank = raw["ts"], raw["events"], raw.get("data_parallel_rank")
    else:
        raise VllmDecodeError(f"batch must be an array or a map, got {type(raw).__name__}")
    if type(ts) not in (int, float):
        raise VllmDecodeError(f"batch ts must be a number, got {type(ts).__name__}")
    if not isinstance(items, list):
        raise VllmDecodeError(f"batch events must be an array, got {type(items).__name__}")
    _opt(rank, int, "batch data_parallel_rank")
    events: list[VllmEvent] = []
    errors: list[str] = []
    if coalesce:
        return _decode_coalesced(float(ts), items, rank)
    for i, item in enumerate(items):
        try:
            events.append(decode_event(item))
        except VllmDecodeError as exc:
            errors.append(f"event {i}: {exc}")
    return DecodedBatch(float(ts), tuple(events), rank, tuple(errors), len(events))


_REMOVAL_MEDIA = (None, "GPU", "CPU")  # compared with ==: an unhashable value cannot raise


def _removal(item: object) -> tuple[list[Any], str | None, int | None] | None:
    """A well-formed ``BlockRemoved`` of a medium kvmesh maps (either form), as (hashes,
    medium, group_idx), checked with no Python call per hash; None for anything else."""
    if type(item) is dict:
        if item.get("type") != "BlockRemoved":
            return None
        hashes, medium, group = item.get("block_hashes"), item.get("medium"), item.get("group_idx")
    elif type(item) is list and 2 <= len(item) <= 4 and item[0] == "BlockRemoved":
        hashes = item[1]
        medium = item[2] if len(item) > 2 else None
        group = item[3] if len(item) > 3 else None
    else:
        return None
    if (
        type(hashes) is list
        and _HASH_TYPES.issuperset(map(type, hashes))
        and medium in _REMOVAL_MEDIA
        and (group is None or type(group) is int)
    ):
        return hashes, medium, group
    return None


def _decode_coalesced(ts: float, items: list[Any], rank: int | None) -> DecodedBatch:
    """``decode_batch(coalesce=True)``: consecutive removals of one medium and group become one
    ``BlockRemoved`` (vLLM announces every evicted block in an event of its own)."""
    events: list[VllmEvent] = []
    errors: list[str] = []
    run: list[ExternalHash] = []  # hashes of the removals being coalesced
    run_medium: str | None = None
    run_group: int | None = None
    num_events = 0
    superset = _HASH_TYPES.issuperset
    for i, item in enumerate(items):
        # vLLM's own form (a map) inline, the array form through _removal: one Python call less
        # per evicted block on the hot path.
        if type(item) is dict:
            removal = None
            if item.get("type") == "BlockRemoved":
                hashes = item.get("block_hashes")
                medium = item.get("medium")
                group = item.get("group_idx")
                if (
                    type(hashes) is list
                    and superset(map(type, hashes))
                    and medium in _REMOVAL_MEDIA
                    and (group is None or type(group) is int)
                ):
                    removal = hashes, medium, group
        else:
            removal = _removal(item)
        if removal is not None:
            hashes, medium, group = removal
            if run and (medium != run_medium or group != run_group):
                events.append(BlockRemoved(tuple(run), run_medium, run_group))
                run = []
            run_medium, run_group = medium, group
            run.extend(hashes)
            num_events += 1
            continue
        if run:
            events.append(BlockRemoved(tuple(run), run_medium, run_group))
            run = []
        try:
            events.append(decode_event(item))
        except VllmDecodeError as exc:
            errors.append(f"event {i}: {exc}")
            continue
        num_events += 1
    if run:
        events.append(BlockRemoved(tuple(run), run_medium, run_group))
    return DecodedBatch(ts, tuple(events), rank, tuple(errors), num_events)


# -- re-keying ---------------------------------------------------------------------------------


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


# -- the subscriber ----------------------------------------------------------------------------


def offset_endpoint(endpoint: str, rank: int) -> str:
    """Where data-parallel rank ``rank`` publishes, as vLLM's (and SGLang's)
    ``ZmqEventPublisher.offset_endpoint_port`` moves it: rank 0 as given, a TCP port plus the
    rank, an inproc name plus ``_dp<rank>``."""
    if rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" in endpoint:
        base, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"endpoint {endpoint!r} has no port to offset by the rank")
        return f"{base}:{int(port) + rank}"
    raise ValueError(f"endpoint {endpoint!r}: data-parallel ranks need tcp:// or inproc://")


@dataclass(slots=True)
class _Stream:
    """One publisher (the worker, or one data-parallel rank of it) and its kvmesh stream."""

    worker_id: str
    rank: int | None  # None without data parallelism
    endpoint: str
    replay_endpoint: str | None
    sub: zmq.asyncio.Socket
    publisher: EventPublisher
    rekeyer: Rekeyer
    index: PrefixIndex = field(default_factory=PrefixIndex)
    last_seq: int = -1

    def snapshot(self) -> Snapshot:
        events = (
            self.index.dump_events(self.worker_id) if self.worker_id in self.index.workers() else []
        )
        return Snapshot(events, self.rekeyer.next_event_id - 1)


def _warm_up() -> None:
    """Compile (or load from numba's cache) the kernels of the hot path -- the block hasher, the
    index's -- now rather than on the first events, which would wait a tenth of a second."""
    block_hash = int(hash_token_blocks(as_token_array([0]), 1, 1)[0])
    index = PrefixIndex()
    index.apply_event(
        "warm-up", KVCacheEvent(0, StoredData(None, [StoredBlock(block_hash, (0,))]), 0)
    )
    index.apply_event("warm-up", KVCacheEvent(1, RemovedData([block_hash]), 0))


class VllmIngest:
    """Subscribes to one vLLM/SGLang server (each of its data-parallel ranks) and republishes
    re-keyed events."""

    def __init__(
        self,
        endpoint: str,
        worker_id: str,
        redis: Redis | str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        url: str | None = None,
        block_size: int | None = None,
        window_size: int = 0,
        data_parallel_size: int = 1,
        source: str = "vllm",
        replay_timeout_s: float = 2.0,
        **publisher_options: Any,
    ) -> None:
        self.worker_id = keys.validate_worker_id(worker_id)
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
        if window_size < 0:
            raise ValueError(f"window_size must be >= 0, got {window_size}")
        ranks: list[int | None] = (
            [None] if data_parallel_size == 1 else [*range(data_parallel_size)]
        )
        for rank in ranks:  # bad endpoints fail here, before any socket exists
            keys.validate_worker_id(self._rank_worker_id(rank))
            offset_endpoint(endpoint, rank or 0)
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.url = url
        self.block_size = block_size
        self.window_size = window_size
        self.source = source
        self.replay_timeout_s = replay_timeout_s
        self._redis, self._owns_redis = client_for(redis)
        self._ctx = zmq.asyncio.Context()
        self._publisher_options = publisher_options
        _warm_up()
        self._streams = [self._make_stream(rank) for rank in ranks]
        self._by_socket = {stream.sub: stream for stream in self._streams}
        self.num_batches = 0
        self.num_events = 0
        self.num_malformed = 0
        self.num_duplicates = 0
        self.num_replayed = 0
        self.num_lost = 0  # batches or events that could not be applied (reported as dropped)
        self.num_restarts = 0
        self.num_rank_mismatches = 0

    def _rank_worker_id(self, rank: int | None) -> str:
        return self.worker_id if rank is None else f"{self.worker_id}-dp{rank}"

    def _make_stream(self, rank: int | None) -> _Stream:
        worker_id = self._rank_worker_id(rank)
        endpoint = offset_endpoint(self.endpoint, rank or 0)
        replay = self.replay_endpoint
        if replay is not None:
            replay = offset_endpoint(replay, rank or 0)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.connect(endpoint)
        entry: dict[str, Any] = {
            "url": self.url,
            "device": self.source,
            "tokens_per_block": self.block_size,
            "source": self.source,
        }
        if rank is not None:
            entry["data_parallel_rank"] = rank
        holder: list[_Stream] = []
        publisher = EventPublisher(
            self._redis,
            worker_id,
            PublisherConfig(**self._publisher_options),
            snapshot_source=lambda: holder[0].snapshot(),
            registry_entry=entry,
        )
        rekeyer = Rekeyer(block_size=self.block_size, window_size=self.window_size)
        stream = _Stream(worker_id, rank, endpoint, replay, sub, publisher, rekeyer)
        holder.append(stream)
        return stream

    async def __aenter__(self) -> VllmIngest:
        for stream in self._streams:
            await stream.publisher.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for stream in self._streams:
            await stream.publisher.aclose()
            stream.sub.close(0)
        self._ctx.term()
        if self._owns_redis:
            await self._redis.aclose()

    # -- what it holds -------------------------------------------------------------------------

    def _stream_of(self, worker_id: str | None) -> _Stream:
        if worker_id is None:
            return self._streams[0]
        for stream in self._streams:
            if stream.worker_id == worker_id:
                return stream
        raise KeyError(worker_id)

    @property
    def worker_ids(self) -> list[str]:
        return [stream.worker_id for stream in self._streams]

    @property
    def publisher(self) -> EventPublisher:
        """The first stream's publisher (the only one without data parallelism)."""
        return self._streams[0].publisher

    @property
    def last_seq(self) -> int:
        """The first stream's last sequence number (the only one without data parallelism)."""
        return self._streams[0].last_seq

    def publishers(self) -> dict[str, EventPublisher]:
        return {stream.worker_id: stream.publisher for stream in self._streams}

    def endpoints(self) -> dict[str, tuple[str, str | None]]:
        """Per kvmesh worker id: the PUB endpoint and the replay endpoint it listens to."""
        return {s.worker_id: (s.endpoint, s.replay_endpoint) for s in self._streams}

    def local_blocks(self, worker_id: str | None = None) -> dict[int, int]:
        """What the ingester believes the worker (or one rank's stream) holds: hash -> tier."""
        stream = self._stream_of(worker_id)
        index = stream.index
        return index.worker_blocks(stream.worker_id) if stream.worker_id in index.workers() else {}

    def stats(self) -> dict[str, Any]:
        return {
            "batches": self.num_batches,
            "events": self.num_events,
            "malformed": self.num_malformed,
            "duplicates": self.num_duplicates,
            "replayed": self.num_replayed,
            "lost": self.num_lost,
            "restarts": self.num_restarts,
            "rank_mismatches": self.num_rank_mismatches,
            "last_seq": self.last_seq,
            "streams": {s.worker_id: s.last_seq for s in self._streams},
        }

    # -- one message ---------------------------------------------------------------------------

    async def handle(self, frames: Sequence[bytes], worker_id: str | None = None) -> None:
        """One multipart message ``(topic, seq, payload)`` from a SUB socket (of the stream
        ``worker_id``; the first stream by default)."""
        await self._handle(self._stream_of(worker_id), frames)

    async def _handle(self, stream: _Stream, frames: Sequence[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.num_malformed += 1
            logger.warning(
                "ingest %s: skipped a message of %d frames", stream.worker_id, len(frames)
            )
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        last = stream.last_seq
        if seq == 0 and last >= 0:
            self._restart(stream)
        elif seq <= last:
            self.num_duplicates += 1
            return
        elif seq > last + 1:
            await self._fill_gap(stream, last + 1, seq)
            if seq <= stream.last_seq:  # the replay already brought it
                return
        self._apply(stream, seq, frames[2])

    def _restart(self, stream: _Stream) -> None:
        self.num_restarts += 1
        logger.info("ingest %s: the publisher restarted (sequence back to 0)", stream.worker_id)
        stream.rekeyer.reset()
        stream.index = PrefixIndex()
        stream.publisher.new_epoch()
        stream.last_seq = -1

    async def _fill_gap(self, stream: _Stream, first: int, upto: int) -> None:
        """Replay ``first .. upto-1``; what does not come back is reported as lost."""
        if stream.replay_endpoint is not None:
            for seq, payload in await self._replay(stream, first):
                if seq >= upto:
                    break
                if seq <= stream.last_seq:
                    continue
                if seq > stream.last_seq + 1:
                    missing = seq - stream.last_seq - 1
                    self._lose(stream, missing, f"replay lacks {stream.last_seq + 1}..")
                self.num_replayed += 1
                self._apply(stream, seq, payload)
        if stream.last_seq < upto - 1:
            missing = upto - 1 - stream.last_seq
            self._lose(stream, missing, f"batches {stream.last_seq + 1}..{upto - 1}")
            stream.last_seq = upto - 1

    def _lose(self, stream: _Stream, count: int, what: str) -> None:
        self.num_lost += count
        logger.warning("ingest %s: lost %s; consumers resync", stream.worker_id, what)
        stream.publisher.publish([], dropped=count)

    async def replay(self, start_seq: int, worker_id: str | None = None) -> list[tuple[int, bytes]]:
        """Ask a stream's replay endpoint for the batches from ``start_seq``."""
        return await self._replay(self._stream_of(worker_id), start_seq)

    async def _replay(self, stream: _Stream, start_seq: int) -> list[tuple[int, bytes]]:
        """The batches from ``start_seq`` the replay endpoint still has (what came before a
        timeout, if it does not answer)."""
        assert stream.replay_endpoint is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        got: list[tuple[int, bytes]] = []
        try:
            sock.connect(stream.replay_endpoint)
            await sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
            while True:
                if not await sock.poll(int(self.replay_timeout_s * 1000)):
                    logger.warning("ingest %s: replay timed out", stream.worker_id)
                    return got
                frames = await sock.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.num_malformed += 1
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == END_SEQ:
                    return got
                got.append((seq, frames[2]))
        finally:
            sock.close(0)

    def apply_payload(self, seq: int, payload: bytes, worker_id: str | None = None) -> None:
        """Decode, re-key and publish one batch of a stream (the first by default)."""
        self._apply(self._stream_of(worker_id), seq, payload)

    def _apply(self, stream: _Stream, seq: int, payload: bytes) -> None:
        """Decode, re-key and publish one batch (synchronously: the snapshot source then always
        matches what was published). Everything lost in the batch is reported with its first
        published entry, so consumers resynchronise once per batch, not once per loss."""
        stream.last_seq = seq
        self.num_batches += 1
        publisher = stream.publisher
        try:
            batch = decode_batch(payload, coalesce=True)
        except VllmDecodeError as exc:
            self.num_malformed += 1
            self._lose(stream, 1, f"batch {seq}: {exc}")
            return
        worker_id = stream.worker_id
        if batch.data_parallel_rank not in (None, stream.rank or 0):
            self.num_rank_mismatches += 1
            logger.warning(
                "ingest %s: batch %d says data-parallel rank %d; applied to its endpoint's stream",
                worker_id,
                seq,
                batch.data_parallel_rank,
            )
        for error in batch.errors:
            logger.warning("ingest %s: batch %d: skipped %s", worker_id, seq, error)
        self.num_malformed += len(batch.errors)
        # Coalesced removals have a medium the re-keying maps, so a refusal is one vLLM event.
        pending, refused = stream.rekeyer.apply_all(batch.events)
        for refusal in refused:
            logger.warning("ingest %s: batch %d: %s", worker_id, seq, refusal)
            if isinstance(refusal, VllmDecodeError):
                self.num_malformed += 1
        lost = len(batch.errors) + len(refused)
        self.num_events += batch.num_events - len(refused)
        apply_event = stream.index.apply_event
        for kv_event in pending:
            apply_event(worker_id, kv_event)
        self.num_lost += lost
        if pending or lost:
            publisher.publish(pending, dropped=lost)

    async def run(self, *, max_batches: int | None = None) -> None:
        """Receive until cancelled (or ``max_batches`` messages, over all streams)."""
        received = 0
        if len(self._streams) == 1:
            stream = self._streams[0]
            recv = stream.sub.recv_multipart
            while max_batches is None or received < max_batches:
                frames = await recv()
                received += 1
                await self._handle(stream, frames)
            return
        poller = zmq.asyncio.Poller()
        for stream in self._streams:
            poller.register(stream.sub, zmq.POLLIN)
        while max_batches is None or received < max_batches:
            for sock, _ in await poller.poll():
                if max_batches is not None and received >= max_batches:
                    break
                frames = await sock.recv_multipart()
                received += 1
                await self._handle(self._by_socket[sock], frames)


async def run_vllm_ingest(
    endpoint: str,
    worker_id: str,
    redis_url: str,
    *,
    replay_endpoint: str | None = None,
    topic: str = "",
    url: str | None = None,
    block_size: int | None = None,
    window_size: int = 0,
    data_parallel_size: int = 1,
    source: str = "vllm",
    max_batches: int | None = None,
) -> dict[str, Any]:
    """What ``kvmesh ingest vllm|sglang`` runs; returns the ingester's stats when it stops."""
    ingest = VllmIngest(
        endpoint,
        worker_id,
        redis_url,
        replay_endpoint=replay_endpoint,
        topic=topic,
        url=url,
        block_size=block_size,
        window_size=window_size,
        data_parallel_size=data_parallel_size,
        source=source,
    )
    async with ingest:
        with contextlib.suppress(asyncio.CancelledError):
            await ingest.run(max_batches=max_batches)
        for publisher in ingest.publishers().values():
            await publisher.flush(10)
        return ingest.stats()
