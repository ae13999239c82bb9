from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from app.core.settings import Settings
from app.router.settings import RouterSettings


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


def test_an_empty_redis_url_means_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVMESH_REDIS_URL", raising=False)
    monkeypatch.setenv("REDIS_URL", "")
    assert Settings().redis_url is None


@pytest.mark.parametrize(
    "url",
    [
        "redis://localhost:6379/0",
        "rediss://user:pw@redis:6380/1?ssl_ca_certs=ca.crt",
        "unix:///run/redis.sock?db=2",
        "redis+cluster://node-1:7000",
        "rediss+cluster://node-1:7000",
    ],
)
def test_every_scheme_the_clients_take_is_accepted(url: str) -> None:
    assert Settings(redis_url=url).redis_url == url


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (
            "localhost:6379",
            "expected a URL starting with redis://, rediss://, unix://, redis+cluster:// or "
            "rediss+cluster://; this one has no scheme",
        ),
        (
            "http://user:s3cret@redis:6379",
            "expected a URL starting with redis://, rediss://, unix://, redis+cluster:// or "
            "rediss+cluster://; this one starts with http://",
        ),
        ("redis://redis:port/0", "Port could not be cast to integer value as 'port'"),
        ("redis+cluster://node-1:70000", "Port out of range 0-65535"),
        (
            "redis://redis:6379/0?socket_timeout=soon",
            "Invalid value for 'socket_timeout' in connection URL.",
        ),
    ],
)
def test_a_bad_redis_url_is_refused_saying_why(url: str, message: str) -> None:
    with pytest.raises(ValidationError) as exc_info:
        Settings(redis_url=url)
    [error] = exc_info.value.errors()
    assert error["msg"] == f"Value error, {message}"
    assert "s3cret" not in str(exc_info.value.errors(include_input=False))


@pytest.mark.parametrize("name", ["load_weight", "decode_weight", "temperature", "session_weight"])
def test_a_weight_flag_past_the_bound_is_refused_by_its_name(name: str) -> None:
    """The router's weight flags carry ``Weights``' bound in their schema, so the error names
    the flag (``--decode-weight``), not the weight, and ``--help`` and ``docs/api.md`` show it."""
    with pytest.raises(ValidationError) as exc_info:
        RouterSettings.model_validate({"redis_url": "redis://localhost:6379/0", name: 1e10})
    [error] = exc_info.value.errors()
    assert (error["loc"], error["type"]) == ((name,), "less_than_equal")
    settings = {"redis_url": "redis://localhost:6379/0", name: 1e9}
    assert getattr(RouterSettings.model_validate(settings), name) == 1e9


def test_a_tokenizer_that_loads_is_kept_as_its_path(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    path = tmp_path / "tokenizer.json"
    Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(path))
    settings = RouterSettings.model_validate(
        {"redis_url": "redis://localhost:6379/0", "tokenizer": str(path)}
    )
    assert settings.tokenizer == str(path)


def test_an_empty_tokenizer_means_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_TOKENIZER", "")
    settings = RouterSettings.model_validate({"redis_url": "redis://localhost:6379/0"})
    assert settings.tokenizer is None
