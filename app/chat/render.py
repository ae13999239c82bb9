"""``ChatRenderer``: a chat rendered by its model's template exactly as transformers'
``apply_chat_template(..., tokenize=False)`` renders it, in about a third of the time.

What ``apply_chat_template`` costs beside the template itself, and what this does instead:

* it converts the messages twice (objects to dicts, then every value to plain JSON data, a
  deep copy each time); here each message is copied once, its string values as they are (a
  ``str`` is already plain data) and any other value through transformers' own two conversions;
* its sandbox resolves ``message.role`` by asking the dict for an attribute ``role`` first and
  catching the ``AttributeError`` (most of the template's time on a long chat); here the same
  template is compiled in an overlay of transformers' own environment (same sandbox, filters,
  globals and extensions) whose ``getattr`` goes straight to the item for a plain ``dict`` and a
  name that is no attribute of ``dict``: the case where the sandbox would have done the same
  after the exception. Its code makes that case no call at all where the object is a loop's
  variable (``message.role``: ``_dict_first_code``). Anything else takes the sandbox's own
  path.

The variables are transformers': ``messages`` (the converted chat, reasoning fields aliased by
transformers' function where a message has one), ``tools``, ``documents`` (None),
``add_generation_prompt``, then the tokenizer's named special tokens updated by the request's
template variables.

What this path does not take goes through ``apply_chat_template`` itself (``render_reference``):
``continue_final_message`` (transformers edits and trims the final message), an empty chat,
template variables named like ``apply_chat_template``'s own parameters. Both paths raise what
transformers raises; the caller maps it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

__all__ = ["ChatRenderer"]

# What ``getattr(d, name)`` finds on a plain dict: its methods and object's dunders. Any other
# name raises AttributeError, and the sandbox then returns ``d[name]`` (or undefined).
_DICT_ATTRIBUTES = frozenset(dir(dict))


@dataclass(frozen=True, slots=True)
class _Helpers:
    """transformers' own conversions (private helpers: the versions are pinned by
    constraints.txt and tests/chat/test_render.py compares every template's output with
    apply_chat_template's)."""

    to_dicts: Callable[[Any], Any]
    plain: Callable[[Any], Any]
    alias_reasoning: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]
    compile: Callable[[str], Any]
    # the names transformers aliases a reasoning field under: with none of them in a chat,
    # ``alias_reasoning`` changes nothing, and is skipped
    reasoning_fields: frozenset[str]


@functools.cache
def _helpers() -> _Helpers:
    """Imported on first use: importing transformers takes 0.6-0.9 s, which every ``kvmesh``
    command and every service serving no chat model would otherwise pay at start (a renderer
    exists only once a tokenizer was loaded, by transformers)."""
    from transformers.utils import chat_template_utils as utils

    return _Helpers(
        to_dicts=utils._message_objects_to_dicts,
        plain=utils._plain_template_data,
        alias_reasoning=utils._alias_reasoning_fields,
        compile=utils._compile_jinja_template,
        reasoning_fields=frozenset(utils._REASONING_FIELDS),
    )


def _dict_first_getattr(environment: Any) -> Callable[[Any, str], Any]:
    """The sandbox's ``getattr`` with the plain-dict case answered without the exception."""
    sandbox_getattr = type(environment).getattr.__get__(environment)
    undefined = environment.undefined

    def getattr_(obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return undefined(obj=obj, name=attribute)
        return sandbox_getattr(obj, attribute)

    return getattr_


@functools.cache
def _dict_first_code() -> type[Any]:
    """Jinja's code generator, writing ``name.attr`` (``name`` a loop's, a ``with``'s or a
    macro parameter's variable: compiled as a bare Python name; ``attr`` no attribute of
    ``dict``) as ``name[attr] if type(name) is dict and attr in name
    else environment.getattr(name, attr)``: the case ``_dict_first_getattr`` answers first,
    answered inline. A chat template reads ``message.role`` and ``message.content`` a few times
    a message: inline, the bench's 54-message chat renders in 127 µs instead of 140. Made on
    first use, as ``_helpers``."""
    from io import StringIO

    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator, Frame, optimizeconst

    class DictFirstCodeGenerator(CodeGenerator):
        @optimizeconst
        def visit_Getattr(self, node: nodes.Getattr, frame: Frame) -> None:
            attr = node.attr
            if (
                self.environment.is_async
                or attr in _DICT_ATTRIBUTES
                or not isinstance(node.node, nodes.Name)
            ):
                super().visit_Getattr(node, frame)
                return
            self.write("(")  # first: it writes any pending line break, not the capture below
            stream, self.stream = self.stream, StringIO()
            try:
                self.visit(node.node, frame)
                name = self.stream.getvalue()
            finally:
                self.stream = stream
            if name.isidentifier():  # a local's plain name: read again, it costs nothing
                self.write(f"{name}[{attr!r}] if type({name}) is dict and {attr!r} in {name} else ")
            self.write(f"environment.getattr({name}, {attr!r}))")

    return DictFirstCodeGenerator


def _template_message(message: Mapping[Any, Any], helpers: _Helpers) -> dict[Any, Any]:
    """One message as ``render_jinja_template`` hands it to the template: keys whose value is
    None dropped, everything else plain data."""
    out: dict[Any, Any] = {}
    for key, value in message.items():
        if value is None:
            continue
        if type(value) is not str:
            value = helpers.plain(helpers.to_dicts(value))
        out[key if type(key) is str else helpers.plain(key)] = value
    return out


class ChatRenderer:
    """Renders chats with one transformers tokenizer's templates; see the module docstring."""

    def __init__(self, hf: Any) -> None:
        self._hf = hf
        self._helpers = _helpers()
        self._fast: dict[str, Any] = {}  # template source -> the template in the fast overlay
        self._own_parameters = frozenset(inspect.signature(hf.apply_chat_template).parameters)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: Mapping[str, Any],
    ) -> str:
        if (
            continue_final_message
            or not messages
            or not self._own_parameters.isdisjoint(template_kwargs)
        ):
            return self.render_reference(
                messages, tools, add_generation_prompt, continue_final_message, template_kwargs
            )
        tool_list = [dict(t) for t in tools] if tools is not None else None
        source: str = self._hf.get_chat_template(None, tool_list)
        template = self._fast.get(source)
        if template is None:
            template = self._fast[source] = self._compile_fast(source)
        helpers = self._helpers
        chat = [_template_message(m, helpers) for m in messages]
        if not helpers.reasoning_fields.isdisjoint(chain.from_iterable(chat)):  # message keys
            chat = helpers.alias_reasoning(chat)
        variables = helpers.plain({**self._hf.special_tokens_map, **template_kwargs})
        text: str = template.render(
            messages=chat,
            tools=helpers.plain(tool_list),
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        return text

    def render_reference(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: Mapping[str, Any],
    ) -> str:
        """The same chat through ``apply_chat_template`` (the fallback, and the reference)."""
        text: str = self._hf.apply_chat_template(
            [dict(m) for m in messages],
            tools=[dict(t) for t in tools] if tools is not None else None,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **template_kwargs,
        )
        return text

    @staticmethod
    def _compile_fast(source: str) -> Any:
        environment = _helpers().compile(source).environment.overlay()
        environment.getattr = _dict_first_getattr(environment)
        environment.code_generator_class = _dict_first_code()
        return environment.from_string(source)
