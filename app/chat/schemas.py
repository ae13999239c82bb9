"""OpenAI's chat completion request, as kvmesh takes it (router and worker alike).

What the official ``openai`` SDK sends is accepted: ``messages`` with the system, developer,
user, assistant and tool roles, string content or the list-of-parts form for text,
``tool_calls`` on assistant turns, ``max_tokens`` / ``max_completion_tokens``, ``stream`` and
``stream_options.include_usage``, ``stop``, ``user``, ``tools`` / ``tool_choice``, sampling
fields, plus vLLM's ``chat_template_kwargs``, ``add_generation_prompt`` and
``continue_final_message``. Fields not listed go to a foreign engine untouched.

What kvmesh cannot honour is refused, naming the field, never silently ignored: ``n`` above 1,
``logprobs`` / ``top_logprobs``, and content parts other than text (images, audio, files).

Text parts of one message are joined with newlines into one string before rendering, and a tool
call's ``arguments`` string is parsed into the object chat templates expect, as vLLM does.
"""

from __future__ import annotations

import contextlib
import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "ContentPart",
    "StreamOptions",
    "template_tools",
]

MAX_U64 = (1 << 64) - 1
Role = Literal["system", "developer", "user", "assistant", "tool"]


class ContentPart(BaseModel):
    """One part of a message's content; kvmesh takes text parts."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


def _text_parts(value: object) -> object:
    """A message's content: a string, a list of text parts, or null; anything else is
    refused with the part that is wrong (images and audio: kvmesh serves text)."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of content parts")
    for i, part in enumerate(value):
        if not isinstance(part, dict):
            raise ValueError(f"part {i}: must be an object with a type")
        kind = part.get("type")
        if kind != "text":
            raise ValueError(
                f"part {i}: content parts of type {kind!r} are not supported: send text"
            )
        if not isinstance(part.get("text"), str):
            raise ValueError(f'part {i}: a "text" part needs its "text" as a string')
    return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Role
    content: Annotated[str | list[ContentPart] | None, BeforeValidator(_text_parts)] = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template reads it (fields left out when unset): text parts
        joined, and a tool call's ``arguments`` (a JSON string in OpenAI's API) as the object
        templates expect, as vLLM passes them."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "\n".join(part.text for part in self.content)
        if not out.get("tool_calls"):
            out.pop("tool_calls", None)  # an empty list is no call (vLLM drops it too)
        for call in out.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                continue
            arguments = function.get("arguments")
            if not arguments:
                function["arguments"] = {}
            elif isinstance(arguments, str):
                # not JSON (or nested past the parser's depth): the template gets the string
                with contextlib.suppress(ValueError, RecursionError):
                    function["arguments"] = json.loads(arguments)
        return out


# apply_chat_template's own parameters: a client must not swap the model's template (the
# router's ids would no longer be the engine's; vLLM refuses it too) nor steer the call.
RESERVED_TEMPLATE_KWARGS = frozenset(
    (
        "chat_template",
        "tokenize",
        "conversation",
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "padding",
        "truncation",
        "max_length",
        "sanitize_control_tokens",
    )
)


def template_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools as vLLM hands them to the template (its pydantic models dumped): ``type`` and
    ``function`` first, the function's ``name``, ``description`` and ``parameters`` in that
    order and present (null when the client left them out), other keys after. Templates
    print tools with ``tojson`` or iterate their items, so order and nulls are in the ids."""
    if tools is None:
        return None
    out: list[dict[str, Any]] = []
    for tool in tools:
        function = tool.get("function")
        if not isinstance(function, dict):
            out.append(dict(tool))
            continue
        rest = {k: v for k, v in function.items() if k not in ("name", "description", "parameters")}
        shaped = {
            "name": function.get("name"),
            "description": function.get("description"),
            "parameters": function.get("parameters"),
            **rest,
        }
        others = {k: v for k, v in tool.items() if k not in ("type", "function")}
        out.append({"type": tool.get("type", "function"), "function": shaped, **others})
    return out


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """OpenAI's ``POST /v1/chat/completions`` request; see the module docstring."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="the model (optional when one is served)")
    messages: list[ChatMessage] = Field(min_length=1, description="the conversation so far")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate (deprecated name)")
    max_completion_tokens: int | None = Field(None, ge=1, description="tokens to generate")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    user: str | None = Field(None, description="the end user; also the session for routing")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    n: int = Field(1, ge=1, description="choices to generate: kvmesh generates 1")
    logprobs: bool = Field(False, description="not supported: false only")
    top_logprobs: int | None = Field(None, description="not supported")
    tools: list[dict[str, Any]] | None = Field(None, description="passed to the chat template")
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extra variables for the chat template (vLLM's field)"
    )
    add_generation_prompt: bool = Field(True, description="end with the assistant's header")
    continue_final_message: bool = Field(
        False, description="continue the last (assistant) message instead of starting one"
    )
    # kvmesh's own
    request_id: str | None = Field(None, min_length=1, max_length=128)
    priority: int = Field(0, ge=-1_000_000, le=1_000_000)
    lora_task_id: int | None = Field(None, ge=0, le=MAX_U64)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    prompt_token_ids: list[int] | None = Field(
        None, description="kvmesh: the rendered prompt's ids, as the router made them"
    )

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("kvmesh generates one choice per request; send n = 1")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool) -> bool:
        if value:
            raise ValueError("not supported; leave it out or send false")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, value: int | None) -> int | None:
        if value is not None:
            raise ValueError("not supported; leave it out")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(set(value or ()) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(
                f"{', '.join(reserved)}: not a template variable a client may set (the model's "
                "template and the request's own fields decide these)"
            )
        return value

    @model_validator(mode="after")
    def _one_ending(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            if "add_generation_prompt" in self.model_fields_set:
                raise ValueError(
                    "continue_final_message and add_generation_prompt cannot both be true"
                )
            self.add_generation_prompt = False  # continuing means no new header, as in vLLM
        return self

    @property
    def completion_tokens(self) -> int:
        """Tokens to generate: ``max_completion_tokens``, else ``max_tokens``, else 16."""
        return self.max_completion_tokens or self.max_tokens or 16

    def template_messages(self) -> list[dict[str, Any]]:
        return [message.for_template() for message in self.messages]

    def render_options(self) -> dict[str, Any]:
        """``ModelTokenizer.encode_chat``'s options for this request."""
        return {
            "tools": template_tools(self.tools),
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "template_kwargs": self.chat_template_kwargs,
        }
