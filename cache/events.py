"""KV cache events and their buffer (TensorRT-LLM's KVCacheEvent and kvCacheEventManager).

The manager enqueues events into a per-iteration list as it works (single writer, no locks);
`flush()` moves them into a bounded queue that drops the oldest event first and counts what it
dropped; `get_events(timeout)` drains the queue. Event ids are consecutive per manager, across
window sizes, starting at 0 with the first `created` event. A removal right after another removal
of the same window joins that event (as in the seed) and takes no new id.

`KVCacheEvent.to_dict()` is TensorRT-LLM's JSON shape; `from_dict()` reads it back, so events
from a real TensorRT-LLM worker and from ours are the same objects.

With events off a manager writes into `NullEventSink`, which drops everything: the code that
enqueues never asks whether anyone listens (`EventSink` is the port both implement).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Literal, Protocol

from cache.block import KVCacheBlock, StoredBlockRow, stored_rows


@dataclass(slots=True)
class CreatedData:
    num_blocks_per_cache_level: list[int]
    type: Literal["created"] = "created"

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "created",
            "num_blocks_per_cache_level": list(self.num_blocks_per_cache_level),
        }


@dataclass(slots=True)
class StoredBlock:
    block_hash: int
    tokens: tuple[int, ...]
    extra_ids: tuple[int, ...] | None = None
    cache_level: int = 0
    priority: int = 35
    mm_keys: tuple[tuple[bytes | str, int], ...] = ()
    cache_salt: str | None = None
    lora_id: int | None = None

    def to_dict(self) -> dict[str, Any]:
        extra = self.extra_ids or (0,) * len(self.tokens)
        return {
            "type": "stored_block",
            "block_hash": self.block_hash,
            "tokens": [
                {"type": "unique_token", "token_id": t, "token_extra_id": e}
                for t, e in zip(self.tokens, extra, strict=True)
            ],
            "cache_level": self.cache_level,
            "priority": self.priority,
            "mm_keys": [
                {
                    "type": "mm_key",
                    "hash": h.hex() if isinstance(h, bytes) else h,
                    "start_offset": o,
                }
                for h, o in self.mm_keys
            ],
            "cache_salt": self.cache_salt,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StoredBlock:
        tokens = d.get("tokens", [])
        extra = tuple(int(t.get("token_extra_id", 0)) for t in tokens)
        mm: list[tuple[bytes | str, int]] = []
        for m in d.get("mm_keys") or []:
            h = m["hash"]
            try:
                raw: bytes | str = bytes.fromhex(h) if len(h) == 64 else h
            except ValueError:
                raw = h
            mm.append((raw, int(m.get("start_offset", 0))))
        return cls(
            block_hash=int(d["block_hash"]),
            tokens=tuple(int(t["token_id"]) for t in tokens),
            extra_ids=extra if any(extra) else None,
            cache_level=int(d.get("cache_level", 0)),
            priority=int(d.get("priority", 35)),
            mm_keys=tuple(mm),
            cache_salt=d.get("cache_salt"),
            lora_id=d.get("lora_id"),
        )


_block_row = attrgetter(
    "block_hash",
    "tokens",
    "extra_ids",
    "cache_level",
    "priority",
    "mm_keys",
    "cache_salt",
    "lora_id",
)


class StoredData:
    """The blocks one storeBlocks call inserted below `parent_hash`.

    The manager makes it from rows (one tuple of StoredBlock's fields per block, built in C);
    the `StoredBlock` objects are made only when `blocks` is first read, so a worker that only
    encodes its events (`rows()`) never makes them. Behaves as the dataclass it replaces
    (fields, equality, repr).
    """

    __slots__ = ("_blocks", "_rows", "parent_hash", "type")
    __match_args__ = ("parent_hash", "blocks", "type")
    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass was

    def __init__(
        self,
        parent_hash: int | None,
        blocks: list[StoredBlock],
        type: Literal["stored"] = "stored",  # the dataclass field it replaces
    ) -> None:
        self.parent_hash = parent_hash
        self._blocks: list[StoredBlock] | None = blocks
        self._rows: list[StoredBlockRow] | None = None
        self.type: Literal["stored"] = type

    @classmethod
    def from_rows(cls, parent_hash: int | None, rows: list[StoredBlockRow]) -> StoredData:
        """A StoredData whose blocks are `StoredBlock(*row)` for each row (made lazily)."""
        data = cls.__new__(cls)
        data.parent_hash = parent_hash
        data._blocks = None
        data._rows = rows
        data.type = "stored"
        return data

    @property
    def blocks(self) -> list[StoredBlock]:
        if self._blocks is None:
            assert self._rows is not None
            self._blocks = [StoredBlock(*row) for row in self._rows]
            self._rows = None  # the list may be changed from now on: it is the truth
        return self._blocks

    @blocks.setter
    def blocks(self, blocks: list[StoredBlock]) -> None:
        self._blocks = blocks
        self._rows = None

    def rows(self) -> list[StoredBlockRow]:
        """Each block's fields as a tuple, in wire order (what the codec packs)."""
        if self._rows is not None:
            return self._rows
        assert self._blocks is not None
        return list(map(_block_row, self._blocks))

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, StoredData)
        return (self.parent_hash, self.type) == (other.parent_hash, other.type) and (
            self.rows() == other.rows()
        )

    def __repr__(self) -> str:
        return (
            f"StoredData(parent_hash={self.parent_hash!r}, blocks={self.blocks!r}, "
            f"type={self.type!r})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "stored",
            "parent_hash": self.parent_hash,
            "blocks": [b.to_dict() for b in self.blocks],
        }


@dataclass(slots=True)
class RemovedData:
    block_hashes: list[int]
    type: Literal["removed"] = "removed"

    def to_dict(self) -> dict[str, Any]:
        return {"type": "removed", "block_hashes": list(self.block_hashes)}


@dataclass(frozen=True, slots=True)
class EventDiff:
    old_value: int
    new_value: int

    def to_dict(self) -> dict[str, Any]:
        return {"type": "event_diff", "new_value": self.new_value, "old_value": self.old_value}


@dataclass(slots=True)
class UpdatedData:
    block_hash: int
    cache_level: EventDiff | None = None
    priority: EventDiff | None = None
    type: Literal["updated"] = "updated"

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "updated",
            "block_hash": self.block_hash,
            "cache_level": self.cache_level.to_dict() if self.cache_level else None,
            "priority": self.priority.to_dict() if self.priority else None,
        }


EventData = CreatedData | StoredData | RemovedData | UpdatedData


@dataclass(slots=True)
class KVCacheEvent:
    event_id: int
    data: EventData
    window_size: int
    attention_dp_rank: int | None = field(default=None)

    @property
    def type(self) -> str:
        return self.data.type

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "event_id": self.event_id,
            "data": self.data.to_dict(),
            "window_size": self.window_size,
        }
        if self.attention_dp_rank is not None:
            out["attention_dp_rank"] = self.attention_dp_rank
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVCacheEvent:
        """Parse TensorRT-LLM's JSON shape; raises ValueError naming what is wrong."""
        try:
            data = d["data"]
            kind = data["type"]
            parsed: EventData
            if kind == "created":
                parsed = CreatedData([int(n) for n in data["num_blocks_per_cache_level"]])
            elif kind == "stored":
                parent = data.get("parent_hash")
                parsed = StoredData(
                    None if parent is None else int(parent),
                    [StoredBlock.from_dict(b) for b in data["blocks"]],
                )
            elif kind == "removed":
                parsed = RemovedData([int(h) for h in data["block_hashes"]])
            elif kind == "updated":
                level, prio = data.get("cache_level"), data.get("priority")
                parsed = UpdatedData(
                    int(data["block_hash"]),
                    EventDiff(int(level["old_value"]), int(level["new_value"])) if level else None,
                    EventDiff(int(prio["old_value"]), int(prio["new_value"])) if prio else None,
                )
            else:
                raise ValueError(f"unknown event type {kind!r}")
            rank = d.get("attention_dp_rank")
            return cls(
                int(d["event_id"]),
                parsed,
                int(d["window_size"]),
                None if rank is None else int(rank),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed KV cache event: missing or bad field {exc}") from exc


class EventSink(Protocol):
    """Where a manager's windows write their events, and where the manager drains them."""

    num_dropped: int

    @property
    def next_event_id(self) -> int: ...

    def enqueue_created(
        self, num_blocks_per_cache_level: Sequence[int], window_size: int
    ) -> None: ...

    def enqueue_stored(self, blocks: Sequence[KVCacheBlock], window_size: int) -> None: ...

    def enqueue_removed(self, block_hash: int, window_size: int) -> None: ...

    def enqueue_removed_many(self, block_hashes: Sequence[int], window_size: int) -> None: ...

    def enqueue_updated(self, data: UpdatedData, window_size: int) -> None: ...

    def flush(self) -> None: ...

    def get_events(self, timeout: float | None = None) -> list[KVCacheEvent]: ...


class NullEventSink:
    """Events off: every event is dropped unseen (no id is used, nothing is counted)."""

    num_dropped = 0

    @property
    def next_event_id(self) -> int:
        return 0

    def enqueue_created(self, num_blocks_per_cache_level: Sequence[int], window_size: int) -> None:
        pass

    def enqueue_stored(self, blocks: Sequence[KVCacheBlock], window_size: int) -> None:
        pass

    def enqueue_removed(self, block_hash: int, window_size: int) -> None:
        pass

    def enqueue_removed_many(self, block_hashes: Sequence[int], window_size: int) -> None:
        pass

    def enqueue_updated(self, data: UpdatedData, window_size: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def get_events(self, timeout: float | None = None) -> list[KVCacheEvent]:
        return []


class KVCacheEventManager:
    """Per-manager event buffer: per-iteration list -> bounded queue -> consumer."""

    def __init__(self, max_size: int) -> None:
        if max_size <= 0:
            raise ValueError(f"event buffer size must be positive, got {max_size}")
        self.max_size = max_size
        self._iteration: list[KVCacheEvent] = []
        self._queue: deque[KVCacheEvent] = deque()
        self._cond = threading.Condition()
        self._next_id = 0
        self.num_dropped = 0

    @property
    def next_event_id(self) -> int:
        return self._next_id

    def _enqueue(self, data: EventData, window_size: int) -> None:
        self._iteration.append(KVCacheEvent(self._next_id, data, window_size))
        self._next_id += 1

    def enqueue_created(self, num_blocks_per_cache_level: Sequence[int], window_size: int) -> None:
        self._enqueue(CreatedData(list(num_blocks_per_cache_level)), window_size)

    def enqueue_stored(self, blocks: Sequence[KVCacheBlock], window_size: int) -> None:
        if not blocks:
            return
        first_parent = blocks[0].prev_block
        parent_hash = (
            None if first_parent is None or first_parent.block_id < 0 else first_parent.hash
        )
        self._enqueue(StoredData.from_rows(parent_hash, stored_rows(blocks)), window_size)

    def enqueue_removed(self, block_hash: int, window_size: int) -> None:
        if self._iteration:
            last = self._iteration[-1]
            if isinstance(last.data, RemovedData) and last.window_size == window_size:
                last.data.block_hashes.append(block_hash)
                return
        self._enqueue(RemovedData([block_hash]), window_size)

    def enqueue_removed_many(self, block_hashes: Sequence[int], window_size: int) -> None:
        """`enqueue_removed` for each hash in turn: they all join one event."""
        if not block_hashes:
            return
        if self._iteration:
            last = self._iteration[-1]
            if isinstance(last.data, RemovedData) and last.window_size == window_size:
                last.data.block_hashes.extend(block_hashes)
                return
        self._enqueue(RemovedData(list(block_hashes)), window_size)

    def enqueue_updated(self, data: UpdatedData, window_size: int) -> None:
        self._enqueue(data, window_size)

    def flush(self) -> None:
        """End of iteration: move this iteration's events to the bounded queue."""
        if not self._iteration:
            return
        events, self._iteration = self._iteration, []
        with self._cond:
            overflow = len(self._queue) + len(events) - self.max_size
            if overflow > 0:
                self.num_dropped += overflow
                drop_queued = min(overflow, len(self._queue))
                for _ in range(drop_queued):
                    self._queue.popleft()
                events = events[overflow - drop_queued :]
            self._queue.extend(events)
            self._cond.notify_all()

    def get_events(self, timeout: float | None = None) -> list[KVCacheEvent]:
        """Drain every queued event; wait up to `timeout` seconds while there are none.

        `None` does not wait: the manager has a single writer, so a caller on that thread
        would otherwise wait for itself.
        """
        with self._cond:
            if not self._queue and timeout:
                self._cond.wait_for(lambda: bool(self._queue), timeout)
            events = list(self._queue)
            self._queue.clear()
            return events
