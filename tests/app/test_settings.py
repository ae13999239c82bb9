from __future__ import annotations

import pytest

from app.settings import Settings


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("REDIS_URL", "KVMESH_REDIS_URL", "KVMESH_ADMIN_TOKEN", "KVMESH_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    settings = Settings()
    assert settings.redis_url is None
    assert settings.admin_token is None
    assert settings.log_level == "INFO"


def test_read_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://redis:6379/0")
    monkeypatch.setenv("KVMESH_ADMIN_TOKEN", "s3cret")
    monkeypatch.setenv("KVMESH_LOG_LEVEL", "debug")
    settings = Settings()
    assert settings.redis_url == "redis://redis:6379/0"
    assert settings.admin_token is not None
    assert settings.admin_token.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(settings)
    assert settings.log_level == "DEBUG"


def test_prefixed_redis_url_also_works(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setenv("KVMESH_REDIS_URL", "redis://other:6379/1")
    assert Settings().redis_url == "redis://other:6379/1"


def test_bad_log_level_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_LOG_LEVEL", "LOUD")
    with pytest.raises(ValueError, match="log_level"):
        Settings()
