"""Chats and text through the router (in-process, with in-process workers and a real Redis):
``/route`` places a chat by transformers' ids on the worker that served it, a model without a
tokenizer at the router is placed by load only and says so, models are checked (404
``model_not_found``, 400 when several are served and none is named), and bad chats are a 400
naming the field (413 for a body over the limit)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import jinja2
import pytest
from transformers import AutoTokenizer

from app.router.runtime import RouterRuntime
from tests.app.router_support import router_client, router_settings
from tests.app.worker_support import worker_client, worker_settings
from tests.support.chat_models import tokenizer_dir
from tests.support.wait import eventually

CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Tell me a short story about a dragon."},
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {style: tokenizer_dir(root, style) for style in ("llama3", "chatml", "mistral")}


def _worker(redis_url: str, worker: str, model: str, path: Path) -> Any:
    return worker_client(
        worker_settings(
            redis_url,
            worker_id=worker,
            served_model_name=model,
            tokenizer=str(path),
            vocab_size=4096,
        )
    )


@contextlib.asynccontextmanager
async def _cluster(
    redis_url: str, llama: Path, **router: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, RouterRuntime, httpx.AsyncClient]]:
    """w0 and w1 serve "llama"; w0 has answered CHAT once."""
    async with (
        _worker(redis_url, "w0", "llama", llama) as (w0, _),
        _worker(redis_url, "w1", "llama", llama) as (_, _),
        router_client(router_settings(redis_url, **router)) as (client, runtime),
    ):
        answer = await w0.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})
        assert answer.status_code == 200
        await eventually(lambda: sorted(runtime.core.workers) == ["w0", "w1"])
        await eventually(lambda: runtime.index.stats()["per_worker"].get("w0", {}).get("blocks"))
        await eventually(lambda: runtime.readiness()["ready"])
        # both up, not only one (ready): a worker whose first load report is not read yet is
        # stale, and GET /v1/models counts the workers that are up
        await eventually(lambda: [v.state for v in runtime.core.workers.values()] == ["up"] * 2)
        yield client, runtime, w0


async def test_a_chat_is_placed_by_the_engines_ids(
    clean_redis_url: str, dirs: dict[str, Path]
) -> None:
    llama = dirs["llama3"]
    ids = AutoTokenizer.from_pretrained(str(llama)).apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    async with _cluster(clean_redis_url, llama, models=[f"llama={llama}"]) as (router, _, _):
        body = (await router.post("/route", json={"model": "llama", "messages": CHAT})).json()
        assert (body["worker"], body["model"], body["tokenized"], body["note"]) == (
            "w0",
            "llama",
            True,
            None,
        )
        assert body["num_tokens"] == len(ids)
        assert body["expected_cached_tokens"] == min(len(ids) // 16 * 16, len(ids) - 1)
        # No model named: the only one served.
        same = (await router.post("/route/explain", json={"messages": CHAT})).json()
        assert (same["worker"], same["num_tokens"]) == ("w0", len(ids))
        assert [(w["worker"], w["model"], w["session"]) for w in same["workers"]] == [
            ("w0", "llama", False),
            ("w1", "llama", False),
        ]
        # A model nobody serves.
        missing = await router.post("/route", json={"model": "gpt-4o", "prompt": "hi"})
        assert missing.status_code == 404
        assert missing.json()["error"] == {
            "message": "The model `gpt-4o` does not exist (no worker serves it; GET /v1/models "
            "lists those that are served).",
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        }
        models = (await router.get("/v1/models")).json()
        assert models["object"] == "list"
        assert [(m["id"], m["owned_by"], m["workers"]) for m in models["data"]] == [
            ("llama", "kvmesh", 2)
        ]


async def test_without_a_tokenizer_the_router_places_by_load_and_says_so(
    clean_redis_url: str, dirs: dict[str, Path]
) -> None:
    async with _cluster(clean_redis_url, dirs["llama3"]) as (router, _, _):
        for body in ({"prompt": "Tell me a story"}, {"messages": CHAT}):
            answer = await router.post("/route/explain", json=body)
            assert answer.status_code == 200, answer.text
            routed = answer.json()
            assert (routed["tokenized"], routed["num_blocks"]) == (False, 0)
            assert routed["note"] == (
                "routed by load only: the router has no tokenizer for model 'llama' "
                "(--model NAME=DIR or --tokenizer), so it cannot tell which worker holds its "
                "prefix"
            )
            assert [w["matched_blocks"] for w in routed["workers"]] == [0, 0]


async def test_several_models_need_a_name(clean_redis_url: str, dirs: dict[str, Path]) -> None:
    async with (
        _cluster(clean_redis_url, dirs["llama3"]) as (router, runtime, _),
        _worker(clean_redis_url, "q0", "qwen", dirs["chatml"]) as (_, _),
    ):
        await eventually(lambda: "q0" in runtime.core.workers)
        answer = await router.post("/route", json={"prompt": [1, 2, 3]})
        assert answer.status_code == 400
        assert answer.json()["error"]["message"] == (
            "model: this router serves several models (llama, qwen); name one"
        )
        placed = (await router.post("/route", json={"model": "qwen", "prompt": [1, 2, 3]})).json()
        assert placed["worker"] == "q0"


async def test_bad_chats_through_the_router(clean_redis_url: str, dirs: dict[str, Path]) -> None:
    mistral = dirs["mistral"]
    twice = [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]
    with pytest.raises(jinja2.TemplateError) as raised:
        AutoTokenizer.from_pretrained(str(mistral)).apply_chat_template(twice, tokenize=False)
    theirs = AutoTokenizer.from_pretrained(str(mistral))
    long_chat = [{"role": "user", "content": "Tell me a story. " * 20}]
    rendered = theirs.apply_chat_template(long_chat, add_generation_prompt=True, tokenize=False)
    chat_ids = theirs(rendered, add_special_tokens=False)["input_ids"]
    long_text = "Once upon a time " * 20
    text_ids = theirs(long_text)["input_ids"]
    assert min(len(chat_ids), len(text_ids)) > 64
    settings = {"models": [f"llama={mistral}"], "max_body_bytes": 1 << 20, "max_prompt_tokens": 64}
    async with _cluster(clean_redis_url, dirs["llama3"], **settings) as (router, runtime, _):
        # over the router's max_prompt_tokens once encoded as the engine encodes them
        over = await router.post("/v1/chat/completions", json={"messages": long_chat})
        assert over.status_code == 400, over.text
        assert over.json()["error"]["message"] == (
            f"messages: {len(chat_ids)} tokens; the router takes at most 64"
        )
        over = await router.post("/v1/completions", json={"prompt": long_text, "max_tokens": 1})
        assert over.status_code == 400, over.text
        assert over.json()["error"]["message"] == (
            f"prompt: {len(text_ids)} tokens; the router takes at most 64"
        )
        assert over.json()["error"]["param"] == "prompt"
        cases: list[tuple[dict[str, Any], str | None, str]] = [
            (
                {"messages": twice},
                "messages",
                f"messages: the chat template refused this chat: {raised.value}",
            ),
            (
                {"messages": CHAT, "n": 3},
                "n",
                "n: kvmesh generates one choice per request; send n = 1",
            ),
            ({"messages": [{"role": "bot", "content": "x"}]}, "messages.0.role", ""),
            ({"messages": "hello"}, "messages", "messages: Input should be a valid list"),
        ]
        for body, param, message in cases:
            answer = await router.post("/v1/chat/completions", json=body)
            assert answer.status_code == 400, (body, answer.text)
            error = answer.json()["error"]
            assert error["param"] == param
            if message:
                assert error["message"] == message
        # A 5 MB message is over the body limit: 413, and nothing was counted in flight.
        huge = {"messages": [{"role": "user", "content": "x" * (5 << 20)}]}
        answer = await router.post("/v1/chat/completions", json=huge)
        assert answer.status_code == 413
        assert runtime.core.inflight == {}
