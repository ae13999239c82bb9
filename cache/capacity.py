"""Capacity arithmetic: how many blocks a sequence needs and how many a memory budget buys.

Closed forms ported from the seed's static KVCacheManager helpers (calculateMaxBlockRequirements*,
calculateMaxAttentionWindow, calculateWindowSizeToShare, calculateMaxNumBlocks,
groupLayersByWindowSize), positional arguments in the seed's order; and the scheduler's two
questions about a live request (getNeededBlocksOneStep, getRemainingBlocksToCompletion), which
`KVCacheManager` answers with them. Pure functions.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping, Sequence

from cache.errors import UnknownRequestError
from cache.request import GenerationRequest, LlmRequest, RequestState

SWA_EXTRA_BLOCK = 1
WINDOW_SIZE_SHARES_ENV = "KVMESH_WINDOW_SIZE_SHARES"
DEFAULT_GPU_MEMORY_FRACTION = 0.9


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def group_layers_by_window_size(
    max_attention_window: Sequence[int], num_layers: int
) -> dict[int, list[int]]:
    """groupLayersByWindowSize: windows cycle over the layers; sorted by window size."""
    groups: dict[int, list[int]] = {}
    for layer in range(num_layers):
        groups.setdefault(max_attention_window[layer % len(max_attention_window)], []).append(layer)
    return dict(sorted(groups.items()))


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


def max_capacity_batch_size(
    window_num_blocks: Mapping[int, int],
    input_length: int,
    output_length: int,
    beam_width: int,
    tokens_per_block: int,
) -> int:
    """getMaxCapacityBatchSize: how many sequences of this shape fit at once, given each
    window's primary blocks (the tightest window decides)."""
    return min(
        num_blocks
        // calculate_max_block_requirements(
            input_length, output_length, 0, window, beam_width, tokens_per_block
        )
        for window, num_blocks in window_num_blocks.items()
    )


# -- a live request's needs ------------------------------------------------------------------------


def needed_blocks_one_step(
    request: LlmRequest,
    sequence: GenerationRequest | None,
    window_size: int,
    tokens_per_block: int,
    is_cross_kv: bool,
    max_token_num: int,
    two_steps_look_ahead: bool = False,
) -> int:
    """getNeededBlocksOneStep: the blocks `request` needs in one window for its next step (its
    first context chunk, or the next one or two decoding steps). `sequence` is its live
    sequence, which a decoding request must have."""
    tpb = tokens_per_block
    if (
        request.state is RequestState.CONTEXT_INIT and request.is_first_context_chunk
    ) or request.state is RequestState.DISAGG_GENERATION_INIT:
        chunk = request.max_new_tokens
        prompt = request.encoder_output_len if is_cross_kv else request.prompt_len
        prompt_cache_len = min(prompt + request.num_draft_tokens, window_size + chunk)
        shared = prompt_cache_len // tpb
        unshared = _ceil_div(prompt_cache_len % tpb, tpb) * request.beam_width
        return shared + unshared
    if request.state is RequestState.GENERATION_IN_PROGRESS:
        if is_cross_kv:
            return 0
        if sequence is None:
            raise UnknownRequestError(f"no live sequence with request id {request.request_id}")
        current = sequence.num_tokens
        generated = current - request.prompt_len
        max_to_add = request.max_new_tokens - generated
        per_step = request.num_draft_tokens + 1
        to_add = min((2 if two_steps_look_ahead else 1) * per_step, max_to_add)
        following = current + to_add
        if following > max_token_num:
            return 0
        return (_ceil_div(following, tpb) - _ceil_div(current, tpb)) * request.beam_width
    return 0


def remaining_blocks_to_completion(
    request: LlmRequest,
    sequence: GenerationRequest | None,
    window_size: int,
    tokens_per_block: int,
    is_cross_kv: bool,
) -> int:
    """getRemainingBlocksToCompletion: the blocks `request` still needs in one window to run
    to its last token, counting what its live `sequence` (if any) holds already."""
    tpb = tokens_per_block
    beam = request.beam_width
    if is_cross_kv:
        if request.state is RequestState.CONTEXT_INIT and request.context_current_position == 0:
            return _ceil_div(request.encoder_output_len, tpb)
        return 0
    whole = request.prompt_len + request.max_new_tokens
    num_context = min(request.prompt_len, window_size) // tpb
    total_per_beam = _ceil_div(min(whole, window_size), tpb)
    gen_per_beam = total_per_beam - num_context
    allocated = len(sequence.cache_block_ids[window_size][0]) if sequence else 0
    sliding = whole > window_size
    current_blocks = _ceil_div(request.num_tokens, tpb)
    max_blocks = _ceil_div(whole, tpb)
    extra = 1 if sliding and max_blocks > current_blocks and max_blocks > total_per_beam else 0
    if allocated < num_context:
        return num_context - allocated + (gen_per_beam + extra) * beam
    return (total_per_beam - allocated + extra) * beam
