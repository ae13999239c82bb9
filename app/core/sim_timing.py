"""The step time of a simulated worker: ``kvmesh worker --engine sim`` sleeps it (or advances a
virtual clock by it), and ``kvmesh replay`` advances its virtual clock by it, so that both
simulate the same hardware. A linear model: a fixed cost per step, plus per prompt token
computed, plus per sequence decoded.

Sim timing defaults model Llama-3-8B in bf16 on one H100 SXM (989 dense TFLOP/s, 3.35 TB/s):

* ``step_overhead_s`` 5 ms: a step reads all 16 GB of weights once (16 GB / 3.35 TB/s = 4.8 ms);
* ``prefill_s_per_token`` 32 us: 2 x 8e9 FLOP per token at ~50 % of peak (~500 TFLOP/s);
* ``decode_s_per_sequence`` 80 us: one decode reads its KV cache, 128 KiB per token (32 layers x
  8 KV heads x 128 x K,V x 2 bytes), ~2,000 tokens of context = 256 MiB at 3.35 TB/s.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SimTiming"]


@dataclass(frozen=True, slots=True)
class SimTiming:
    step_overhead_s: float = 5e-3
    prefill_s_per_token: float = 32e-6
    decode_s_per_sequence: float = 80e-6

    def step_time(self, num_prefill_tokens: int, num_decodes: int) -> float:
        if not num_prefill_tokens and not num_decodes:
            return 0.0
        return (
            self.step_overhead_s
            + self.prefill_s_per_token * num_prefill_tokens
            + self.decode_s_per_sequence * num_decodes
        )
