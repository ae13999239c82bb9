"""``ModelTokenizer``: a model's prompts as the engine serving it tokenizes them.

A cache-aware router is only as good as its tokenization: its block hashes must be made from the
very ids the engine will see, or its view of every worker's cache is fiction. So nothing here is
written by hand:

* a Hugging Face model or tokenizer directory (``tokenizer.json``, ``tokenizer_config.json``,
  and where the model has them ``chat_template.jinja`` and ``special_tokens_map.json``) is
  loaded by transformers' ``AutoTokenizer``, as vLLM, SGLang and TensorRT-LLM load it;
* a chat is rendered by that tokenizer's ``apply_chat_template`` (its own Jinja template in
  transformers' sandboxed environment, with its special tokens as template variables), then
  encoded without adding special tokens: what ``apply_chat_template(..., tokenize=True)``
  returns, and what vLLM's chat endpoint sends to its engine;
* a text prompt is encoded *with* the tokenizer's special tokens (``add_special_tokens=True``,
  the default of vLLM's completions endpoint and of transformers), so a Llama-family BOS is
  there as the engine has it.

A bare ``tokenizer.json`` (``--tokenizer FILE``, kvmesh's first form) is loaded by the
tokenizers library alone: text prompts as above, no chat template.

Errors: ``TokenizerLoadError`` (the directory or file cannot serve: one line, said at start),
``ChatTemplateError`` (this chat cannot be rendered: the template's own message, e.g. from its
``raise_exception``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["ChatTemplateError", "ModelTokenizer", "TokenizerLoadError"]


class TokenizerLoadError(ValueError):
    """The path cannot be loaded as a tokenizer; the message says why, in one line."""


class ChatTemplateError(ValueError):
    """The chat cannot be rendered by the model's template (its message says why)."""


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


class ModelTokenizer:
    """One model's tokenizer; see the module docstring. Build with ``ModelTokenizer.load``."""

    def __init__(self, path: str, backend: Any, hf: Any = None) -> None:
        self.path = path
        self._backend = backend  # a tokenizers.Tokenizer: what both forms encode with
        self._hf = hf  # the transformers tokenizer of a directory; None for a bare file

    @classmethod
    def load(cls, path: str | Path) -> ModelTokenizer:
        """A tokenizer directory (chat and text) or a ``tokenizer.json`` (text only)."""
        where = Path(path)
        if not where.exists():
            raise TokenizerLoadError(f"{path}: no such file or directory")
        if where.is_dir():
            return cls._load_directory(where)
        from tokenizers import Tokenizer

        try:
            backend = Tokenizer.from_file(str(where))
        except Exception as exc:  # tokenizers raises a bare Exception for any parse error
            raise TokenizerLoadError(
                f"{path}: not a tokenizer.json the tokenizers library can load ({_one_line(exc)})"
            ) from None
        return cls(str(where), backend)

    @classmethod
    def _load_directory(cls, where: Path) -> ModelTokenizer:
        if not (where / "tokenizer.json").is_file():
            raise TokenizerLoadError(
                f"{where}: a tokenizer directory needs a tokenizer.json (the fast tokenizer "
                "the engines load)"
            )
        config = where / "tokenizer_config.json"
        if config.is_file():
            try:
                json.loads(config.read_text())
            except (ValueError, UnicodeDecodeError) as exc:
                raise TokenizerLoadError(f"{config}: not JSON ({_one_line(exc)})") from None
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(str(where), local_files_only=True)
        except Exception as exc:  # transformers raises many kinds; all mean "cannot load"
            raise TokenizerLoadError(
                f"{where}: transformers cannot load this tokenizer directory ({_one_line(exc)})"
            ) from None
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise TokenizerLoadError(f"{where}: not a fast tokenizer (no tokenizer.json backend)")
        return cls(str(where), backend, hf)

    # -- what it knows ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Ids it can produce: the vocabulary and the added tokens."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def has_chat_template(self) -> bool:
        return self._hf is not None and bool(getattr(self._hf, "chat_template", None))

    # -- prompts ---------------------------------------------------------------------------------

    def encode_text(self, text: str) -> list[int]:
        """A completions prompt as the engine encodes it (with the special tokens)."""
        ids: list[int] = self._backend.encode(text, add_special_tokens=True).ids
        return ids

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat as its template renders it (transformers' ``apply_chat_template``)."""
        if not self.has_chat_template:
            raise ChatTemplateError(
                f"the tokenizer at {self.path} has no chat template: send a completions prompt"
            )
        from jinja2 import TemplateError

        try:
            text: str = self._hf.apply_chat_template(
                [dict(m) for m in messages],
                tools=[dict(t) for t in tools] if tools is not None else None,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **dict(template_kwargs or {}),
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused this chat: {exc}") from None
        except Exception as exc:  # whatever a template does with a client's input
            # transformers' own checks (continue_final_message with no final message, ...), a
            # template reading a field this chat lacks, arithmetic or nesting it cannot take:
            # all are this request's fault, none may become a 500
            raise ChatTemplateError(f"the chat cannot be rendered: {_one_line(exc)}") from None
        return text

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> list[int]:
        """The chat's token ids: rendered, then encoded without adding special tokens (the
        template wrote them)."""
        return self.encode_rendered(self.render_chat(messages, **options))

    def encode_rendered(self, text: str) -> list[int]:
        """A rendered chat's ids: its template wrote the special tokens, none are added."""
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Generated ids as text (special tokens left out, as OpenAI's servers answer)."""
        text: str = self._backend.decode(list(ids), skip_special_tokens=True)
        return text
