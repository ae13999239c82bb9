"""The manager's statistics: block counts per level and the allocation counters, summed over
the windows (`KVCacheManager.get_kv_cache_stats`, `window_capacity`, a request's own counts).

The windows keep the counters (`WindowBlockManager.alloc_total_blocks` and the like); this
module only sums them. Not compiled (`cache._native`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from cache.request import LlmRequest

if TYPE_CHECKING:
    from cache.window import WindowBlockManager


@dataclass(slots=True)
class KvCacheStats:
    max_num_blocks: int
    free_num_blocks: int
    used_num_blocks: int
    tokens_per_block: int
    alloc_total_blocks: int
    alloc_new_blocks: int
    reused_blocks: int
    missed_blocks: int
    cache_hit_rate: float
    num_free_blocks_per_window_size: dict[int, int] = field(default_factory=dict)
    allocated_bytes: int = 0


@dataclass(frozen=True, slots=True)
class WindowCapacity:
    """Blocks of one attention window (or of all windows summed), per level."""

    primary: int
    secondary: int
    free_primary: int
    free_secondary: int


class Counters(NamedTuple):
    """The allocation counters, summed over windows."""

    alloc_total_blocks: int
    alloc_new_blocks: int
    reused_blocks: int
    missed_blocks: int


def counters(windows: Iterable[WindowBlockManager]) -> Counters:
    ws = list(windows)
    return Counters(
        sum(w.alloc_total_blocks for w in ws),
        sum(w.alloc_new_blocks for w in ws),
        sum(w.reused_blocks for w in ws),
        sum(w.missed_blocks for w in ws),
    )


def add_to_request(request: LlmRequest, before: Counters, after: Counters) -> None:
    """Charge a request with what the counters gained while it was added."""
    request.alloc_total_blocks += after.alloc_total_blocks - before.alloc_total_blocks
    request.alloc_new_blocks += after.alloc_new_blocks - before.alloc_new_blocks
    request.reused_blocks += after.reused_blocks - before.reused_blocks
    request.missed_blocks += after.missed_blocks - before.missed_blocks


def window_capacity(windows: Iterable[WindowBlockManager]) -> WindowCapacity:
    ws = list(windows)
    return WindowCapacity(
        primary=sum(wm.num_primary_blocks for wm in ws),
        secondary=sum(wm.num_secondary_blocks for wm in ws),
        free_primary=sum(wm.get_num_free_blocks() for wm in ws),
        free_secondary=sum(wm.get_num_free_secondary_blocks() for wm in ws),
    )


def kv_cache_stats(
    windows: Mapping[int, WindowBlockManager], tokens_per_block: int, allocated_bytes: int
) -> KvCacheStats:
    total, new, reused, missed = counters(windows.values())
    free = sum(wm.get_num_free_blocks() for wm in windows.values())
    maximum = sum(wm.num_primary_blocks for wm in windows.values())
    return KvCacheStats(
        max_num_blocks=maximum,
        free_num_blocks=free,
        used_num_blocks=maximum - free,
        tokens_per_block=tokens_per_block,
        alloc_total_blocks=total,
        alloc_new_blocks=new,
        reused_blocks=reused,
        missed_blocks=missed,
        cache_hit_rate=reused / (reused + missed) if reused else 0.0,
        num_free_blocks_per_window_size={w: wm.get_num_free_blocks() for w, wm in windows.items()},
        allocated_bytes=allocated_bytes,
    )
