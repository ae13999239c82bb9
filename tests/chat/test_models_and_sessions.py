"""The router's core with several models and sessions: a request goes only to its model's
workers (and those that named none), and kv_aware prefers a session's last worker by the
documented fraction of the prompt, without overriding a loaded worker."""

from __future__ import annotations

import pytest

from app.router.core import MAX_SESSIONS, NoWorkerError, RouterCore
from app.router.policies import Weights
from events.index import PrefixIndex

TPB = 16
PROMPT = list(range(1_000, 1_320))  # 320 tokens, 20 full blocks


def _core() -> RouterCore:
    core = RouterCore(PrefixIndex(), tokens_per_block=TPB)
    for worker, model in (("a0", "llama"), ("a1", "llama"), ("b0", "qwen"), ("x", None)):
        core.upsert_worker(worker, url=f"http://{worker}", capacity_blocks=1_000, model=model)
        core.set_load(worker, {"free_blocks_0": 1_000, "used_blocks_0": 0})
    return core


def test_requests_go_to_their_models_workers() -> None:
    core = _core()
    hashes = core.hashes(PROMPT)
    llama = core.decide(hashes, len(PROMPT), model="llama")
    assert [c.worker for c in llama.costs] == ["a0", "a1", "x"]
    qwen = core.decide(hashes, len(PROMPT), model="qwen")
    assert [c.worker for c in qwen.costs] == ["b0", "x"]
    anyone = core.decide(hashes, len(PROMPT))
    assert [c.worker for c in anyone.costs] == ["a0", "a1", "b0", "x"]
    assert core.models() == {"llama": ["a0", "a1"], "qwen": ["b0"]}
    assert (core.serves("llama"), core.serves("mistral")) == (True, True)  # x takes any
    core.remove_worker("x")
    assert core.serves("mistral") is False
    with pytest.raises(NoWorkerError, match=r"^no worker serving 'mistral' is up$"):
        core.decide(hashes, len(PROMPT), model="mistral")


def test_a_session_prefers_its_last_worker_softly() -> None:
    core = _core()
    hashes = core.hashes(PROMPT)
    plain = core.decide(hashes, len(PROMPT), model="llama")
    assert [(c.worker, c.cost, c.affinity) for c in plain.costs] == [
        ("a0", 320.0, 0.0),
        ("a1", 320.0, 0.0),
        ("x", 320.0, 0.0),
    ]
    # The session's first request went to a1 (as if a tie-break had chosen it).
    chosen = core.decide(hashes, len(PROMPT), model="llama", exclude=("a0", "x"))
    core.begin("r1", chosen, [], len(PROMPT), session="agent-7")
    core.finish("r1")
    assert core.sessions == {"agent-7": "a1"}

    # Its next request, before any event: a1 by 0.1 of the prompt (32 tokens).
    again = core.decide(hashes, len(PROMPT), model="llama", session="agent-7")
    assert again.worker == "a1"
    assert [(c.worker, c.cost, c.affinity) for c in again.costs] == [
        ("a0", 320.0, 0.0),
        ("a1", 288.0, 32.0),
        ("x", 320.0, 0.0),
    ]
    # A loaded a1 (0.1 x 400 queued prefill tokens = 40 > 32) loses it: the term is soft.
    core.set_load("a1", {"free_blocks_0": 1_000, "used_blocks_0": 0})
    core.workers["a1"].inflight_prefill_tokens = 400
    core.workers["a1"].changed()
    loaded = core.decide(hashes, len(PROMPT), model="llama", session="agent-7")
    assert loaded.worker != "a1"
    assert loaded.cost_of("a1").cost == 320.0 + 40.0 - 32.0
    # Weight 0 turns it off.
    off = core.decide(
        hashes, len(PROMPT), model="llama", session="agent-7", weights=Weights(session=0.0)
    )
    assert off.cost_of("a1").affinity == 0.0


def test_sessions_are_bounded() -> None:
    core = _core()
    decision = core.decide([], 10, model="qwen")
    for i in range(MAX_SESSIONS + 2):
        core.begin(f"r{i}", decision, [], 10, session=f"s{i}")
        core.finish(f"r{i}")
    assert len(core.sessions) == MAX_SESSIONS
    assert next(iter(core.sessions)) == "s2"


def test_tools_and_tool_calls_reach_the_template_as_vllm_hands_them() -> None:
    from app.chat import ChatMessage
    from app.chat.schemas import template_tools

    tools = [{"function": {"parameters": {"type": "object"}, "name": "now", "strict": True}}]
    assert template_tools(tools) == [
        {
            "type": "function",
            "function": {
                "name": "now",
                "description": None,
                "parameters": {"type": "object"},
                "strict": True,
            },
        }
    ]
    assert template_tools([]) == []
    assert template_tools(None) is None
    call = {"id": "c1", "type": "function", "function": {"name": "now", "arguments": ""}}
    parsed = {"id": "c2", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    message = ChatMessage.model_validate(
        {"role": "assistant", "content": None, "tool_calls": [call, parsed]}
    )
    assert message.for_template()["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "now", "arguments": {}}},
        {"id": "c2", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
    ]
    empty = ChatMessage.model_validate({"role": "assistant", "content": "x", "tool_calls": []})
    assert empty.for_template() == {"role": "assistant", "content": "x"}
