"""What the dashboard shows, aggregated as events arrive: pure and synchronous, no I/O.

``DashboardState`` is fed by the event consumer's hook (``on_entry``: every applied stream
entry with its decoded events) and by the router (``on_decision``), and turns what it has into
*frames* (``frame``): one JSON-ready dict per update interval, the same for every browser except
the feed items each has not seen yet.

Bounded by construction, whatever the event rate:

* rates: per worker, one counter triple (stored, removed, updated blocks) per second, for the
  last ``window_s`` seconds;
* the feed: a ring of ``feed_size`` items; at most ``feed_per_interval`` events per interval
  become items (the rest are counted as ``skipped``), so 10,000 events/s cost a counter each;
* decisions: a ring of ``decisions_size``;
* prefixes: counts per first block hash, pruned to ``max_prefixes`` by count when they pass
  twice that, each with its chain of at most ``prefix_blocks`` hashes; the router's requests
  are counted in batches, fewer than ``_PENDING_CHAINS`` chains of ``prefix_blocks`` waiting.

Hashes leave as 16-digit hex strings: a browser's numbers hold 53 bits, a block hash 64.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from cache import CreatedData, KVCacheEvent, RemovedData, StoredData, UpdatedData
from events.envelope import Envelope
from events.index import PrefixIndex

__all__ = ["DashboardState", "DecisionLike", "hex_hash"]

_TYPES = ("stored", "removed", "updated")
_FEED_HASHES = 3  # hashes shown per feed item
_PENDING_CHAINS = 64  # requested chains kept before they are counted


def hex_hash(block_hash: int) -> str:
    return f"{block_hash:016x}"


class _CostLike(Protocol):
    @property
    def worker(self) -> str: ...
    @property
    def cost(self) -> float: ...


class DecisionLike(Protocol):
    """What the dashboard reads of a router's decision (``app.router.policy.Decision`` is one;
    the dashboard does not import the router)."""

    @property
    def policy(self) -> str: ...
    @property
    def worker(self) -> str: ...
    @property
    def expected_cached_tokens(self) -> int: ...
    @property
    def fresh(self) -> bool: ...
    @property
    def costs(self) -> Sequence[_CostLike]: ...


# (id, time, request id, kind, the decision, prompt tokens): a decision as recorded.
_Recorded = tuple[int, float, str, str, DecisionLike, int]


def _row(recorded: _Recorded) -> dict[str, Any]:
    decision_id, t, request_id, kind, decision, num_tokens = recorded
    return {
        "id": decision_id,
        "t": round(t, 3),
        "request_id": request_id,
        "kind": kind,
        "policy": decision.policy,
        "worker": decision.worker,
        "num_tokens": num_tokens,
        "expected_cached_tokens": decision.expected_cached_tokens,
        "fresh": decision.fresh,
        "costs": {c.worker: round(c.cost, 3) for c in decision.costs},
    }


@dataclass(slots=True)
class _Prefix:
    count: int
    chain: list[int]


class DashboardState:
    """Aggregates events and decisions for the dashboard; see the module docstring."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.time,
        interval_s: float = 0.25,
        window_s: int = 180,
        feed_size: int = 2_000,
        feed_per_interval: int = 40,
        decisions_size: int = 50,
        max_prefixes: int = 16,
        prefix_blocks: int = 64,
        record_decisions: bool = True,
    ) -> None:
        self.clock = clock
        self.interval_s = interval_s
        self.window_s = window_s
        self.feed_per_interval = feed_per_interval
        self.max_prefixes = max_prefixes
        self.prefix_blocks = prefix_blocks
        # worker -> second -> [stored, removed, updated] blocks
        self._rates: dict[str, dict[int, list[int]]] = {}
        self._feed: deque[dict[str, Any]] = deque(maxlen=feed_size)
        self._next_feed_id = 1
        self._feed_budget_at = 0.0
        self._feed_budget = feed_per_interval
        self.num_skipped = 0
        # The router's last decisions as it made them; the table's rows are built when read (a
        # row per decision cost more than the decision itself: a dict and a cost per worker).
        self._decisions: deque[_Recorded] | None = (
            deque(maxlen=decisions_size) if record_decisions else None
        )
        self._rows: dict[int, dict[str, Any]] = {}  # id -> row, for those recorded
        self._next_decision_id = 1
        # Prefixes by first block hash: requested (router) and stored from the root (events).
        self._requested: dict[int, _Prefix] = {}
        self._pending: list[Sequence[int]] = []  # requested chains not counted yet
        self._stored_roots: dict[int, _Prefix] = {}

    # -- input ---------------------------------------------------------------------------------

    def on_entry(
        self, worker: str, envelope: Envelope, events: list[KVCacheEvent], blocks: int
    ) -> None:
        """The consumer's hook: count the entry's blocks per type, sample it into the feed."""
        now = self.clock()
        second = int(now)
        per_second = self._rates.setdefault(worker, {})
        counts = per_second.get(second)
        if counts is None:
            counts = per_second[second] = [0, 0, 0]
            self._prune_rates(per_second, second)
        if now >= self._feed_budget_at:
            self._feed_budget_at = now + self.interval_s
            self._feed_budget = self.feed_per_interval
        for event in events:
            data = event.data
            kind = type(data)
            if kind is StoredData:
                assert isinstance(data, StoredData)
                counts[0] += len(data.blocks)
                if data.parent_hash is None and data.blocks:
                    self._count_root(data)
            elif kind is RemovedData:
                assert isinstance(data, RemovedData)
                counts[1] += len(data.block_hashes)
            elif kind is UpdatedData:
                counts[2] += 1
            if self._feed_budget > 0:
                self._feed_budget -= 1
                self._feed.append(self._feed_item(self._next_feed_id, now, worker, event))
                self._next_feed_id += 1
            else:
                self.num_skipped += 1

    def on_decision(
        self,
        request_id: str,
        kind: str,
        decision: DecisionLike,
        num_tokens: int,
        block_hashes: Sequence[int],
    ) -> None:
        """The router's hook: a decision for the table, a request for the prefix map."""
        if self._decisions is not None:
            self._decisions.append(
                (self._next_decision_id, self.clock(), request_id, kind, decision, num_tokens)
            )
            self._next_decision_id += 1
        if block_hashes:
            # Counted when the prefixes are read, or every _PENDING_CHAINS: a decision pays
            # for a short slice and an append, the counting runs in one warm loop.
            pending = self._pending
            pending.append(block_hashes[: self.prefix_blocks])  # what a prefix keeps of it
            if len(pending) >= _PENDING_CHAINS:
                self._count_pending()

    def _count_pending(self) -> None:
        for chain in self._pending:
            self._count(self._requested, chain[0], chain)
        self._pending.clear()

    def _count_root(self, data: StoredData) -> None:
        hashes = [block.block_hash for block in data.blocks[: self.prefix_blocks]]
        self._count(self._stored_roots, hashes[0], hashes)

    def _count(self, table: dict[int, _Prefix], first: int, chain: Sequence[int]) -> None:
        entry = table.get(first)
        if entry is None:
            table[first] = _Prefix(1, list(chain[: self.prefix_blocks]))
            if len(table) > 2 * self.max_prefixes * 8:
                keep = sorted(table.items(), key=lambda item: -item[1].count)
                table.clear()
                table.update(keep[: self.max_prefixes * 8])
            return
        entry.count += 1
        if len(entry.chain) < min(len(chain), self.prefix_blocks):
            entry.chain = list(chain[: self.prefix_blocks])

    def _prune_rates(self, per_second: dict[int, list[int]], now_second: int) -> None:
        oldest = now_second - self.window_s
        for second in [s for s in per_second if s <= oldest]:
            del per_second[second]

    @staticmethod
    def _feed_item(feed_id: int, now: float, worker: str, event: KVCacheEvent) -> dict[str, Any]:
        data = event.data
        item: dict[str, Any] = {
            "id": feed_id,
            "t": round(now, 3),
            "worker": worker,
            "type": data.type,
            "blocks": 0,
            "hashes": [],
            "parent": None,
            "tier": None,
        }
        if isinstance(data, StoredData):
            item["blocks"] = len(data.blocks)
            item["hashes"] = [hex_hash(b.block_hash) for b in data.blocks[:_FEED_HASHES]]
            levels = {b.cache_level for b in data.blocks}
            item["tier"] = None if levels == {0} else "/".join(str(v) for v in sorted(levels))
            if data.parent_hash is not None:
                item["parent"] = hex_hash(data.parent_hash)
        elif isinstance(data, RemovedData):
            item["blocks"] = len(data.block_hashes)
            item["hashes"] = [hex_hash(h) for h in data.block_hashes[:_FEED_HASHES]]
        elif isinstance(data, UpdatedData):
            item["blocks"] = 1
            item["hashes"] = [hex_hash(data.block_hash)]
            if data.cache_level is not None:
                item["tier"] = f"{data.cache_level.old_value}\u2192{data.cache_level.new_value}"
        elif isinstance(data, CreatedData):
            item["blocks"] = 0
        return item

    # -- output --------------------------------------------------------------------------------

    def feed_since(
        self, last_id: int | None, *, fresh: int = 100
    ) -> tuple[list[dict[str, Any]], int]:
        """Feed items after ``last_id`` (the newest ``fresh`` ones when it is None or older than
        the ring), and the id of the newest item."""
        feed = self._feed
        newest = feed[-1]["id"] if feed else 0
        if not feed:
            return [], newest
        oldest = feed[0]["id"]
        if last_id is None or last_id < oldest - 1 or last_id > newest:
            start = max(len(feed) - fresh, 0)
        else:
            start = last_id - oldest + 1
        return [feed[i] for i in range(start, len(feed))], newest

    def rates(self, workers: Iterable[str]) -> dict[str, Any]:
        end = int(self.clock())
        seconds = range(end - self.window_s + 1, end + 1)
        series: dict[str, dict[str, list[int]]] = {}
        for worker in workers:
            per_second = self._rates.get(worker, {})
            rows = [per_second.get(s, (0, 0, 0)) for s in seconds]
            series[worker] = {kind: [row[i] for row in rows] for i, kind in enumerate(_TYPES)}
        return {"step_s": 1, "end": end, "series": series}

    def decisions(self) -> list[dict[str, Any]] | None:
        """The recorded decisions as the table's rows, oldest first; a row is built once."""
        if self._decisions is None:
            return None
        built, rows = self._rows, {}
        for recorded in self._decisions:
            rows[recorded[0]] = built.get(recorded[0]) or _row(recorded)
        self._rows = rows
        return list(rows.values())

    def prefixes(self, index: PrefixIndex, workers: Sequence[str]) -> dict[str, Any]:
        """The most requested prefixes (the router's requests; else the most stored roots)
        against the workers: how many leading blocks of each every worker holds."""
        self._count_pending()
        table, by = (
            (self._requested, "requests") if self._requested else (self._stored_roots, "stored")
        )
        top = sorted(table.items(), key=lambda item: (-item[1].count, item[0]))[: self.max_prefixes]
        rows = []
        for first, entry in top:
            matches = index.find_matches(entry.chain)
            rows.append(
                {
                    "prefix": hex_hash(first),
                    "count": entry.count,
                    "blocks": len(entry.chain),
                    "held": {w: matches.get(w, 0) for w in workers},
                }
            )
        return {"by": by, "workers": list(workers), "rows": rows}
