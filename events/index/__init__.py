"""The cluster-wide prefix index: which worker holds which KV block, on which tier.

A router feeds every worker's KV events into one `PrefixIndex` (ours, or TensorRT-LLM's JSON
dicts) and asks, for the chained block hashes of a request, how many leading blocks each worker
already holds. Pure and synchronous: no asyncio, no Redis; it imports only `cache` event types.

The parts, one concept each::

    prefix.py       PrefixIndex: workers and their slots, applying events, matching, dumps
    tables.py       the table protocol (Table), the pure-Python DictTable (the source of
                    truth) and the vocabulary both tables share (tiers, uint64 words)
    kernels.py      the numba kernels over the compiled table's rows, and their layout
    array_table.py  ArrayTable: the Table protocol on those kernels, and its self-test
"""

from events.index.prefix import PrefixIndex
from events.index.tables import GPU_TIER, HOST_TIER

__all__ = ["GPU_TIER", "HOST_TIER", "PrefixIndex"]
