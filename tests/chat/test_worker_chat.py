"""``POST /v1/chat/completions`` and text prompts on a worker with a tokenizer (in-process, real
Redis): the prompt is transformers' ids, the answer OpenAI's shape (plain, stop strings,
streamed), and what cannot be served is a 400 naming the field. Start-up checks of
``--tokenizer`` and ``--served-model-name``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import orjson
import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from app.worker.settings import WorkerSettings
from tests.app.worker_support import worker_client, worker_settings
from tests.support.chat_models import tokenizer_dir

CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Tell me a short story about a dragon."},
]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenizer_dir(tmp_path_factory.mktemp("models"), "llama3")


def _settings(redis_url: str, path: Path | None, **overrides: Any) -> WorkerSettings:
    extra: dict[str, Any] = {"vocab_size": 4096, "served_model_name": "llama"}
    if path is not None:
        extra["tokenizer"] = str(path)
    return worker_settings(redis_url, **extra, **overrides)


def _events(body: bytes) -> list[Any]:
    lines = [line.removeprefix(b"data: ") for line in body.split(b"\n\n") if line]
    assert lines[-1] == b"[DONE]"
    return [orjson.loads(line) for line in lines[:-1]]


async def test_chat_on_a_worker_is_transformers_ids_and_openais_shape(
    clean_redis_url: str, llama: Path
) -> None:
    hf = AutoTokenizer.from_pretrained(str(llama))
    ids = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    async with worker_client(_settings(clean_redis_url, llama)) as (client, runtime):
        answer = await client.post(
            "/v1/chat/completions", json={"model": "llama", "messages": CHAT, "max_tokens": 6}
        )
        assert answer.status_code == 200, answer.text
        body = answer.json()
        output = body["choices"][0]["token_ids"]
        assert body["object"] == "chat.completion"
        assert body["id"].startswith("chatcmpl-")
        assert body["model"] == "llama"
        assert body["choices"][0]["message"] == {
            "role": "assistant",
            "content": hf.decode(output, skip_special_tokens=True),
        }
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"] == {
            "prompt_tokens": len(ids),
            "completion_tokens": 6,
            "total_tokens": len(ids) + 6,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        # The engine saw exactly those ids: the second time, every full block is reused.
        again = (
            await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})
        ).json()
        # (every token but the last: full blocks, and the last one's prefix, copied)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1

        # The registry entry names the served model and the preset.
        raw = await runtime.redis.hget("kvmesh:workers", "w0")
        assert raw is not None
        entry = json.loads(raw)
        assert (entry["model"], entry["preset"]) == ("llama", "tiny")

        # A text prompt is encoded as the engine does: with the BOS.
        text = (await client.post("/v1/completions", json={"prompt": "Hello world"})).json()
        assert text["usage"]["prompt_tokens"] == len(hf("Hello world")["input_ids"])
        assert hf("Hello world")["input_ids"][0] == hf.bos_token_id


async def test_stop_strings_and_the_stream(clean_redis_url: str, llama: Path) -> None:
    async with worker_client(_settings(clean_redis_url, llama)) as (client, _):
        request = {"messages": CHAT, "max_tokens": 12}
        plain = (await client.post("/v1/chat/completions", json=request)).json()
        content = plain["choices"][0]["message"]["content"]
        assert len(content) > 6

        # The stream carries the same text: the role first, deltas, the finish, the usage.
        streamed = await client.post(
            "/v1/chat/completions",
            json={**request, "stream": True, "stream_options": {"include_usage": True}},
        )
        assert streamed.headers["content-type"].startswith("text/event-stream")
        chunks = _events(streamed.content)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
        deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]]
        assert "".join(deltas) == content
        assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
        assert chunks[-1]["choices"] == []
        # (the same usage, but for the prompt it now finds cached: all of it but the last token)
        cached = {"prompt_tokens_details": {"cached_tokens": plain["usage"]["prompt_tokens"] - 1}}
        assert chunks[-1]["usage"] == {**plain["usage"], **cached}

        # A stop string ends the answer where it first appears, plain and streamed.
        stop = content[3:6]
        cut = content[: content.index(stop)]
        stopped = (await client.post("/v1/chat/completions", json={**request, "stop": stop})).json()
        assert stopped["choices"][0]["message"]["content"] == cut
        assert stopped["choices"][0]["finish_reason"] == "stop"
        # The job ended at the stop: fewer than max_tokens generated, all of them reported.
        generated = stopped["choices"][0]["token_ids"]
        assert stopped["usage"]["completion_tokens"] == len(generated) < 12
        assert content.startswith(AutoTokenizer.from_pretrained(str(llama)).decode(generated[:-1]))
        streamed = await client.post(
            "/v1/chat/completions", json={**request, "stop": [stop], "stream": True}
        )
        chunks = _events(streamed.content)
        deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks]
        assert "".join(deltas) == cut
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {"messages": []},
            "messages",
            "messages: List should have at least 1 item after validation, not 0",
        ),
        ({"messages": [{"content": "hi"}]}, "messages.0.role", "messages.0.role: Field required"),
        (
            {"messages": [{"role": "wizard", "content": "hi"}]},
            "messages.0.role",
            "messages.0.role: Input should be 'system', 'developer', 'user', 'assistant' or 'tool'",
        ),
        (
            {"messages": [{"role": "user", "content": 7}]},
            "messages.0.content",
            "messages.0.content: must be a string or a list of content parts",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content",
            "messages.0.content: part 0: content parts of type 'image_url' are not supported: "
            "send text",
        ),
        (
            {"messages": CHAT, "n": 2},
            "n",
            "n: kvmesh generates one choice per request; send n = 1",
        ),
        (
            {"messages": CHAT, "logprobs": True},
            "logprobs",
            "logprobs: not supported; leave it out or send false",
        ),
        (
            {"messages": CHAT, "add_generation_prompt": True, "continue_final_message": True},
            None,
            "continue_final_message and add_generation_prompt cannot both be true",
        ),
        (
            {"messages": CHAT, "max_tokens": 5000},
            "max_tokens",
            None,
        ),
    ],
)
async def test_bad_chats_are_400_naming_the_field(
    clean_redis_url: str, llama: Path, body: dict[str, Any], param: str | None, message: str | None
) -> None:
    async with worker_client(_settings(clean_redis_url, llama)) as (client, _):
        answer = await client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    if message is not None:
        assert error["message"] == message


async def test_a_template_that_raises_is_a_400_with_its_message(
    clean_redis_url: str, tmp_path: Path
) -> None:
    mistral = tokenizer_dir(tmp_path, "mistral")
    twice = [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]
    with pytest.raises(jinja2.TemplateError) as raised:
        AutoTokenizer.from_pretrained(str(mistral)).apply_chat_template(twice, tokenize=False)
    async with worker_client(_settings(clean_redis_url, mistral)) as (client, _):
        answer = await client.post("/v1/chat/completions", json={"messages": twice})
    assert answer.status_code == 400
    assert answer.json()["error"] == {
        "message": f"messages: the chat template refused this chat: {raised.value}",
        "type": "invalid_request_error",
        "param": "messages",
        "code": None,
    }


async def test_a_worker_takes_the_routers_ids_and_without_a_tokenizer_no_chat(
    clean_redis_url: str, llama: Path
) -> None:
    ids = list(range(40, 90))
    with_ids = {"messages": CHAT, "prompt_token_ids": ids, "max_tokens": 2}
    async with worker_client(_settings(clean_redis_url, None)) as (client, _):
        for body in ({"messages": CHAT}, with_ids):
            refused = await client.post("/v1/chat/completions", json=body)
            assert refused.status_code == 400
            assert refused.json()["error"]["message"] == (
                "messages: this worker has no tokenizer (--tokenizer DIR) to serve a chat with"
            )
    async with worker_client(_settings(clean_redis_url, llama)) as (client, _):
        taken = await client.post("/v1/chat/completions", json=with_ids)
        assert taken.status_code == 200
        assert taken.json()["usage"]["prompt_tokens"] == 50  # the router's ids, not a render


def test_a_tokenizer_the_model_cannot_embed_is_refused_at_start(
    clean_redis_url: str, llama: Path
) -> None:
    vocab = AutoTokenizer.from_pretrained(str(llama)).backend_tokenizer.get_vocab_size(True)
    with pytest.raises(ValidationError) as caught:
        worker_settings(clean_redis_url, tokenizer=str(llama))  # the tiny preset: 512 ids
    assert caught.value.errors()[0]["msg"] == (
        f"Value error, tokenizer: {llama} has {vocab} tokens, the model's vocabulary is 512 "
        "(give --vocab-size or the model's preset)"
    )
    with pytest.raises(ValidationError) as caught:
        worker_settings(clean_redis_url, tokenizer=str(llama / "missing"))
    assert caught.value.errors()[0]["msg"] == (
        f"Value error, tokenizer: {llama / 'missing'}: no such file or directory"
    )


@pytest.mark.parametrize(
    "body",
    [
        {"chat_template_kwargs": {"chat_template": "{{ 1 // 0 }}"}},
        {"chat_template_kwargs": {"tokenize": True}},
    ],
)
async def test_a_client_cannot_swap_the_template(
    clean_redis_url: str, llama: Path, body: dict[str, Any]
) -> None:
    async with worker_client(_settings(clean_redis_url, llama)) as (client, _):
        answer = await client.post("/v1/chat/completions", json={"messages": CHAT, **body})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "chat_template_kwargs"
    reserved = next(iter(body["chat_template_kwargs"]))
    assert error["message"] == (
        f"chat_template_kwargs: {reserved}: not a template variable a client may set (the "
        "model's template and the request's own fields decide these)"
    )


async def test_input_a_template_cannot_take_is_a_400_not_a_500(
    clean_redis_url: str, llama: Path
) -> None:
    deep = "[" * 50_000 + "]" * 50_000  # past the JSON parser's depth, and the template's
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}
    nested: dict[str, Any] = {}
    for _ in range(700):
        nested = {"a": nested}
    tool = {"type": "function", "function": {"name": "f", "parameters": nested}}
    async with worker_client(_settings(clean_redis_url, llama)) as (client, _):
        for body in (
            {"messages": [*CHAT, {"role": "assistant", "tool_calls": [call]}]},
            {"messages": CHAT, "tools": [tool]},
        ):
            answer = await client.post("/v1/chat/completions", json=body)
            assert answer.status_code == 400, answer.text[:300]
            assert answer.json()["error"]["param"] == "messages"


async def test_completions_on_a_worker_with_a_tokenizer_carry_their_text(
    clean_redis_url: str, llama: Path
) -> None:
    """``/v1/completions``: ``text`` is the output decoded (plain, fast path or not, and
    streamed, the chunks' texts adding up to it); without a tokenizer it stays empty."""
    theirs = AutoTokenizer.from_pretrained(str(llama), local_files_only=True)
    async with worker_client(_settings(clean_redis_url, llama)) as (client, _):
        for prompt in ("The weather in Paris", [5, 6, 7, 8]):  # text (FastAPI), ids (fast path)
            request = {"prompt": prompt, "max_tokens": 16}
            plain = (await client.post("/v1/completions", json=request)).json()["choices"][0]
            assert plain["text"] == theirs.decode(plain["token_ids"], skip_special_tokens=True)
            assert len(plain["text"]) > 8
            streamed = await client.post("/v1/completions", json={**request, "stream": True})
            chunks = _events(streamed.content)
            ids = [i for c in chunks for i in c["choices"][0]["token_ids"]]
            assert ids == plain["token_ids"]  # the sim's output is a function of the prompt
            assert "".join(c["choices"][0]["text"] for c in chunks) == plain["text"]
    async with worker_client(_settings(clean_redis_url, None)) as (client, _):
        bare = await client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 4})
        assert bare.json()["choices"][0]["text"] == ""
