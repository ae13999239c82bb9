"""``WordEncoder``: plain ASCII text encoded pre-token by pre-token gives the ids IDENTICAL to the
tokenizers library's, on every byte-level test tokenizer (Llama 3's and Qwen's split patterns,
the demo model's, GPT-2's ``ByteLevel(use_regex=True)``); anything else is declined (None), and
so is a tokenizer where that is not proven or where the ``regex`` module reads its pattern
otherwise; the cache stays within its bound."""

from __future__ import annotations

import random
import re
import warnings
from typing import Any

import pytest
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from app.bench.chat import DEMO_MODEL
from app.chat.pieces import PieceEncoder, control_tokens
from app.chat.words import (
    CHECK_TEXTS,
    MAX_WORD_CHARS,
    SAFE_CHARS,
    WordEncoder,
    _ascii_pattern,
    _portable,
)
from tests.support.chat_models import tokenizer_dir

CORPUS = [
    "The weather in Paris is sunny today, isn't it? We'll see: 22 degrees at 3:45pm.",
    "  Indented code\n\tdef f(x):\n\t\treturn x + 1  # it's done\r\n",
    "DON'T SHOUT!!! They're here... (and they've brought 1,234 friends)",
    "one two three, three two one",
] * 20


def _trained(pre_tokenizer: Any) -> Tokenizer:
    """A byte-level BPE of 400 ids learnt from ``CORPUS`` after ``pre_tokenizer``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return tokenizer


def _gpt2_style() -> Tokenizer:
    """GPT-2's layout: ``ByteLevel(use_regex=True)`` alone, a normalized special token."""
    tokenizer = _trained(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    tokenizer.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=True)])
    return tokenizer


def _split_then_byte_level(pattern: str) -> Any:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _split(pattern: str) -> Tokenizer:
    """A byte-level BPE after a ``Split`` on ``pattern``, as Llama 3 and Qwen are built."""
    return _trained(_split_then_byte_level(pattern))


@pytest.fixture(scope="module")
def backends(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("word_models")
    found = {
        style: Tokenizer.from_file(str(tokenizer_dir(root, style) / "tokenizer.json"))
        for style in ("llama3", "chatml")
    }
    found["demo"] = Tokenizer.from_file(str(DEMO_MODEL / "tokenizer.json"))
    found["gpt2"] = _gpt2_style()
    return found


def _words(backend: Tokenizer, max_words: int = 1 << 16) -> WordEncoder | None:
    vocab = backend.get_vocab(with_added_tokens=True).values()
    return WordEncoder.for_backend(backend, list(range(max(vocab) + 1)), max_words)


def _theirs(backend: Tokenizer, text: str) -> list[int]:
    ids: list[int] = backend.encode(text, add_special_tokens=False).ids
    return ids


# Characters where the patterns' alternatives meet, each class several times over.
ALPHABET = (
    *("a", "b", "e", "h", "t", "Z", "S", "'", "'s", "'T", "'ll", "'re", "'ve", "'d", "'M"),
    *(" ", " ", "  ", "\n", "\n\n", "\t", "\r\n", "\r", " \n", "0", "7", "12", "345"),
    *(".", ",", "!", "?", "...", "(", ")", "-", "_", "#", "\\", "/", "`", "~", "{", "}"),
    *(" the", " weather", "Paris", " isn", "today", " code", "return", " DON", "SHOUT"),
)


def _same_on_random_ascii(words: WordEncoder, backend: Tokenizer, seed: int, count: int) -> None:
    rng = random.Random(seed)
    for _ in range(count):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 30)))
        assert words.encode(text) == _theirs(backend, text), repr(text)


@pytest.mark.parametrize("model", ["llama3", "chatml", "demo", "gpt2"])
def test_random_ascii_is_encoded_as_the_library_encodes_it(
    model: str, backends: dict[str, Tokenizer]
) -> None:
    backend = backends[model]
    words = _words(backend)
    assert words is not None
    _same_on_random_ascii(words, backend, seed=5, count=1_500)
    every = "".join(random.Random(6).choice(SAFE_CHARS) for _ in range(5_000))
    assert words.encode(every) == _theirs(backend, every)
    assert 0 < len(words) <= 1 << 16


def test_other_characters_and_normalized_tokens_are_declined(
    backends: dict[str, Tokenizer],
) -> None:
    words = _words(backends["gpt2"])
    assert words is not None
    others = ("Zürich", "東京", "🌦", "a\x0bb", "tab\x1f", "x\x7f")
    for text in (*others, "<|endoftext|>", "a<|endoftext|>"):
        assert words.encode(text) is None, repr(text)
    assert words.encode("<|endoftext") == _theirs(backends["gpt2"], "<|endoftext")


def _normalizer(tokenizer: Tokenizer) -> None:
    tokenizer.normalizer = normalizers.Lowercase()


def _prefix_space(tokenizer: Tokenizer) -> None:
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)


def _metaspace(tokenizer: Tokenizer) -> None:
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()


def _dropout(tokenizer: Tokenizer) -> None:
    tokenizer.model.dropout = 0.1


def _no_pre_tokenizer(tokenizer: Tokenizer) -> None:
    tokenizer.pre_tokenizer = None


@pytest.mark.parametrize(
    "change", [_normalizer, _prefix_space, _metaspace, _dropout, _no_pre_tokenizer]
)
def test_a_tokenizer_not_proven_has_no_word_encoder(change: Any) -> None:
    tokenizer = _gpt2_style()
    assert _words(tokenizer) is not None
    change(tokenizer)
    assert _words(tokenizer) is None


def test_a_pattern_the_regex_module_reads_otherwise_is_declined() -> None:
    """``$`` ends every line in Oniguruma (Ruby's syntax), only the text in Python: in a check
    text, ``three`` before a blank line is one split to the library and five here (each letter).
    The portability scan refuses the pattern (and the check texts would have)."""
    pattern = r"[a-z]+$|[a-z]|\s+|."
    tokenizer = _split(r"[a-z]+|\s+|.")  # learns whole words' merges
    tokenizer.pre_tokenizer = _split_then_byte_level(pattern)
    vocab = tokenizer.get_vocab(with_added_tokens=True).values()
    unchecked = WordEncoder(tokenizer, pattern, list(range(max(vocab) + 1)), 100)
    assert any("three\n\nnewlines" in text for text in CHECK_TEXTS)
    assert unchecked.encode("three\n\nnewlines") != _theirs(tokenizer, "three\n\nnewlines")
    assert _words(tokenizer) is None
    assert _words(_split(r"[a-z]+|\s+|.")) is not None


@pytest.mark.parametrize(
    ("pattern", "portable"),
    [
        (r"(?i:'s|'t)|[^\r\n\p{L}\p{N}]?\p{L}+|\s+(?!\S)|\s+", True),
        (r"[\^a]+|[^^]|\$", True),  # ^ and $ escaped or inside a class
        (r"(?<=a)b|(?:c)|.", True),
        (r"^\s+|.", False),
        (r"\w+$|.", False),
        (r"\h+|.", False),
        (r"\Aa|.", False),
        (r"(?m)a|.", False),
        (r"(?s:.)", False),
        (r"[a-z&&[^aeiou]]+|.", False),
        (r"[[:alpha:]]+|.", False),
        (r"[]a]|.", False),
        (r"[^]a]|.", False),
    ],
)
def test_patterns_the_engines_read_differently_are_refused(pattern: str, portable: bool) -> None:
    assert _portable(pattern) is portable


@pytest.mark.parametrize(
    ("pattern", "written"),
    [
        (
            r"(?i:'s|'t)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
            r"(?i:'s|'t)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]{1,3}| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+",
        ),
        (r"[\p{L}\]x]+|\\p{L}|[^^\p{N}]", r"[A-Za-z\]x]+|\\p{L}|[^^0-9]"),  # escapes kept
        (r"[+-\p{N}]|[\p{N}-]|.", None),  # a range's end or start: refused
        (r"\p{Lu}+|.", None),
        (r"\pL+|.", None),
        (r"\P{L}+|.", None),
    ],
)
def test_letters_and_numbers_are_written_as_their_ascii_members(
    pattern: str, written: str | None
) -> None:
    assert _ascii_pattern(pattern) == written


def test_a_pattern_re_would_warn_about_goes_to_the_regex_module() -> None:
    """``[\\p{L}~~]`` is a letter or ``~`` to Oniguruma and the regex module; Python's ``re``
    warns that it may read ``~~`` as a set operation one day: the regex module splits it, and
    encodes as the library does. (Warnings ignored, as a service would run: this suite's
    filter makes every warning an error.)"""
    pattern = r"[\p{L}~~]+|[^\p{L}~]"
    tokenizer = _split(pattern)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        words = _words(tokenizer)
    assert words is not None and not isinstance(words._split, re.Pattern)
    _same_on_random_ascii(words, tokenizer, seed=10, count=200)


@pytest.mark.parametrize("model", ["llama3", "chatml", "demo", "gpt2"])
def test_the_test_models_split_in_the_standard_re(
    model: str, backends: dict[str, Tokenizer]
) -> None:
    """Each test model's pattern is one ``_ascii_pattern`` writes: the ASCII tests above ran
    ``re``; a pattern naming another property keeps the ``regex`` module, and encodes alike."""
    words = _words(backends[model])
    assert words is not None and isinstance(words._split, re.Pattern)
    other = _split(r"\p{Lu}?\p{Ll}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+")
    kept = _words(other)
    assert kept is not None and not isinstance(kept._split, re.Pattern)
    _same_on_random_ascii(kept, other, seed=9, count=300)


def test_a_pattern_that_matches_empty_is_refused() -> None:
    """Oniguruma steps past an empty match otherwise than the regex module (the library splits
    ``hello`` into letters with this one, the regex module does not)."""
    assert _words(_split(r"x*|\w+")) is None


def test_a_unicode_normalizer_is_admitted_and_others_are_not(
    backends: dict[str, Tokenizer],
) -> None:
    """Qwen's tokenizer.json has an NFC normalizer, which leaves ASCII as it is."""
    tokenizer = Tokenizer.from_str(backends["chatml"].to_str())
    tokenizer.normalizer = normalizers.NFC()
    words = _words(tokenizer)
    assert words is not None
    _same_on_random_ascii(words, tokenizer, seed=8, count=300)
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    assert _words(tokenizer) is None


def test_a_long_word_is_encoded_but_not_kept(backends: dict[str, Tokenizer]) -> None:
    backend = backends["demo"]
    words = _words(backend)
    assert words is not None
    long_word = " " + "ab" * MAX_WORD_CHARS
    assert words.encode(long_word + " x") == _theirs(backend, long_word + " x")
    assert list(words._words) == [" x"]


def test_a_pattern_with_groups_and_gaps_splits_as_the_library_does() -> None:
    """Capturing groups (findall would give the groups, not the matches) and characters no
    alternative matches (the gaps are splits of their own)."""
    tokenizer = _split(r"([a-z])([a-z]*)|(\d)")
    words = _words(tokenizer)
    assert words is not None
    for text in ("one two, three!", "x1y22 z", "  ", "DON'T 42"):
        assert words.encode(text) == _theirs(tokenizer, text), text


def test_the_cache_keeps_at_most_its_bound_oldest_out(backends: dict[str, Tokenizer]) -> None:
    backend = backends["demo"]
    words = _words(backend, max_words=3)
    assert words is not None and len(words) == 0  # the check texts are not kept
    assert words.encode(" one two three four") == _theirs(backend, " one two three four")
    assert list(words._words) == [" two", " three", " four"]
    assert words.encode(" one") == _theirs(backend, " one")
    assert list(words._words) == [" three", " four", " one"]


def test_pieces_use_it_and_still_encode_as_the_whole_text(backends: dict[str, Tokenizer]) -> None:
    backend = backends["chatml"]
    tokens = control_tokens(backend)
    assert tokens is not None
    pieces = PieceEncoder(backend, tokens, 10_000)
    assert pieces._words is not None
    text = "<|im_start|>user\nHello there, it's me.<|im_end|>\n<|im_start|>assistant\nZürich!"
    assert pieces.encode(text) == _theirs(backend, text)
    # the two ASCII pieces' words are cached; the last piece went to the library whole
    assert len(pieces._words) > 0
    assert " Z" not in pieces._words._words and "Zürich" not in pieces._words._words
    none = PieceEncoder(backend, tokens, 0)
    assert none._words is None
