"""``ModelTokenizer``: a model's prompts as the engine serving it tokenizes them.

A cache-aware router is only as good as its tokenization: its block hashes must be made from the
very ids the engine will see, or its view of every worker's cache is fiction. So nothing here is
written by hand:

* a Hugging Face model or tokenizer directory (``tokenizer.json``, ``tokenizer_config.json``,
  and where the model has them ``chat_template.jinja`` and ``special_tokens_map.json``) is
  loaded by transformers' ``AutoTokenizer``, as vLLM, SGLang and TensorRT-LLM load it;
* a chat is rendered as that tokenizer's ``apply_chat_template`` renders it (its own Jinja
  template in transformers' sandboxed environment, with its special tokens as template
  variables; ``app.chat.render`` does it without the call's overhead, the same text), then
  encoded without adding special tokens: what ``apply_chat_template(..., tokenize=True)``
  returns, and what vLLM's chat endpoint sends to its engine. The rendered text is encoded
  piece by piece, cut before the template's control tokens, each piece's ids kept in an LRU
  (``app.chat.pieces``: the same ids as encoding the whole text, for the tokenizers where that
  is proven; the others encode the whole text), so that a conversation's next request encodes
  only its new turns; and a new piece of plain ASCII goes word by word through a cache of each
  word's ids (``app.chat.words``: byte-level BPE tokenizers, where proven the same);
* a text prompt is encoded *with* the tokenizer's special tokens (``add_special_tokens=True``,
  the default of vLLM's completions endpoint and of transformers), so a Llama-family BOS is
  there as the engine has it: through the pieces where they are proven, with the ids the
  post-processor adds around any text (``special_ends``).

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

import numpy as np

from app.chat.pieces import (
    DEFAULT_CACHE_TOKENS,
    PieceCacheInfo,
    PieceEncoder,
    U32Array,
    control_tokens,
    words_of,
)
from app.chat.render import ChatRenderer

__all__ = ["ChatTemplateError", "ModelTokenizer", "TokenizerLoadError", "special_ends"]


class TokenizerLoadError(ValueError):
    """The path cannot be loaded as a tokenizer; the message says why, in one line."""


class ChatTemplateError(ValueError):
    """The chat cannot be rendered by the model's template (its message says why)."""


# Texts whose ids with and without the special tokens show what a post-processor adds.
_END_PROBES = ("Hello world", "x", "1 2 3\n")


def special_ends(backend: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The ids ``backend``'s post-processor adds before and after a text's own (BOS and EOS,
    ``[CLS]`` and ``[SEP]``...), found from probe texts; None when they are not the same for
    every probe. The post-processors ``PieceEncoder`` admits (ByteLevel, TemplateProcessing,
    BERT's, RoBERTa's) add constant ids around a single sequence, truncation being off."""
    found: set[tuple[tuple[int, ...], tuple[int, ...]]] | None = None
    for probe in _END_PROBES:
        bare = tuple(backend.encode(probe, add_special_tokens=False).ids)
        full = tuple(backend.encode(probe, add_special_tokens=True).ids)
        ends = {
            (full[:start], full[start + len(bare) :])
            for start in range(len(full) - len(bare) + 1)
            if full[start : start + len(bare)] == bare
        }
        found = ends if found is None else found & ends
    if not found or len(found) != 1:
        return None
    head, tail = found.pop()
    empty = tuple(backend.encode("", add_special_tokens=True).ids)
    return (head, tail) if empty == head + tail else None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


class ModelTokenizer:
    """One model's tokenizer; see the module docstring. Build with ``ModelTokenizer.load``."""

    def __init__(
        self, path: str, backend: Any, hf: Any = None, *, cache_tokens: int = DEFAULT_CACHE_TOKENS
    ) -> None:
        self.path = path
        self._backend = backend  # a tokenizers.Tokenizer: what both forms encode with
        self._hf = hf  # the transformers tokenizer of a directory; None for a bare file
        self._renderer = ChatRenderer(hf) if hf is not None else None
        tokens = control_tokens(backend) if cache_tokens > 0 else None
        # None: rendered chats are encoded whole (no cache wanted, or not proven separable)
        self._pieces = PieceEncoder(backend, tokens, cache_tokens) if tokens else None
        # What the post-processor adds around a text prompt's ids, where a text can go through
        # the pieces too (see encode_text), as the arrays a request's ids are joined with
        ends = special_ends(backend) if self._pieces is not None else None
        self._text_ends = None if ends is None else (words_of(ends[0]), words_of(ends[1]))

    @classmethod
    def load(cls, path: str | Path, *, cache_tokens: int = DEFAULT_CACHE_TOKENS) -> ModelTokenizer:
        """A tokenizer directory (chat and text) or a ``tokenizer.json`` (text only).
        ``cache_tokens`` bounds the ids the chat piece cache holds (0: no cache)."""
        where = Path(path)
        if not where.exists():
            raise TokenizerLoadError(f"{path}: no such file or directory")
        if where.is_dir():
            return cls._load_directory(where, cache_tokens)
        from tokenizers import Tokenizer

        try:
            backend = Tokenizer.from_file(str(where))
        except Exception as exc:  # tokenizers raises a bare Exception for any parse error
            raise TokenizerLoadError(
                f"{path}: not a tokenizer.json the tokenizers library can load ({_one_line(exc)})"
            ) from None
        return cls(str(where), backend, cache_tokens=cache_tokens)

    @classmethod
    def _load_directory(cls, where: Path, cache_tokens: int) -> ModelTokenizer:
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
        return cls(str(where), backend, hf, cache_tokens=cache_tokens)

    # -- what it knows ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Ids it can produce: the vocabulary and the added tokens."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def has_chat_template(self) -> bool:
        return self._hf is not None and bool(getattr(self._hf, "chat_template", None))

    @property
    def piece_cache(self) -> PieceCacheInfo | None:
        """The chat piece cache's counters; None where rendered chats are encoded whole."""
        return self._pieces.info() if self._pieces is not None else None

    # -- prompts ---------------------------------------------------------------------------------

    def encode_text(self, text: str) -> list[int]:
        """A completions prompt as the engine encodes it (with the special tokens). Through the
        pieces (and their words) where proven the same: the post-processors ``PieceEncoder``
        admits add the same ids before and after any text (``special_ends``)."""
        if self._text_ends is not None and self._pieces is not None:
            ids: list[int] = self.encode_text_words(text).tolist()
            return ids
        whole: list[int] = self._backend.encode(text, add_special_tokens=True).ids
        return whole

    def encode_text_words(self, text: str) -> U32Array:
        """``encode_text`` as a uint32 array: what the router hashes, with no int per id."""
        if self._text_ends is not None and self._pieces is not None:
            head, tail = self._text_ends
            ids = self._pieces.encode_words(text)
            if len(head) or len(tail):
                ids = np.concatenate((head, ids, tail))
            return ids
        return words_of(self._backend.encode(text, add_special_tokens=True).ids)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        reference: bool = False,
    ) -> str:
        """The chat as its template renders it: the text of transformers'
        ``apply_chat_template``, which ``reference=True`` calls (the slow path, for comparison)."""
        if self._renderer is None or not self.has_chat_template:
            raise ChatTemplateError(
                f"the tokenizer at {self.path} has no chat template: send a completions prompt"
            )
        from jinja2 import TemplateError

        render = self._renderer.render_reference if reference else self._renderer.render
        try:
            return render(
                messages,
                tools,
                add_generation_prompt,
                continue_final_message,
                template_kwargs or {},
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused this chat: {exc}") from None
        except Exception as exc:  # whatever a template does with a client's input
            # transformers' own checks (continue_final_message with no final message, ...), a
            # template reading a field this chat lacks, arithmetic or nesting it cannot take:
            # all are this request's fault, none may become a 500
            raise ChatTemplateError(f"the chat cannot be rendered: {_one_line(exc)}") from None

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> list[int]:
        """The chat's token ids: rendered, then encoded without adding special tokens (the
        template wrote them)."""
        return self.encode_rendered(self.render_chat(messages, **options))

    def encode_chat_words(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> U32Array:
        """``encode_chat`` as a uint32 array: what the router hashes, with no int per id."""
        return self.encode_rendered_words(self.render_chat(messages, **options))

    def encode_rendered_words(self, text: str) -> U32Array:
        """``encode_rendered`` as a uint32 array."""
        if self._pieces is not None:
            return self._pieces.encode_words(text)
        return words_of(self.encode_whole(text))

    def encode_rendered(self, text: str) -> list[int]:
        """A rendered chat's ids: its template wrote the special tokens, none are added. Piece
        by piece through the cache where proven the same (see the module docstring)."""
        if self._pieces is not None:
            return self._pieces.encode(text)
        return self.encode_whole(text)

    def encode_whole(self, text: str) -> list[int]:
        """A rendered chat's ids, the whole text in one call (no cache)."""
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Generated ids as text (special tokens left out, as OpenAI's servers answer)."""
        text: str = self._backend.decode(list(ids), skip_special_tokens=True)
        return text
