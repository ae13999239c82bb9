"""Shared fixtures: a real Redis for the session, and Hypothesis profiles.

Redis is always a real server: ``$REDIS_URL`` when set, else a private ``redis-server`` that
``EmbeddedRedis`` starts once per session. Never a stand-in.
"""

from __future__ import annotations

import asyncio
import os
import urllib.parse
from collections.abc import Callable, Iterator

import pytest
import redis
import uvloop
from hypothesis import HealthCheck, settings

from app.core.embedded_redis import EmbeddedRedis

# Deadlines flake on a loaded 2-core CI machine; CI also runs derandomised so a failure there
# reproduces locally with HYPOTHESIS_PROFILE=ci.
settings.register_profile("dev", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
# `make test-long` (KVMESH_HYPOTHESIS=long): random seeds, many more and longer runs of the state
# machines, for a soak before and after changes to the hot paths.
settings.register_profile(
    "long",
    deadline=None,
    derandomize=False,
    print_blob=True,
    max_examples=int(os.environ.get("KVMESH_HYPOTHESIS_EXAMPLES", "1000")),
    stateful_step_count=80,
    suppress_health_check=[HealthCheck.too_slow],
)
if os.environ.get("KVMESH_HYPOTHESIS") == "long":
    settings.load_profile("long")
else:
    settings.load_profile(
        os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev")
    )


def _own_database(url: str) -> str:
    """``url`` for this test process: under pytest-xdist (``make test`` runs two), process gwN
    uses the database N above the URL's, so that one's FLUSHDB never empties another's."""
    process = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not process.startswith("gw"):
        return url
    parts = urllib.parse.urlsplit(url)
    database = int(parts.path.strip("/") or 0) + int(process[2:])
    return urllib.parse.urlunsplit(parts._replace(path=f"/{database}"))


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of the session's Redis: ``$REDIS_URL`` (a database of its own per test process),
    else a private embedded server."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield _own_database(url)
        return
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture
def clean_redis_url(redis_url: str) -> str:
    """The session's Redis database, emptied (FLUSHDB) before the test."""
    client = redis.Redis.from_url(redis_url)
    try:
        client.flushdb()
    finally:
        client.close()
    return redis_url


@pytest.fixture
def embedded_redis() -> Iterator[EmbeddedRedis]:
    """A private redis-server for this test alone, which it may kill and restart."""
    with EmbeddedRedis() as server:
        yield server


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """An async test runs on asyncio's loop; one marked ``both_loops`` on uvloop's too (the
    services run on uvloop: code that subclasses the loop's protocols or transports is tested
    on both)."""
    if item.get_closest_marker("both_loops") is not None:
        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}
