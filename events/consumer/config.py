"""``ConsumerConfig``: every setting of an ``EventConsumer``, with its default and its check.

A frozen dataclass, made once and handed to ``EventConsumer(redis, config)``; a setting out of
range raises ``ValueError`` naming it when the config is made, as ``PublisherConfig`` does.
The defaults are what a router and a dashboard use; tests shorten the periods.
"""

from __future__ import annotations

from dataclasses import dataclass

from events.envelope import DEFAULT_MAX_ENTRY_BYTES

__all__ = ["ConsumerConfig"]


@dataclass(frozen=True, slots=True)
class ConsumerConfig:
    """How a consumer reads the streams; times in seconds unless the name says otherwise."""

    block_ms: int = 100  # one XREAD waits this long for entries at most (milliseconds)
    # At most one XREAD this often (0: at once): what arrives meanwhile comes in one reply. An
    # XREAD costs ~170 us beside its entries, and busy workers flush at their own moments.
    read_interval_s: float = 0.0
    count: int = 256  # one XREAD returns this many entries per stream at most
    registry_interval_s: float = 0.5  # read the registry (and Redis's run_id) this often
    liveness_interval_s: float = 0.5  # read every worker's heartbeat key this often
    max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES  # larger entries are refused unparsed
    resync_delay_s: float = 0.02  # wait for a requested snapshot; doubles per new request
    resync_delay_max_s: float = 1.0  # ... up to this
    backoff_initial_s: float = 0.02  # first delay after a failed round; doubles per failure
    backoff_max_s: float = 2.0  # ... up to this
    pause_gc: bool = True  # pause the cyclic garbage collector while entries are applied
    step_budget_s: float = 0.010  # give the event loop back after applying this long
    stale_after_s: float = 2.0  # a worker whose heartbeat's event id is not applied by then
    restart_hold_s: float = 5.0  # hold after a Redis restart, when a worker's entry has no TTL

    def __post_init__(self) -> None:
        for name, value in (
            ("block_ms", self.block_ms),
            ("count", self.count),
            ("max_entry_bytes", self.max_entry_bytes),
            ("backoff_initial_s", self.backoff_initial_s),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        for name, value in (
            ("registry_interval_s", self.registry_interval_s),
            ("liveness_interval_s", self.liveness_interval_s),
            ("resync_delay_s", self.resync_delay_s),
            ("step_budget_s", self.step_budget_s),
            ("read_interval_s", self.read_interval_s),
            ("stale_after_s", self.stale_after_s),
            ("restart_hold_s", self.restart_hold_s),
        ):
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if not self.resync_delay_max_s >= self.resync_delay_s:
            raise ValueError(
                f"resync_delay_max_s must be >= resync_delay_s ({self.resync_delay_s}), "
                f"got {self.resync_delay_max_s}"
            )
        if not self.backoff_max_s >= self.backoff_initial_s:
            raise ValueError(
                f"backoff_max_s must be >= backoff_initial_s ({self.backoff_initial_s}), "
                f"got {self.backoff_max_s}"
            )
