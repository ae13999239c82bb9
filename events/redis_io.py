"""Redis clients, and the retry and shutdown steps every long-running Redis task shares.

``redis_client(url)`` makes an asyncio client that fails fast (short timeouts, no backoff):
kvmesh's loops do their own retrying. It makes one immediate second attempt after a
*connection* error, and only then: a pooled connection that the server closed (a restart, an
idle timeout) fails its next command, and without that attempt every client would report
"Redis is down" once after each restart, though Redis answers (a worker's ``/ready`` did, on
the first call after a restart). A server that is really down refuses the second attempt as
fast as the first; a timeout is not retried. ``client_for(redis)`` takes a URL (the caller then owns
the client it gets, and closes it) or a client (not owned). ``REDIS_ERRORS`` is what a lost or
refused connection or a timeout looks like from redis-py.

``Backoff`` is the retry step of the publisher's flusher and the consumer's loop: it runs one
step; a Redis error is counted, logged once per outage and slept off with exponential backoff
(with jitter, so that many clients coming back together do not retry in step); any other error
is logged with its traceback and slept off too; the first success after failures says so and
resets the delay. ``stop_tasks`` ends a service's tasks: a grace period, then cancellation.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, cast
from urllib.parse import parse_qsl, urlencode, urlsplit

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

__all__ = [
    "CLUSTER_SCHEMES",
    "REDIS_ERRORS",
    "Backoff",
    "client_for",
    "is_cluster",
    "raise_if_cancelled",
    "redacted_url",
    "redis_client",
    "stop_tasks",
]

# What a lost connection, a refused connection or a timeout look like from redis-py.
REDIS_ERRORS: Final = (RedisError, OSError, TimeoutError)
CLUSTER_SCHEMES: Final = ("redis+cluster://", "rediss+cluster://")


def raise_if_cancelled() -> None:
    """Re-raise a cancellation that a library turned into another error.

    redis-py may catch the ``CancelledError`` of a task cancelled mid-command and raise a
    connection error instead; a loop that logs and carries on would then never stop.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def redacted_url(url: str) -> str:
    """``url`` fit for a log line: its password replaced by ``***``, in the address or in a
    ``password=`` option (redis-py takes both)."""
    parts = urlsplit(url)
    if parts.password is not None:
        host = parts.netloc.rpartition("@")[2]
        parts = parts._replace(netloc=f"{parts.username or ''}:***@{host}")
    if parts.query:
        options = [
            (name, "***" if name.lower() == "password" else value)
            for name, value in parse_qsl(parts.query, keep_blank_values=True)
        ]
        parts = parts._replace(query=urlencode(options, safe="*"))
    # Joined by hand: urlunsplit drops the "//" of an empty host (unix:///path).
    query = f"?{parts.query}" if parts.query else ""
    return f"{parts.scheme}://{parts.netloc}{parts.path}{query}"


def redis_client(url: str, *, socket_timeout: float | None = 5.0) -> Redis:
    """An asyncio client that fails fast: kvmesh's loops do their own retrying and backoff.

    ``redis+cluster://host:port`` (or ``rediss+cluster://``) names a Redis Cluster by any of
    its nodes: the client is then a ``RedisCluster``, typed as ``Redis`` because it speaks the
    same commands; the few places that must differ ask ``is_cluster``. Every key of one worker
    carries its id as a hash tag, so its stream, snapshot, load and heartbeat share a slot."""
    connect_timeout = min(socket_timeout or 2.0, 2.0)
    if url.startswith(CLUSTER_SCHEMES):
        cluster = RedisCluster.from_url(  # it retries by itself when the topology changes
            url.replace("+cluster", "", 1),
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
        )
        return cast(Redis, cluster)
    client: Redis = Redis.from_url(
        url,
        socket_timeout=socket_timeout,
        socket_connect_timeout=connect_timeout,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )
    return client


def is_cluster(client: Redis) -> bool:
    return isinstance(client, RedisCluster)


def client_for(redis: Redis | str, *, socket_timeout: float | None = 5.0) -> tuple[Redis, bool]:
    """A client for a URL, owned by the caller (who closes it), or the client given, not owned."""
    if isinstance(redis, str):
        return redis_client(redis, socket_timeout=socket_timeout), True
    return redis, False


class Backoff:
    """Runs the steps of one long-running Redis loop; see the module docstring.

    ``name`` starts every log line ("publisher w3", "consumer"), ``verb`` says what the loop
    does to Redis ("write", "read"), ``doing`` what a step is ("flushing"). ``on_redis_error``
    runs after each Redis error (e.g. to write a fresh snapshot, or check the server, once
    Redis answers again).
    """

    __slots__ = (
        "_doing",
        "_initial_s",
        "_logger",
        "_max_s",
        "_name",
        "_on_redis_error",
        "_verb",
        "delay_s",
        "failing",
        "num_errors",
    )

    def __init__(
        self,
        logger: logging.Logger,
        name: str,
        *,
        verb: str,
        doing: str,
        initial_s: float,
        max_s: float,
        on_redis_error: Callable[[], None] | None = None,
    ) -> None:
        self._logger = logger
        self._name = name
        self._verb = verb
        self._doing = doing
        self._initial_s = initial_s
        self._max_s = max_s
        self._on_redis_error = on_redis_error
        self.delay_s = initial_s
        self.failing = False  # the last step failed with a Redis error
        self.num_errors = 0

    async def step(self, action: Callable[[], Awaitable[object]]) -> bool:
        """Run ``action`` once; True if it succeeded, False after an error and its delay."""
        try:
            await action()
        except REDIS_ERRORS as exc:
            raise_if_cancelled()
            self.num_errors += 1
            if self._on_redis_error is not None:
                self._on_redis_error()
            if not self.failing:
                self._logger.warning("%s: Redis %s failed: %s", self._name, self._verb, exc)
            self.failing = True
            await asyncio.sleep(self.delay_s * (0.5 + random.random()))
            self.delay_s = min(self.delay_s * 2, self._max_s)
            return False
        except Exception:
            raise_if_cancelled()
            self.num_errors += 1
            self._logger.exception("%s: unexpected error while %s", self._name, self._doing)
            await asyncio.sleep(self.delay_s)
            self.delay_s = min(self.delay_s * 2, self._max_s)
            return False
        if self.failing:
            self._logger.info("%s: Redis %ss succeed again", self._name, self._verb)
            self.failing = False
        self.delay_s = self._initial_s
        return True


async def stop_tasks(tasks: Sequence[asyncio.Task[Any]], *, grace_s: float = 0.0) -> None:
    """Give ``tasks`` up to ``grace_s`` to end by themselves, cancel the rest, wait for all.

    Their errors are not raised here: the tasks log their own (a task's loop never dies
    silently), and a shutdown goes on whatever one of them did."""
    if not tasks:
        return
    pending: Sequence[asyncio.Task[Any]] = tasks
    if grace_s > 0:
        _, pending_set = await asyncio.wait(tasks, timeout=grace_s)
        pending = list(pending_set)
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
