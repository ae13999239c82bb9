"""Capacity arithmetic: how many blocks a sequence needs and how many a memory budget buys.

Closed forms ported from the seed's static KVCacheManager helpers (calculateMaxBlockRequirements*,
calculateMaxAttentionWindow, calculateWindowSizeToShare, calculateMaxNumBlocks). Pure functions,
positional arguments in the seed's order.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping, Sequence

SWA_EXTRA_BLOCK = 1
WINDOW_SIZE_SHARES_ENV = "KVMESH_WINDOW_SIZE_SHARES"
DEFAULT_GPU_MEMORY_FRACTION = 0.9


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def sink_bubble_length(sink_token_length: int, tokens_per_block: int) -> int:
    in_last_block = sink_token_length % tokens_per_block
    return 0 if in_last_block == 0 else tokens_per_block - in_last_block


def calculate_max_block_requirements_per_beam(
    sequence_length: int, sink_token_length: int, window_size: int, tokens_per_block: int
) -> int:
    bubble = sink_bubble_length(sink_token_length, tokens_per_block)
    blocks = _ceil_div(min(sequence_length, window_size) + bubble, tokens_per_block)
    if sequence_length > window_size:
        blocks += SWA_EXTRA_BLOCK
    return blocks


def calculate_max_block_requirements(
    input_length: int,
    output_length: int,
    sink_token_length: int,
    window_size: int,
    beam_width: int,
    tokens_per_block: int,
) -> int:
    whole = input_length + output_length
    if beam_width == 1:
        return calculate_max_block_requirements_per_beam(
            whole, sink_token_length, window_size, tokens_per_block
        )
    if window_size <= output_length:
        per_beam = calculate_max_block_requirements_per_beam(
            output_length, sink_token_length, window_size, tokens_per_block
        )
        return per_beam * beam_width
    context_tokens = min(window_size, whole) - output_length
    bubble = sink_bubble_length(sink_token_length, tokens_per_block)
    context_blocks = (context_tokens + bubble) // tokens_per_block
    leftover = context_tokens - context_blocks * tokens_per_block
    output_blocks = _ceil_div(output_length + leftover, tokens_per_block)
    if whole > window_size:
        output_blocks += SWA_EXTRA_BLOCK
    return context_blocks + output_blocks * beam_width


def calculate_max_attention_window(
    input_length: int,
    output_length: int,
    sink_token_length: int,
    block_capacity: int,
    beam_width: int,
    tokens_per_block: int,
) -> int:
    output_blocks = calculate_max_block_requirements(
        0, output_length, sink_token_length, output_length, beam_width, tokens_per_block
    )
    if output_blocks > block_capacity:
        return (block_capacity // beam_width) * tokens_per_block
    leftover_capacity = block_capacity - output_blocks
    return min(output_length + leftover_capacity * tokens_per_block, input_length + output_length)


def calculate_window_size_to_share(
    window_size_to_layers: Mapping[int, Sequence[int]],
    window_size_to_cache_size_per_token: Mapping[int, int],
) -> dict[int, float]:
    """VSWA memory split: proportional to window x cache size per token (sums to 1)."""
    if len(window_size_to_layers) == 1:
        return {next(iter(window_size_to_layers)): 1.0}
    total_per_token = sum(window_size_to_cache_size_per_token.values())
    contribution = {
        w: size / total_per_token * w for w, size in window_size_to_cache_size_per_token.items()
    }
    total = sum(contribution.values())
    shares = {w: c / total for w, c in sorted(contribution.items())}
    if not math.isclose(sum(shares.values()), 1.0):
        raise ArithmeticError(f"window shares do not sum to 1: {shares}")
    return shares


def window_size_shares(window_sizes: Sequence[int]) -> dict[int, float]:
    """Equal shares, or those of KVMESH_WINDOW_SIZE_SHARES (like TRTLLM_WINDOW_SIZE_SHARES)."""
    raw = os.environ.get(WINDOW_SIZE_SHARES_ENV)
    if not raw:
        return {w: 1.0 / len(window_sizes) for w in window_sizes}
    try:
        shares = [float(s) for s in raw.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"{WINDOW_SIZE_SHARES_ENV}={raw!r} is not a list of numbers") from None
    if len(shares) != len(window_sizes):
        raise ValueError(
            f"{WINDOW_SIZE_SHARES_ENV} has {len(shares)} shares for "
            f"{len(window_sizes)} window sizes"
        )
    for share in shares:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"{WINDOW_SIZE_SHARES_ENV}: shares must lie in [0, 1], got {share}")
    total = sum(shares)
    if total <= 0:
        raise ValueError(f"{WINDOW_SIZE_SHARES_ENV}: the sum of shares must be > 0")
    return {w: s / total for w, s in zip(sorted(window_sizes), shares, strict=True)}


def cache_size_per_token(
    layers: Sequence[int], num_kv_heads_per_layer: Sequence[int], head_dim: int, kv_factor: int
) -> int:
    """Elements of KV cache one token needs in the given layers."""
    return sum(num_kv_heads_per_layer[layer] for layer in layers) * head_dim * kv_factor


def calculate_max_num_blocks(
    window_size_to_layers: Mapping[int, Sequence[int]],
    num_kv_heads_per_layer: Sequence[int],
    head_dim: int,
    tokens_per_block: int,
    dtype_bytes: int,
    primary_mem_bytes: int,
    secondary_mem_bytes: int = 0,
    extra_cost_mem_bytes: int = 0,
    kv_factor: int = 2,
    max_tokens: int | None = None,
) -> dict[int, tuple[int, int]]:
    """calculateMaxNumBlocks: (primary, secondary) blocks per window from a memory budget."""
    if primary_mem_bytes < extra_cost_mem_bytes:
        raise ValueError(
            f"extra cost {extra_cost_mem_bytes} B exceeds the primary budget {primary_mem_bytes} B"
        )
    windows = sorted(window_size_to_layers)
    is_vswa = len(windows) > 1
    if max_tokens is not None and is_vswa:
        warnings.warn(
            "max_tokens limits the tokens of each window size under variable sliding-window "
            "attention, which is probably not what was meant; it is ignored",
            stacklevel=2,
        )
    budget = primary_mem_bytes - extra_cost_mem_bytes
    shares = window_size_shares(windows)
    result: dict[int, tuple[int, int]] = {}
    for window in windows:
        per_token = (
            cache_size_per_token(
                window_size_to_layers[window], num_kv_heads_per_layer, head_dim, kv_factor
            )
            * dtype_bytes
        )
        tokens = int(budget * shares[window] / per_token)
        if max_tokens is not None and not is_vswa:
            tokens = min(tokens, max_tokens)
        primary = _ceil_div(tokens, tokens_per_block)
        secondary_tokens = int(secondary_mem_bytes * shares[window] / per_token)
        result[window] = (primary, max(0, secondary_tokens // tokens_per_block))
    return result


def calculate_free_mem_bytes(
    free_device_bytes: int,
    host_cache_bytes: int = 0,
    free_gpu_memory_fraction: float | None = None,
) -> tuple[int, int]:
    """calculateFreeMemBytes: (primary, secondary) budgets from free device memory."""
    fraction = (
        DEFAULT_GPU_MEMORY_FRACTION
        if free_gpu_memory_fraction is None
        else free_gpu_memory_fraction
    )
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"free_gpu_memory_fraction must lie in (0, 1), got {fraction}")
    return int(free_device_bytes * fraction), host_cache_bytes
