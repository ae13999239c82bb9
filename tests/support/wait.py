"""Waiting for a condition, with a deadline that fails the test (never a bare sleep)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["eventually", "wait_for"]


async def eventually(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll ``condition`` every few milliseconds on the event loop; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition still false after {timeout_s} s")
        await asyncio.sleep(0.005)


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll ``condition`` (blocking, for tests without an event loop); fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"condition still false after {timeout_s} s"
        time.sleep(0.02)
