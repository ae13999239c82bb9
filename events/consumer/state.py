"""What the consumer knows: per worker (``WorkerState``), and in all (``Counters``).

Plain records, shared by the consumer's parts (``events.consumer.registry``, ``.liveness``,
``.resync``, ``.apply``) and changed only by them, on the consumer's event loop. Also the
reading of stream entry ids (``"<ms>-<seq>"``) that those parts compare.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Final

from events.errors import EnvelopeError

__all__ = ["NO_DEADLINE", "Counters", "Suspect", "WorkerState", "entry_key", "entry_ms"]

logger = logging.getLogger(__name__)

NO_DEADLINE: Final = float("inf")


def entry_ms(entry_id: bytes | str) -> int:
    """The milliseconds part of a stream entry id (when Redis added it, by its clock)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.partition("-")[0])


def entry_key(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry id as ``(ms, seq)``, to compare positions in a stream."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


@dataclass(frozen=True, slots=True)
class Suspect:
    """An entry that made the consumer resynchronise: checked against the next snapshot."""

    entry_id: bytes
    position: tuple[int, int]
    epoch: int
    seq_first: int
    seq_last: int
    reason: str


@dataclass(slots=True)
class WorkerState:
    """What the consumer knows about one worker's stream."""

    worker: str
    key: bytes
    info: dict[str, Any] = field(default_factory=dict)
    alive: bool = False
    synced: bool = False
    epoch: int = -1
    last_seq: int = -1
    snapshot_seq: int = -1
    pos: bytes | str = "0-0"
    retry_at: float = NO_DEADLINE
    retry_delay: float = 0.0
    request_snapshot: bool = False
    applied_since_resync: int = 0
    bad_high_water: tuple[int, int] = (-1, -1)  # last malformed entry counted
    # Why the index for this worker cannot be trusted although it is synchronised (None: it
    # can): "behind_heartbeat" -- the worker's heartbeat reported an event id that this
    # consumer has not applied within ``stale_after_s``. Cleared once it has.
    stale: str | None = None
    # The worker's own word, from its heartbeat: its epoch and the last event id it has.
    reported_epoch: int = -1
    reported_seq: int = -1
    # An event id the heartbeat reported that is not applied yet, since when (monotonic), and
    # the last_seq at that moment (to tell a consumer that lags from one that is frozen).
    behind_target: tuple[int, int] | None = None
    behind_since: float = 0.0
    behind_from_seq: int = -1
    # After a Redis restart (monotonic): until then the worker is kept, though the registry or
    # its heartbeat does not name it, while it writes them again (0: not held).
    held_until: float = 0.0
    # The entry that made the last resynchronisation, and the snapshot loaded before it.
    suspect: Suspect | None = None
    loaded_snapshot: tuple[int, int, str] | None = None
    entries: int = 0
    events: int = 0
    blocks: int = 0


@dataclass(slots=True)
class Counters:
    """The consumer's counters; ``EventConsumer`` shows each as ``num_*`` and in ``stats()``."""

    num_entries: int = 0
    num_events: int = 0
    num_blocks: int = 0
    num_skipped_entries: int = 0
    num_stale_entries: int = 0
    num_malformed: int = 0
    num_oversized: int = 0
    num_syncs: int = 0
    num_resyncs: int = 0
    resync_reasons: Counter[str] = field(default_factory=Counter)
    num_snapshot_loads: int = 0
    num_snapshot_requests: int = 0
    num_expired: int = 0
    num_redis_restarts: int = 0
    num_held: int = 0  # workers held through a Redis restart (WorkerState.held_until)
    apply_lag_ms: float = 0.0
    num_bad_registry_entries: int = 0
    num_yields: int = 0  # times a batch or a snapshot was split to give the loop back
    num_stale_reports: int = 0  # workers found behind their heartbeat (WorkerState.stale)
    num_memory_releases: int = 0  # malloc_trim calls after an oversized entry was read

    def count_malformed(
        self, state: WorkerState, entry_id: bytes, exc: EnvelopeError, *, oversized: bool = False
    ) -> None:
        """Count a bad entry once, even when a resynchronisation makes it read again."""
        position = entry_key(entry_id)
        if position <= state.bad_high_water:
            return
        state.bad_high_water = position
        self.num_malformed += 1
        if oversized:
            self.num_oversized += 1
        # str(exc): a record holding the exception would hold its frames, and the entry.
        logger.warning("consumer: skipped entry %r of %s: %s", entry_id, state.worker, str(exc))
