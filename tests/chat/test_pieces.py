"""``PieceEncoder`` (``ModelTokenizer.encode_rendered``): a rendered chat encoded piece by piece
through the cache gives ids IDENTICAL to encoding the whole text, on every tokenizer of
``tests.support.chat_models`` and the demo's; the cache hits what a conversation repeats and
encodes only what is new; it stays within its bound; and tokenizers where separability is not
proven are encoded whole."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, pre_tokenizers
from transformers import AutoTokenizer

from app.bench.chat import DEMO_MODEL
from app.chat.pieces import PieceCacheInfo, PieceEncoder, control_tokens
from app.chat.tokenizer import ModelTokenizer
from tests.support.chat_models import CONVERSATIONS, PREFILLS, STYLES, WEATHER_TOOL, tokenizer_dir

MODELS = (*STYLES, "demo")
# Texts a turn may hold: words cut short before the template's control token, spaces and
# newlines at both ends, digits, apostrophes, accents, CJK, emoji, SentencePiece's own "▁", a
# byte-level "Ġ", and control tokens written by the user.
FRAGMENTS = (
    *("The weather in Paris is", "unfinishe", "  two spaces", "trailing  ", "\n\nnewlines\n"),
    *("1234567", " 22 degrees", "don't", "we'll", "Zürich", "東京の天気", "🌦🌦", "▁already"),
    *("Ġbyte", "\t", " ", "x", "<|im_start|>", "[INST]", "<bos>", "<|eot_id|>", "<s>", "</s"),
)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat_models")
    built = {style: tokenizer_dir(root, style) for style in STYLES}
    return {**built, "demo": DEMO_MODEL}


@pytest.fixture(scope="module")
def theirs(dirs: dict[str, Path]) -> dict[str, Any]:
    return {
        style: AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        for style, path in dirs.items()
    }


def _whole(tokenizer: ModelTokenizer, text: str) -> list[int]:
    return tokenizer.encode_whole(text)


def _turn(rng: random.Random) -> str:
    return "".join(rng.choice(FRAGMENTS) + rng.choice(("", " ", "\n")) for _ in range(6)).strip()


def _growing_conversation(style: str, seed: int, num_turns: int) -> list[list[dict[str, str]]]:
    """Requests as a client sends them: each the previous one, the reply, and a new user turn."""
    rng = random.Random(seed)
    messages = [{"role": "user", "content": _turn(rng)}]
    if style != "gemma" or seed % 2:  # Gemma folds a system message into the first user turn
        messages.insert(0, {"role": "system", "content": "You are helpful. " + _turn(rng)})
    requests = [copy.deepcopy(messages)]
    for _ in range(num_turns):
        messages.append({"role": "assistant", "content": _turn(rng)})
        messages.append({"role": "user", "content": _turn(rng)})
        requests.append(copy.deepcopy(messages))
    return requests


def test_every_model_is_proven_separable(dirs: dict[str, Path]) -> None:
    for model, path in dirs.items():
        info = ModelTokenizer.load(path).piece_cache
        assert info is not None, model
        assert (info.hits, info.misses, info.tokens) == (0, 0, 0)


@pytest.mark.parametrize("model", MODELS)
def test_a_growing_conversation_is_encoded_as_transformers_encodes_each_request(
    model: str, dirs: dict[str, Path], theirs: dict[str, Any]
) -> None:
    ours = ModelTokenizer.load(dirs[model])
    for seed in range(3):
        for messages in _growing_conversation(model, seed, 8):
            ids = ours.encode_chat(messages)
            expected = theirs[model].apply_chat_template(
                messages, tokenize=True, return_dict=False, add_generation_prompt=True
            )
            assert ids == expected
            assert ids == _whole(ours, ours.render_chat(messages))
    info = ours.piece_cache
    assert info is not None
    # every request after a conversation's first starts from the one before it; but Mistral's
    # template writes the system prompt into the last user turn, so its texts differ early
    assert info.prefix_hits == (0 if model == "mistral" else 3 * 8)
    assert info.hits > info.misses


@pytest.mark.parametrize(("style", "name"), [(s, n) for s in STYLES for n in CONVERSATIONS[s]])
def test_every_chat_with_tools_and_both_endings_is_encoded_as_transformers(
    style: str, name: str, dirs: dict[str, Path], theirs: dict[str, Any]
) -> None:
    ours = ModelTokenizer.load(dirs[style])
    chat = CONVERSATIONS[style][name]
    for _ in range(2):  # cold, then every piece from the cache
        for ending in (True, False):
            options: dict[str, Any] = {"tools": chat.get("tools")}
            options["add_generation_prompt"] = ending
            ids = ours.encode_chat(copy.deepcopy(chat["messages"]), **options)
            expected = theirs[style].apply_chat_template(
                copy.deepcopy(chat["messages"]), tokenize=True, return_dict=False, **options
            )
            assert ids == expected
    prefill: dict[str, Any] = {"add_generation_prompt": False, "continue_final_message": True}
    ids = ours.encode_chat(PREFILLS[style], **prefill)
    assert ids == theirs[style].apply_chat_template(
        copy.deepcopy(PREFILLS[style]), tokenize=True, return_dict=False, **prefill
    )


@pytest.mark.parametrize("model", MODELS)
def test_any_text_is_encoded_as_the_whole_text(model: str, dirs: dict[str, Path]) -> None:
    """Seeded texts of fragments and each model's control tokens, in any order, starting and
    ending anywhere: through one cache that grows, every one as its whole encoding."""
    ours = ModelTokenizer.load(dirs[model], cache_tokens=4_000)
    controls = [t.content for t in ours._backend.get_added_tokens_decoder().values()]
    rng = random.Random(11)
    alphabet = (*FRAGMENTS, *controls, *controls)
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        assert ours.encode_rendered(text) == _whole(ours, text), text
    info = ours.piece_cache
    assert info is not None and info.hits > 0 and info.tokens <= 4_000


@pytest.mark.parametrize("model", MODELS)
def test_text_prompts_are_encoded_as_the_engine_encodes_them(
    model: str, dirs: dict[str, Path], theirs: dict[str, Any]
) -> None:
    """A completions prompt goes through the pieces (and their words) with what the
    post-processor adds around it (a Llama or Mistral BOS): the library's ids with the special
    tokens, and transformers'."""
    ours = ModelTokenizer.load(dirs[model], cache_tokens=4_000)
    assert ours._text_ends is not None
    backend = ours._backend
    bos = theirs[model].bos_token
    with_bos = bos is not None and theirs[model]("x")["input_ids"][0] == backend.token_to_id(bos)
    head, tail = ours._text_ends
    assert (head.tolist(), tail.tolist()) == (([backend.token_to_id(bos)] if with_bos else []), [])
    controls = [t.content for t in backend.get_added_tokens_decoder().values()]
    rng = random.Random(13)
    alphabet = (*FRAGMENTS, *controls, "Hello world, it's a fine day.", " 42 ")
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        expected = backend.encode(text, add_special_tokens=True).ids
        assert ours.encode_text(text) == expected, text
        assert theirs[model](text)["input_ids"] == expected, text


def test_the_next_request_encodes_only_its_new_turns(dirs: dict[str, Path]) -> None:
    ours = ModelTokenizer.load(dirs["chatml"])
    first = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello world! How are you doing this morning?"},
    ]
    reply, question = "I am well, thank you. How can I help", "Tell me a story"
    ours.encode_chat(first)
    before = ours.piece_cache
    assert before is not None
    # system, user, the generation prompt: 3 control-token pieces, each with its <|im_end|>\n
    assert (before.hits, before.misses) == (1, 4)  # the second <|im_end|>\n was a hit
    second = [
        *first,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": question},
    ]
    ids = ours.encode_chat(second)
    after = ours.piece_cache
    assert after is not None
    # it starts from the first request's text up to its generation prompt; then, new:
    # "<|im_start|>assistant\n" + reply and "<|im_start|>user\n" + question; from the cache:
    # two <|im_end|>\n and the generation prompt
    assert after.prefix_hits - before.prefix_hits == 1
    assert after.misses - before.misses == 2
    assert after.hits - before.hits == 3
    new_chars = len("<|im_start|>assistant\n" + reply) + len("<|im_start|>user\n" + question)
    assert after.encoded_chars - before.encoded_chars == new_chars
    assert ids == _whole(ours, ours.render_chat(second))


def test_the_cache_keeps_at_most_its_bound_and_drops_the_least_recently_used(
    dirs: dict[str, Path],
) -> None:
    pieces = ["<|im_start|>user\n" + f"Question number {n} is about the weather" for n in range(4)]
    sizes = [len(ModelTokenizer.load(dirs["chatml"]).encode_whole(piece)) for piece in pieces]
    bound = sizes[0] + sizes[1]
    assert bound < sizes[0] + sizes[2] + sizes[1] and min(sizes) > 1  # room for two, not three
    ours = ModelTokenizer.load(dirs["chatml"], cache_tokens=bound)
    for piece in pieces[:2]:
        ours.encode_rendered(piece)
    ours.encode_rendered(pieces[0])  # a hit: pieces[0] is now the most recently used
    ours.encode_rendered(pieces[2])  # drops pieces[1]
    info = ours.piece_cache
    assert info is not None
    assert (info.pieces, info.tokens, info.hits, info.misses) == (2, sizes[0] + sizes[2], 1, 3)
    ours.encode_rendered(pieces[0])
    assert ours.piece_cache == PieceCacheInfo(
        hits=2,
        misses=3,
        encoded_chars=info.encoded_chars,
        prefix_hits=0,
        pieces=2,
        tokens=sizes[0] + sizes[2],
        max_tokens=bound,
        prefixes=0,  # each text is one piece: no cut inside it to start a later text from
        prefix_tokens=0,
    )
    ours.encode_rendered(pieces[1])  # encoded again
    again = ours.piece_cache
    assert again is not None
    assert (again.misses, again.encoded_chars) == (4, info.encoded_chars + len(pieces[1]))
    assert again.tokens <= bound
    ours.encode_rendered("<|im_start|>user\n" + "word " * 80)  # more than the bound: not kept
    assert ours.piece_cache is not None and ours.piece_cache.tokens == again.tokens


def test_no_cache_encodes_the_whole_text(dirs: dict[str, Path]) -> None:
    ours = ModelTokenizer.load(dirs["llama3"], cache_tokens=0)
    assert ours.piece_cache is None
    messages = CONVERSATIONS["llama3"]["multi_turn"]["messages"]
    assert ours.encode_chat(messages) == _whole(ours, ours.render_chat(messages))
    backend = Tokenizer.from_file(str(dirs["llama3"] / "tokenizer.json"))
    tokens = control_tokens(backend)
    assert tokens is not None
    with pytest.raises(ValueError, match="max_tokens must be >= 0, got -1"):
        PieceEncoder(backend, tokens, -1)


def _chatml(dirs: dict[str, Path]) -> Tokenizer:
    return Tokenizer.from_file(str(dirs["chatml"] / "tokenizer.json"))


class _Nothing:
    def pre_tokenize(self, pretokenized: Any) -> None:
        pass


def _lstrip(tokenizer: Tokenizer) -> None:
    tokenizer.add_special_tokens([AddedToken("<mask>", lstrip=True, normalized=False)])


def _custom_pre_tokenizer(tokenizer: Tokenizer) -> None:
    tokenizer.pre_tokenizer = pre_tokenizers.PreTokenizer.custom(_Nothing())


def _unreviewed_pre_tokenizer(tokenizer: Tokenizer) -> None:
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.ByteLevel(), pre_tokenizers.FixedLength(length=4)]
    )


def _special_tokens_as_text(tokenizer: Tokenizer) -> None:
    tokenizer.encode_special_tokens = True


def _truncation(tokenizer: Tokenizer) -> None:
    tokenizer.enable_truncation(max_length=100)


@pytest.mark.parametrize(
    "change",
    [
        _lstrip,
        _custom_pre_tokenizer,
        _unreviewed_pre_tokenizer,
        _special_tokens_as_text,
        _truncation,
    ],
)
def test_a_tokenizer_not_proven_separable_has_no_boundaries(
    change: Any, dirs: dict[str, Path]
) -> None:
    tokenizer = _chatml(dirs)
    assert control_tokens(tokenizer) is not None
    change(tokenizer)
    assert control_tokens(tokenizer) is None
    ours = ModelTokenizer("probe", tokenizer)
    assert ours.piece_cache is None
    text = "<|im_start|>user\nHello <mask> world<|im_end|>\n"
    assert ours.encode_rendered(text) == tokenizer.encode(text, add_special_tokens=False).ids


def test_overlapping_control_tokens_are_cut_leftmost_longest(dirs: dict[str, Path]) -> None:
    tokenizer = _chatml(dirs)
    tokenizer.add_special_tokens(
        [AddedToken(t, normalized=False) for t in ("<x>", "<x>y", "x><", "><x", "<x><")]
    )
    tokens = control_tokens(tokenizer)
    assert tokens is not None
    encoder = PieceEncoder(tokenizer, tokens, 1_000)
    rng = random.Random(5)
    alphabet = ("<", ">", "x", "y", "<x>", " ", "a", "<|im_end|>", "<|im_start|>", "é")
    for _ in range(1_000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 16)))
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids, text
    assert encoder.info().hits > 0


def test_a_template_that_quotes_a_control_token_is_encoded_as_transformers(
    dirs: dict[str, Path], theirs: dict[str, Any]
) -> None:
    ours = ModelTokenizer.load(dirs["chatml"])
    messages = [
        {"role": "user", "content": "Say <|im_end|> and <tool_call>, then <|im_start|>"},
        {"role": "assistant", "content": "<|im_start|><|im_start|> </tool_call>x"},
        {"role": "user", "content": "ok"},
    ]
    options: dict[str, Any] = {"tools": [WEATHER_TOOL], "add_generation_prompt": True}
    for _ in range(2):
        ids = ours.encode_chat(messages, **options)
        assert ids == theirs["chatml"].apply_chat_template(
            messages, tokenize=True, return_dict=False, **options
        )


# -- starting from a remembered prefix -------------------------------------------------------------


def _extensions(rng: random.Random, alphabet: tuple[str, ...], num: int) -> list[str]:
    """Texts each made from the one before: cut anywhere (inside a control token too), then
    grown by a few fragments; now and then a fresh one."""
    texts = [""]
    for _ in range(num):
        before = texts[-1] if rng.random() < 0.9 else ""
        kept = before[: rng.randint(len(before) // 2, len(before))] if before else ""
        texts.append(kept + "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))))
    return texts[1:]


@pytest.mark.parametrize("window", [6, 40, 16_384])
def test_texts_grown_from_earlier_ones_are_encoded_as_the_whole_text(
    window: int, dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Overlapping control tokens (one inside, before or after another), texts cut inside them
    and grown again, and a prefix search window that starts anywhere, inside a token too."""
    monkeypatch.setattr("app.chat.pieces.PREFIX_WINDOWS", (window // 2, window))
    tokenizer = _chatml(dirs)
    tokenizer.add_special_tokens(
        [AddedToken(t, normalized=False) for t in ("<x>", "<x>y", "z<x>q", "x><", "<x><")]
    )
    tokens = control_tokens(tokenizer)
    assert tokens is not None
    encoder = PieceEncoder(tokenizer, tokens, 1_000)
    alphabet = ("<", ">", "x", "y", "z", "q", "<x>", " ", "a", "<|im_end|>", "<|im_start|>", "é")
    for text in _extensions(random.Random(3), alphabet, 3_000):
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids, text
    info = encoder.info()
    # a quarter of the texts start from an earlier one (fewer with a window of a few characters)
    assert info.prefix_hits >= (50 if window == 6 else 700)
    assert info.prefix_tokens <= encoder.max_prefix_tokens


def test_a_control_token_crossing_the_remembered_cut_is_not_a_start(
    dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new text has the earlier text up to its cut and a control token at the cut, but
    another one starting before the cut runs past it: that one is the match, not the cut."""
    monkeypatch.setattr("app.chat.pieces.PREFIX_WINDOWS", (9,))  # the search starts at the cut
    tokenizer = _chatml(dirs)
    tokenizer.add_special_tokens([AddedToken(t, normalized=False) for t in ("<x>", "z<x>q")])
    tokens = control_tokens(tokenizer)
    assert tokens is not None
    encoder = PieceEncoder(tokenizer, tokens, 1_000)
    encoder.encode("hello z<x>r")  # remembers "hello z", cut before "<x>"
    crossed = "hello z<x>q rain"  # "z<x>q" is the match; no cut before "<x>"
    assert len(crossed) - 9 == len("hello z")
    assert encoder.encode(crossed) == tokenizer.encode(crossed, add_special_tokens=False).ids
    assert encoder.info().prefix_hits == 0
    uncrossed = "hello z<x>r rain"
    assert encoder.encode(uncrossed) == tokenizer.encode(uncrossed, add_special_tokens=False).ids
    assert encoder.info().prefix_hits == 1


def test_an_edited_turn_misses_the_prefix_and_a_resent_request_hits_it(
    dirs: dict[str, Path], theirs: dict[str, Any]
) -> None:
    ours = ModelTokenizer.load(dirs["llama3"])
    requests = _growing_conversation("llama3", 5, 3)
    for messages in requests:
        ours.encode_chat(messages)
    before = ours.piece_cache
    assert before is not None and (before.prefix_hits, before.prefixes) == (3, 1)
    edited = copy.deepcopy(requests[-1])
    edited[1]["content"] += " (edited)"
    ids = ours.encode_chat(edited)
    assert ids == theirs["llama3"].apply_chat_template(
        edited, tokenize=True, return_dict=False, add_generation_prompt=True
    )
    after_edit = ours.piece_cache
    assert after_edit is not None
    assert (after_edit.prefix_hits, after_edit.prefixes) == (3, 2)  # a new conversation
    assert after_edit.misses - before.misses == 1  # the edited turn's piece
    # sent again: all from its own prefix, but for its last piece (<|end_header_id|>\n\n)
    ours.encode_chat(requests[-1])
    resent = ours.piece_cache
    assert resent is not None
    assert (resent.prefix_hits, resent.prefixes) == (4, 2)
    assert (resent.misses, resent.hits - after_edit.hits) == (after_edit.misses, 1)


@pytest.mark.parametrize("model", MODELS)
def test_the_words_forms_are_the_lists_as_uint32_arrays(model: str, dirs: dict[str, Path]) -> None:
    """What the router hashes (``*_words``) is what the list forms give, request by request,
    and a caller writing into an array it was given changes nothing the cache gives later."""
    ours, listed = ModelTokenizer.load(dirs[model]), ModelTokenizer.load(dirs[model])
    for messages in _growing_conversation(model if model in STYLES else "chatml", 7, 4):
        words = ours.encode_chat_words(messages)
        expected = listed.encode_chat(messages)
        assert words.dtype == np.uint32 and words.tolist() == expected
        words[:] = 0  # the caller's own array: not the cache's
    last = _growing_conversation(model if model in STYLES else "chatml", 7, 4)[-1]
    assert ours.encode_chat_words(last).tolist() == listed.encode_chat(last)
    text = "The weather in Paris is " + "rainy " * 40
    assert ours.encode_text_words(text).tolist() == listed.encode_text(text)
    whole = ModelTokenizer.load(dirs[model], cache_tokens=0)
    assert (
        whole.encode_chat_words(last).tolist()
        == whole.encode_chat(last)
        == listed.encode_chat(last)
    )
    assert whole.encode_text_words(text).tolist() == listed.encode_text(text)
