"""NVIDIA Dynamo's Rust ``RadixTree`` (its Python binding) on kvmesh's ``bench index`` workload.

Run with an interpreter that has ai-dynamo-runtime (see README.md):
``python dynamo_index.py DIR [--builds N]``. Apply: every stored event, serialized beforehand
as the JSON ``apply_event`` takes (the block's ``tokens_hash`` is Dynamo's own hash of its
tokens), into an empty tree; the clock stops after a ``find_matches`` that waits for the tree's
worker thread. Match: ``find_matches`` on Dynamo's block hashes of each 4,096-token request,
computed beforehand; hash + match: ``compute_block_hash_for_seq`` then ``find_matches``.
"""

import argparse
import gc
import json
import pickle
import statistics
import time
from pathlib import Path

from dynamo._core import RadixTree, compute_block_hash_for_seq


def percentile_us(samples_ns: list[int], q: float) -> float:
    ordered = sorted(samples_ns)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000, 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir", type=Path)
    parser.add_argument("--builds", type=int, default=5)
    args = parser.parse_args()
    with open(args.dir / "index.pkl", "rb") as f:
        w = pickle.load(f)
    bs = w["tokens_per_block"]
    payloads = []
    for event_id, (worker, parent, blocks) in enumerate(w["events"]):
        local = compute_block_hash_for_seq([t for _, tokens in blocks for t in tokens], bs)
        stored = [
            {"block_hash": h, "tokens_hash": lh} for (h, _), lh in zip(blocks, local, strict=True)
        ]
        event = {
            "event_id": event_id,
            "data": {"stored": {"parent_hash": parent, "blocks": stored}},
        }
        payloads.append((worker, json.dumps(event).encode()))
    requests = w["requests"]
    hashes = [compute_block_hash_for_seq(r, bs) for r in requests]
    gc.collect()
    gc.freeze()
    builds = []
    for _ in range(args.builds):
        tree = RadixTree()
        start = time.perf_counter()
        for worker, payload in payloads:
            tree.apply_event(worker, payload)
        tree.find_matches([0])  # queued behind the events on the tree's thread
        builds.append(time.perf_counter() - start)
    match_ns, hash_match_ns = [], []
    for tokens, request_hashes in zip(requests, hashes, strict=True):
        t0 = time.perf_counter_ns()
        tree.find_matches(compute_block_hash_for_seq(tokens, bs))
        t1 = time.perf_counter_ns()
        tree.find_matches(request_hashes)
        t2 = time.perf_counter_ns()
        hash_match_ns.append(t1 - t0)
        match_ns.append(t2 - t1)
    seconds = statistics.median(builds)
    print(
        json.dumps(
            {
                "peer": "dynamo RadixTree",
                "events": len(payloads),
                "blocks": w["num_blocks"],
                "apply_events_per_s": round(len(payloads) / seconds),
                "apply_blocks_per_s": round(w["num_blocks"] / seconds),
                "apply_best_events_per_s": round(len(payloads) / min(builds)),
                "match_p50_us": percentile_us(match_ns, 0.5),
                "match_p99_us": percentile_us(match_ns, 0.99),
                "hash_match_p50_us": percentile_us(hash_match_ns, 0.5),
                "hash_match_p99_us": percentile_us(hash_match_ns, 0.99),
            }
        )
    )


if __name__ == "__main__":
    main()
