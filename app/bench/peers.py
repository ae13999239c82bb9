"""kvmesh's ``bench manager`` and ``bench index`` workloads as plain data for the peers.

``.venv/bin/python -m app.bench.peers DIR`` (benchmarks/peers/run.sh calls it).
The peers read ``DIR/manager.pkl`` (the prompts, warm-up first) and ``DIR/index.pkl`` (the
stored events decoded to (worker, parent hash, [(block hash, tokens)]) and the requests), so
both sides run the very same requests and events.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Any

from app.bench import index, manager
from cache import StoredData
from events.codec import decode_events


def main(
    out: Path,
    *,
    num_requests: int = manager.NUM_REQUESTS,
    num_events: int = index.NUM_EVENTS,
    num_index_requests: int = index.NUM_REQUESTS,
) -> None:
    """Write ``out/manager.pkl`` and ``out/index.pkl`` (full-size workloads by default)."""
    out.mkdir(parents=True, exist_ok=True)
    prompts: dict[str, Any] = {
        "warmup": manager.make_prompts(manager.NUM_WARMUP, seed=manager.SEED + 1),
        "prompts": manager.make_prompts(num_requests),
        "tokens_per_block": manager.TOKENS_PER_BLOCK,
        "num_blocks": manager.NUM_PRIMARY_BLOCKS,
        "max_live": manager.MAX_LIVE,
    }
    with open(out / "manager.pkl", "wb") as f:
        pickle.dump(prompts, f)
    entries, num_blocks, requests = index.generate(num_events, num_index_requests)
    stored: list[tuple[int, int | None, list[tuple[int, list[int]]]]] = []
    for worker, payload in entries:
        for event in decode_events(payload):
            data = event.data
            assert isinstance(data, StoredData)  # the workload stores only
            blocks = [(b.block_hash, list(b.tokens)) for b in data.blocks]
            stored.append((int(worker.rsplit("-", 1)[1]), data.parent_hash, blocks))
    with open(out / "index.pkl", "wb") as f:
        pickle.dump(
            {
                "events": stored,
                "num_blocks": num_blocks,
                "requests": requests.tolist(),
                "tokens_per_block": index.TOKENS_PER_BLOCK,
            },
            f,
        )
    print(f"{out}: {len(prompts['prompts'])} manager prompts, {len(stored)} index events")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
