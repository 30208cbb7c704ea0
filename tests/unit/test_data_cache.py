"""The tokenise/pack cache: hit when nothing changed, miss when source, tokenizer or max length changed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from llm_train.data import prepare_data
from tests.unit.data_fixtures import data_section, fresh_tokenizer, get_tokenizer, text_rows, write_jsonl


def _cache(section: Any, tokenizer: Any) -> dict[str, str]:
    return prepare_data(section, tokenizer, seed=0).train.parts[0].cache


def test_second_prepare_is_a_hit_and_reads_the_same_data(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", text_rows(30))
    section = data_section(tmp_path, train=[str(path)], seq_len=64)
    first = prepare_data(section, get_tokenizer(), seed=0).train
    second = prepare_data(section, get_tokenizer(), seed=0).train
    assert first.parts[0].cache == {"tokenize": "miss", "pack": "miss"}
    assert second.parts[0].cache == {"tokenize": "hit", "pack": "hit"}
    assert first.fingerprint == second.fingerprint
    assert (first.parts[0].store.input_ids == second.parts[0].store.input_ids).all()


def test_max_length_change_repacks_without_retokenising(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", text_rows(30))
    _cache(data_section(tmp_path, train=[str(path)], seq_len=64), get_tokenizer())
    assert _cache(data_section(tmp_path, train=[str(path)], seq_len=32), get_tokenizer()) == {
        "tokenize": "hit",
        "pack": "miss",
    }


def test_tokenizer_change_is_a_miss(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", text_rows(30))
    section = data_section(tmp_path, train=[str(path)], seq_len=64)
    _cache(section, get_tokenizer())
    changed = fresh_tokenizer()
    changed.add_tokens(["lambda scope"])  # a new token changes how the same text tokenises
    assert _cache(section, changed) == {"tokenize": "miss", "pack": "miss"}


def test_source_change_is_a_miss(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", text_rows(30))
    section = data_section(tmp_path, train=[str(path)], seq_len=64)
    _cache(section, get_tokenizer())
    write_jsonl(path, text_rows(30, seed=1))
    os.utime(path, ns=(1, 1))  # even with an old mtime, the content hash differs
    assert _cache(section, get_tokenizer())["tokenize"] == "miss"


def test_format_fields_are_part_of_the_key(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "qa.jsonl", [{"q": "Why?", "a": "Because.", "ctx": "x"}] * 3)
    base = {"path": str(path), "format": "instruction", "prompt_field": "q", "response_field": "a"}
    first = _cache(data_section(tmp_path, train=[{**base, "input_field": None}], seq_len=64), get_tokenizer())
    other = _cache(
        data_section(tmp_path, train=[{**base, "input_field": "ctx"}], seq_len=64), get_tokenizer()
    )
    assert first["tokenize"] == other["tokenize"] == "miss"
