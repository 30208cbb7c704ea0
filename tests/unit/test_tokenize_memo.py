"""The per-word tokenisation memo gives exactly the tokenizer's ids, or is not used at all."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import numpy as np
import pytest

from llm_train.data import tokenize_memo
from llm_train.data.formats.base import make_encoder
from llm_train.data.formats.text import TEXT
from llm_train.data.tokenize_memo import TokenizeMemo
from tests.unit.data_fixtures import TOKENIZER_DIR, get_tokenizer

# Every kind of character the cutting rules look at: ASCII and Unicode whitespace (including the
# ones Python and the Unicode standard disagree on), letters, digits (also non-decimal ones),
# punctuation, contraction parts, CJK, emoji, and the tokenizer's added tokens.
_ALPHABET = [
    *"aZé0²½ \t\n\r\x0b\x0c\x1c\x1f\x85\xa0\u1680\u2028\u3000\u180e\u200b\ufeff!.,'\"-_sSlLdD日😀(",
    *[
        "'s",
        "'ll",
        "'RE",
        "  ",
        "   ",
        "\n\n",
        " \n ",
        "\r\n",
        "word",
        " word",
        "<|eos|>",
        "<|user|>",
        "<|",
        "|>",
    ],
]


def _ids(rows: list[bytes]) -> list[list[int]]:
    return [np.frombuffer(row, dtype=np.int32).tolist() for row in rows]


def _fuzz(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_ALPHABET) for _ in range(rng.randint(0, 40))) for _ in range(n)]


def _variant(pre_tokenizer: dict[str, Any] | None = None, **changes: Any) -> Any:
    """The bundled tokenizer, made sensitive, with another pre-tokenizer or top-level settings."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    _merge_every_pair(spec["model"])
    if pre_tokenizer is not None:
        spec["pre_tokenizer"] = pre_tokenizer
    spec.update(changes)
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token="<|eos|>")


def _merge_every_pair(model: dict[str, Any]) -> None:
    """Merge, first of all, every pair of the characters the cutting rules look at.

    The bundled vocabulary never merges newlines, so a wrong cut beside one would change no id;
    with these merges any two of them split apart that the tokenizer keeps together do.
    """
    from tokenizers import pre_tokenizers

    to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    chars = [to_bytes.pre_tokenize_str(c)[0][0] for c in " \n\t\r\x0b\x0c.!'\"as0Z(-_"]
    vocab = model["vocab"]
    pairs = [[a, b] for a in chars for b in chars]
    for a, b in pairs:
        vocab.setdefault(a + b, max(vocab.values()) + 1)
    model["merges"] = pairs + [m for m in model["merges"] if m not in pairs]


def _split_then_bytes(pattern: str) -> dict[str, Any]:
    return {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }


_BOS_TEMPLATE = {
    "type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [1], "tokens": ["<|bos|>"]}},
}

SUPPORTED = {
    "gpt2 (bundled)": lambda: get_tokenizer(),
    "gpt2": lambda: _variant(),
    "llama3 split": lambda: _variant(_split_then_bytes(tokenize_memo._LLAMA3)),
    "qwen2 split": lambda: _variant(_split_then_bytes(tokenize_memo._QWEN2)),
    "gpt2 with bos": lambda: _variant(post_processor=_BOS_TEMPLATE),
}


@pytest.mark.parametrize("name", list(SUPPORTED))
def test_ids_equal_the_tokenizer_on_adversarial_text(name: str) -> None:
    tok = SUPPORTED[name]()
    memo = TokenizeMemo.for_tokenizer(tok)
    assert memo is not None
    backend = tok.backend_tokenizer
    # Two rounds of batches: the first learns, the later ones read the memo.
    for seed in range(3):
        texts = _fuzz(3000, seed) + ["", " ", "  x", "x  ", "a   b", "\n    indented", "type.\n\nFor", "it's"]
        for special in (True, False):
            want = [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=special)]
            got = _ids(memo.encode(texts, special))
            bad = [t for t, g, w in zip(texts, got, want, strict=True) if g != w]
            assert not bad, f"{len(bad)} texts differ, e.g. {bad[:3]!r}"


def test_ids_equal_the_tokenizer_on_prose_and_code() -> None:
    tok = get_tokenizer()
    corpus = (TOKENIZER_DIR.parent / "corpus.txt").read_text(encoding="utf-8").split("\n\n")
    texts = ["\n\n".join(corpus[i : i + 5]) for i in range(0, len(corpus), 5)]
    want = [e.ids for e in tok.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=True)]
    assert _ids(TokenizeMemo.for_tokenizer(tok).encode(texts, True)) == want


def test_a_full_memo_starts_over_and_stays_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenize_memo, "_MAX_ENTRIES", 50)
    tok = get_tokenizer()
    memo = TokenizeMemo.for_tokenizer(tok)
    for seed in range(5):
        texts = _fuzz(200, seed)
        want = [e.ids for e in tok.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
        assert _ids(memo.encode(texts, False)) == want
    # Cleared when full, then refilled by one batch: bounded by the limit plus one batch's units.
    assert len(memo._first) + len(memo._spaced) + len(memo._pieces) < 50 + 200 * 40 * 3


@pytest.mark.parametrize(
    "name,tok",
    [
        ("a normalizer", lambda: _variant(normalizer={"type": "NFC"})),
        (
            "add_prefix_space",
            lambda: _variant(
                {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
            ),
        ),
        ("an unknown split regex", lambda: _variant(_split_then_bytes(r"\w+|\s+|[^\w\s]+"))),
        ("a plain split pre-tokenizer", lambda: _variant({"type": "Whitespace"})),
        ("BPE dropout", lambda: _with_dropout()),
    ],
)
def test_other_tokenizers_keep_the_plain_path(name: str, tok: Any) -> None:
    tokenizer = tok()
    assert TokenizeMemo.for_tokenizer(tokenizer) is None, name
    texts = _fuzz(50, 7)
    if name != "BPE dropout":  # dropout is random by design
        assert _ids(make_encoder(tokenizer)(texts, True)) == tokenizer(texts)["input_ids"]


def _with_dropout() -> Any:
    tok = _variant()
    spec = json.loads(tok.backend_tokenizer.to_str())
    spec["model"]["dropout"] = 0.1
    return _variant(model=spec["model"])


def test_truncation_keeps_the_plain_path() -> None:
    tok = _variant()
    tok.backend_tokenizer.enable_truncation(8)
    assert TokenizeMemo.for_tokenizer(tok) is None


def test_the_pipeline_uses_the_memo_for_the_bundled_tokenizer() -> None:
    encode = make_encoder(get_tokenizer())
    assert getattr(encode, "__self__", None).__class__ is TokenizeMemo


def test_data_tokenize_memo_false_tokenises_through_the_tokenizer_alone_to_the_same_rows() -> None:
    from llm_train import ASSETS_DIR
    from llm_train.config.recipe import load_recipe

    tok = get_tokenizer()
    data = load_recipe("tiny-cpu", ["data.tokenize_memo=false"]).data
    source = data.sources("train")[0]
    texts = (ASSETS_DIR / "tiny" / "corpus.txt").read_text().splitlines()[:200]
    batch, indices = {"text": texts}, list(range(len(texts)))
    plain = TEXT.tokenize_fn(source, tok, None, "data.train[0]", data.tokenize_memo)
    memo = TEXT.tokenize_fn(source, tok, None, "data.train[0]")
    assert plain(batch, indices) == memo(batch, indices)
    assert getattr(make_encoder(tok, memo_words=False), "__self__", None).__class__ is not TokenizeMemo


def test_cuts_only_where_the_tokenizer_sees_no_whitespace() -> None:
    """The cutting regexes call a character non-whitespace only if Oniguruma (the tokenizer's engine) agrees.

    Probe: in "a" + c + c, a whitespace c ends a pre-token between the two copies (a run gives
    up its last character before a non-space); any other c keeps them in one pre-token.
    """
    from tokenizers import pre_tokenizers

    rng = random.Random(0)
    codes = [*range(0xD800), *range(0xE000, 0x10000), *rng.sample(range(0x10000, 0x110000), 5000)]
    chars = [chr(c) for c in codes]
    probe = "".join("a" + c + c for c in chars) + "a"
    ends = {
        end
        for _, (_, end) in pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True).pre_tokenize_str(
            probe
        )
    }
    onig_space = {c for i, c in enumerate(chars) if 3 * i + 2 in ends}
    assert set(" \t\n\r\x0b\x0c") <= onig_space  # the probe sees whitespace when it is there
    not_space = re.compile(tokenize_memo._NOT_SPACE)
    assert not [hex(ord(c)) for c in onig_space if not_space.match(c)]


@pytest.mark.parametrize("name", ["_GPT2", "_LLAMA3", "_QWEN2"])
def test_ascii_forms_split_ascii_text_like_the_tokenizer(name: str) -> None:
    from tokenizers import Regex, pre_tokenizers

    pattern = getattr(tokenize_memo, name)
    theirs = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    ours = tokenize_memo._ASCII_PRE_TOKENS[pattern]
    ascii_chars = [chr(c) for c in range(128)]
    pool = [*ascii_chars, *" \t\n\r0aZ'", "'s", "'LL", "'Re", "0000", "12345", "   ", "\r\n", "\n\n", " \n"]
    rng = random.Random(0)
    texts = ["".join(rng.choice(pool) for _ in range(rng.randint(1, 30))) for _ in range(4000)]
    texts.append("".join(a + b for a in ascii_chars for b in ascii_chars))  # every pair, once
    for text in texts:
        assert ours.findall(text) == [piece for piece, _ in theirs.pre_tokenize_str(text)], repr(text)
