"""``ChatRenderer`` (``ModelTokenizer.render_chat``) against transformers' ``apply_chat_template``:
the same text, to the character, on every template of ``tests.support.chat_models``, every chat,
both endings, and the inputs the fast path treats on its own (values that are not strings, None,
reasoning fields, template variables, dict methods and missing keys read by a template)."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from app.chat.render import ChatRenderer
from app.chat.schemas import ChatCompletionRequest
from app.chat.tokenizer import ChatTemplateError, ModelTokenizer
from tests.support.chat_models import CONVERSATIONS, PREFILLS, STYLES, WEATHER_TOOL

CHATS = [(style, name) for style in STYLES for name in CONVERSATIONS[style]]


def _transformers_text(tokenizer: Any, messages: list[Any], **options: Any) -> str:
    text = tokenizer.apply_chat_template(copy.deepcopy(messages), tokenize=False, **options)
    assert isinstance(text, str)
    return text


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize(("style", "name"), CHATS)
def test_every_chat_renders_as_apply_chat_template(
    style: str,
    name: str,
    add_generation_prompt: bool,
    ours: dict[str, ModelTokenizer],
    theirs: dict[str, Any],
) -> None:
    chat = CONVERSATIONS[style][name]
    options: dict[str, Any] = {"tools": chat.get("tools")}
    options["add_generation_prompt"] = add_generation_prompt
    text = ours[style].render_chat(copy.deepcopy(chat["messages"]), **options)
    assert text == _transformers_text(theirs[style], chat["messages"], **options)
    assert text == ours[style].render_chat(chat["messages"], reference=True, **options)


@pytest.mark.parametrize("style", STYLES)
def test_a_continued_final_message_renders_as_apply_chat_template(
    style: str, ours: dict[str, ModelTokenizer], theirs: dict[str, Any]
) -> None:
    options: dict[str, Any] = {"add_generation_prompt": False, "continue_final_message": True}
    text = ours[style].render_chat(copy.deepcopy(PREFILLS[style]), **options)
    assert text == _transformers_text(theirs[style], PREFILLS[style], **options)
    assert text.endswith("The weather in Paris is")


class _Text(str):
    """A ``str`` subclass (as an enum or a numpy string is): the template must see a plain str."""


class _Message(Mapping[str, Any]):
    """A message that is a Mapping but not a dict."""

    def __init__(self, **fields: Any) -> None:
        self._fields = fields

    def __getitem__(self, key: str) -> Any:
        return self._fields[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)


def _unusual_messages() -> list[Any]:
    return [
        {"role": "system", "content": _Text("You are a helpful assistant."), "name": None},
        _Message(role="user", content="What is the weather like in Paris today?"),
        {
            "role": "assistant",
            "content": None,  # dropped, as transformers drops it
            "reasoning": "The user wants the weather.",  # aliased to reasoning_content
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "n": 2}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 22 degrees Celsius."},
        {"role": "user", "content": "Thanks! And in Zürich? 東京? 🌦"},
    ]


@pytest.mark.parametrize("style", ["llama3", "chatml"])
def test_values_that_are_not_strings_none_and_reasoning_render_as_transformers(
    style: str, ours: dict[str, ModelTokenizer], theirs: dict[str, Any]
) -> None:
    messages = _unusual_messages()
    options: dict[str, Any] = {"tools": [WEATHER_TOOL], "add_generation_prompt": True}
    text = ours[style].render_chat(messages, **options)
    assert text == _transformers_text(theirs[style], [dict(m) for m in messages], **options)
    assert "Zürich? 東京? 🌦" in text
    assert "None" not in text
    assert type(messages[0]["content"]) is _Text  # the caller's messages are not changed
    assert messages[2]["content"] is None


def test_an_openai_request_renders_as_transformers(
    ours: dict[str, ModelTokenizer], theirs: dict[str, Any]
) -> None:
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Nice"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "Rain."},
            ],
            "tools": [WEATHER_TOOL],
        }
    )
    messages = request.template_messages()
    options = request.render_options()
    text = ours["chatml"].render_chat(messages, **options)
    del options["template_kwargs"]
    assert text == _transformers_text(theirs["chatml"], messages, **options)
    assert '{"name": "get_weather", "arguments": {"city": "Nice"}}' in text


# A template that reads a message every way a template can: attribute and item, a dict method,
# a key the message lacks, a value that is not a string, and the tokenizer's special tokens.
PROBE_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "[{{ message.role }}|{{ message['role'] }}|{{ message.items() | list | length }}"
    "|{{ message.get('name', 'anon') }}|{{ message.name is defined }}|{{ message.missing }}"
    "|{{ message.keys() | list | join(',') }}|{{ message.meta.tags | join('+') if message.meta }}"
    "|{{ message.content }}]{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _with_template(tmp_path: Path, chatml: Path, template: str) -> ModelTokenizer:
    directory = tmp_path / "probe"
    shutil.copytree(chatml, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return ModelTokenizer.load(directory)


def test_a_template_reading_messages_every_way_renders_as_transformers(
    tmp_path: Path, dirs: dict[str, Path]
) -> None:
    probe = _with_template(tmp_path, dirs["chatml"], PROBE_TEMPLATE)
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "probe"), local_files_only=True)
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Hi", "name": "ann", "meta": {"tags": ["a", "b"]}},
        {"role": "assistant", "content": "Hello", "name": None},
    ]
    text = probe.render_chat(messages)
    assert text == _transformers_text(hf, messages, add_generation_prompt=True)
    assert text == (
        "[user|user|4|ann|True||role,content,name,meta|a+b|Hi]<|im_end|>\n"
        "[assistant|assistant|2|anon|False||role,content||Hello]<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_a_local_dict_is_read_inline_and_everything_else_through_the_sandbox() -> None:
    """What the fast template is compiled to: ``message.role`` on a loop's message as an
    inline lookup, a dict method, an attribute of an attribute and a context variable as the
    sandbox's calls (``test_a_template_reading_messages_every_way...`` renders them alike)."""
    source = ChatRenderer._compile_fast(PROBE_TEMPLATE).environment.compile(
        PROBE_TEMPLATE, raw=True
    )
    inline = "(l_1_message['role'] if type(l_1_message) is dict and 'role' in l_1_message else "
    assert inline + "environment.getattr(l_1_message, 'role'))" in source
    assert "environment.getattr(l_1_message, 'items')" in source
    assert "'items' in l_1_message" not in source
    assert "environment.getattr(" + inline.replace("role", "meta") in source  # .meta.tags
    assert source.count(" is dict and ") == 6  # role, name, missing, meta twice, content


def test_a_dict_method_that_changes_the_message_is_refused_as_by_transformers(
    tmp_path: Path, dirs: dict[str, Path]
) -> None:
    probe = _with_template(tmp_path, dirs["chatml"], "{{ messages[0].pop('role') }}")
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "probe"), local_files_only=True)
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(Exception) as theirs_refused:
        hf.apply_chat_template(messages, tokenize=False)
    with pytest.raises(ChatTemplateError) as refused:
        probe.render_chat(messages)
    assert str(refused.value) == f"the chat template refused this chat: {theirs_refused.value}"
    assert "unsafe" in str(refused.value)
    assert messages == [{"role": "user", "content": "Hi"}]


def test_services_and_the_command_line_start_without_importing_transformers() -> None:
    """transformers (0.6-0.9 s to import) comes with the first tokenizer loaded, not before:
    ``kvmesh --help`` and a worker or router serving no chat model never pay for it."""
    code = (
        "import sys, app.cli, app.router.app, app.worker.app, app.chat; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, "[]\n"), done.stderr
