"""The open-loop client of the fault scenarios: completions sent at a stated rate whatever
became of those before, each with its outcome (completed, rejected, failed, unclear)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import orjson

from app.bench.faults.harness import MAX_IN_FLIGHT, REQUEST_TIMEOUT_S, SEED, TOKENS_PER_BLOCK, VOCAB

# -- the client: an open loop of completions ---------------------------------------------------


@dataclass(slots=True)
class Outcome:
    index: int
    stream: bool
    due: float  # time.monotonic() when it was due
    ended: float = 0.0
    status: int | None = None
    worker: str | None = None
    kind: str = "unclear"  # completed | rejected | failed | unclear
    detail: str = ""


def make_prompts(num: int, seed: int, *, num_documents: int = 16) -> list[list[int]]:
    """Prompts sharing one of ``num_documents`` openings of 8 blocks, plus a 2-block tail."""
    rng = np.random.default_rng(seed)
    documents = rng.integers(0, VOCAB, size=(num_documents, 8 * TOKENS_PER_BLOCK)).tolist()
    tails = rng.integers(0, VOCAB, size=(num, 2 * TOKENS_PER_BLOCK)).tolist()
    picks = rng.integers(0, num_documents, size=num).tolist()
    return [documents[d] + tail for d, tail in zip(picks, tails, strict=True)]


def error_of(content: bytes) -> str | None:
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    return error.get("type") if isinstance(error, dict) else None


async def send(
    client: httpx.AsyncClient, outcome: Outcome, prompt: list[int], max_tokens: int
) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": outcome.stream}
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            async with client.stream("POST", "/v1/completions", json=body) as response:
                outcome.status = response.status_code
                outcome.worker = response.headers.get("x-kvmesh-worker")
                if not (outcome.stream and response.status_code == 200):
                    content = await response.aread()
                    error = error_of(content)
                    if response.status_code == 200 and b'"choices"' in content:
                        outcome.kind = "completed"
                    elif response.status_code in (429, 503) and error:
                        outcome.kind, outcome.detail = "rejected", error
                    elif response.status_code == 502 and error:
                        outcome.kind, outcome.detail = "failed", error
                    else:
                        outcome.detail = f"HTTP {response.status_code}: {content[:120]!r}"
                    return
                last = b""
                error = None
                async for line in response.aiter_lines():
                    if not line:
                        continue
                    last = line.encode()
                    if line.startswith('data: {"error"'):
                        error = error_of(last.removeprefix(b"data: "))
                if error:
                    outcome.kind, outcome.detail = "failed", f"stream: {error}"
                elif last == b"data: [DONE]":
                    outcome.kind = "completed"
                else:
                    outcome.detail = f"stream cut without an error event after {last[:80]!r}"
    except TimeoutError:
        outcome.detail = f"no answer within {REQUEST_TIMEOUT_S} s"
    except httpx.HTTPError as exc:
        outcome.detail = f"{type(exc).__name__}: {exc}"
    finally:
        outcome.ended = time.monotonic()


async def drive(
    base_url: str,
    prompts: Sequence[list[int]],
    *,
    rate: float,
    stream_share: float,
    max_tokens: int,
    seed: int = SEED,
) -> list[Outcome]:
    """Request ``i`` is due at ``start + i / rate`` whatever became of those before it."""
    rng = random.Random(seed)
    # httpx's pool scans every queued request for each one it assigns: thousands queued in it
    # cost the client more CPU than the router. Requests past MAX_IN_FLIGHT wait here instead,
    # and their latency still counts from their due time.
    slots = asyncio.Semaphore(MAX_IN_FLIGHT)
    limits = httpx.Limits(max_connections=MAX_IN_FLIGHT, max_keepalive_connections=MAX_IN_FLIGHT)

    async def one(outcome: Outcome, prompt: list[int]) -> None:
        async with slots:
            await send(client, outcome, prompt, max_tokens)

    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as client:
        outcomes: list[Outcome] = []
        tasks: list[asyncio.Task[None]] = []
        start = time.monotonic()
        for i, prompt in enumerate(prompts):
            due = start + i / rate
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            outcome = Outcome(i, rng.random() < stream_share, due)
            outcomes.append(outcome)
            tasks.append(asyncio.create_task(one(outcome, prompt)))
        await asyncio.gather(*tasks)
    return outcomes


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def summarize(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Counts per kind, latency of the completed (from their due time), unclear samples."""
    kinds = {"completed": 0, "rejected": 0, "failed": 0, "unclear": 0}
    for outcome in outcomes:
        kinds[outcome.kind] += 1
    latency = [(o.ended - o.due) * 1e3 for o in outcomes if o.kind == "completed"]
    return {
        "requests": len(outcomes),
        "streaming": sum(o.stream for o in outcomes),
        **kinds,
        "unclear_samples": [o.detail for o in outcomes if o.kind == "unclear"][:5],
        "p50_ms": round(percentile(latency, 0.5), 2),
        "p99_ms": round(percentile(latency, 0.99), 2),
        "max_ms": round(max(latency, default=0.0), 2),
    }


def statuses(outcomes: Sequence[Outcome]) -> dict[str, int]:
    """How many requests got each HTTP status ("none": no answer at all)."""
    counts: dict[str, int] = {}
    for outcome in outcomes:
        key = "none" if outcome.status is None else str(outcome.status)
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def metric(router_url: str, name: str) -> float:
    for line in httpx.get(f"{router_url}/metrics", timeout=5.0).text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return 0.0
