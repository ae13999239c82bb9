"""The transfer-engine port: how block contents move between memory slots.

The manager decides *which* slots to copy; an engine moves the bytes. `NoOpTransferEngine` serves
managers without pools (metadata only); the torch engine that moves real tensors implements the
same protocol. Every call is recorded by `RecordingTransferEngine`, which tests use to assert the
exact copies the manager issued.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol


@dataclass(frozen=True, slots=True)
class Slot:
    """A memory slot: index into the primary (GPU) or secondary (host) pool."""

    index: int
    is_primary: bool


class TransferEngine(Protocol):
    def copy(self, src: Slot, dst: Slot, num_tokens: int = 0, directory: str | None = None) -> None:
        """Copy block contents from `src` to `dst` (all token slots when num_tokens is 0).

        With `directory`, an offload writes the block to files there instead of host memory.
        """

    def flush(self) -> None:
        """Issue every queued copy (the manager calls this before it returns)."""

    def sync(self) -> None:
        """Wait until every issued copy has completed."""


class NoOpTransferEngine:
    def copy(self, src: Slot, dst: Slot, num_tokens: int = 0, directory: str | None = None) -> None:
        pass

    def flush(self) -> None:
        pass

    def sync(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class TransferRecord:
    kind: Literal["offload", "onboard", "copy"]
    src: Slot
    dst: Slot
    num_tokens: int
    directory: str | None = None


class RecordingTransferEngine:
    """Records every copy (kind from the slots' tiers) and forwards it to `inner` if given."""

    def __init__(self, inner: TransferEngine | None = None) -> None:
        self.records: list[TransferRecord] = []
        self._inner = inner

    def copy(self, src: Slot, dst: Slot, num_tokens: int = 0, directory: str | None = None) -> None:
        if src.is_primary and not dst.is_primary:
            kind: Literal["offload", "onboard", "copy"] = "offload"
        elif not src.is_primary and dst.is_primary:
            kind = "onboard"
        else:
            kind = "copy"
        self.records.append(TransferRecord(kind, src, dst, num_tokens, directory))
        if self._inner is not None:
            self._inner.copy(src, dst, num_tokens, directory)

    def flush(self) -> None:
        if self._inner is not None:
            self._inner.flush()

    def sync(self) -> None:
        if self._inner is not None:
            self._inner.sync()
