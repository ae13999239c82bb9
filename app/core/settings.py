"""Process settings, read from the environment (prefix ``KVMESH_``, plus ``REDIS_URL``).

Nothing here is created at import time: services build a ``Settings()`` in their entry point
and pass it down. The Redis URL is checked here, as redis-py will parse it, so that every
command taking one (flag or variable) refuses a bad one at start, in one line.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
# What events.redis_io.redis_client connects to: redis-py's own schemes, and a Redis Cluster
# named by any of its nodes (events.redis_io.CLUSTER_SCHEMES).
REDIS_SCHEMES: Final = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")


class Settings(BaseSettings):
    """Settings shared by every kvmesh process."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_", extra="ignore")

    # None means "start a private embedded redis-server" (kvmesh demo) or is an error
    # (services that need a shared Redis).
    redis_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("REDIS_URL", "KVMESH_REDIS_URL"),
    )
    # Bearer token for mutating admin calls; None disables them.
    admin_token: SecretStr | None = None
    log_level: LogLevel = "INFO"

    @field_validator("redis_url", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("redis_url")
    @classmethod
    def _redis_url_valid(cls, value: str | None) -> str | None:
        if value is not None:
            check_redis_url(value)
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_log_level(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value


def check_redis_url(url: str) -> None:
    """ValueError saying what is wrong with ``url`` as a Redis URL, checked as redis-py will
    parse it (port, database, options), so that a bad one stops a command at start, with one
    line, instead of in a service's start-up with a traceback. The URL itself is never quoted:
    it may hold a password."""
    from redis.connection import parse_url

    if not url.startswith(REDIS_SCHEMES):
        scheme, sep, _ = url.partition("://")
        given = f"starts with {scheme}://" if sep and "@" not in scheme else "has no scheme"
        expected = ", ".join(REDIS_SCHEMES[:-1]) + f" or {REDIS_SCHEMES[-1]}"
        raise ValueError(f"expected a URL starting with {expected}; this one {given}")
    parse_url(url.replace("+cluster", "", 1))  # its ValueError says what is wrong
