"""The retry step and the shutdown the publisher and the consumer share (``events.redis_io``),
on their own: the delays, the counts, one log line per outage, and tasks stopped in order."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from app.core.embedded_redis import EmbeddedRedis
from events.redis_io import Backoff, redacted_url, redis_client, stop_tasks

LOGGER = logging.getLogger("events.test_redis_io")


class Flaky:
    """An action that fails with the given errors, in order, then succeeds."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def __call__(self) -> None:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)


def _messages(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == LOGGER.name]


async def test_redis_errors_back_off_doubling_and_are_logged_once_per_outage(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER.name)
    lost: list[int] = []
    backoff = Backoff(
        LOGGER,
        "publisher w0",
        verb="write",
        doing="flushing",
        initial_s=0.001,
        max_s=0.004,
        on_redis_error=lambda: lost.append(1),
    )
    action = Flaky(*(RedisConnectionError(f"down {i}") for i in range(4)))
    delays = []
    for _ in range(4):
        assert await backoff.step(action) is False
        delays.append(backoff.delay_s)
    assert delays == [0.002, 0.004, 0.004, 0.004]
    assert (backoff.num_errors, backoff.failing, len(lost)) == (4, True, 4)
    assert await backoff.step(action) is True
    assert (backoff.delay_s, backoff.failing, backoff.num_errors, action.calls) == (
        0.001,
        False,
        4,
        5,
    )
    assert _messages(caplog) == [
        ("WARNING", "publisher w0: Redis write failed: down 0"),
        ("INFO", "publisher w0: Redis writes succeed again"),
    ]


async def test_an_unexpected_error_is_logged_with_its_traceback_every_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER.name)
    lost: list[int] = []
    backoff = Backoff(
        LOGGER,
        "consumer",
        verb="read",
        doing="reading",
        initial_s=0.001,
        max_s=0.002,
        on_redis_error=lambda: lost.append(1),
    )
    action = Flaky(KeyError("a"), KeyError("b"))
    assert await backoff.step(action) is False
    assert await backoff.step(action) is False
    assert (backoff.num_errors, backoff.failing, backoff.delay_s, lost) == (2, False, 0.002, [])
    assert await backoff.step(action) is True
    assert backoff.delay_s == 0.001
    assert _messages(caplog) == [
        ("ERROR", "consumer: unexpected error while reading"),
        ("ERROR", "consumer: unexpected error while reading"),
    ]
    assert all(r.exc_info is not None for r in caplog.records if r.name == LOGGER.name)


async def test_a_cancellation_is_not_taken_for_an_error() -> None:
    backoff = Backoff(LOGGER, "consumer", verb="read", doing="reading", initial_s=1, max_s=1)
    started = asyncio.Event()

    async def hang() -> None:
        started.set()
        await asyncio.sleep(60)

    task = asyncio.create_task(backoff.step(hang))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert backoff.num_errors == 0


async def test_stop_tasks_waits_out_the_grace_period_then_cancels() -> None:
    finished: list[str] = []

    async def quick() -> None:
        await asyncio.sleep(0.01)
        finished.append("quick")

    async def slow() -> None:
        await asyncio.sleep(60)
        finished.append("slow")

    async def failing() -> None:
        raise RuntimeError("logged by the task itself")

    tasks = [asyncio.create_task(f()) for f in (quick, slow, failing)]
    await stop_tasks(tasks, grace_s=1.0)
    assert finished == ["quick"]
    assert [t.cancelled() for t in tasks] == [False, True, False]
    await stop_tasks([])  # nothing to stop


async def test_stop_tasks_without_grace_cancels_at_once() -> None:
    task = asyncio.create_task(asyncio.sleep(60))
    await stop_tasks([task])
    assert task.cancelled()


async def test_a_client_survives_a_restart_without_an_error(embedded_redis: EmbeddedRedis) -> None:
    """The pooled connection dies with the server; the first command after the restart takes
    a fresh one instead of failing (a worker's /ready said "redis": false once per restart)."""
    client = redis_client(embedded_redis.url)
    try:
        assert await client.set("k", "before") is True
        embedded_redis.kill()
        embedded_redis.start()
        assert await client.ping() is True
        assert await client.get("k") is None  # the server restarted empty
    finally:
        await client.aclose()


async def test_a_server_that_is_down_still_fails_fast(embedded_redis: EmbeddedRedis) -> None:
    """Refused at once, twice (the one second attempt), no backoff: well under a second."""
    client = redis_client(embedded_redis.url)
    embedded_redis.kill()
    try:
        started = time.monotonic()
        with pytest.raises(RedisConnectionError, match="Error 111 connecting"):
            await client.ping()
        assert time.monotonic() - started < 1.0
    finally:
        await client.aclose()
        embedded_redis.start()


def test_a_redis_url_in_a_log_line_has_no_password() -> None:
    assert redacted_url("redis://kv:s3cret@redis-host:6379/0") == "redis://kv:***@redis-host:6379/0"
    assert redacted_url("rediss://:s3cret@h:6380") == "rediss://:***@h:6380"
    assert redacted_url("redis://h:6379/0") == "redis://h:6379/0"
    assert redacted_url("redis://h:6379/0?password=s3cret&db=1") == (
        "redis://h:6379/0?password=***&db=1"
    )
    assert redacted_url("unix:///run/redis.sock?password=s3cret") == (
        "unix:///run/redis.sock?password=***"
    )
