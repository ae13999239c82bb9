"""The official ``openai`` SDK against a real ``kvmesh router`` process in front of two models
(Llama-3 and ChatML/Qwen templates, built in the test) with two ``kvmesh worker`` processes
each: the model list, chat (plain and streamed with usage), text completions tokenized with the
model's BOS, an unknown model, and a conversation's second turn landing on the first turn's
worker with its blocks reused."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from app.core.embedded_redis import EmbeddedRedis
from app.core.net import free_port
from tests.support.chat_models import tokenizer_dir
from tests.support.processes import service_process, sim_worker_args, wait_ready
from tests.support.wait import wait_for

MODELS = {"llama": "llama3", "qwen": "chatml"}  # served name -> template style
TOKENS_PER_BLOCK = 16  # the tiny preset's


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: tokenizer_dir(root, style) for name, style in MODELS.items()}


@contextlib.contextmanager
def _fleet(redis_url: str, dirs: dict[str, Path]) -> Iterator[tuple[str, dict[str, str]]]:
    """Two workers per model and a router knowing both tokenizers; (router URL, worker id ->
    its model)."""
    served: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        procs: dict[str, tuple[str, subprocess.Popen[str]]] = {}
        for name, path in dirs.items():
            for i in range(2):
                worker, port = f"{name}-{i}", free_port()
                args = sim_worker_args(worker, port, redis_url, num_blocks=256, heartbeat_ttl_s=5)
                args += ["--served-model-name", name, "--tokenizer", str(path)]
                args += ["--vocab-size", "4096"]
                proc = stack.enter_context(service_process("worker", args))
                procs[worker] = (f"http://127.0.0.1:{port}", proc)
                served[worker] = name
        base = f"http://127.0.0.1:{free_port()}"
        router_args = ["--port", base.rpartition(":")[2], "--redis-url", redis_url]
        for name, path in dirs.items():
            router_args += ["--model", f"{name}={path}"]
        router = stack.enter_context(service_process("router", router_args))
        for url, proc in procs.values():
            wait_ready(url, proc)
        wait_ready(base, router)

        def all_up() -> bool:
            workers = httpx.get(f"{base}/workers").json()["workers"]
            return sorted(w["worker"] for w in workers if w["state"] == "up") == sorted(served)

        wait_for(all_up)
        yield base, served


def _ids(tokenizer: Any, chat: list[Any]) -> list[int]:
    """transformers' ids for the chat, with the generation prompt (the reference)."""
    ids = tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert isinstance(ids, list)
    return ids


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def test_the_openai_sdk_through_the_router(
    embedded_redis: EmbeddedRedis, tokenizers: dict[str, Path]
) -> None:
    hf = {name: AutoTokenizer.from_pretrained(str(path)) for name, path in tokenizers.items()}
    with (
        _fleet(embedded_redis.url, tokenizers) as (base, served),
        # Closed with the fleet: its keep-alive sockets must not outlive the router.
        openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as client,
    ):
        listed = client.models.list()
        assert [(m.id, m.object, m.owned_by) for m in listed.data] == [
            ("llama", "model", "kvmesh"),
            ("qwen", "model", "kvmesh"),
        ]
        assert [m.model_extra["workers"] for m in listed.data if m.model_extra] == [2, 2]

        # A chat: the router renders it as transformers does and sends it to a llama worker.
        turn1: list[Any] = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather like in Paris today?"},
        ]
        raw = client.chat.completions.with_raw_response.create(
            model="llama", messages=turn1, max_tokens=4
        )
        first = raw.parse()
        worker = raw.headers["x-kvmesh-worker"]
        assert served[worker] == "llama"
        ids1 = _ids(hf["llama"], turn1)
        assert first.object == "chat.completion"
        assert first.model == "llama"
        assert first.choices[0].message.role == "assistant"
        assert first.choices[0].finish_reason == "length"
        assert first.usage is not None
        assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (len(ids1), 4)
        output = first.choices[0].model_extra["token_ids"]  # type: ignore[index]
        assert len(output) == 4
        assert first.choices[0].message.content == hf["llama"].decode(
            output, skip_special_tokens=True
        )

        # The second turn: the same worker, the first turn's full blocks reused.
        turn2 = [
            *turn1,
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And tomorrow?"},
        ]
        raw = client.chat.completions.with_raw_response.create(
            model="llama", messages=turn2, max_tokens=2
        )
        second = raw.parse()
        ids2 = _ids(hf["llama"], turn2)
        assert raw.headers["x-kvmesh-worker"] == worker
        assert second.usage is not None and second.usage.prompt_tokens_details is not None
        common_blocks = _common_prefix(ids1, ids2) // TOKENS_PER_BLOCK
        assert common_blocks >= 2
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached is not None
        assert common_blocks * TOKENS_PER_BLOCK <= cached < len(ids2)

        # Streamed, with usage: the role first, then content, the finish reason, the usage.
        stream = client.chat.completions.create(
            model="qwen",
            messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == []
        assert chunks[-1].usage is not None
        qwen_ids = _ids(hf["qwen"], [{"role": "user", "content": "Tell me a story."}])
        assert chunks[-1].usage.prompt_tokens == len(qwen_ids)
        assert chunks[-1].usage.completion_tokens == 5
        assert {c.model for c in chunks} == {"qwen"}

        # A text completion is encoded with the model's special tokens (Llama-3's BOS).
        text = "The quick brown fox jumps over the lazy dog."
        completion = client.completions.create(model="llama", prompt=text, max_tokens=1)
        assert completion.usage is not None
        expected = hf["llama"](text)["input_ids"]
        assert expected[0] == hf["llama"].bos_token_id
        assert completion.usage.prompt_tokens == len(expected)

        # A model no worker serves: OpenAI's 404, model_not_found.
        with pytest.raises(openai.NotFoundError) as caught:
            client.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
            )
        assert caught.value.code == "model_not_found"
        assert caught.value.param == "model"
        assert caught.value.body == {
            "message": "The model `gpt-4o` does not exist (no worker serves it; GET /v1/models "
            "lists those that are served).",
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        }
