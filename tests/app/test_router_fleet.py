"""``app.router.fleet``: kv_aware's compiled decision makes the Python policy's decisions, costs
included, over random fleets, and follows every change of a worker's view."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from app.router import fleet
from app.router.core import NoWorkerError, RouterCore
from app.router.policies import Decision, Weights
from app.router.predicted import PredictedCache
from cache import KVCacheEvent, StoredBlock, StoredData, block_hashes_for_tokens
from events.index import PrefixIndex

TPB = 16

pytestmark = pytest.mark.skipif(not fleet.compiled(), reason="needs numba")


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many decisions the kernel made (the compiled path taken, not the fallback)."""
    calls: list[int] = []
    real = fleet._kernel

    def counted(*args: Any) -> int:
        calls.append(1)
        result: int = real(*args)
        return result

    monkeypatch.setattr(fleet, "_kernel", counted)
    yield calls


def python_decision(monkeypatch: pytest.MonkeyPatch, decide: Callable[[], Decision]) -> Decision:
    """The same decision by the candidates and the Python policy (the kernel taken away)."""
    with monkeypatch.context() as patch:
        patch.setattr(fleet, "_kernel", None)
        return decide()


def random_load(rng: random.Random) -> dict[str, int]:
    load = {
        "free_blocks_0": rng.choice([0, 3, 40, 500, 10_000]),
        "used_blocks_0": rng.randrange(0, 400),
        "running_requests": rng.randrange(0, 40),
        "waiting_requests": rng.choice([0, 0, 3]),
    }
    if rng.random() < 0.7:  # a worker that reports its speed
        load |= {
            # -900: a speed no fit gives, read as none (``speed_from_load``)
            "step_overhead_us": rng.choice([0, 900, 3_000, -900]),
            "prefill_ns_per_token": rng.choice([15_000, 40_000, 90_000, 40_000]),
            "decode_ns_per_sequence": rng.choice([0, 100_000, 250_000]),
            "max_tokens_per_step": rng.choice([1, 8, 512, 8_192]),
        }
    return load


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def build(rng: random.Random, num_workers: int, clock: Clock) -> tuple[RouterCore, list[list[int]]]:
    """A core over ``num_workers`` workers holding random prefixes of a few shared prompts."""
    index = PrefixIndex()
    core = RouterCore(
        index, tokens_per_block=TPB, seed=rng.randrange(1 << 32), predict_ttl_s=1.0, clock=clock
    )
    prompts = [[rng.randrange(50_000) for _ in range(TPB * 40)] for _ in range(4)]
    for i in rng.sample(range(40), num_workers):  # ids out of order: slots unlike positions
        worker = f"w{i:02d}"
        core.upsert_worker(
            worker,
            url=f"http://{worker}",
            capacity_blocks=10_000,
            model=rng.choice([None, "a", "b"]),
            draining=rng.random() < 0.1,
            approximate=(approximate := rng.random() < 0.2),  # no events: what the core sent
        )
        core.set_load(worker, random_load(rng))
        for prompt in rng.sample(prompts, 2):
            if not approximate:
                store(index, worker, prompt[: rng.randrange(0, len(prompt) + 1)], rng)
    return core, prompts


def store(index: PrefixIndex, worker: str, tokens: list[int], rng: random.Random) -> None:
    """``worker`` holds the full blocks of ``tokens``, each on the GPU or the host tier."""
    hashes = block_hashes_for_tokens(tokens, TPB)
    blocks = [
        StoredBlock(h, tuple(tokens[j * TPB : (j + 1) * TPB]), cache_level=rng.choice([0, 1]))
        for j, h in enumerate(hashes)
    ]
    if blocks:
        index.apply_event(worker, KVCacheEvent(1, StoredData(None, blocks), 1 << 20))


def request(rng: random.Random, prompts: list[list[int]]) -> list[int]:
    if rng.random() < 0.03:
        return []  # no token at all: the core takes it (the services refuse it before)
    prompt = rng.choice(prompts)
    tokens = prompt[: rng.randrange(1, len(prompt) + 1)]
    return tokens + [rng.randrange(50_000) for _ in range(rng.choice([0, 0, 5, 100]))]


def random_weights(rng: random.Random) -> Weights:
    if rng.random() < 0.1:  # an int weight decides as the float (kv_aware.config)
        return Weights(load=1, session=0.1)
    return Weights(
        load=rng.choice([0.1, 0.0, 1.0, 0.37]),
        decode=rng.choice([8.0, 0.0, 2.5]),
        host_hit=rng.choice([0.25, 0.0, 1.0]),
        session=rng.choice([0.1, 0.0, 0.6]),
    )


def change_a_view(
    rng: random.Random,
    core: RouterCore,
    clock: Clock,
    prompts: list[list[int]],
    turn: int,
    decided: tuple[Decision, list[int], int, str | None] | None,
    newcomers: list[str],
) -> None:
    """What happens to views between decisions: a new load, a request sent (its blocks
    predicted there) and ended, a worker stale, draining, cordoned or serving another model,
    one gone and another in its index slot (from its first event, a decision later: the
    table learns it from the index alone), and the core's workers changing apart from the
    index's, as a router's registry and streams change them (one joining before its first
    event, with an id sorted first; one gone from the core whose blocks the index keeps)."""
    for new in newcomers:
        store(core.index, new, rng.choice(prompts)[: TPB * rng.randrange(1, 40)], rng)
    newcomers.clear()
    worker = rng.choice(sorted(core.workers))
    view = core.workers[worker]
    change = rng.randrange(8)
    if change == 0:
        core.set_load(worker, random_load(rng))
    elif change == 1 and decided is not None:
        decision, hashes, num_tokens, session = decided
        core.begin(f"r{turn}", decision, hashes, num_tokens, session=session)
        clock.now += rng.choice([0.0, 0.5, 3.0])  # predictions kept, or expired
    elif change == 2:
        core.set_stale(worker, rng.choice([None, "lagging"]))
    elif change == 3:
        core.upsert_worker(
            worker,
            url=view.url,
            capacity_blocks=view.capacity_blocks,
            draining=rng.random() < 0.2,
            cordon=rng.choice([None, None, "cordoned", "draining"]),
            model=rng.choice([view.model, view.model, None, "a", "c"]),
            approximate=view.approximate,
        )
    elif change == 4 and len(core.workers) > 1:
        # Gone; a new worker then takes its index slot (the index reuses a freed slot).
        core.remove_worker(worker)
        core.index.remove_worker(worker)
        new = f"n{turn:02d}"
        core.upsert_worker(new, url=f"http://{new}", capacity_blocks=10_000, model=view.model)
        core.set_load(new, random_load(rng))
        newcomers.append(new)
    elif change == 5:
        early = f"a{turn:02d}"
        core.upsert_worker(early, url=f"http://{early}", capacity_blocks=10_000)
        core.set_load(early, random_load(rng))
    elif change == 6 and len(core.workers) > 1:
        core.remove_worker(worker)
    else:
        for request_id in list(core.inflight)[: rng.randrange(3)]:
            core.prefilled(request_id)
            core.finish(request_id)


@pytest.mark.parametrize("seed", range(16))
def test_the_kernel_decides_as_the_python_policy(
    seed: int, monkeypatch: pytest.MonkeyPatch, kernel_calls: list[int]
) -> None:
    rng = random.Random(seed)
    clock = Clock()
    core, prompts = build(rng, rng.choice([1, 2, 5, 16, 33]), clock)
    compared = 0
    decided: tuple[Decision, list[int], int, str | None] | None = None
    newcomers: list[str] = []
    for turn in range(80):
        tokens = request(rng, prompts)
        hashes = core.hashes(tokens)
        hash_array = core.hash_array(tokens) if rng.random() < 0.5 else None
        session = rng.choice([None, "s1", "s2"])
        model = rng.choice([None, None, "a", "b", "z"])  # z: no worker names it
        weights = random_weights(rng)

        def decide(
            hashes: list[int] = hashes,
            n: int = len(tokens),
            array: Any = hash_array,
            session: str | None = session,
            model: str | None = model,
            weights: Weights = weights,
        ) -> Decision:
            return core.decide(
                hashes, n, weights=weights, session=session, model=model, hash_array=array
            )

        if any(
            v.admitting and (model is None or v.model in (None, model))
            for v in core.workers.values()
        ):
            before = len(kernel_calls)
            compiled = decide()
            assert len(kernel_calls) == before + 1
            # repr: the same types too (an int where Python has an int, -0.0 as -0.0).
            assert repr(compiled) == repr(python_decision(monkeypatch, decide)), (seed, turn)
            compared += 1
            decided = (compiled, hashes, len(tokens), session)
        else:
            with pytest.raises(NoWorkerError):  # from the candidates' path, saying why
                decide()
        change_a_view(rng, core, clock, prompts, turn, decided, newcomers)
    assert compared >= 25  # most turns have a worker for their model


def test_a_load_too_large_for_a_double_leaves_the_decisions_to_python(
    monkeypatch: pytest.MonkeyPatch, kernel_calls: list[int]
) -> None:
    """Beyond 2**53 a double is not the int: the Python path decides until the load is sane."""
    rng = random.Random(7)
    core, prompts = build(rng, 5, Clock())
    worker = sorted(core.workers)[0]
    core.upsert_worker(worker, url="http://x", capacity_blocks=10_000)  # admitting, any model
    tokens = prompts[0][: TPB * 20]
    hashes = core.hashes(tokens)

    def decide() -> Decision:
        return core.decide(hashes, len(tokens))

    for free, calls in ((10**400, 0), (2**53 + 1, 0), (2**53 - 1, 1), (500, 1)):
        core.set_load(worker, {"free_blocks_0": free, "used_blocks_0": 0})
        before = len(kernel_calls)
        decision = decide()
        assert len(kernel_calls) - before == calls, free
        assert repr(decision) == repr(python_decision(monkeypatch, decide)), free


def test_a_prediction_that_raises_leaves_no_trace(
    monkeypatch: pytest.MonkeyPatch, kernel_calls: list[int]
) -> None:
    """The depths handed to the kernel go back even when extending one raises."""
    clock = Clock()
    core = RouterCore(PrefixIndex(), tokens_per_block=TPB, predict_ttl_s=1.0, clock=clock)
    for worker in ("w0", "w1", "w2"):
        core.upsert_worker(worker, url=f"http://{worker}", capacity_blocks=10_000)
        core.set_load(worker, {"free_blocks_0": 10_000, "used_blocks_0": 0})
    tokens = list(range(TPB * 30))
    hashes = core.hashes(tokens)
    for worker in ("w0", "w1", "w2"):  # predicted; the index holds nothing
        core.predict(worker, hashes)

    def decide() -> Decision:
        return core.decide(hashes, len(tokens))

    real = PredictedCache.depth
    calls: list[int] = []

    def fails_on_the_second(self: PredictedCache, *args: Any) -> int:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real(self, *args)

    with monkeypatch.context() as patch:
        patch.setattr(PredictedCache, "depth", fails_on_the_second)
        with pytest.raises(RuntimeError, match="boom"):
            core.decide(hashes, len(tokens))
    assert len(calls) == 2  # one worker's depth was handed (30 blocks), then one raised
    clock.now += 3.0  # the predictions expire: a depth left behind would show alone
    before = len(kernel_calls)
    assert repr(decide()) == repr(python_decision(monkeypatch, decide))
    assert len(kernel_calls) == before + 1
