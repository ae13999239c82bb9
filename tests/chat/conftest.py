"""Fixtures of the chat tests: the test models' tokenizer directories (``tests.support.
chat_models``), loaded by kvmesh (``ours``) and by transformers (``theirs``), once a module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from app.chat.tokenizer import ModelTokenizer
from tests.support.chat_models import STYLES, tokenizer_dir


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat_models")
    return {style: tokenizer_dir(root, style) for style in STYLES}


@pytest.fixture(scope="module")
def ours(dirs: dict[str, Path]) -> dict[str, ModelTokenizer]:
    return {style: ModelTokenizer.load(path) for style, path in dirs.items()}


@pytest.fixture(scope="module")
def theirs(dirs: dict[str, Path]) -> dict[str, Any]:
    return {
        style: AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        for style, path in dirs.items()
    }
