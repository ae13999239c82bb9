"""The peers' copy of the benchmark workloads (app/bench/peers.py) is kvmesh's own, exactly."""

from __future__ import annotations

import pickle
from pathlib import Path

from app.bench import index, manager, peers
from cache import block_hashes_for_tokens


def test_peer_workloads_are_the_benchmarks_own(tmp_path: Path) -> None:
    peers.main(tmp_path, num_requests=3, num_events=40, num_index_requests=4)
    with open(tmp_path / "manager.pkl", "rb") as f:
        m = pickle.load(f)
    assert m["prompts"] == manager.make_prompts(3)
    assert m["warmup"] == manager.make_prompts(manager.NUM_WARMUP, seed=manager.SEED + 1)
    assert (m["tokens_per_block"], m["num_blocks"], m["max_live"]) == (16, 16_384, 32)
    with open(tmp_path / "index.pkl", "rb") as f:
        w = pickle.load(f)
    entries, num_blocks, requests = index.generate(40, 4)
    assert len(w["events"]) == 40
    assert w["num_blocks"] == num_blocks == sum(len(blocks) for _, _, blocks in w["events"])
    assert w["requests"] == requests.tolist()
    assert [f"worker-{worker}" for worker, _, _ in w["events"]] == [e[0] for e in entries]
    # An event from the root carries the chained hashes of its own tokens.
    roots = [blocks for _, parent, blocks in w["events"] if parent is None]
    assert roots
    for blocks in roots:
        tokens = [t for _, block_tokens in blocks for t in block_tokens]
        assert [h for h, _ in blocks] == block_hashes_for_tokens(tokens, 16)
