"""Retention configuration: which priority and duration each block of a request gets.

Mirrors TensorRT-LLM's KvCacheRetentionConfig: token ranges with a priority (0..100) and an
optional duration; a block takes the range that contains its *first* token; decode blocks take the
decode priority. Durations are in seconds here (the C++ code uses milliseconds).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from cache.errors import InvalidRetentionConfigError

MIN_PRIORITY = 0
MAX_PRIORITY = 100
DEFAULT_PRIORITY = 35


class TransferMode(Enum):
    """How blocks move between tiers (KvCacheTransferMode)."""

    DRAM = "dram"
    GDS = "gds"
    POSIX_DEBUG_FALLBACK = "posix_debug_fallback"


def _check_priority(priority: int, what: str) -> None:
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidRetentionConfigError(
            f"{what} priority {priority} is outside {MIN_PRIORITY}..{MAX_PRIORITY}"
        )


@dataclass(frozen=True, slots=True)
class TokenRangeRetention:
    """Tokens [start, end) keep `priority` for `duration_s` after release (end None: to the end)."""

    start: int
    end: int | None
    priority: int
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if self.start < 0:
            raise InvalidRetentionConfigError(f"token range start {self.start} is negative")
        if self.end is not None and self.end < self.start:
            raise InvalidRetentionConfigError(
                f"token range end {self.end} is before its start {self.start}"
            )
        _check_priority(self.priority, "token range")
        if self.duration_s is not None and self.duration_s < 0:
            raise InvalidRetentionConfigError(f"duration {self.duration_s} s is negative")


@dataclass(frozen=True, slots=True)
class RetentionConfig:
    """Per-request retention: token ranges (sorted, non-overlapping) plus decode settings."""

    ranges: tuple[TokenRangeRetention, ...] | list[TokenRangeRetention] = ()
    decode_priority: int = DEFAULT_PRIORITY
    decode_duration_s: float | None = None
    transfer_mode: TransferMode = TransferMode.DRAM
    directory: str | None = None
    _sorted: tuple[TokenRangeRetention, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        ranges = tuple(sorted(self.ranges, key=lambda r: r.start))
        for i in range(len(ranges) - 1):
            this, following = ranges[i], ranges[i + 1]
            if this.end is None:
                raise InvalidRetentionConfigError(
                    f"open-ended token range starting at {this.start} is followed by another range"
                )
            if this.end > following.start:
                raise InvalidRetentionConfigError(
                    f"token ranges [{this.start}, {this.end}) and "
                    f"[{following.start}, {following.end}) overlap"
                )
        _check_priority(self.decode_priority, "decode")
        if self.decode_duration_s is not None and self.decode_duration_s < 0:
            raise InvalidRetentionConfigError(
                f"decode duration {self.decode_duration_s} s is negative"
            )
        object.__setattr__(self, "_sorted", ranges)

    def per_block_retention(
        self, tokens_per_block: int, sequence_length: int
    ) -> list[tuple[int | None, float | None]]:
        """getPerBlockRetentionPriorityDuration: (priority, duration) per block, None when unset."""
        num_blocks = -(-sequence_length // tokens_per_block)
        if not self._sorted:
            return [(None, None)] * num_blocks
        result: list[tuple[int | None, float | None]] = []
        for block in range(num_blocks):
            first = block * tokens_per_block
            chosen: tuple[int | None, float | None] = (None, None)
            for r in self._sorted:
                if r.start <= first and (r.end is None or first < r.end):
                    chosen = (r.priority, r.duration_s)
                    break
            result.append(chosen)
        return result


DEFAULT_RETENTION = RetentionConfig()
