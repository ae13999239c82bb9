"""``ModelTokenizer`` against transformers, on real tokenizer directories in four chat styles.

The directories come from ``tests.support.chat_models`` (real templates of Llama 3.1, Qwen2.5,
Mistral v0.3 and Gemma 3 over small BPEs trained in-process). Every chat is encoded by kvmesh and
by ``AutoTokenizer.apply_chat_template`` and the ids must be equal; beside that, each test checks
something it knows on its own: the exact text of a rendered chat, where the BOS is, that every
control token is one id.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from app.chat.schemas import ChatCompletionRequest
from app.chat.tokenizer import ChatTemplateError, ModelTokenizer, TokenizerLoadError
from tests.support.chat_models import (
    CONVERSATIONS,
    PREFILLS,
    STYLES,
    WEATHER_TOOL,
    tokenizer_dir,
)

CHATS = [(style, name) for style in STYLES for name in CONVERSATIONS[style]]
BOS = {"llama3": "<|begin_of_text|>", "chatml": None, "mistral": "<s>", "gemma": "<bos>"}
GENERATION_PROMPT = {
    "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "chatml": "<|im_start|>assistant\n",
    "mistral": "[/INST]",
    "gemma": "<start_of_turn>model\n",
}
BOS_STYLES = [style for style in STYLES if BOS[style] is not None]
GEMMA_ALTERNATION = "Conversation roles must alternate user/assistant/user/assistant/..."
MISTRAL_ALTERNATION = (
    "After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant/..."
)


def _file_tokenizer(directory: Path) -> Tokenizer:
    """The directory's tokenizer.json, loaded by the tokenizers library alone."""
    return Tokenizer.from_file(str(directory / "tokenizer.json"))


def _added_tokens(directory: Path) -> dict[int, str]:
    data = json.loads((directory / "tokenizer.json").read_text())
    return {token["id"]: token["content"] for token in data["added_tokens"]}


def _token_id(directory: Path, token: str) -> int:
    found = _file_tokenizer(directory).token_to_id(token)
    assert found is not None, token
    return int(found)


def _transformers_ids(tokenizer: Any, messages: list[dict[str, Any]], **options: Any) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **options)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    return ids


# -- every chat, every style ---------------------------------------------------------------------


@pytest.mark.parametrize(("style", "name"), CHATS)
def test_a_chat_is_encoded_as_transformers_encodes_it(
    style: str,
    name: str,
    dirs: dict[str, Path],
    ours: dict[str, ModelTokenizer],
    theirs: dict[str, Any],
) -> None:
    chat = copy.deepcopy(CONVERSATIONS[style][name])
    tools = chat.get("tools")
    ids = ours[style].encode_chat(chat["messages"], tools=tools, add_generation_prompt=True)
    assert ids == _transformers_ids(
        theirs[style], chat["messages"], tools=tools, add_generation_prompt=True
    )

    text = ours[style].render_chat(chat["messages"], tools=tools, add_generation_prompt=True)
    bos = BOS[style]
    if bos is None:  # Qwen's template writes no BOS, and its tokenizer has none
        assert ids[0] == _token_id(dirs[style], "<|im_start|>")
    else:  # the template's BOS, once: encoding it added no second one
        bos_id = _token_id(dirs[style], bos)
        assert ids[0] == bos_id
        assert ids.count(bos_id) == 1
        assert text.startswith(bos)
    if style == "mistral" and name == "tool_call":  # Mistral's template has no generation prompt
        assert text.endswith("[/TOOL_RESULTS]")
    else:
        assert text.endswith(GENERATION_PROMPT[style])
    if tools:
        assert "get_weather" in text

    # every control token the template wrote is one id, and no other control id appears
    added = _added_tokens(dirs[style])
    control = re.compile("|".join(re.escape(token) for token in added.values()))
    assert [added[i] for i in ids if i in added] == control.findall(text)


SYSTEM_CHAT_TEXT = {
    "llama3": (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "You are a helpful assistant. Answer briefly.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n"
        "What is the weather like in Paris today?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "chatml": (
        "<|im_start|>system\nYou are a helpful assistant. Answer briefly.<|im_end|>\n"
        "<|im_start|>user\nWhat is the weather like in Paris today?<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    "mistral": (
        "<s>[INST] You are a helpful assistant. Answer briefly.\n\n"
        "What is the weather like in Paris today?[/INST]"
    ),
    # Gemma has no system turn: the system message opens the first user turn
    "gemma": (
        "<bos><start_of_turn>user\nYou are a helpful assistant. Answer briefly.\n\n"
        "What is the weather like in Paris today?<end_of_turn>\n<start_of_turn>model\n"
    ),
}


@pytest.mark.parametrize("style", STYLES)
def test_a_system_prompt_renders_as_the_model_family_writes_it(
    style: str, ours: dict[str, ModelTokenizer]
) -> None:
    messages = CONVERSATIONS[style]["system"]["messages"]
    assert ours[style].render_chat(messages) == SYSTEM_CHAT_TEXT[style]


TOOL_CALL_TEXT = {
    "llama3": (
        "What is the weather like in Paris today?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
        '<|start_header_id|>ipython<|end_header_id|>\n\n"Sunny, 22 degrees Celsius."<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "chatml": (
        "<|im_start|>user\nWhat is the weather like in Paris today?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nSunny, 22 degrees Celsius.\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    ),
    "mistral": (
        "[INST] What is the weather like in Paris today?[/INST]"
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, '
        '"id": "abcDEF123"}]</s>'
        '[TOOL_RESULTS] {"content": Sunny, 22 degrees Celsius., "call_id": "abcDEF123"}'
        "[/TOOL_RESULTS]"
    ),
}


@pytest.mark.parametrize("style", sorted(TOOL_CALL_TEXT))
def test_a_tool_call_and_its_result_render_in_the_family_format(
    style: str, ours: dict[str, ModelTokenizer]
) -> None:
    chat = CONVERSATIONS[style]["tool_call"]
    text = ours[style].render_chat(chat["messages"], tools=chat["tools"])
    assert text.endswith(TOOL_CALL_TEXT[style])
    assert text.count('"name": "get_weather"') == 2  # once in the tool's schema, once in the call


def test_template_variables_reach_the_template(
    ours: dict[str, ModelTokenizer], theirs: dict[str, Any]
) -> None:
    chat = CONVERSATIONS["llama3"]["tools"]
    variables = {"date_string": "01 Jan 2025", "tools_in_user_message": False}
    options: dict[str, Any] = {"tools": chat["tools"], "add_generation_prompt": True}
    text = ours["llama3"].render_chat(chat["messages"], template_kwargs=variables, **options)
    assert "Today Date: 01 Jan 2025\n\n" in text
    # with tools_in_user_message false, the tools go in the system turn, before its message
    system_turn = text.split("<|eot_id|>")[0]
    assert system_turn.endswith("\n\nYou are a helpful assistant. Answer briefly.")
    assert '"name": "get_weather"' in system_turn
    ids = ours["llama3"].encode_chat(chat["messages"], template_kwargs=variables, **options)
    assert ids == _transformers_ids(theirs["llama3"], chat["messages"], **options, **variables)


@pytest.mark.parametrize("style", ["llama3", "chatml"])
def test_an_openai_request_is_encoded_as_transformers_encodes_its_messages(
    style: str, ours: dict[str, ModelTokenizer], theirs: dict[str, Any]
) -> None:
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is the weather like"},
                        {"type": "text", "text": "in Paris today?"},
                    ],
                },
            ],
            "tools": [WEATHER_TOOL],
        }
    )
    plain = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather like\nin Paris today?"},
    ]
    ids = ours[style].encode_chat(request.template_messages(), **request.render_options())
    assert ids == _transformers_ids(
        theirs[style], plain, tools=[WEATHER_TOOL], add_generation_prompt=True
    )


# -- continuing a final assistant message --------------------------------------------------------


@pytest.mark.parametrize("style", STYLES)
def test_a_final_assistant_message_is_continued_as_transformers_continues_it(
    style: str, ours: dict[str, ModelTokenizer], theirs: dict[str, Any]
) -> None:
    messages = copy.deepcopy(PREFILLS[style])
    options: dict[str, Any] = {"add_generation_prompt": False, "continue_final_message": True}
    text = ours[style].render_chat(messages, **options)
    assert text.endswith("The weather in Paris is")  # no end of turn, no new header
    ids = ours[style].encode_chat(messages, **options)
    assert ids == _transformers_ids(theirs[style], messages, **options)
    closed = ours[style].encode_chat(messages, add_generation_prompt=False)
    assert closed[: len(ids)] == ids
    assert len(closed) > len(ids)  # the closed turn only adds its end-of-turn tokens


# -- text prompts ----------------------------------------------------------------------------------


@pytest.mark.parametrize("style", BOS_STYLES)
def test_a_text_prompt_starts_with_the_bos_the_engine_adds(
    style: str, dirs: dict[str, Path], ours: dict[str, ModelTokenizer], theirs: dict[str, Any]
) -> None:
    bos = BOS[style]
    assert bos is not None
    bos_id = _token_id(dirs[style], bos)
    ids = ours[style].encode_text("Hello world")
    assert ids == theirs[style]("Hello world")["input_ids"]
    # what kvmesh used to send (add_special_tokens=False) lacks exactly the BOS
    without = _file_tokenizer(dirs[style]).encode("Hello world", add_special_tokens=False).ids
    assert ids == [bos_id, *without]
    assert bos_id not in without


def test_a_qwen_text_prompt_has_no_bos(
    dirs: dict[str, Path], ours: dict[str, ModelTokenizer], theirs: dict[str, Any]
) -> None:
    ids = ours["chatml"].encode_text("Hello world")
    assert ids == theirs["chatml"]("Hello world")["input_ids"]
    without = _file_tokenizer(dirs["chatml"]).encode("Hello world", add_special_tokens=False).ids
    assert ids == without
    assert not set(ids) & set(_added_tokens(dirs["chatml"]))


@pytest.mark.parametrize("style", STYLES)
def test_a_bare_tokenizer_json_encodes_text_as_its_directory_but_has_no_template(
    style: str, dirs: dict[str, Path], ours: dict[str, ModelTokenizer]
) -> None:
    path = dirs[style] / "tokenizer.json"
    bare = ModelTokenizer.load(path)
    assert bare.encode_text("Hello world") == ours[style].encode_text("Hello world")
    assert bare.vocab_size == ours[style].vocab_size
    assert ours[style].has_chat_template
    assert not bare.has_chat_template
    with pytest.raises(ChatTemplateError) as refused:
        bare.render_chat([{"role": "user", "content": "Hello"}])
    assert str(refused.value) == (
        f"the tokenizer at {path} has no chat template: send a completions prompt"
    )


# -- chats a template refuses --------------------------------------------------------------------


def _two_tool_calls() -> list[dict[str, Any]]:
    chat = copy.deepcopy(CONVERSATIONS["llama3"]["tool_call"]["messages"])
    chat[1]["tool_calls"].append(copy.deepcopy(chat[1]["tool_calls"][0]))
    return chat


def _long_tool_call_id() -> list[dict[str, Any]]:
    chat = copy.deepcopy(CONVERSATIONS["mistral"]["tool_call"]["messages"])
    chat[1]["tool_calls"][0]["id"] = "call_1"
    return chat


TWO_USERS = [{"role": "user", "content": "Hello"}, {"role": "user", "content": "Are you there?"}]


@pytest.mark.parametrize(
    ("style", "messages", "message"),
    [
        ("mistral", TWO_USERS, MISTRAL_ALTERNATION),
        ("gemma", TWO_USERS, GEMMA_ALTERNATION),
        ("gemma", [{"role": "assistant", "content": "Hello"}], GEMMA_ALTERNATION),
        (
            "mistral",
            _long_tool_call_id(),
            "Tool call IDs should be alphanumeric strings with length 9!",
        ),
        ("llama3", _two_tool_calls(), "This model only supports single tool-calls at once!"),
    ],
    ids=[
        "mistral-two-users",
        "gemma-two-users",
        "gemma-assistant-first",
        "mistral-long-call-id",
        "llama3-two-calls",
    ],
)
def test_a_chat_the_template_refuses_is_a_chat_template_error_with_its_message(
    style: str, messages: list[dict[str, Any]], message: str, ours: dict[str, ModelTokenizer]
) -> None:
    with pytest.raises(ChatTemplateError) as refused:
        ours[style].encode_chat(messages)
    assert str(refused.value) == f"the chat template refused this chat: {message}"


def test_transformers_own_refusal_is_a_chat_template_error(ours: dict[str, ModelTokenizer]) -> None:
    with pytest.raises(ChatTemplateError) as refused:
        ours["chatml"].render_chat(
            PREFILLS["chatml"], add_generation_prompt=True, continue_final_message=True
        )
    assert str(refused.value).startswith(
        "the chat cannot be rendered: continue_final_message and add_generation_prompt are not "
        "compatible."
    )
    assert "\n" not in str(refused.value)


# -- what cannot be loaded -----------------------------------------------------------------------


def _missing(tmp_path: Path, llama3: Path) -> tuple[Path, str]:
    path = tmp_path / "nonexistent"
    return path, f"{path}: no such file or directory"


def _without_tokenizer_json(tmp_path: Path, llama3: Path) -> tuple[Path, str]:
    shutil.copy(llama3 / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    return tmp_path, (
        f"{tmp_path}: a tokenizer directory needs a tokenizer.json (the fast tokenizer the "
        "engines load)"
    )


def _garbage_tokenizer_json(tmp_path: Path, llama3: Path) -> tuple[Path, str]:
    shutil.copy(llama3 / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    (tmp_path / "tokenizer.json").write_text("garbage\n")
    return tmp_path, f"{tmp_path}: transformers cannot load this tokenizer directory ("


def _garbage_bare_file(tmp_path: Path, llama3: Path) -> tuple[Path, str]:
    path = tmp_path / "tokenizer.json"
    path.write_text("garbage\n")
    return path, (
        f"{path}: not a tokenizer.json the tokenizers library can load "
        "(expected value at line 1 column 1)"
    )


def _config_not_json(tmp_path: Path, llama3: Path) -> tuple[Path, str]:
    directory = tmp_path / "llama3"
    shutil.copytree(llama3, directory)
    (directory / "tokenizer_config.json").write_text('{"tokenizer_class": ')
    return directory, f"{directory / 'tokenizer_config.json'}: not JSON ("


@pytest.mark.parametrize(
    "make",
    [
        _missing,
        _without_tokenizer_json,
        _garbage_tokenizer_json,
        _garbage_bare_file,
        _config_not_json,
    ],
)
def test_what_cannot_be_loaded_is_one_line_naming_the_path(
    make: Callable[[Path, Path], tuple[Path, str]], tmp_path: Path, dirs: dict[str, Path]
) -> None:
    path, prefix = make(tmp_path, dirs["llama3"])
    with pytest.raises(TokenizerLoadError) as refused:
        ModelTokenizer.load(path)
    assert str(refused.value).startswith(prefix)
    assert "\n" not in str(refused.value)


# -- the vocabulary and the directories themselves -----------------------------------------------


@pytest.mark.parametrize("style", STYLES)
def test_vocab_size_counts_the_vocabulary_and_the_added_tokens(
    style: str, dirs: dict[str, Path], ours: dict[str, ModelTokenizer], theirs: dict[str, Any]
) -> None:
    data = json.loads((dirs[style] / "tokenizer.json").read_text())
    ids = set(data["model"]["vocab"].values()) | {t["id"] for t in data["added_tokens"]}
    assert ids == set(range(len(ids)))  # no holes: every id below the size is a token
    assert ours[style].vocab_size == len(ids)
    assert ours[style].vocab_size == len(theirs[style])


LAYOUT = {  # the control tokens' ids, as the real models number theirs
    "mistral": {"<unk>": 0, "<s>": 1, "</s>": 2, "[INST]": 3, "[/INST]": 4},
    "gemma": {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3},
}


@pytest.mark.parametrize("style", STYLES)
def test_the_directories_are_laid_out_as_the_models(
    style: str, dirs: dict[str, Path], theirs: dict[str, Any]
) -> None:
    added = _added_tokens(dirs[style])
    if style in LAYOUT:  # SentencePiece models: control tokens first, then the 256 bytes
        for token, token_id in LAYOUT[style].items():
            assert added[token_id] == token
        assert _token_id(dirs[style], "<0x00>") == len(added)
    else:  # Llama 3 and Qwen: the added tokens follow the byte-level vocabulary
        base = len(json.loads((dirs[style] / "tokenizer.json").read_text())["model"]["vocab"])
        assert sorted(added) == list(range(base, base + len(added)))
    assert theirs[style].bos_token == BOS[style]


def test_the_directories_are_the_same_bytes_on_every_build(
    tmp_path: Path, dirs: dict[str, Path]
) -> None:
    for style in STYLES:
        again = tokenizer_dir(tmp_path, style)
        for name in sorted(path.name for path in dirs[style].iterdir()):
            assert (again / name).read_bytes() == (dirs[style] / name).read_bytes(), name
