"""The chat case of ``kvmesh bench router``: what a chat request costs the router before it can
choose, stage by stage, as a conversation grows turn by turn.

The model is the demo's (``app/demo/chat-model``: a byte-level BPE with a ChatML template, as
Qwen2.5's), loaded as the router loads any model (``app.chat.ModelTokenizer``, its piece cache
at the default bound). The traffic: ``NUM_CONVERSATIONS`` seeded conversations (a system prompt,
then user turns of 1-3 English-like sentences and assistant replies of 2-6), each request what a
client sends: the previous request's messages, the assistant's reply and a new user turn. The
router sees them interleaved (one turn of every conversation, then the next). The requests
before a conversation reaches ``TARGET_TOKENS`` are sent untimed (the router saw those turns);
its next ``NUM_MEASURED`` requests are timed, so each timed request finds the conversation's
earlier turns in the cache and encodes its new reply and user turn. ``conversation`` is the
first conversation's first timed request.

Timed per request, in one pass as the router does them: ``chat_render_*`` (the template,
``render_chat``), ``chat_tokenize_*`` (the rendered text, ``encode_rendered_words``: the
piece cache), ``chat_hash_*`` (``core.hash_array`` and its list), ``chat_decide_*``
(``core.decide`` on the bench's index and loads), ``chat_render_tokenize_*`` and
``chat_total_*`` (the sums): as the router does them. Then the same requests cold, as before
the cache: ``chat_cold_render_*`` (transformers' ``apply_chat_template``),
``chat_cold_tokenize_*`` (the whole text encoded) and ``chat_cold_render_tokenize_*``. Every
request's ids are checked against the cold ones. Also: the timed requests' prompt tokens,
``chat_encoded_chars_p50`` (characters the tokenizer encoded per timed request),
``chat_prefix_hit_ratio`` (timed requests that started from their conversation's remembered
prefix) and ``chat_piece_hit_ratio`` (pieces of the rest found in the cache).
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from app.chat import ModelTokenizer
from app.router.core import RouterCore

__all__ = ["conversation", "conversation_requests", "measure_chat"]

DEMO_MODEL = Path(__file__).resolve().parents[1] / "demo" / "chat-model"
TARGET_TOKENS = 4_096
NUM_CONVERSATIONS = 40
NUM_MEASURED = 5  # per conversation: 200 timed requests
SEED = 7
_WORDS = (
    *("the", "a", "cache", "router", "worker", "block", "prefix", "token", "model", "request"),
    *("answer", "story", "dragon", "city", "weather", "morning", "river", "mountain", "engine"),
    *("memory", "quickly", "slowly", "bright", "quiet", "garden", "reads", "writes", "finds"),
    *("keeps", "sends", "holds", "asks", "tells", "brings", "shows"),
)

Messages = list[dict[str, str]]


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 14))]
    return " ".join(words).capitalize() + "."


def _text(rng: random.Random, low: int, high: int) -> str:
    return " ".join(_sentence(rng) for _ in range(rng.randint(low, high)))


def conversation_requests(
    tokenizer: ModelTokenizer,
    seed: int = SEED,
    target: int = TARGET_TOKENS,
    num_after: int = NUM_MEASURED,
) -> tuple[list[Messages], int]:
    """A seeded conversation's requests, each the previous one + the reply + a new user turn,
    until ``num_after`` of them have rendered prompts (with the generation prompt) of at least
    ``target`` tokens; and the index of the first of those."""
    rng = random.Random(seed)
    messages = [
        {"role": "system", "content": "You are a helpful assistant. " + _sentence(rng)},
        {"role": "user", "content": _text(rng, 1, 3)},
    ]
    requests: list[Messages] = []
    first = -1
    while first < 0 or len(requests) < first + num_after:
        requests.append([dict(m) for m in messages])
        if first < 0 and len(tokenizer.encode_chat(messages)) >= target:
            first = len(requests) - 1
        messages.append({"role": "assistant", "content": _text(rng, 2, 6)})
        messages.append({"role": "user", "content": _text(rng, 1, 3)})
    return requests, first


def conversation(tokenizer: ModelTokenizer, target: int = TARGET_TOKENS) -> Messages:
    """The first conversation at its first request of at least ``target`` tokens."""
    requests, first = conversation_requests(tokenizer, SEED, target, 1)
    return requests[first]


def _p50_p99(samples: list[int]) -> tuple[float, float]:
    ordered = sorted(samples)
    return (
        round(ordered[len(ordered) // 2] / 1e3, 2),
        round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] / 1e3, 2),
    )


def _interleaved(
    conversations: list[tuple[list[Messages], int]],
) -> list[tuple[Messages, bool]]:
    """Every request, one turn of each conversation at a time; True for the timed ones."""
    out: list[tuple[Messages, bool]] = []
    for turn in range(max(len(requests) for requests, _ in conversations)):
        for requests, first in conversations:
            if turn < len(requests):
                out.append((requests[turn], first <= turn < first + NUM_MEASURED))
    return out


def measure_chat(core: RouterCore, num_conversations: int = NUM_CONVERSATIONS) -> dict[str, Any]:
    reference = ModelTokenizer.load(DEMO_MODEL, cache_tokens=0)  # whole texts, no cache
    conversations = [conversation_requests(reference, SEED + n) for n in range(num_conversations)]
    traffic = _interleaved(conversations)
    timed = [request for request, measured in traffic if measured]
    expected = [reference.encode_chat(request) for request in timed]
    tokenizer = ModelTokenizer.load(DEMO_MODEL)
    clock = time.perf_counter_ns
    names = ("render", "tokenize", "hash", "decide", "render_tokenize", "total")
    stages: dict[str, list[int]] = {name: [] for name in names}
    encoded_chars: list[int] = []
    hits = misses = prefix_hits = 0
    got: list[list[int]] = []
    for request, measured in traffic:
        if not measured:
            untimed = tokenizer.encode_chat_words(request)
            core.decide(core.hashes(untimed), len(untimed))
            continue
        before = tokenizer.piece_cache
        t0 = clock()
        text = tokenizer.render_chat(request)
        t1 = clock()
        ids = tokenizer.encode_rendered_words(text)
        t2 = clock()
        array = core.hash_array(ids)
        hashes = array.tolist()
        t3 = clock()
        core.decide(hashes, len(ids), hash_array=array)
        t4 = clock()
        after = tokenizer.piece_cache
        assert before is not None and after is not None  # the demo model is separable
        spans = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t2 - t0, t4 - t0)
        for name, span in zip(names, spans, strict=True):
            stages[name].append(span)
        encoded_chars.append(after.encoded_chars - before.encoded_chars)
        hits += after.hits - before.hits
        misses += after.misses - before.misses
        prefix_hits += after.prefix_hits - before.prefix_hits
        got.append(ids.tolist())
    if got != expected:
        raise AssertionError("the cached encoding differs from the whole text's")
    cold: dict[str, list[int]] = {"render": [], "tokenize": [], "render_tokenize": []}
    for request in timed:
        t0 = clock()
        text = reference.render_chat(request, reference=True)
        t1 = clock()
        reference.encode_whole(text)
        t2 = clock()
        cold["render"].append(t1 - t0)
        cold["tokenize"].append(t2 - t1)
        cold["render_tokenize"].append(t2 - t0)
    first = conversation(reference)
    lengths = sorted(len(ids) for ids in expected)
    out: dict[str, Any] = {
        "chat_prompt_tokens": len(reference.encode_chat(first)),
        "chat_messages": len(first),
        "chat_chars": len(reference.render_chat(first)),
        "chat_requests": len(timed),
        "chat_conversations": num_conversations,
        "chat_prompt_tokens_min": lengths[0],
        "chat_prompt_tokens_p50": lengths[len(lengths) // 2],
        "chat_prompt_tokens_max": lengths[-1],
        "chat_encoded_chars_p50": sorted(encoded_chars)[len(encoded_chars) // 2],
        "chat_prefix_hit_ratio": round(prefix_hits / len(timed), 3),
        "chat_piece_hit_ratio": round(hits / (hits + misses), 3),
    }
    for name, samples in stages.items():
        out[f"chat_{name}_p50_us"], out[f"chat_{name}_p99_us"] = _p50_p99(samples)
    for name, samples in cold.items():
        out[f"chat_cold_{name}_p50_us"], out[f"chat_cold_{name}_p99_us"] = _p50_p99(samples)
    return out
