"""An engine behind ``kvmesh ingest`` (here a TensorRT-LLM stand-in: a real HTTP server on a
loopback port) gets the client's body as it came, less kvmesh's ``routing``: it tokenizes the
prompt itself, and the router's own ids only placed it. Its registry entry names its model
(``--served-model-name``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.ingest.trtllm import TrtllmIngest
from tests.app.router_support import router_client, router_settings
from tests.support.chat_models import tokenizer_dir
from tests.support.json_server import JsonServer
from tests.support.wait import eventually

CREATED = {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [8, 0]}}
ANSWER = {
    "id": "chatcmpl-engine",
    "object": "chat.completion",
    "created": 1,
    "model": "llama",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10},
}


class Engine(JsonServer):
    """Answers ``POST /kv_cache_events`` with one ``created`` event, then none, and any other
    ``POST`` with ``ANSWER``."""

    def __init__(self) -> None:
        self.events = [[CREATED]]
        super().__init__(self._answer)

    def _answer(self, path: str, body: Any) -> tuple[int, Any]:
        if path == "/kv_cache_events":
            return 200, self.events.pop(0) if self.events else []
        return 200, ANSWER

    @property
    def bodies(self) -> list[tuple[str, Any]]:
        """What the engine got, but the event polls."""
        return [(path, body) for path, body in self.requests if path != "/kv_cache_events"]


@pytest.fixture
def engine() -> Iterator[Engine]:
    with Engine().running() as server:
        yield server


async def test_an_ingested_engine_gets_the_clients_body(
    clean_redis_url: str, engine: Engine, tmp_path: Path
) -> None:
    llama = tokenizer_dir(tmp_path, "llama3")
    ingest = TrtllmIngest(
        engine.url, "e0", clean_redis_url, tokens_per_block=16, model="llama", poll_interval_s=0.02
    )
    settings = router_settings(clean_redis_url, models=[f"llama={llama}"])
    async with ingest, router_client(settings) as (router, runtime):
        await ingest.run(max_polls=2)
        await eventually(lambda: "e0" in runtime.core.workers)
        view = runtime.core.workers["e0"]
        assert (view.model, view.foreign, view.url) == ("llama", True, engine.url)

        chat = {
            "model": "llama",
            "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 3,
            "top_k": 5,  # a field kvmesh does not know: the engine's business
            "routing": {"policy": "least_loaded"},
        }
        answer = await router.post("/v1/chat/completions", json=chat)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-kvmesh-worker"] == "e0"
        assert answer.json() == ANSWER
        text = {"model": "llama", "prompt": "Hello there", "max_tokens": 2}
        assert (await router.post("/v1/completions", json=text)).status_code == 200
    sent = {k: v for k, v in chat.items() if k != "routing"}
    assert engine.bodies == [("/v1/chat/completions", sent), ("/v1/completions", text)]
