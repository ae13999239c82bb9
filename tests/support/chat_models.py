"""Small but real Hugging Face tokenizer directories, in four chat styles, built in-process.

A cache-aware router must tokenize a chat exactly as the engine serving the model does: same
template, same special tokens, same BOS. ``app.chat.tokenizer.ModelTokenizer`` does it by loading
the model's own tokenizer directory with transformers, and the tests prove it by comparing its ids
with ``transformers.AutoTokenizer(...).apply_chat_template`` on the same directory. Those tests
need tokenizer directories, and no test may download a model, so this module writes them:

* ``tokenizer.json``: a BPE trained here by the ``tokenizers`` library on a few dozen English
  sentences written below (deterministic: the same bytes on every build), laid out as the model
  family's own: byte-level BPE with the GPT-4-style split regex of Llama 3 / Qwen2.5 (their
  special tokens after the vocabulary), or SentencePiece-style BPE with ``\u2581`` spaces and
  byte fallback for Mistral / Gemma (their control tokens first, then the 256 byte tokens);
* BOS as the real models: Llama 3, Mistral and Gemma add theirs when a text is encoded with
  ``add_special_tokens=True`` (a ``TemplateProcessing`` post-processor); Qwen (ChatML) adds none;
* ``tokenizer_config.json`` (``tokenizer_class: PreTrainedTokenizerFast``, the model's BOS / EOS /
  PAD, ``model_max_length``) and ``special_tokens_map.json``;
* the chat template: the real public template of each family, copied verbatim (each constant
  below says where from): Llama-3.1-Instruct, Qwen2.5-Instruct, Mistral-7B-Instruct-v0.3 and
  Gemma-3-it. It goes in ``tokenizer_config.json``, except Gemma's, written as
  ``chat_template.jinja`` (the newer layout), so both ways of shipping a template are covered.

``tokenizer_dir(root, style)`` writes one directory; ``CONVERSATIONS`` holds the chats the tests
render in each style (plain dicts, as an OpenAI request's ``messages`` and ``tools``), and
``PREFILLS`` a chat ending in a partial assistant message, for ``continue_final_message``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

__all__ = [
    "CONVERSATIONS",
    "PREFILLS",
    "STYLES",
    "WEATHER_TOOL",
    "tokenizer_dir",
]

STYLES = ("llama3", "chatml", "mistral", "gemma")

# -- the chat templates, verbatim --------------------------------------------------------------

# meta-llama/Llama-3.1-8B-Instruct, tokenizer_config.json "chat_template" (Hugging Face Hub; the
# Llama 3.1 Community License). Copied from huggingface/huggingface.js (MIT) at fe42e680,
# packages/jinja/test/e2e.test.js, entry "meta-llama/Llama-3.1-8B-Instruct".
LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""  # noqa: E501

# Qwen/Qwen2.5-7B-Instruct, tokenizer_config.json "chat_template" (Hugging Face Hub; Apache-2.0).
# Copied from huggingface/huggingface.js (MIT) at fe42e680, packages/jinja/test/e2e.test.js,
# entry "Qwen/Qwen2.5-7B-Instruct".
CHATML_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""  # noqa: E501

# mistralai/Mistral-7B-Instruct-v0.3, tokenizer_config.json "chat_template", its current revision
# (Hugging Face Hub; Apache-2.0): the one that checks role alternation skipping tool turns and
# requires 9-character tool call ids. huggingface/huggingface.js (MIT),
# packages/jinja/test/e2e.test.js, carries the earlier revision ("mistralai/Mistral-7B-Instruct-v0.3
# (JSON Schema)") and the sibling "mistralai/Mistral-Nemo-Instruct-2407"; this text was taken from
# verbatim copies of the current revision in public code (the GGUF metadata of
# lmstudio-community/Mistral-7B-Instruct-v0.3-GGUF) and checked line by line against that Nemo
# template, from which it differs only in spacing ("[INST] ", "[TOOL_CALLS] [", ...), in the
# alternation check and in the tool-call test.
MISTRAL_TEMPLATE = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""  # noqa: E501

# google/gemma-3-270m-it, chat template (Hugging Face Hub; Gemma Terms of Use): the Gemma 3
# instruct template, system message folded into the first user turn. Copied from
# huggingface/huggingface.js (MIT) at fe42e680, packages/ollama-utils/src/chat-template-automap.ts,
# entry "library/gemma3:270m" (the template in that model's GGUF metadata). Its string literals
# hold real newlines where other copies write "\n": the rendered text is the same.
GEMMA_TEMPLATE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '

' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '

' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '
' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>
' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model
'}}
{%- endif -%}
"""

# -- the training text ---------------------------------------------------------------------------

_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "A cache-aware router sends each request to the worker that already holds its prefix.",
    "What is the weather like in Paris today?",
    "It is sunny in Paris, with a light wind and a temperature of twenty two degrees.",
    "The weather in London is cloudy, and it may rain in the evening.",
    "Tokyo, Berlin, Madrid and Rome are large cities with old centres and busy stations.",
    "Please call the function get_weather with the city you want to know about.",
    "You are a helpful assistant. Answer briefly and politely.",
    "Hello world! How are you doing this morning?",
    "I am doing well, thank you. How can I help you today?",
    "Can you tell me a short story about a dragon who learned to bake bread?",
    "Once upon a time, a small dragon lived in a quiet village near the mountains.",
    "Every morning the dragon lit the oven with one careful breath of fire.",
    "The villagers came early, because the bread was warm and the crust was golden.",
    "Large language models read tokens, not words, and every token has a number.",
    "The key value cache keeps the attention keys and values of tokens already seen.",
    "When two requests share a long system prompt, the engine can reuse those blocks.",
    "A block is a fixed number of tokens, and its hash depends on every token before it.",
    "If the router hashes different tokens than the engine, its view of the cache is wrong.",
    "Tools are described as JSON schemas with a name, a description and parameters.",
    "The assistant answered with a tool call, and the tool returned its result.",
    "Temperatures are given in degrees Celsius unless the user asks for Fahrenheit.",
    "Numbers like 1, 22, 333, 4096 and 65536 appear in logs, configs and prompts.",
    "She said: 'Don't forget the umbrella; it'll rain later.' He didn't listen.",
    "We're sure they've seen it, and you'd agree that I'm right about the plan.",
    "Lists can be short: apples, pears, plums, cherries and grapes.",
    "Questions end with a question mark? Statements end with a full stop.",
    "The user asked a second question after the assistant replied to the first one.",
    "Multi-turn chats alternate between the user and the assistant.",
    "The system message sets the tone, the rules and the persona of the assistant.",
    "Good evening! The museum opens at nine and closes at six on weekdays.",
    "Write a haiku about autumn leaves falling on a quiet river.",
    "Red leaves drift slowly, the river carries them home, the evening is still.",
    "Translate 'good morning' into French: bonjour. Into Spanish: buenos dias.",
    "The train to Lyon leaves from platform four at half past ten.",
    "Save the file, run the tests, and read the report before you commit.",
    "Error messages should say what went wrong and what to do about it.",
    "The router keeps an index of which worker holds which blocks of the cache.",
    "A prompt of one thousand tokens fills many blocks of sixteen or thirty two tokens.",
    "Thank you for your help, that was exactly what I needed to know.",
)

# -- the four styles -------------------------------------------------------------------------------

# The split regex of Llama 3's tokenizer.json (tiktoken cl100k-style: up to three digits a piece);
# Qwen2.5's is the same with one digit a piece.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPACE = "\u2581"  # SentencePiece's visible space


@dataclass(frozen=True)
class _Style:
    """One family's tokenizer layout and configuration."""

    special: tuple[str, ...]  # special tokens, in id order
    plain_added: tuple[str, ...]  # added tokens that are not special (Qwen's <tool_call>)
    bos: str | None  # added by the post-processor when encoding with special tokens
    eos: str
    pad: str | None
    unk: str | None
    template: str
    template_file: bool  # chat_template.jinja rather than tokenizer_config.json's key
    model_max_length: int
    byte_level: bool  # byte-level BPE (Llama 3, Qwen) or SentencePiece-style BPE (Mistral, Gemma)
    split_regex: str = ""  # byte-level only
    prefix_space: bool = False  # SentencePiece-style only: a leading space before the text


_STYLES: dict[str, _Style] = {
    "llama3": _Style(
        special=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eom_id|>",
            "<|eot_id|>",
            "<|python_tag|>",
        ),
        plain_added=(),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad=None,
        unk=None,
        template=LLAMA3_TEMPLATE,
        template_file=False,
        model_max_length=131072,
        byte_level=True,
        split_regex=_LLAMA3_SPLIT,
    ),
    "chatml": _Style(
        special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        plain_added=("<tool_call>", "</tool_call>"),
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        unk=None,
        template=CHATML_TEMPLATE,
        template_file=False,
        model_max_length=131072,
        byte_level=True,
        split_regex=_QWEN2_SPLIT,
    ),
    "mistral": _Style(
        special=(
            "<unk>",
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ),
        plain_added=(),
        bos="<s>",
        eos="</s>",
        pad=None,
        unk="<unk>",
        template=MISTRAL_TEMPLATE,
        template_file=False,
        model_max_length=32768,
        byte_level=False,
        prefix_space=True,
    ),
    "gemma": _Style(
        special=("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
        plain_added=(),
        bos="<bos>",
        eos="<eos>",
        pad="<pad>",
        unk="<unk>",
        template=GEMMA_TEMPLATE,
        template_file=True,
        model_max_length=32768,
        byte_level=False,
        prefix_space=False,
    ),
}


def _special(content: str) -> AddedToken:
    return AddedToken(content, special=True, normalized=False)


def _byte_level_bpe(style: _Style, vocab_size: int) -> Tokenizer:
    """Llama 3 / Qwen2.5: byte-level BPE after a regex split; added tokens after the vocab."""
    tokenizer = Tokenizer(models.BPE(ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(style.split_regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    tokenizer.add_special_tokens([_special(token) for token in style.special])
    if style.plain_added:
        tokenizer.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t in style.plain_added]
        )
    if style.bos is not None:
        bos_id = tokenizer.token_to_id(style.bos)
        tokenizer.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{style.bos} $A",
                    pair=f"{style.bos} $A {style.bos}:1 $B:1",
                    special_tokens=[(style.bos, bos_id)],
                ),
            ]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _sentencepiece_bpe(style: _Style) -> Tokenizer:
    """Mistral / Gemma: SentencePiece-style BPE (``\u2581`` for spaces, byte fallback), the
    control tokens first, then the 256 byte tokens, then the learnt pieces."""
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPACE, prepend_scheme="first" if style.prefix_space else "never"
    )
    learner.train_from_iterator(
        _CORPUS, trainer=trainers.BpeTrainer(vocab_size=400, min_frequency=2, show_progress=False)
    )
    learnt = json.loads(learner.to_str())["model"]
    pieces = sorted(learnt["vocab"].items(), key=lambda item: item[1])
    vocab: dict[str, int] = {}
    for token in (*style.special, *(f"<0x{byte:02X}>" for byte in range(256))):
        vocab[token] = len(vocab)
    for piece, _ in pieces:
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(merge) for merge in learnt["merges"]]
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab, merges=merges, unk_token=style.unk, fuse_unk=True, byte_fallback=True
        )
    )
    if style.prefix_space:  # Mistral: a Metaspace pre-tokenizer over the whole text
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_SPACE, prepend_scheme="first", split=False
        )
        tokenizer.decoder = decoders.Sequence(
            [
                decoders.Replace(_SPACE, " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:  # Gemma: spaces replaced by the normalizer, no pre-tokenizer
        tokenizer.normalizer = normalizers.Replace(" ", _SPACE)
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        )
    tokenizer.add_special_tokens([_special(token) for token in style.special])
    assert style.bos is not None
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{style.bos} $A",
        pair=f"{style.bos} $A {style.bos}:1 $B:1",
        special_tokens=[(style.bos, vocab[style.bos])],
    )
    return tokenizer


def _config(style: _Style) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": style.bos,
        "eos_token": style.eos,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": style.model_max_length,
    }
    if style.pad is not None:
        config["pad_token"] = style.pad
    if style.unk is not None:
        config["unk_token"] = style.unk
    if not style.template_file:
        config["chat_template"] = style.template
    return config


def _special_tokens_map(style: _Style) -> dict[str, str]:
    named = {"bos_token": style.bos, "eos_token": style.eos, "pad_token": style.pad}
    named["unk_token"] = style.unk
    return {key: value for key, value in named.items() if value is not None}


def tokenizer_dir(root: Path, style: str, *, vocab_size: int = 640) -> Path:
    """Write ``root/style`` (tokenizer.json, tokenizer_config.json, special_tokens_map.json and,
    for Gemma, chat_template.jinja) and return it. ``vocab_size`` caps a byte-level BPE's
    trained vocabulary (the demo's model, ``app/demo/chat-model``, fits the tiny preset's 512
    ids with its added tokens)."""
    spec = _STYLES[style]
    where = root / style
    where.mkdir(parents=True, exist_ok=True)
    tokenizer = _byte_level_bpe(spec, vocab_size) if spec.byte_level else _sentencepiece_bpe(spec)
    tokenizer.save(str(where / "tokenizer.json"))
    (where / "tokenizer_config.json").write_text(json.dumps(_config(spec), indent=2) + "\n")
    (where / "special_tokens_map.json").write_text(
        json.dumps(_special_tokens_map(spec), indent=2) + "\n"
    )
    if spec.template_file:
        (where / "chat_template.jinja").write_text(spec.template)
    return where


# -- the chats -------------------------------------------------------------------------------------

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Paris"},
            },
            "required": ["city"],
        },
    },
}

_SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
_ASK = {"role": "user", "content": "What is the weather like in Paris today?"}
_MULTI_TURN = [
    {"role": "user", "content": "Hello world! How are you doing this morning?"},
    {"role": "assistant", "content": "I am doing well, thank you. How can I help you today?"},
    {"role": "user", "content": "Can you tell me a short story about a dragon?"},
]


def _tool_call_chat(call_id: str) -> dict[str, Any]:
    return {
        "messages": [
            _ASK,
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "content": "Sunny, 22 degrees Celsius."},
        ],
        "tools": [WEATHER_TOOL],
    }


def _chats(call_id: str | None) -> dict[str, dict[str, Any]]:
    chats: dict[str, dict[str, Any]] = {
        "system": {"messages": [_SYSTEM, _ASK]},
        "multi_turn": {"messages": list(_MULTI_TURN)},
    }
    if call_id is not None:  # the style's template supports tools
        chats["tools"] = {"messages": [_SYSTEM, _ASK], "tools": [WEATHER_TOOL]}
        chats["tool_call"] = _tool_call_chat(call_id)
    return chats


# Per style, the chats the tests render: name -> {"messages": [...], "tools": [...] (optional)}.
# Gemma's template folds the system message into the first user turn and knows no tools; Mistral's
# wants tool call ids of exactly nine letters and digits.
CONVERSATIONS: dict[str, dict[str, dict[str, Any]]] = {
    "llama3": _chats("call_1"),
    "chatml": _chats("call_1"),
    "mistral": _chats("abcDEF123"),
    "gemma": _chats(None),
}

# A chat ending with a partial assistant message, to continue (``continue_final_message``).
PREFILLS: dict[str, list[dict[str, Any]]] = {
    style: [_ASK, {"role": "assistant", "content": "The weather in Paris is"}] for style in STYLES
}
