"""vLLM's (and SGLang's) KV event wire format: a ``KVEventBatch`` payload into typed records.

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

``decode_batch`` turns a payload into records (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``); pure and synchronous. A payload that is not a batch raises
``VllmDecodeError`` (a ``ValueError``); a single malformed event is skipped and its error (naming
the event and the field) returned. With ``coalesce=True`` (the ingester's hot path) consecutive
removals of one medium become one record: vLLM announces every evicted block in an event of its
own, and one kvmesh ``removed`` event for the run is far cheaper for every consumer than one per
block.
"""

from __future__ import annotations

import array
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]

from app.ingest.errors import VllmDecodeError

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "DecodedBatch",
    "ExternalHash",
    "VllmDecodeError",
    "VllmEvent",
    "decode_batch",
    "decode_event",
]

ExternalHash = int | bytes  # vLLM's ExternalBlockHash: an int (builtin hash) or sha256 bytes


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
