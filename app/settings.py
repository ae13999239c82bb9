"""Process settings, read from the environment (prefix ``KVMESH_``, plus ``REDIS_URL``).

Nothing here is created at import time: services build a ``Settings()`` in their entry point
and pass it down.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


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

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_log_level(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value
