"""The dashboard page in a real headless Chromium, against a real router and two sim workers on
a private Redis: the page shows what the cluster did, exactly, and logs no error.

Chromium is Debian's (``make setup`` installs it as root); Playwright's Python package drives
it through ``executable_path``, so no browser is downloaded. Without Chromium the test fails and
says how to install it (a skipped browser test would prove nothing). Screenshots
go to the test's ``tmp_path``; ``KVMESH_DOCS_SCREENSHOT=1`` also writes ``docs/img/dashboard.png``
(the README's picture).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import playwright.sync_api as playwright_api
import pytest
import redis

from app.core.embedded_redis import EmbeddedRedis
from events import keys
from tests.support.processes import two_workers_and_a_router
from tests.support.wait import wait_for

CHROMIUM = os.environ.get("KVMESH_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"

DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "img" / "dashboard.png"
BLOCK = 16
HEARTBEAT_TTL_S = 2.0
# Distinct prompts (the sim's vocabulary is 0..511), each full blocks and a partial one.
PROMPT = list(range(300, 400))  # 100 tokens: 6 full blocks
OTHER_PROMPT = list(range(400, 440))  # 40 tokens: 2 full blocks
FRESH_PROMPT = list(range(440, 490))  # 50 tokens: 3 full blocks
SYSTEM = list(range(64))  # a 4-block "system prompt" for the screenshot


def _complete(base: str, prompt: list[int], request_id: str, max_tokens: int = 2) -> str:
    """Sends a completion through the router; the worker that served it."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "request_id": request_id}
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=10)
    assert response.status_code == 200, response.text
    worker: str = response.headers["x-kvmesh-worker"]
    return worker


def _blocks(base: str, worker: str) -> int:
    """How many GPU blocks the router's index says the worker holds."""
    workers = httpx.get(f"{base}/workers").json()["workers"]
    num_blocks: int = next(w for w in workers if w["worker"] == worker)["blocks"]["gpu"]
    return num_blocks


def _settled_count(page: Any, pause_button: Any) -> int:
    """The number of feed items waiting behind a paused feed, once it stops growing: the same
    over 4 frames the page received (a second of the router's frames), however slowly they
    come on a loaded machine (wall time alone once let an event arrive after the count)."""
    pattern = re.compile(r"^Resume \((\d+) new\)$")
    playwright_api.expect(pause_button).to_have_text(pattern)
    frames = page.locator("#stream-frames")

    def frame_count() -> int:
        return int(re.sub(r"\D", "", frames.text_content() or "") or 0)

    last, since = -1, frame_count()
    deadline = time.monotonic() + 30
    while frame_count() - since < 4:
        assert time.monotonic() < deadline, "the page received no frame for 30 s"
        match = pattern.match(pause_button.text_content() or "")
        count = int(match.group(1)) if match else 0
        if count != last:
            last, since = count, frame_count()
        time.sleep(0.05)
    return last


@pytest.fixture
def cluster(embedded_redis: EmbeddedRedis) -> Iterator[dict[str, Any]]:
    """Two ``kvmesh worker`` processes and a ``kvmesh router``, all up."""
    with two_workers_and_a_router(
        embedded_redis.url, num_blocks=256, heartbeat_ttl_s=HEARTBEAT_TTL_S
    ) as (base, procs, _):
        router = procs["router"]
        yield {"base": base, "procs": procs, "router": router, "redis_url": embedded_redis.url}
        router.send_signal(signal.SIGTERM)
        router.wait(timeout=15)


@pytest.fixture
def browser_page() -> Iterator[tuple[Any, list[str]]]:
    """A 1280x900 page in headless Chromium, and the errors it logs (console and uncaught)."""
    assert os.access(CHROMIUM, os.X_OK), (
        f"no Chromium at {CHROMIUM}: `make setup` installs Debian's chromium when run as root "
        "(or `apt-get install chromium`; KVMESH_CHROMIUM names another binary)"
    )
    errors: list[str] = []
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(10_000)
            page.on(
                "console",
                lambda message: errors.append(message.text) if message.type == "error" else None,
            )
            page.on("pageerror", lambda exc: errors.append(f"uncaught: {exc}"))
            yield page, errors
        finally:
            browser.close()


def test_dashboard_page_shows_the_cluster_live(
    cluster: dict[str, Any], browser_page: tuple[Any, list[str]], tmp_path: Path
) -> None:
    expect = playwright_api.expect
    page, errors = browser_page
    base = cluster["base"]
    page.goto(f"{base}/dashboard")

    # Both workers, up, and the stream connected.
    expect(page.locator("#conn")).to_have_text("connected")
    for worker in ("w0", "w1"):
        card = page.locator(f'article.worker[data-worker="{worker}"]')
        expect(card.locator(".badge")).to_have_text("up")
        expect(card.locator('.tier[data-tier="gpu"] .tier-num')).to_have_text("0 / 256")
    expect(page.locator("#source")).to_have_text("router")

    # The same prompt twice (the second lands on the first's blocks), another prompt once.
    holder = _complete(base, PROMPT, "dash-a1")
    # (Not by asking /route: a routing decision counts as a request in the prefix map.)
    wait_for(lambda: _blocks(base, holder) >= len(PROMPT) // BLOCK)
    assert _complete(base, PROMPT, "dash-a2") == holder
    other_holder = _complete(base, OTHER_PROMPT, "dash-b1")
    other = "w1" if holder == "w0" else "w0"

    # Decisions: each request id with the worker its response named.
    for request_id, worker in (("dash-a1", holder), ("dash-a2", holder), ("dash-b1", other_holder)):
        row = page.locator(f'tr.decision-row[data-request-id="{request_id}"]')
        expect(row.locator(".chosen-worker")).to_have_text(worker)
        expect(row.locator(f'.cost.chosen[data-worker="{worker}"]')).to_have_count(1)
    expect(page.locator('tr.decision-row[data-request-id="dash-a2"] .cached')).to_contain_text(
        "96 / 100"
    )
    expect(page.locator("#decisions-none")).to_be_hidden()

    # The prefix map: the prompt's row, requested twice, all 6 blocks on the holder, none on
    # the other worker.
    prefix_row = page.locator("tr.prefix-row").filter(
        has=page.locator("td.count", has_text=re.compile(r"^2$"))
    )
    expect(prefix_row).to_have_count(1)
    full_blocks = len(PROMPT) // BLOCK
    expect(prefix_row.locator(f'td[data-worker="{holder}"]')).to_have_text(str(full_blocks))
    expect(prefix_row.locator(f'td[data-worker="{other}"]')).to_have_text("0")
    first_hash = prefix_row.get_attribute("data-prefix")
    assert first_hash is not None and len(first_hash) == 16

    # The feed: the holder's stored event starts with the block the router hashed for the map.
    stored = page.locator(f'tr.feed-row[data-worker="{holder}"][data-type="stored"]')
    expect(stored.filter(has=page.locator(f'code[data-hash="{first_hash}"]'))).to_have_count(1)
    expect(
        stored.filter(has=page.locator(f'code[data-hash="{first_hash}"]')).locator("td.num")
    ).to_have_text(str(full_blocks))

    # The holder's card counts what it served.
    card = page.locator(f'article.worker[data-worker="{holder}"]')
    served = 2 + (other_holder == holder)
    expect(card.locator('[data-stat="decisions"]')).to_have_text(str(served))

    # Filtering out the holder hides its rows; turning it back on shows them again.
    page.locator(f'input[name="feed-worker"][value="{holder}"]').uncheck()
    expect(page.locator(f'tr.feed-row[data-worker="{holder}"]')).to_have_count(0)
    page.locator(f'input[name="feed-worker"][value="{holder}"]').check()
    expect(stored.filter(has=page.locator(f'code[data-hash="{first_hash}"]'))).to_have_count(1)

    # Paused, new events wait (counted on the button); resumed, they come in on top.
    pause = page.locator("#feed-pause")
    pause.click()
    expect(pause).to_have_text("Resume")
    top_id = page.locator("tr.feed-row").first.get_attribute("data-id")
    held = {worker: _blocks(base, worker) for worker in (holder, other)}
    fresh_worker = _complete(base, FRESH_PROMPT, "dash-c1")
    expect(page.locator('tr.decision-row[data-request-id="dash-c1"]')).to_have_count(1)
    # The router has its stored event before its feed's count is read.
    fresh_blocks = held[fresh_worker] + len(FRESH_PROMPT) // BLOCK
    wait_for(lambda: _blocks(base, fresh_worker) >= fresh_blocks)
    num_new = _settled_count(page, pause)
    assert num_new >= 1
    assert page.locator("tr.feed-row").first.get_attribute("data-id") == top_id
    pause.click()
    expect(pause).to_have_text("Pause")
    ids = [
        int(i)
        for i in page.locator("tr.feed-row").evaluate_all("rows => rows.map(r => r.dataset.id)")
    ]
    fresh_ids = [i for i in ids if i > int(top_id or 0)]
    assert len(fresh_ids) == num_new
    assert fresh_ids == sorted(fresh_ids, reverse=True)  # newest on top
    for fresh_id in fresh_ids:
        row = page.locator(f'tr.feed-row[data-id="{fresh_id}"]')
        expect(row).to_have_attribute("data-worker", fresh_worker)
    # Its prompt's full blocks, stored at once (the partial block follows on its own).
    first_store = page.locator(
        f'tr.feed-row[data-worker="{fresh_worker}"][data-id="{min(fresh_ids)}"]'
    )
    expect(first_store).to_have_attribute("data-type", "stored")
    expect(first_store.locator("td.num")).to_have_text(str(len(FRESH_PROMPT) // BLOCK))

    # Some traffic for the picture: two system prompts under a few questions, a few at once
    # (so that the in-flight load spreads them over both workers).
    def ask(i: int) -> str:
        system = SYSTEM if i % 2 else list(range(64, 128))
        question = list(range(128 + 37 * (i % 4), 165 + 37 * (i % 4)))
        return _complete(base, system + question, f"q-{i}", max_tokens=24)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(ask, range(16)))
    expect(page.locator('tr.decision-row[data-request-id="q-15"]')).to_have_count(1)
    page.wait_for_timeout(600)  # a frame or two, so the rates and the map include it
    page.screenshot(path=str(tmp_path / "dashboard.png"))
    if os.environ.get("KVMESH_DOCS_SCREENSHOT") == "1":
        page.screenshot(path=str(DOCS_SCREENSHOT))

    # An operator's cordon (written to Redis as any router's admin API writes it) shows on
    # the worker's badge, with when and by whom in its title, and goes when lifted.
    badge = page.locator(f'article.worker[data-worker="{holder}"] .badge')
    with redis.Redis.from_url(cluster["redis_url"]) as client:
        client.hset(keys.CORDONS_KEY, holder, json.dumps({"state": "cordoned", "since": 0.0}))
        expect(badge).to_have_text("cordoned")
        expect(badge).to_have_attribute("title", re.compile(r"^cordoned by an operator since \S"))
        client.hdel(keys.CORDONS_KEY, holder)
        expect(badge).to_have_text("up")

    # A killed worker turns grey: gone, once its heartbeat expires.
    cluster["procs"][other].send_signal(signal.SIGKILL)
    expect(page.locator(f'article.worker[data-worker="{other}"] .badge')).to_have_text(
        "gone", timeout=(HEARTBEAT_TTL_S + 4) * 1000
    )
    page.screenshot(path=str(tmp_path / "dashboard-gone.png"))
    assert errors == []
