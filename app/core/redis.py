"""The start-up check every kvmesh service makes of its Redis URL's credentials.

A Redis that is down, restarting or loading is a fault the services ride out (publishers buffer,
consumers retry, ``/ready`` says so). A Redis that refuses the URL's user and password, or a
user whose ACL lacks ``PING``, is a mistake in the configuration that no retry will mend: the
service stops at start with one message naming the server and the user, never the password.

Errors::

    RedisCredentialsError       Redis refused the URL's credentials (WRONGPASS, NOAUTH, NOPERM)
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.exceptions import AuthenticationError, NoPermissionError

from events.redis_io import REDIS_ERRORS

__all__ = ["RedisCredentialsError", "check_credentials"]


class RedisCredentialsError(RuntimeError):
    """Redis refused the credentials of the service's URL."""


async def check_credentials(client: Redis, service: str) -> None:
    """Raise ``RedisCredentialsError`` if Redis refuses ``client``'s user and password; any
    other failure is left to the service's loops, which retry."""
    try:
        await client.ping()
    except (AuthenticationError, NoPermissionError) as exc:
        options = client.connection_pool.connection_kwargs
        where = f"{options.get('host')}:{options.get('port')}"
        reason = str(exc).rstrip(".")
        if options.get("password") is None:
            raise RedisCredentialsError(
                f"{service}: Redis at {where} needs a user and password, and REDIS_URL gives "
                f"none (redis://USER:PASSWORD@HOST:PORT/DB); it said: {reason}"
            ) from None
        user = options.get("username") or "default"
        raise RedisCredentialsError(
            f"{service}: Redis at {where} refused user {user!r} ({reason}); "
            "check the user and password in REDIS_URL and the user's ACL"
        ) from None
    except REDIS_ERRORS:
        pass
