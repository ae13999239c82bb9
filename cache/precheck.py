"""What a manager operation plans and checks before it changes anything.

The seed throws half way through an allocation; kvmesh refuses first, so that a refused call
changes neither blocks, tree, statistics nor events, and refuses only what the seed would fail
on. Here: the request `add_sequence` is given (`check_request`), its plan for every window
(`plan_windows`: its share of the input and the keys it matches) and the room it needs
(`check_room`, which asks the exact dry run of `cache.dryrun` when the plain bound does not
settle it); the room and window length `add_token` and `add_tokens` need (`check_add_token`,
`check_add_tokens`, `check_add_tokens_swa`), raising the error the first failing step would.

Not compiled (`cache._native`): the manager's arguments arrive here as the caller gave them.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

from cache.dryrun import blocks_needed_for_next_token, count_blocks_needed, would_leave_window
from cache.errors import DuplicateRequestError, OutOfBlocksError
from cache.hashing import BlockHash, BlockKey
from cache.request import INT_MAX, GenerationRequest, LlmRequest

if TYPE_CHECKING:
    from cache.window import WindowBlockManager


class WindowPlan(NamedTuple):
    """What add_sequence does in one window: its share of the input, and the keys it matches."""

    window: WindowBlockManager
    input_length: int
    num_context_blocks: int
    keys: list[BlockKey]
    hashes: list[BlockHash]
    max_num_blocks: int  # free blocks it takes at most (one per position, per beam at the tail)


def check_request(
    request: LlmRequest, live: Container[int], max_beam_width: int, encoder: bool
) -> int:
    """Refuse a request add_sequence cannot take (an id already live, too wide a beam, no
    tokens); else its input length (the encoder's output in a cross-attention cache)."""
    rid = request.request_id
    if rid in live:
        raise DuplicateRequestError(f"request id {rid} is already live")
    if request.beam_width > max_beam_width:
        raise ValueError(f"request {rid}: beam width {request.beam_width} exceeds {max_beam_width}")
    if encoder and request.encoder_tokens is None:
        raise ValueError(f"request {rid}: a cross-attention cache needs encoder tokens")
    input_length = request.encoder_output_len if encoder else request.num_tokens
    if input_length <= 0:
        raise ValueError(f"request {rid} has no tokens")
    return input_length


def plan_windows(
    windows: Mapping[int, WindowBlockManager],
    max_token_num: Mapping[int, int],
    request: LlmRequest,
    input_length: int,
    reuse: bool,
    encoder: bool,
) -> list[WindowPlan]:
    """add_sequence's plan for each window: the input it holds there (at most the window's
    max_token_num), its context blocks, the keys to match (windows that hold the same input
    share them), and the free blocks it takes at most: one per position, and one per beam for
    the last block of a beam search."""
    beam = request.beam_width
    plans: list[WindowPlan] = []
    key_cache: dict[int, tuple[list[BlockKey], list[BlockHash]]] = {}
    for window, wm in windows.items():
        effective = min(input_length, max_token_num[window])
        num_context_blocks = -(-effective // wm.tokens_per_block)
        keys: list[BlockKey] = []
        hashes: list[BlockHash] = []
        if reuse:
            if effective not in key_cache:
                key_cache[effective] = wm.context_keys(request, effective, encoder)
            keys, hashes = key_cache[effective]
        shared = num_context_blocks - 1 if beam > 1 else num_context_blocks
        bound = shared + (num_context_blocks - shared) * beam
        plans.append(WindowPlan(wm, effective, num_context_blocks, keys, hashes, bound))
    return plans


def check_room(
    request: LlmRequest,
    sequence: GenerationRequest,
    plans: Sequence[WindowPlan],
    reuse: bool,
    encoder: bool,
    tokens_per_block: int,
) -> None:
    """Raise OutOfBlocksError, before any change, exactly when add_sequence would run out
    of blocks in some window (the seed would throw there, half way)."""
    cap = INT_MAX  # a window reuses at most what the windows before it reused
    for plan in plans:
        wm = plan.window
        share_last = encoder or plan.input_length % tokens_per_block == 0
        need, matched = count_blocks_needed(
            wm,
            plan.keys,
            plan.hashes,
            sequence,
            plan.num_context_blocks,
            cap,
            reuse,
            share_last,
        )
        free = wm.get_num_free_blocks()
        if need > free:
            raise OutOfBlocksError(
                f"request {request.request_id} needs {need} blocks in window "
                f"{wm.window_size}, {free} free"
            )
        if reuse:
            cap = matched


def _too_long(rid: int, count: int, window: int, max_sequence_length: int) -> ValueError:
    return ValueError(
        f"request {rid}: {count} tokens exceed what window {window} holds "
        f"(max_sequence_length {max_sequence_length})"
    )


def check_add_token(
    windows: Mapping[int, WindowBlockManager],
    sequence: GenerationRequest,
    max_sequence_length: int,
) -> None:
    """Refuse one more token where a window without sliding would overflow or a window lacks
    the free blocks the token needs."""
    rid = sequence.request_id
    for window, wm in windows.items():
        if not wm.is_swa and would_leave_window(wm, sequence):
            raise _too_long(rid, sequence.num_tokens + 1, window, max_sequence_length)
        need = blocks_needed_for_next_token(wm, sequence)
        if need > wm.get_num_free_blocks():
            raise OutOfBlocksError(
                f"request {rid} needs {need} new block(s) in window {window}, "
                f"{wm.get_num_free_blocks()} free"
            )


def check_add_tokens(
    windows: Mapping[int, WindowBlockManager],
    sequence: GenerationRequest,
    num_tokens: int,
    tokens_per_block: int,
    max_sequence_length: int,
) -> range:
    """add_tokens' refusal without sliding windows: the error the first failing add_token
    would raise (the earliest token count, then the window order). Else the token counts at
    which add_token would allocate: those t with (t - 1) % tokens_per_block == 0."""
    tpb = tokens_per_block
    rid = sequence.request_id
    start = sequence.num_tokens
    end = start + num_tokens
    boundaries = range(start + (-start) % tpb + 1, end + 1, tpb)
    num_new = len(boundaries)
    per_boundary = 1 if sequence.beam_width == 1 else sequence.beam_width
    # (token count at which add_token would fail, window order, error): the first one wins.
    failures: list[tuple[int, int, Exception]] = []
    for order, (window, wm) in enumerate(windows.items()):
        front = sequence.num_front_blocks_removed[window]
        too_long = front * tpb + window + tpb  # would_leave_window from this count on
        if too_long <= end:
            error = _too_long(rid, too_long, window, max_sequence_length)
            failures.append((too_long, order, error))
        free = wm.get_num_free_blocks()
        if num_new * per_boundary > free:
            fit = free // per_boundary  # boundaries that still fit
            failures.append(
                (
                    boundaries.start + fit * tpb,
                    order,
                    OutOfBlocksError(
                        f"request {rid} needs {num_new * per_boundary} new block(s) "
                        f"in window {window} for {num_tokens} tokens, {free} free"
                    ),
                )
            )
    if failures:
        raise min(failures, key=lambda f: (f[0], f[1]))[2]
    return boundaries


def check_add_tokens_swa(
    windows: Mapping[int, WindowBlockManager],
    sequence: GenerationRequest,
    num_tokens: int,
    tokens_per_block: int,
    max_sequence_length: int,
) -> None:
    """Dry run of `num_tokens` add_token checks with sliding windows: a block that leaves
    the window frees its slot when this sequence alone holds it (ref_count 1)."""
    tpb = tokens_per_block
    rid = sequence.request_id
    per_boundary = 1 if sequence.beam_width == 1 else sequence.beam_width
    fronts = dict(sequence.num_front_blocks_removed)
    avail = {window: wm.get_num_free_blocks() for window, wm in windows.items()}
    for count in range(sequence.num_tokens + 1, sequence.num_tokens + num_tokens + 1):
        for window, wm in windows.items():
            front = fronts[window]
            if not wm.is_swa and count - front * tpb >= window + tpb:
                raise _too_long(rid, count, window, max_sequence_length)
            if (count - 1) % tpb:
                continue
            blocks = wm.allocated_blocks_per_seq[rid]
            while count - front * tpb >= window + tpb:
                # Past the blocks held now: one this dry run allocated, held by it alone.
                if front >= len(blocks) or blocks[front].ref_count == 1:
                    avail[window] += 1
                front += 1
            fronts[window] = front
            if per_boundary > avail[window]:
                raise OutOfBlocksError(
                    f"request {rid} needs {per_boundary} new block(s) in window {window} "
                    f"at token {count}, {avail[window]} free"
                )
            avail[window] -= per_boundary
