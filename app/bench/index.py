"""``kvmesh bench index``: the router's prefix index (`events.PrefixIndex`), apply and match.

Workload (seeded; generated in a child process before any clock starts): 16 workers, 32 shared
system prompts of 512..2,048 tokens, 16 tokens per block. 64 multi-turn chat sessions are open
at a time; each step picks one at random and runs its next turn (a user message of 32..384
tokens and a reply of 64..384). The worker serving the turn stores the turn's new full blocks
as one `stored` event whose `parent_hash` is the last block of the previous turn. A session's
first turn goes to a random worker, which stores the system prompt too unless it already holds
it; with probability 1/20 a turn moves to another random worker, which stores the whole chain
from the first block it does not hold (from the root, unless it holds the system prompt). A
session ends when its next turn would pass 8,192 tokens; a new one replaces it. Hashes are the
real chained block hashes (`cache.block_hashes_for_tokens`); events carry their tokens and are
msgpack-encoded (`events.codec`), as on the stream. No eviction. 20,000 events.

Timed:

* applying all 20,000 events, decoded beforehand, to an empty index (`apply_event` per event;
  5 builds, median and fastest);
* the same with each event decoded just before it is applied, as a consumer reading the stream
  does (`apply_streaming_*`; only `apply_event` is timed, but decoding cools the CPU caches);
* `find_matches` for 4,096-token requests (256 blocks): half continue a conversation (its
  first 1..3,840 tokens, then new ones), a quarter share only a system prompt, a quarter are
  cold; also `find_matches_by_tier` and the binary-search variant (`assume_monotone=True`,
  checked to give the same answers here, where nothing is evicted);
* the same requests from token lists to matches (`hash_and_match_*`): the list goes to
  `cache.hashing.block_hash_array` (which packs it into a uint32 array, `array("I", tokens)`,
  and hashes it into a uint64 array) and the array to `find_matches`;
  `hash_list_and_match_p50_us` takes the list API instead (`block_hashes_for_tokens`, a list
  of ints, matched as a list); each is timed after one untimed pass over all requests;
* applying TensorRT-LLM JSON dicts (the first 2,000 events as `to_dict()`), which
  `KVCacheEvent.from_dict` parses token by token.

`bytes_per_block` is the index's memory per (block, worker) entry, measured with tracemalloc
while a fresh index is built from the encoded stream (numpy's buffers and any hash integers the
index keeps are counted), divided by the number of entries. `index_impl` says which table the
index uses: `numba` (an open-addressing table of uint64 hashes, probed by compiled kernels) or
`python` (a dict; without numba or with `KVMESH_NO_NUMBA`).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import statistics
import time
import tracemalloc
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from cache import (
    HASH_IMPL,
    KVCacheEvent,
    StoredBlock,
    StoredData,
    block_hashes_for_tokens,
)
from cache.hashing import block_hash_array
from events.codec import decode_events, encode_events
from events.index import PrefixIndex

SEED = 11
NUM_WORKERS = 16
NUM_SYSTEM_PROMPTS = 32
SYSTEM_PROMPT_TOKENS = (512, 2_048)
USER_TOKENS = (32, 384)
REPLY_TOKENS = (64, 384)
MAX_SESSION_TOKENS = 8_192
OPEN_SESSIONS = 64
MOVE_PROBABILITY = 1 / 20
TOKENS_PER_BLOCK = 16
VOCAB_SIZE = 32_000
NUM_EVENTS = 20_000
NUM_EVENTS_QUICK = 1_000
REQUEST_TOKENS = 4_096
REQUEST_PREFIX_MAX = 3_840
NUM_REQUESTS = 2_000
NUM_REQUESTS_QUICK = 200
NUM_BUILDS = 5
NUM_JSON_EVENTS = 2_000
NUM_SAMPLED_SESSIONS = 512

TokenArray = npt.NDArray[np.uint32]


@dataclass
class Session:
    system_prompt: int
    worker: int
    tokens: TokenArray
    hashes: list[int] = field(default_factory=list)


@dataclass
class Workload:
    entries: list[tuple[str, bytes]]  # (worker, one msgpack-encoded event), in stream order
    system_prompts: list[TokenArray]
    sessions: list[TokenArray]  # conversations to continue in requests (a sample)
    num_blocks: int


def _tokens(rng: np.random.Generator, n: int) -> TokenArray:
    return rng.integers(0, VOCAB_SIZE, size=n).astype(np.uint32)


def make_workload(num_events: int, seed: int = SEED) -> Workload:
    """The stored events of the chat workload, in order, with the prompts requests draw from."""
    rng = np.random.default_rng(seed)
    prompts = [
        _tokens(rng, int(rng.integers(*SYSTEM_PROMPT_TOKENS))) for _ in range(NUM_SYSTEM_PROMPTS)
    ]
    held: list[set[int]] = [set() for _ in range(NUM_WORKERS)]
    entries: list[tuple[str, bytes]] = []
    finished: list[TokenArray] = []  # a uniform sample of the sessions that ended
    num_finished = 0
    num_blocks = 0

    def new_session() -> Session:
        p = int(rng.integers(NUM_SYSTEM_PROMPTS))
        return Session(p, int(rng.integers(NUM_WORKERS)), prompts[p])

    open_sessions = [new_session() for _ in range(OPEN_SESSIONS)]
    while len(entries) < num_events:
        i = int(rng.integers(OPEN_SESSIONS))
        session = open_sessions[i]
        turn = int(rng.integers(*USER_TOKENS)) + int(rng.integers(*REPLY_TOKENS))
        if len(session.tokens) + turn > MAX_SESSION_TOKENS:
            num_finished += 1
            if len(finished) < NUM_SAMPLED_SESSIONS:
                finished.append(session.tokens)
            elif (k := int(rng.integers(num_finished))) < NUM_SAMPLED_SESSIONS:
                finished[k] = session.tokens
            open_sessions[i] = session = new_session()
        if session.hashes and rng.random() < MOVE_PROBABILITY:
            session.worker = int((session.worker + rng.integers(1, NUM_WORKERS)) % NUM_WORKERS)
        session.tokens = np.concatenate([session.tokens, _tokens(rng, turn)])
        session.hashes = block_hashes_for_tokens(session.tokens, TOKENS_PER_BLOCK)
        mine = held[session.worker]
        first = 0
        while first < len(session.hashes) and session.hashes[first] in mine:
            first += 1
        new = session.hashes[first:]
        if not new:
            continue
        mine.update(new)
        start = first * TOKENS_PER_BLOCK
        tokens: list[int] = session.tokens[start : start + len(new) * TOKENS_PER_BLOCK].tolist()
        blocks = [
            StoredBlock(h, tuple(tokens[k * TOKENS_PER_BLOCK : (k + 1) * TOKENS_PER_BLOCK]))
            for k, h in enumerate(new)
        ]
        parent = session.hashes[first - 1] if first else None
        event = KVCacheEvent(len(entries), StoredData(parent, blocks), MAX_SESSION_TOKENS)
        entries.append((f"worker-{session.worker}", encode_events([event])))
        num_blocks += len(blocks)
    return Workload(entries, prompts, finished or [s.tokens for s in open_sessions], num_blocks)


def make_requests(workload: Workload, num_requests: int, seed: int = SEED + 1) -> list[list[int]]:
    """4,096-token requests: 1/2 continue a conversation, 1/4 share a system prompt, 1/4 cold."""
    rng = np.random.default_rng(seed)
    requests: list[list[int]] = []
    for k in range(num_requests):
        kind = k % 4
        if kind < 2:
            conversation = workload.sessions[int(rng.integers(len(workload.sessions)))]
            prefix = conversation[: int(rng.integers(1, REQUEST_PREFIX_MAX + 1))]
        elif kind == 2:
            prefix = workload.system_prompts[int(rng.integers(NUM_SYSTEM_PROMPTS))]
        else:
            prefix = _tokens(rng, 0)
        tail = _tokens(rng, REQUEST_TOKENS - len(prefix))
        requests.append(np.concatenate([prefix, tail]).tolist())
    return requests


def build(events: list[tuple[str, KVCacheEvent]], **kwargs: Any) -> tuple[PrefixIndex, float]:
    """An index of all `events`, and the seconds it took to apply them."""
    index = PrefixIndex(**kwargs)
    apply = index.apply_event
    start = time.perf_counter()
    for worker, event in events:
        apply(worker, event)
    return index, time.perf_counter() - start


def build_streaming(stream: list[tuple[str, bytes]]) -> tuple[PrefixIndex, float]:
    """The same from the encoded stream, each entry decoded just before its events are
    applied, as a consumer does; only `apply_event` is timed."""
    index = PrefixIndex()
    apply = index.apply_event
    clock = time.perf_counter_ns
    elapsed = 0
    for worker, blob in stream:
        events = decode_events(blob)
        start = clock()
        for event in events:
            apply(worker, event)
        elapsed += clock() - start
    return index, elapsed / 1e9


def _percentiles_us(samples_ns: list[int]) -> tuple[float, float]:
    samples_ns.sort()
    p50 = samples_ns[len(samples_ns) // 2]
    p99 = samples_ns[min(len(samples_ns) - 1, int(len(samples_ns) * 0.99))]
    return round(p50 / 1e3, 2), round(p99 / 1e3, 2)


def _time_calls(fn: Any, inputs: list[Any]) -> list[int]:
    clock = time.perf_counter_ns
    out = []
    for item in inputs:
        start = clock()
        fn(item)
        out.append(clock() - start)
    return out


def measure_memory(stream: list[tuple[str, bytes]]) -> tuple[int, int]:
    """(bytes the index holds after applying everything, its block-worker entries)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index, _ = build_streaming(stream)
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    entries: int = index.stats()["entries"]
    return used, entries


def generate(
    num_events: int, num_requests: int
) -> tuple[list[tuple[str, bytes]], int, npt.NDArray[np.uint32]]:
    """The encoded stream, its number of blocks, and the requests' tokens (one row each)."""
    workload = make_workload(num_events)
    requests = np.array(make_requests(workload, num_requests), dtype=np.uint32)
    return workload.entries, workload.num_blocks, requests


def measure(num_events: int, num_requests: int, num_builds: int) -> dict[str, Any]:
    # Generating leaves the heap full of holes that decoded events would then be scattered
    # into; a child process generates, so this one decodes into fresh memory as a consumer
    # that has only ever decoded events would.
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        stream, num_blocks, request_array = pool.apply(generate, (num_events, num_requests))
    requests: list[list[int]] = request_array.tolist()
    request_hashes = [block_hashes_for_tokens(r, TOKENS_PER_BLOCK) for r in requests]
    events = [(worker, event) for worker, blob in stream for event in decode_events(blob)]
    gc.collect()
    gc.freeze()  # the input is not the index's garbage to collect
    try:
        apply = _measure_apply(events, stream, num_builds)
        matching = _measure_matching(events, requests, request_hashes)
    finally:
        gc.unfreeze()
    del events
    used_bytes, entries = measure_memory(stream)
    return {
        "workers": NUM_WORKERS,
        "events": len(stream),
        "blocks": num_blocks,
        **apply,
        "apply_events_per_s": round(len(stream) / apply["apply_seconds"]),
        "apply_blocks_per_s": round(num_blocks / apply["apply_seconds"]),
        "apply_best_events_per_s": round(len(stream) / apply["apply_best_seconds"]),
        "apply_best_blocks_per_s": round(num_blocks / apply["apply_best_seconds"]),
        "apply_streaming_events_per_s": round(len(stream) / apply["apply_streaming_seconds"]),
        "apply_streaming_blocks_per_s": round(num_blocks / apply["apply_streaming_seconds"]),
        **matching,
        "bytes_per_block": round(used_bytes / entries, 1),
        "hash_impl": HASH_IMPL,
        "index_impl": "numba" if PrefixIndex().compiled else "python",
    }


def _measure_apply(
    events: list[tuple[str, KVCacheEvent]], stream: list[tuple[str, bytes]], num_builds: int
) -> dict[str, Any]:
    apply_s: list[float] = []
    streaming_s: list[float] = []
    for _ in range(num_builds):
        gc.collect()
        index, seconds = build(events)
        apply_s.append(seconds)
        stats = index.stats()
        del index
        gc.collect()
        index, seconds = build_streaming(stream)
        streaming_s.append(seconds)
        del index
    json_events = [(worker, event.to_dict()) for worker, event in events[:NUM_JSON_EVENTS]]
    index = PrefixIndex()
    start = time.perf_counter()
    for worker, json_event in json_events:
        index.apply_event(worker, json_event)
    json_s = time.perf_counter() - start
    return {
        "index_hashes": stats["blocks"],
        "entries": stats["entries"],
        "apply_seconds": round(statistics.median(apply_s), 4),
        "apply_best_seconds": round(min(apply_s), 4),
        "apply_streaming_seconds": round(statistics.median(streaming_s), 4),
        "apply_json_events_per_s": round(len(json_events) / json_s),
    }


def _measure_matching(
    events: list[tuple[str, KVCacheEvent]],
    requests: list[list[int]],
    request_hashes: list[list[int]],
) -> dict[str, Any]:
    index, _ = build(events)
    matches = [index.find_matches(h) for h in request_hashes]
    monotone, _ = build(events, assume_monotone=True)
    if [monotone.find_matches(h) for h in request_hashes] != matches:
        raise RuntimeError("the monotone match disagrees with the exact walk")
    _time_calls(index.find_matches, request_hashes)  # warm-up
    match_p50, match_p99 = _percentiles_us(_time_calls(index.find_matches, request_hashes))
    tier_p50, _ = _percentiles_us(_time_calls(index.find_matches_by_tier, request_hashes))
    mono_p50, mono_p99 = _percentiles_us(_time_calls(monotone.find_matches, request_hashes))
    del monotone

    def hash_and_match(tokens: list[int]) -> None:
        index.find_matches(block_hash_array(tokens, TOKENS_PER_BLOCK))

    def hash_list_and_match(tokens: list[int]) -> None:
        index.find_matches(block_hashes_for_tokens(tokens, TOKENS_PER_BLOCK))

    # A whole pass first: the first walk over the requests' 260 MB of token ints runs
    # 20-40% slower, whichever variant comes first (both get the same warm-up).
    _time_calls(hash_and_match, requests)
    hm_p50, hm_p99 = _percentiles_us(_time_calls(hash_and_match, requests))
    _time_calls(hash_list_and_match, requests)
    hml_p50, _ = _percentiles_us(_time_calls(hash_list_and_match, requests))
    best = [max(m.values(), default=0) for m in matches]
    return {
        "requests": len(requests),
        "request_blocks": REQUEST_TOKENS // TOKENS_PER_BLOCK,
        "mean_best_match_blocks": round(statistics.fmean(best), 1),
        "match_p50_us": match_p50,
        "match_p99_us": match_p99,
        "match_by_tier_p50_us": tier_p50,
        "match_monotone_p50_us": mono_p50,
        "match_monotone_p99_us": mono_p99,
        "hash_and_match_p50_us": hm_p50,
        "hash_and_match_p99_us": hm_p99,
        "hash_list_and_match_p50_us": hml_p50,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        return measure(NUM_EVENTS_QUICK, NUM_REQUESTS_QUICK, 1)
    return measure(NUM_EVENTS, NUM_REQUESTS, NUM_BUILDS)
