"""Checks on the committed tiny-cpu assets (corpus, tokenizer, chat examples, preference pairs) and their build script."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from llm_train.assets import build

ASSETS = build.DEFAULT_OUT
TOKENIZER_DIR = ASSETS / "tokenizer"


@pytest.fixture(scope="module")
def manifest() -> dict[str, Any]:
    return json.loads((ASSETS / "MANIFEST.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    # A local folder: must load without any hub access.
    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)


def _corpus_paragraphs() -> list[str]:
    text = (ASSETS / "corpus.txt").read_text(encoding="utf-8")
    return [p for p in text.split("\n\n") if p.strip()]


def test_manifest_lists_existing_files(manifest: dict[str, Any]) -> None:
    assert manifest["vocab_size"] == build.VOCAB_SIZE
    assert {"corpus.txt", "chat.jsonl", "tokenizer/tokenizer.json"} <= set(manifest["files"])
    for rel in manifest["files"]:
        assert (ASSETS / rel).is_file(), rel
    corpus = (ASSETS / "corpus.txt").read_text(encoding="utf-8")
    assert len(corpus) == manifest["corpus_chars"]


def test_committed_files_match_manifest(manifest: dict[str, Any]) -> None:
    # Catches hand edits / partial regeneration: the manifest must describe the committed bytes.
    for rel, digest in manifest["files"].items():
        assert hashlib.sha256((ASSETS / rel).read_bytes()).hexdigest() == digest, rel


def test_corpus_is_normalised() -> None:
    text = (ASSETS / "corpus.txt").read_text(encoding="utf-8")
    assert text.endswith("\n") and not text.endswith("\n\n")
    assert "\n\n\n" not in text
    assert all(line == line.rstrip() for line in text.split("\n"))


def test_tokenizer_special_tokens(tokenizer: Any) -> None:
    assert len(tokenizer) == build.VOCAB_SIZE
    assert tokenizer.bos_token == build.BOS
    assert tokenizer.eos_token == build.EOS
    assert tokenizer.pad_token == build.PAD
    ids = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    assert None not in ids and len(ids) == 3
    for token in (build.USER, build.ASSISTANT, build.SYSTEM):
        # Each role marker must be a single token, not split into bytes.
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token


def test_tokenizer_round_trips_corpus_paragraphs(tokenizer: Any) -> None:
    paragraphs = _corpus_paragraphs()
    # A spread of paragraphs (prose, grammar blocks, unicode quotes) plus text outside the corpus.
    samples = [*paragraphs[:: max(1, len(paragraphs) // 50)], "héllo wörld 🙂\ttabs  and  spaces \n"]
    for text in samples:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text


def test_tokenizer_compresses_corpus(tokenizer: Any) -> None:
    # Sanity check that BPE merges were learned (byte-level alone would be ~1 char per token).
    paragraph = max(_corpus_paragraphs()[:200], key=len)
    assert len(tokenizer.encode(paragraph, add_special_tokens=False)) < len(paragraph) / 2.5


def test_chat_template(tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "What is a list?"},
        {"role": "assistant", "content": "A mutable sequence."},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == ("<|bos|><|user|>\nWhat is a list?<|eos|><|assistant|>\nA mutable sequence.<|eos|>")
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|eos|><|assistant|>\n")

    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assistant_ids = [i for i, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert tokenizer.decode(assistant_ids) == "A mutable sequence.<|eos|>"


def test_chat_jsonl() -> None:
    lines = (ASSETS / "chat.jsonl").read_text(encoding="utf-8").splitlines()
    assert 150 <= len(lines) <= build.MAX_CHAT_EXAMPLES
    n_system = 0
    for line in lines:
        messages = json.loads(line)["messages"]
        roles = [m["role"] for m in messages]
        assert roles in (["user", "assistant"], ["system", "user", "assistant"]), roles
        n_system += roles[0] == "system"
        assert messages[-2]["content"].startswith("Explain the Python topic '")
        answer = messages[-1]["content"]
        assert 0 < len(answer) <= build.MAX_ANSWER_CHARS
    assert n_system > 0


def test_preferences_jsonl() -> None:
    # The shape of HuggingFaceH4/ultrafeedback_binarized train_prefs: a prompt, and two conversations
    # that share its user turn and differ in the assistant's answer (same words, another order).
    lines = (ASSETS / "preferences.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) >= 150
    for line in lines:
        pair = json.loads(line)
        chosen, rejected = pair["chosen"], pair["rejected"]
        assert [m["role"] for m in chosen] == [m["role"] for m in rejected] == ["user", "assistant"]
        assert chosen[0] == rejected[0] == {"role": "user", "content": pair["prompt"]}
        assert chosen[1]["content"] != rejected[1]["content"]
        # The same words on the same lines, in another order.
        good, bad = chosen[1]["content"].split("\n"), rejected[1]["content"].split("\n")
        assert len(good) == len(bad) and all(
            sorted(g.split()) == sorted(b.split()) for g, b in zip(good, bad, strict=True)
        )


# What each committed file is built from besides build.py: pydoc_data.topics changes between Python
# releases, and the saved tokenizer files depend on the library versions that wrote them.
BUILT_FROM = {
    "corpus.txt": ("python_version",),
    "chat.jsonl": ("python_version",),
    "preferences.jsonl": ("python_version",),
    "prompts.jsonl": ("python_version",),
    "tokenizer/tokenizer.json": ("python_version", "tokenizers_version"),
    "tokenizer/tokenizer_config.json": ("python_version", "tokenizers_version", "transformers_version"),
    "tokenizer/chat_template.jinja": ("transformers_version",),
}


def test_build_is_reproducible_and_rebuilds_every_committed_file_whose_inputs_match(
    tmp_path: Path, manifest: dict[str, Any]
) -> None:
    # Never skipped: on any install two builds agree byte for byte, and each committed file is
    # rebuilt exactly wherever the versions it comes from are the manifest's (all of them on the
    # machine that committed the assets).
    first, second = tmp_path / "a", tmp_path / "b"
    assert build.main(["--out", first]) == 0 and build.main(["--out", second]) == 0
    rebuilt = json.loads((first / "MANIFEST.json").read_text(encoding="utf-8"))
    assert (first / "MANIFEST.json").read_bytes() == (second / "MANIFEST.json").read_bytes()
    assert set(rebuilt["files"]) == set(manifest["files"]) == set(BUILT_FROM)
    assert rebuilt["vocab_size"] == manifest["vocab_size"]
    same_inputs = [f for f, inputs in BUILT_FROM.items() if all(rebuilt[k] == manifest[k] for k in inputs)]
    assert {f: rebuilt["files"][f] for f in same_inputs} == {f: manifest["files"][f] for f in same_inputs}
    if len(same_inputs) == len(BUILT_FROM):
        assert (first / "MANIFEST.json").read_bytes() == (ASSETS / "MANIFEST.json").read_bytes()
