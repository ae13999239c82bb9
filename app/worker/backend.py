"""The model back-end interface of the worker's engine, and the ``sim`` back-end.

The engine (``app.worker.engine``) schedules; a back-end computes one step of a batch: the
prompt chunks being prefilled and the sequences being decoded. It returns one sampled token for
every decode and for every chunk that completes its prompt, and how long the step took on the
modelled hardware. Two back-ends implement ``Backend``:

* ``SimBackend`` (here): no model. Step time is a linear model, output tokens a deterministic
  function of the request's seed (a hash of its prompt) and the position.
* ``TorchBackend`` (``app.worker.torch_backend``): a tiny random-weight decoder whose paged
  attention reads and writes K/V in the manager's pools through its block tables.

Positions are absolute: a chunk computes the K/V of ``tokens[start:end]`` (``start`` is at least
the prepopulated, i.e. reused, prompt length); a decode computes the K/V of ``tokens[-1]`` at
position ``len(tokens) - 1``. In both, the KV-cache blocks for those positions are already
allocated by the manager when ``execute`` is called.
The sim's step time is ``app.core.sim_timing.SimTiming`` (shared with ``kvmesh replay``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from app.core.sim_timing import SimTiming

__all__ = [
    "Backend",
    "Decode",
    "PrefillChunk",
    "SimBackend",
    "StepBatch",
    "StepOutput",
    "prompt_seed",
]

_MASK64 = (1 << 64) - 1


def prompt_seed(prompt: Sequence[int]) -> int:
    """A request's output seed: a 64-bit hash of its prompt (tuple hashing is C, not a loop)."""
    return hash(tuple(prompt)) & _MASK64


@dataclass(slots=True)
class PrefillChunk:
    """Compute the K/V of ``tokens[start:end]``; ``end == len(tokens)`` completes the prompt."""

    request_id: int
    tokens: list[int]
    start: int
    end: int
    seed: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def completes_prompt(self) -> bool:
        return self.end == len(self.tokens)


@dataclass(slots=True)
class Decode:
    """Compute the K/V of ``tokens[-1]`` and sample the next token."""

    request_id: int
    tokens: list[int]
    seed: int


@dataclass(slots=True)
class StepBatch:
    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[Decode] = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(chunk.end - chunk.start for chunk in self.prefills)

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


@dataclass(slots=True)
class StepOutput:
    # request id -> sampled token, for every decode and every chunk that completes its prompt
    tokens: dict[int, int]
    # Time the step takes on the modelled hardware; 0 when the step's own run time is real.
    model_time_s: float = 0.0


class Backend(Protocol):
    """One model step over a batch (called on the engine task, between manager calls)."""

    name: str
    vocab_size: int

    def execute(self, batch: StepBatch) -> StepOutput: ...


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit value from a seed and a position."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


class SimBackend:
    """No model: modelled step time, and the token at position p is f(seed, p) mod vocab."""

    name = "sim"

    def __init__(self, vocab_size: int, timing: SimTiming | None = None) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self.timing = timing or SimTiming()

    def next_token(self, seed: int, position: int) -> int:
        """The token sampled after computing ``position`` (so it lands at ``position + 1``)."""
        return _mix64((seed + 0x9E3779B97F4A7C15 * (position + 1)) & _MASK64) % self.vocab_size

    def execute(self, batch: StepBatch) -> StepOutput:
        tokens: dict[int, int] = {}
        for chunk in batch.prefills:
            if chunk.completes_prompt:
                tokens[chunk.request_id] = self.next_token(chunk.seed, chunk.end - 1)
        for decode in batch.decodes:
            tokens[decode.request_id] = self.next_token(decode.seed, len(decode.tokens) - 1)
        model_time = self.timing.step_time(batch.num_prefill_tokens, len(batch.decodes))
        return StepOutput(tokens, model_time)
