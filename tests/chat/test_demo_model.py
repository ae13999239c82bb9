"""``app/demo/chat-model`` (the tour's and the demo's chat model) is exactly what
``tests/support/chat_models.py`` builds, and fits the tiny preset's vocabulary."""

from __future__ import annotations

from pathlib import Path

from app.chat import ModelTokenizer
from app.worker.settings import MODEL_PRESETS
from tests.support.chat_models import tokenizer_dir

DEMO = Path(__file__).resolve().parents[2] / "app" / "demo" / "chat-model"


def test_the_demo_model_is_the_chatml_fixture(tmp_path: Path) -> None:
    built = tokenizer_dir(tmp_path, "chatml", vocab_size=500)
    names = sorted(p.name for p in built.iterdir())
    assert sorted(p.name for p in DEMO.iterdir()) == names
    for name in names:
        assert (DEMO / name).read_bytes() == (built / name).read_bytes(), name
    tokenizer = ModelTokenizer.load(DEMO)
    assert tokenizer.has_chat_template
    assert tokenizer.vocab_size == 505 <= MODEL_PRESETS["tiny"].vocab_size
