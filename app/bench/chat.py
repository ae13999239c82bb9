"""The chat case of ``kvmesh bench router``: what a chat request costs the router before it can
choose, stage by stage, next to a token-id request's decision.

The model is the demo's (``app/demo/chat-model``: a byte-level BPE with a ChatML template, as
Qwen2.5's), loaded as the router loads any model (``app.chat.ModelTokenizer``). The
conversation: a system prompt and alternating user and assistant turns of seeded English-like
sentences, grown until the rendered prompt is at least 4,096 tokens. Timed per request, each
stage in its own pass over ``NUM_SAMPLES`` copies (new dicts each time, as a request brings):
``chat_render_*`` (the template, through transformers' ``apply_chat_template``),
``chat_tokenize_*`` (the rendered text encoded), ``chat_hash_*`` (``core.hashes``),
``chat_decide_*`` (``core.decide`` on the bench's index and loads), and ``chat_total_*`` (all
four, as the router does them).
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from app.chat import ModelTokenizer
from app.router.core import RouterCore

__all__ = ["conversation", "measure_chat"]

DEMO_MODEL = Path(__file__).resolve().parents[1] / "demo" / "chat-model"
TARGET_TOKENS = 4_096
NUM_SAMPLES = 200
_WORDS = (
    *("the", "a", "cache", "router", "worker", "block", "prefix", "token", "model", "request"),
    *("answer", "story", "dragon", "city", "weather", "morning", "river", "mountain", "engine"),
    *("memory", "quickly", "slowly", "bright", "quiet", "garden", "reads", "writes", "finds"),
    *("keeps", "sends", "holds", "asks", "tells", "brings", "shows"),
)


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 14))]
    return " ".join(words).capitalize() + "."


def conversation(tokenizer: ModelTokenizer, target: int = TARGET_TOKENS) -> list[dict[str, str]]:
    """A seeded chat whose rendered prompt (with the generation prompt) is at least ``target``
    tokens."""
    rng = random.Random(7)
    chat = [{"role": "system", "content": "You are a helpful assistant. " + _sentence(rng)}]
    while True:
        for role in ("user", "assistant"):
            text = " ".join(_sentence(rng) for _ in range(rng.randint(2, 6)))
            chat.append({"role": role, "content": text})
        chat.append({"role": "user", "content": _sentence(rng)})
        if len(tokenizer.encode_chat(chat)) >= target:
            return chat
        chat.pop()


def _p50_p99(samples: list[int]) -> tuple[float, float]:
    ordered = sorted(samples)
    return (
        round(ordered[len(ordered) // 2] / 1e3, 2),
        round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] / 1e3, 2),
    )


def measure_chat(core: RouterCore, num_samples: int = NUM_SAMPLES) -> dict[str, Any]:
    tokenizer = ModelTokenizer.load(DEMO_MODEL)
    chat = conversation(tokenizer)
    requests = [[dict(m) for m in chat] for _ in range(num_samples)]
    text = tokenizer.render_chat(chat)
    ids = tokenizer.encode_chat(chat)
    hashes = core.hashes(ids)
    clock = time.perf_counter_ns
    stages: dict[str, list[int]] = {
        name: [] for name in ("render", "tokenize", "hash", "decide", "total")
    }
    for request in requests[:10]:  # warm-up
        core.decide(core.hashes(tokenizer.encode_chat(request)), len(ids))
    for request in requests:
        start = clock()
        tokenizer.render_chat(request)
        stages["render"].append(clock() - start)
        start = clock()
        tokenizer.encode_rendered(text)
        stages["tokenize"].append(clock() - start)
        start = clock()
        core.hashes(ids)
        stages["hash"].append(clock() - start)
        start = clock()
        core.decide(hashes, len(ids))
        stages["decide"].append(clock() - start)
        start = clock()
        tokens = tokenizer.encode_chat(request)
        core.decide(core.hashes(tokens), len(tokens))
        stages["total"].append(clock() - start)
    out: dict[str, Any] = {
        "chat_prompt_tokens": len(ids),
        "chat_messages": len(chat),
        "chat_chars": len(text),
    }
    for name, samples in stages.items():
        out[f"chat_{name}_p50_us"], out[f"chat_{name}_p99_us"] = _p50_p99(samples)
    return out
