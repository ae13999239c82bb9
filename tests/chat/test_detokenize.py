"""``IncrementalText``: generated ids decoded as they come give the text of the whole output,
on every tokenizer of ``tests.support.chat_models`` and the demo's, whatever the chunking,
holding back a partial character until the ids that complete it arrive, and never sending a
character it takes back."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from app.bench.chat import DEMO_MODEL
from app.chat.detokenize import IncrementalText
from app.chat.tokenizer import ModelTokenizer
from tests.support.chat_models import STYLES, tokenizer_dir

MODELS = (*STYLES, "demo")
TEXTS = (
    "The weather in Paris is sunny, 22 degrees. Don't forget an umbrella!",
    "  two spaces\n\nnewlines\n and\ttabs  ",
    "Zürich, 東京の天気, 🌦🌦 and ▁already Ġbyte",
    "x",
)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModelTokenizer]:
    root = tmp_path_factory.mktemp("detok_models")
    dirs: dict[str, Path] = {style: tokenizer_dir(root, style) for style in STYLES}
    dirs["demo"] = DEMO_MODEL
    return {name: ModelTokenizer.load(path) for name, path in dirs.items()}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("text", TEXTS)
def test_the_text_so_far_is_the_whole_decode_less_a_held_partial_character(
    tokenizers: dict[str, ModelTokenizer], model: str, text: str
) -> None:
    tokenizer = tokenizers[model]
    ids = tokenizer.encode_whole(text)
    whole = tokenizer.decode(ids)
    for seed in range(4):  # one id at a time, then random chunks
        rng = random.Random(seed)
        incremental = IncrementalText(tokenizer)
        taken = 0
        while taken < len(ids):
            taken = min(taken + (1 if seed == 0 else rng.randint(1, 4)), len(ids))
            got = incremental.update(ids[:taken])
            so_far = tokenizer.decode(ids[:taken])
            assert "\ufffd" not in got or "\ufffd" in whole
            # Never a character the whole text does not have there (a byte-fallback decoder
            # turns a run of byte ids that is not yet valid UTF-8 into one U+FFFD per byte,
            # even the bytes before that were whole: the decode so far is no guide then), and
            # nothing held back once the decode so far is whole.
            assert whole.startswith(got)
            assert got == so_far or "\ufffd" in so_far
        assert incremental.final() == whole


def test_updates_decode_a_window_not_the_whole_output(
    tokenizers: dict[str, ModelTokenizer],
) -> None:
    """Each update decodes the ids of the last text sent and the new ones, whatever the
    output's length."""
    tokenizer = tokenizers["chatml"]
    ids = tokenizer.encode_whole(TEXTS[0] * 40)
    decoded: list[int] = []

    class Counting:
        def decode(self, window: Sequence[int]) -> str:
            decoded.append(len(window))
            return tokenizer.decode(window)

    incremental = IncrementalText(Counting())
    for n in range(1, len(ids) + 1):
        incremental.update(ids[:n])
    assert incremental.final() == tokenizer.decode(ids)
    assert len(ids) > 500
    assert max(decoded) <= 2  # one id at a time: the last text's id and the new one
