"""What a request is to the engine: a ``Job`` (its prompt, limits, state and output so far, and
the future its handler awaits), the states it goes through, the engine's refusals, and the
virtual clock a simulated worker runs on. Plain data; ``app.worker.engine`` moves jobs along.

Errors::

    EngineError              the engine refuses (mapped to HTTP in ``app.worker.api``)
    ├── QueueFullError       429: the waiting queue is full
    ├── DrainingError        503: shutting down, or an operator's drain
    └── DuplicateJobError    409: a live request already has this id
"""

from __future__ import annotations

import asyncio
from array import array
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

import numpy as np
import numpy.typing as npt

from cache import LlmRequest
from cache.retention import RetentionConfig

__all__ = [
    "DrainingError",
    "DuplicateJobError",
    "EngineError",
    "Job",
    "JobState",
    "QueueFullError",
    "VirtualClock",
]


class EngineError(Exception):
    """Base of the engine's refusals (mapped to HTTP statuses in ``app.worker.api``)."""


class QueueFullError(EngineError):
    """The waiting queue is full (429)."""


class DrainingError(EngineError):
    """The worker drains (shutting down, or an operator asked) and admits nothing new (503)."""


class DuplicateJobError(EngineError):
    """A live request already has this id (409)."""


class JobState(Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


class VirtualClock:
    """A clock that moves only when the engine says a step took time (sim back-end)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass(slots=True, eq=False)
class Job:
    """One completion request, from submission to its last token."""

    job_id: str
    prompt: list[int]
    max_tokens: int
    seed: int
    priority: int = 0
    lora_task_id: int | None = None
    cache_salt: str | None = None
    cache_salt_id: int | None = None
    retention: RetentionConfig | None = None
    # the prompt as uint32 words (an array("I") or a numpy array), where checked that way
    words: array[int] | npt.NDArray[np.uint32] | None = None

    state: JobState = JobState.WAITING
    request_id: int = -1  # the manager's id while admitted
    request: LlmRequest | None = None
    position: int = 0  # next prompt position to compute (prefill)
    output: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens reused (at the first prefill, preemptions aside)
    admitted_reused: int = 0  # tokens reused at the latest admission
    num_preemptions: int = 0
    finish_reason: Literal["length", "cancelled", "aborted", "error"] | None = None
    error: str | None = None
    cancel_requested: bool = False
    arrival_s: float = 0.0
    admitted_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    # Set by the engine whenever output or state changes; readers clear it before reading.
    updated: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    @property
    def finished(self) -> bool:
        return self.state is JobState.FINISHED
