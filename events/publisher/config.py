"""What a worker hands an ``EventPublisher``: its settings (``PublisherConfig``), and the
registry and load fields a ``KVCacheManager`` can tell (``manager_registry_entry``,
``manager_load``).

A setting out of range raises ``ValueError`` naming it when the config is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cache import KVCacheManager
from events.envelope import DEFAULT_MAX_ENTRY_BYTES, FMT_MSGPACK, FORMATS

__all__ = ["PublisherConfig", "manager_load", "manager_registry_entry"]


def manager_registry_entry(
    mgr: KVCacheManager, *, url: str | None = None, device: str | None = None
) -> dict[str, Any]:
    """The registry fields a ``KVCacheManager`` can tell: capacity per level and per window."""
    windows = {}
    for size in mgr.window_sizes:
        cap = mgr.window_capacity(size)
        windows[str(size)] = [cap.primary, cap.secondary]
    total = mgr.window_capacity()
    return {
        "url": url,
        "device": device if device is not None else str(mgr.device),
        "tokens_per_block": mgr.tokens_per_block,
        "capacity": [total.primary, total.secondary],
        "windows": windows,
    }


def manager_load(mgr: KVCacheManager, *, num_waiting: int = 0) -> dict[str, int]:
    """Load fields of a ``KVCacheManager`` (summed over windows) for the load hash."""
    cap = mgr.window_capacity()
    return {
        "active_sequences": len(mgr.sequences),
        "waiting_requests": num_waiting,
        "free_blocks_0": cap.free_primary,
        "used_blocks_0": cap.primary - cap.free_primary,
        "free_blocks_1": cap.free_secondary,
        "used_blocks_1": cap.secondary - cap.free_secondary,
    }


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    """How a publisher writes its stream; the defaults are what a worker uses.

    Sizes are in blocks (a stored event weighs its blocks, a removal its hashes, any other
    event 1) or bytes; times in seconds. Out-of-range values raise ``ValueError`` here.
    """

    fmt: str = FMT_MSGPACK  # the events inside an entry: "msgpack" (events.codec) or "json"
    maxlen: int | None = 10_000  # cap on the stream's entries (XTRIM MAXLEN ~); None: no cap
    retain_s: float | None = 60.0  # keep entries this long (XADD MINID ~); None: maxlen alone
    max_entry_blocks: int = 4_096  # an entry's blocks at most; this many waiting: no lingering
    max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES  # larger entries are split (consumer's cap)
    linger_s: float = 0.002  # wait this long for more batches before a flush
    max_buffer_blocks: int = 1_000_000  # buffered while Redis is away; past it the oldest go
    heartbeat_interval_s: float = 1.0  # registry entry and heartbeat key, this often
    heartbeat_ttl_s: float = 5.0  # the heartbeat key's TTL: longer than heartbeat_interval_s
    load_interval_s: float = 1.0  # the load hash (needs a load_source), this often
    backoff_initial_s: float = 0.02  # first delay after a failed write; doubles per failure
    backoff_max_s: float = 2.0  # ... up to this
    close_timeout_s: float = 5.0  # aclose() waits this long for the buffer to be written
    close_timeout_failing_s: float = 1.0  # ... or this long while Redis writes are failing
    unregister_on_close: bool = True  # aclose() removes the registry entry and heartbeat key

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}, got {self.fmt!r}")
        for name, value in (
            ("maxlen", 1 if self.maxlen is None else self.maxlen),
            ("retain_s", 1 if self.retain_s is None else self.retain_s),
            ("max_entry_blocks", self.max_entry_blocks),
            ("max_entry_bytes", self.max_entry_bytes),
            ("max_buffer_blocks", self.max_buffer_blocks),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.heartbeat_ttl_s <= self.heartbeat_interval_s:
            raise ValueError("heartbeat_ttl_s must be longer than heartbeat_interval_s")
