"""Errors raised by the block manager.

KVCacheError
├── OutOfBlocksError            no room: the manager is left exactly as it was
├── DuplicateRequestError       add_sequence with a request id already live
├── UnknownRequestError         an operation names a request id that is not live (also KeyError)
├── UnknownBlockError           a block id outside the pool (also ValueError)
├── PinConflictError            an unpin that would leave a pinned block's ancestor unpinned
└── InvalidRetentionConfigError a retention config the seed would reject (also ValueError)
"""

from __future__ import annotations


class KVCacheError(Exception):
    """Base class of every error the block manager raises on purpose."""


class OutOfBlocksError(KVCacheError):
    """Not enough free blocks; the failed call changed nothing."""


class DuplicateRequestError(KVCacheError):
    """A sequence with this request id is already live."""


class UnknownRequestError(KVCacheError, KeyError):
    """No live sequence has this request id."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown request"


class UnknownBlockError(KVCacheError, ValueError):
    """A block id outside the pool."""


class PinConflictError(KVCacheError, ValueError):
    """An unpin that would leave a pinned block with an unpinned ancestor; nothing changed."""


class InvalidRetentionConfigError(KVCacheError, ValueError):
    """A retention configuration that TensorRT-LLM would refuse."""
