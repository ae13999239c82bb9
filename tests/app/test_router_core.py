"""``RouterCore``: in-flight accounting, the predicted cache, hot spots, routers that agree."""

from __future__ import annotations

from collections import Counter

import pytest

from app.router.core import NoWorkerError, RouterCore
from cache import (
    EventDiff,
    KVCacheEvent,
    RemovedData,
    StoredBlock,
    StoredData,
    UpdatedData,
    block_hashes_for_tokens,
    cache_salt_id,
)
from events.index import PrefixIndex

TPB = 16


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_core(
    num_workers: int = 4, *, index: PrefixIndex | None = None, **kwargs: object
) -> tuple[RouterCore, Clock]:
    clock = Clock()
    core = RouterCore(
        index if index is not None else PrefixIndex(),
        tokens_per_block=TPB,
        clock=clock,
        **kwargs,  # type: ignore[arg-type]
    )
    for i in range(num_workers):
        core.upsert_worker(f"w{i}", url=f"http://w{i}", capacity_blocks=10_000)
        core.set_load(f"w{i}", {"free_blocks_0": 10_000, "used_blocks_0": 0})
    return core, clock


def store(index: PrefixIndex, worker: str, tokens: list[int], event_id: int = 1) -> list[int]:
    """``worker`` stores the full blocks of ``tokens`` (as its manager's event would say)."""
    hashes = block_hashes_for_tokens(tokens, TPB)
    blocks = [StoredBlock(h, tuple(tokens[i * TPB : (i + 1) * TPB])) for i, h in enumerate(hashes)]
    index.apply_event(worker, KVCacheEvent(event_id, StoredData(None, blocks), 1 << 20))
    return hashes


def route(core: RouterCore, request_id: str, tokens: list[int]) -> str:
    hashes = core.hashes(tokens)
    decision = core.decide(hashes, len(tokens))
    core.begin(request_id, decision, hashes, len(tokens))
    return decision.worker


def test_in_flight_accounting_follows_a_request() -> None:
    core, _ = make_core(2)
    tokens = list(range(100))
    hashes = core.hashes(tokens)
    decision = core.decide(hashes, 100)
    core.begin("r1", decision, hashes, 100)
    view = core.workers[decision.worker]
    assert (view.inflight_prefill_tokens, view.inflight_running, view.inflight_blocks) == (
        100,
        1,
        7,
    )
    core.prefilled("r1")
    assert (view.inflight_prefill_tokens, view.inflight_running) == (0, 1)
    core.finish("r1")
    core.finish("r1")  # twice: no effect
    assert (view.inflight_prefill_tokens, view.inflight_running, view.inflight_blocks) == (0, 0, 0)
    assert core.inflight == {}
    with pytest.raises(ValueError, match="request_id: 'r2' is already in flight"):
        core.begin("r2", decision, hashes, 100)
        core.begin("r2", decision, hashes, 100)


def test_the_predicted_cache_holds_a_burst_together_until_its_ttl() -> None:
    core, clock = make_core(4, predict_ttl_s=2.0)
    prefix = list(range(1_000, 1_512))  # a new 512-token prefix nobody holds
    burst = [route(core, f"r{i}", [*prefix, *range(i * 32, i * 32 + 32)]) for i in range(8)]
    # The first lands anywhere (a tie among idle workers); the rest follow it.
    first = burst[0]
    assert burst == [first] * 8
    decision = core.decide(core.hashes([*prefix, 7]), 513)
    cost = decision.cost_of(first)
    assert cost.cached_tokens == 512
    # Once two TTLs pass without stored events, the prediction is gone.
    clock.now += 4.0
    decision = core.decide(core.hashes([*prefix, 7]), 513)
    assert decision.cost_of(first).cached_tokens == 0
    assert core.num_predicted(first) == 0


def test_predictions_last_one_to_two_ttls_on_a_fixed_beat() -> None:
    """Predictions age in two generations that turn every TTL (100.0, 102.0, 104.0, ...): one
    lasts until the end of the generation after its own."""
    core, clock = make_core(2, predict_ttl_s=2.0)
    first, second = list(range(64)), list(range(1_000, 1_064))  # 4 blocks each
    h1, h2 = core.hashes(first), core.hashes(second)
    core.begin("r1", core.decide(h1, 64, exclude=("w1",)), h1, 64)  # w0, at 100.0
    clock.now = 103.5
    core.begin("r2", core.decide(h2, 64, exclude=("w1",)), h2, 64)  # w0, at 103.5
    core.predict("w0", h1[:2])  # the first half of r1's chain again, at 103.5

    def cached() -> tuple[int, ...]:
        return tuple(core.decide(h, 65).cost_of("w0").cached_tokens for h in (h1, h2))

    clock.now = 103.99
    assert cached() == (64, 64)
    assert core.num_predicted("w0") == 8
    clock.now = 104.0  # r1's generation (100.0-102.0) is over, the renewed half is not
    assert cached() == (32, 64)
    assert core.num_predicted("w0") == 6
    clock.now = 105.99
    assert cached() == (32, 64)
    clock.now = 106.0
    assert cached() == (0, 0)
    assert core.num_predicted("w0") == 0
    # The beat goes on through a silence: made at 109.0, in the generation 108.0-110.0.
    clock.now = 109.0
    core.predict("w0", h1)
    clock.now = 111.99
    assert cached() == (64, 0)
    # Looked at again only a whole generation late (the turn due at 112.0 comes at 114.5):
    # everything has expired, and the tables are emptied.
    clock.now = 114.5
    assert cached() == (0, 0)
    assert core.predicted.newer == {} and core.predicted.older == {}


def test_a_chain_sent_again_is_predicted_once_and_a_failed_one_takes_its_prefix_along() -> None:
    core, _ = make_core(2)
    prefix = list(range(32))
    a, b = core.hashes([*prefix, *range(100, 132)]), core.hashes([*prefix, *range(200, 232)])
    core.predict("w0", a)
    core.predict("w0", b)
    core.predict("w0", a)  # known by its last block: nothing written
    generation = core.predicted.newer["w0"]
    assert (len(generation.blocks), generation.leaves) == (6, {a[-1], b[-1]})
    core.unpredict("w0", a)  # a's request never reached w0: its blocks go, b's prefix too
    assert [c.matched_blocks for c in core.candidates(b)] == [0, 0]
    core.predict("w0", b)  # b sent again puts its whole chain back
    assert [c.matched_blocks for c in core.candidates(b)] == [4, 0]
    assert core.num_predicted("w0") == 4


def test_a_flight_predicts_its_whole_chain_even_the_part_the_index_holds() -> None:
    """The worker may evict a block of the prefix it held before the request reaches it (a
    leaf, by LRU); the request will make it again there, so the router still counts it."""
    index = PrefixIndex()
    core, _ = make_core(2, index=index)
    tokens = list(range(96))  # 6 blocks, of which w0 holds the first 4
    held = store(index, "w0", tokens[:64])
    hashes = core.hashes(tokens)
    core.begin("r1", core.decide(hashes, 96), hashes, 96)
    index.apply_event("w0", KVCacheEvent(2, RemovedData(held[3:]), 1 << 20))
    assert core.decide(hashes, 97).cost_of("w0").cached_tokens == 96


def test_without_predictions_a_burst_scatters() -> None:
    core, _ = make_core(4, predict_ttl_s=0.0)
    prefix = list(range(1_000, 1_512))
    burst = [route(core, f"r{i}", [*prefix, *range(i * 32, i * 32 + 32)]) for i in range(4)]
    assert sorted(burst) == ["w0", "w1", "w2", "w3"]


def test_one_system_prompt_for_everyone_still_spreads_over_every_worker() -> None:
    """1,000 requests sent at once to 4 idle workers share their first 64 blocks, which one
    worker holds: it takes more than its share, not everything."""
    index = PrefixIndex()
    core, _ = make_core(4, index=index)
    system = list(range(50_000, 51_024))
    store(index, "w0", system)
    placed = [route(core, f"r{i}", [*system, *range(i * 256, i * 256 + 256)]) for i in range(1_000)]
    counts = Counter(placed)
    assert sorted(counts) == ["w0", "w1", "w2", "w3"]
    assert min(counts.values()) >= 230, counts
    assert max(counts.values()) <= 290, counts
    # Until the prefix pays less than the queue ahead, w0 takes every request.
    first_elsewhere = next(i for i, worker in enumerate(placed) if worker != "w0")
    assert 30 <= first_elsewhere <= 50


def test_two_cores_with_the_same_index_and_loads_choose_alike() -> None:
    index = PrefixIndex()
    store(index, "w1", list(range(64)))
    store(index, "w2", list(range(64)), event_id=2)
    a, _ = make_core(4, index=index, seed=5)
    b, _ = make_core(4, index=index, seed=5)
    for i in range(30):  # a alone has made decisions before (its history differs)
        a.decide(a.hashes(list(range(i, i + 40))), 40)
    prompts = [[*range(64), *range(1_000 + i, 1_032 + i)] for i in range(20)]
    prompts += [list(range(5_000 + 100 * i, 5_000 + 100 * i + 70)) for i in range(20)]
    choices_a = [a.decide(a.hashes(p), len(p)).worker for p in prompts]
    choices_b = [b.decide(b.hashes(p), len(p)).worker for p in prompts]
    assert choices_a == choices_b
    assert set(choices_a[:20]) == {"w1", "w2"}  # the two holding the prefix share the ties
    assert len(set(choices_a[20:])) == 4  # cold prompts: ties among all four, by request


def test_draining_excluded_and_missing_workers_are_not_candidates() -> None:
    core, _ = make_core(3)
    core.upsert_worker("w1", url="http://w1", capacity_blocks=10_000, draining=True)
    assert [c.worker for c in core.candidates([])] == ["w0", "w2"]
    assert [c.worker for c in core.candidates([], exclude=["w0"])] == ["w2"]
    core.remove_worker("w2")
    with pytest.raises(NoWorkerError, match=r"^every worker is draining or cordoned$"):
        core.decide([], 10, exclude=["w0"])
    with pytest.raises(NoWorkerError, match=r"^no worker is left$"):
        core.decide([], 10, exclude=["w0", "w1"])
    # An operator's cordon (or drain) takes a worker out of rotation like its own draining.
    core.upsert_worker("w0", url="http://w0", capacity_blocks=10_000, cordon="cordoned")
    core.upsert_worker("w1", url="http://w1", capacity_blocks=10_000, cordon="draining")
    assert [(w, v.state, v.admitting) for w, v in core.workers.items()] == [
        ("w0", "cordoned", False),
        ("w1", "draining", False),
    ]
    with pytest.raises(NoWorkerError, match=r"^every worker is draining or cordoned$"):
        core.decide([], 10)
    core.upsert_worker("w0", url="http://w0", capacity_blocks=10_000)
    assert [c.worker for c in core.candidates([])] == ["w0"]
    empty, _ = make_core(0)
    with pytest.raises(NoWorkerError, match="no worker is up"):
        empty.decide([], 10)


def test_stale_workers_are_flagged_in_the_decision() -> None:
    core, _ = make_core(1)
    core.set_stale("w0", "resyncing")
    decision = core.decide(core.hashes([1, 2, 3]), 3)
    assert (decision.worker, decision.fresh) == ("w0", False)
    assert core.workers["w0"].state == "stale"
    core.set_stale("w0", None)
    assert core.decide(core.hashes([1, 2, 3]), 3).fresh is True


def test_a_candidate_is_kept_until_its_worker_changes() -> None:
    core, _ = make_core(2)
    tokens = list(range(64))
    hashes = store(core.index, "w0", tokens)  # w0 holds all 4 blocks, w1 none
    first = {c.worker: c for c in core.candidates(hashes, tree_sizes=False)}
    again = {c.worker: c for c in core.candidates(hashes, tree_sizes=False)}
    # The same request sees the same two objects; another depth is another candidate.
    assert [again[w] is first[w] for w in ("w0", "w1")] == [True, True]
    shorter = {c.worker: c for c in core.candidates(hashes[:2], tree_sizes=False)}
    assert (shorter["w0"].matched_blocks, shorter["w1"] is first["w1"]) == (2, True)

    # A request in flight on w1 changes w1's load, and w1 only.
    core.begin("r1", core.decide(hashes, 64, exclude=("w0",)), hashes, 64)
    after = {c.worker: c for c in core.candidates(hashes, tree_sizes=False)}
    assert after["w0"] is first["w0"]
    assert (after["w1"].matched_blocks, after["w1"].queued_prefill_tokens) == (4, 64)
    core.finish("r1")
    core.set_load("w0", {"free_blocks_0": 5_000, "used_blocks_0": 5_000})
    core.set_stale("w1", "resyncing")
    fresh = {
        c.worker: (c.free_blocks, c.queued_prefill_tokens, c.fresh)
        for c in core.candidates(hashes, tree_sizes=False)
    }
    assert fresh == {"w0": (5_000, 0, True), "w1": (10_000, 0, False)}

    # A report equal to the last (an idle worker's, read anew every load interval) keeps the
    # candidates; a changed one builds them again.
    kept = {c.worker: c for c in core.candidates(hashes, tree_sizes=False)}
    core.set_load("w0", {"used_blocks_0": 5_000, "free_blocks_0": 5_000})
    same = {c.worker: c for c in core.candidates(hashes, tree_sizes=False)}
    assert [same[w] is kept[w] for w in ("w0", "w1")] == [True, True]
    core.set_load("w0", {"used_blocks_0": 5_000, "free_blocks_0": 4_999})
    moved = {c.worker: c for c in core.candidates(hashes, tree_sizes=False)}
    assert (moved["w0"] is kept["w0"], moved["w0"].free_blocks, moved["w1"] is kept["w1"]) == (
        False,
        4_999,
        True,
    )


def test_host_tier_matches_and_salted_prompts() -> None:
    index = PrefixIndex()
    core, _ = make_core(2, index=index)
    tokens = list(range(64))
    hashes = store(index, "w0", tokens)
    (w0,) = [c for c in core.candidates(hashes) if c.worker == "w0"]
    assert (w0.matched_blocks, w0.host_blocks) == (4, 0)
    # The last two blocks move to the host tier: still matched, counted as host blocks.
    index.apply_event("w0", KVCacheEvent(2, UpdatedData(hashes[2], EventDiff(0, 1)), 1 << 20))
    index.apply_event("w0", KVCacheEvent(3, UpdatedData(hashes[3], EventDiff(0, 1)), 1 << 20))
    (w0,) = [c for c in core.candidates(hashes) if c.worker == "w0"]
    assert (w0.matched_blocks, w0.host_blocks) == (4, 2)
    salted = core.hashes(tokens, cache_salt="tenant-a")
    assert salted != hashes
    assert [c.matched_blocks for c in core.candidates(salted)] == [0, 0]


def test_the_hashes_as_an_array_match_as_the_list_does() -> None:
    """The HTTP paths hand the index the uint64 array the hashes were made in."""
    index = PrefixIndex()
    core, _ = make_core(2, index=index)
    tokens = list(range(64))
    store(index, "w0", tokens[:48])
    array = core.hash_array(tokens, cache_salt=None)
    assert array.dtype.name == "uint64" and array.tolist() == block_hashes_for_tokens(tokens, TPB)
    by_list = core.candidates(core.hashes(tokens))
    by_array = core.candidates(core.hashes(tokens), hash_array=array)
    assert [(c.worker, c.matched_blocks) for c in by_array] == [("w0", 3), ("w1", 0)]
    assert by_array == by_list
    salted = core.hash_array(tokens, lora_task_id=7, cache_salt="tenant-a")
    assert salted.tolist() == block_hashes_for_tokens(
        tokens, TPB, lora_task_id=7, cache_salt_id=cache_salt_id("tenant-a")
    )
    assert [c.matched_blocks for c in core.candidates(salted.tolist(), hash_array=salted)] == [0, 0]


def test_a_worker_back_after_a_lapse_counts_its_flights_again() -> None:
    core, _ = make_core(2)
    tokens = list(range(64))
    hashes = core.hashes(tokens)
    core.begin("r1", core.decide(hashes, 64, exclude=("w1",)), hashes, 64)
    core.begin_remote("other", "r2", "w0", 30, 2, [])
    core.remove_worker("w0")  # its heartbeat lapsed
    core.upsert_worker("w0", url="http://w0", capacity_blocks=10_000)
    view = core.workers["w0"]
    assert (view.inflight_prefill_tokens, view.inflight_running, view.inflight_blocks) == (64, 1, 4)
    assert (view.remote_prefill_tokens, view.remote_running, view.remote_blocks) == (30, 1, 2)
    core.finish("r1")
    core.finish_remote("other", "r2")
    assert (view.inflight_prefill_tokens, view.inflight_running, view.inflight_blocks) == (0, 0, 0)
    assert (view.remote_prefill_tokens, view.remote_running, view.remote_blocks) == (0, 0, 0)


def test_a_failed_attempt_leaves_no_prediction() -> None:
    core, _ = make_core(2)
    hashes = core.hashes(list(range(64)))
    decision = core.decide(hashes, 64)
    core.begin("r1", decision, hashes, 64)
    core.finish("r1")
    core.unpredict(decision.worker, hashes)
    assert core.num_predicted(decision.worker) == 0


def test_the_speed_a_worker_reports_reaches_the_policy() -> None:
    """A load report's speed fields (app.core.step_speed) become the candidate's speed, and a
    new report replaces them; a worker reporting none is costed without."""
    core, _ = make_core(2)
    speed = {
        "step_overhead_us": 10_000,
        "prefill_ns_per_token": 100_000,
        "decode_ns_per_sequence": 150_000,
        "max_tokens_per_step": 8_192,
    }
    core.set_load("w0", {"free_blocks_0": 10_000, "used_blocks_0": 0, **speed})
    w0, w1 = core.candidates(core.hashes(list(range(64))))
    assert (w0.step_s, w0.prefill_s, w0.decode_s, w0.step_tokens) == (0.01, 1e-4, 1.5e-4, 8_192)
    assert (w1.step_s, w1.prefill_s, w1.decode_s, w1.step_tokens) == (0.0, 0.0, 0.0, 0)
    decision = core.decide(core.hashes(list(range(64))), 64)
    assert decision.cost_of("w0").ttft_s == pytest.approx(64 * 1e-4 + 0.01)
    assert decision.cost_of("w1").ttft_s is None
    assert core.workers["w0"].as_dict()["speed"] == {
        "step_s": 0.01,
        "prefill_s_per_token": 1e-4,
        "decode_s_per_sequence": 1.5e-4,
    }
    assert core.workers["w1"].as_dict()["speed"] is None
    core.set_load("w0", {**speed, "prefill_ns_per_token": 200_000})
    assert core.candidates([])[0].prefill_s == 2e-4
