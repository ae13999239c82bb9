"""Random manager runs, each twice: with `store_blocks` going on below the request's last stored
block (`cache.store._last_stored`), and with it always walking from the root. Run on the sources
(`KVMESH_PURE=1`: a compiled `store_blocks` would not see the stand-in), by
`test_store_walk.py`:

    KVMESH_PURE=1 python -m tests.cache.store_walk SEEDS

prints one JSON line: the seeds whose runs differ (results, events, the trees, pins, free
blocks after every step), the seeds where a block in a tree could not be reached from its root
(either way: the comparison alone cannot see what both ways do wrong), and how often the
shortcut was taken. A run that hangs (a cycle in a tree) is stopped after 60 s with every
thread's stack.
"""

from __future__ import annotations

import faulthandler
import json
import random
import sys
import warnings
from typing import Any

import cache.store as store
from cache import KVCacheManager, LlmRequest

_LAST_STORED = store._last_stored
taken = 0


def _counted(*args: Any) -> int:
    global taken
    known = _LAST_STORED(*args)
    taken += known >= 0
    return known


def _walk_from_root(*args: Any) -> int:
    return -1


def _unreachable(mgr: KVCacheManager) -> list[int]:
    """The blocks in a tree (a parent, or in the flat map) that do not lead up to its root."""
    out: list[int] = []
    for window in mgr.windows.values():
        root, steps = window.tree.root, len(window.blocks) + 1
        held = [b for b in window.blocks if b.prev_block is not None]
        for block in [*held, *window.tree.by_hash.values()]:
            node = block
            for _ in range(steps):
                if node is root or node.prev_block is None:
                    break
                node = node.prev_block
            if node is not root:
                out.append(block.block_id)
    return out


def _state(mgr: KVCacheManager) -> list[Any]:
    """Every window's tree (each block's parent, hash, key, children, refs), pins, free blocks."""
    out: list[Any] = []
    for size, window in mgr.windows.items():
        blocks = [
            (
                b.block_id,
                None if b.prev_block is None else b.prev_block.block_id,
                b.hash if b.prev_block is not None else None,
                b.key.tokens,
                sorted((h, c.block_id) for h, c in b.next_blocks.items()),
                b.ref_count,
            )
            for b in window.blocks
        ]
        root = sorted((h, c.block_id) for h, c in window.tree.root.next_blocks.items())
        flat = sorted((h, b.block_id) for h, b in window.tree.by_hash.items())
        out.append((size, blocks, root, flat, window.get_num_free_blocks(), dict(window.pins)))
    return out


_WEIGHTS = {"add": 2, "prefill": 1, "grow": 3, "rewind": 1, "store": 1, "remove": 2, "unpin": 1}
_OPS = [op for op, times in _WEIGHTS.items() for _ in range(times)]


def run(seed: int, shortcut: bool, steps: int = 60) -> list[Any]:
    """One random run: adds (shared prefixes, a 2-3 token alphabet, beams), prefills, decodes,
    rewinds, stores for reuse and releases (with and without pins), unpins; sliding windows in
    a third of the runs."""
    store._last_stored = _counted if shortcut else _walk_from_root  # type: ignore[assignment]
    rng = random.Random(seed)
    tpb = rng.choice([2, 4])
    windows = [rng.choice([2, 3]) * tpb, 64] if rng.random() < 0.35 else [64]
    beam = rng.choice([1, 1, 1, 2])
    mgr = KVCacheManager(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        tokens_per_block=tpb,
        blocks_per_window={w: (rng.randint(4, 14), rng.choice([0, 0, 3])) for w in windows},
        max_attention_window=windows,
        max_sequence_length=64,
        event_buffer_max_size=100_000,
        allocate_pools=False,
        enable_partial_reuse=rng.random() < 0.6,
        copy_on_partial_reuse=rng.random() < 0.5,
        max_beam_width=beam,
        clock=lambda: 0.0,
        report_leaf_takeover=rng.random() < 0.5,
    )
    alphabet = rng.choice([2, 3])
    live: dict[int, LlmRequest] = {}
    pinned: list[list[int]] = []
    log: list[Any] = []
    for next_id in range(steps):
        op = rng.choice(_OPS) if live else "add"
        rid = rng.choice(sorted(live)) if live else -1
        result: Any = None
        try:
            if op == "add":
                prefix = rng.choice([[0, 0, 0], [1, 0, 1, 0], [0, 1], []])
                n = rng.randint(1, 4 * tpb)
                tokens = (prefix + [rng.randrange(alphabet) for _ in range(n)])[:n]
                request = LlmRequest(next_id, tokens, beam_width=rng.choice([1, beam]))
                result = mgr.add_sequence(request)
                live[next_id] = request
            elif op == "prefill":
                mgr.store_context_blocks(live[rid])
            elif op == "grow":
                request = live[rid]
                for _ in range(rng.randint(1, 2 * tpb)):
                    request.add_new_token(rng.randrange(alphabet))
                    mgr.add_token(rid)
                    if rng.random() < 0.7:
                        mgr.store_new_block(request)
            elif op == "rewind":
                request = live[rid]
                k = rng.randint(1, min(3 * tpb, max(1, len(request.tokens) - 1)))
                if k < len(request.tokens) and mgr.get_num_tokens(rid) > k:
                    mgr.rewind_kv_cache(rid, k)
                    request.remove_tokens(k)
                    result = k
            elif op == "store":
                result = mgr.store_blocks_for_reuse(rid, live[rid], rng.random() < 0.5)
            elif op == "remove":
                request = live.pop(rid)
                given = request if rng.random() < 0.9 else None
                result = mgr.remove_sequence(rid, given, rng.random() < 0.4)
            elif op == "unpin" and pinned:
                mgr.unpin_blocks_by_id(pinned.pop(rng.randrange(len(pinned))))
        except Exception as exc:  # the same refusal both ways is part of the run
            result = (type(exc).__name__, str(exc))
        if op in ("store", "remove") and result:
            pinned.append(list(result))
        mgr.flush_iteration_events()
        events = [e.to_dict() for e in mgr.get_latest_events()]
        log.append((op, rid, result, events, _state(mgr), _unreachable(mgr)))
    return log


def main(num_seeds: int) -> None:
    warnings.simplefilter("ignore")  # the random calls' warnings (no sequence, ...)
    faulthandler.dump_traceback_later(60, exit=True)
    differ: list[int] = []
    broken: list[int] = []
    for seed in range(num_seeds):
        print(seed, file=sys.stderr, flush=True)  # the last one named is the one that hung
        new, old = run(seed, True), run(seed, False)
        if new != old:
            differ.append(seed)
        if any(step[-1] for step in (*new, *old)):
            broken.append(seed)
    print(json.dumps({"seeds": num_seeds, "differ": differ, "broken": broken, "taken": taken}))


if __name__ == "__main__":
    main(int(sys.argv[1]))
