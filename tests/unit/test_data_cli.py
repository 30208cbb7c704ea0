"""`llm-train data prepare | inspect`: statistics, cache status and decoded samples with trained-on text marked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llm_train.cli import main


def test_prepare_then_inspect_the_chat_recipe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = f"data.cache_dir={tmp_path}"
    assert main(["data", "prepare", "--recipe", "tiny-cpu-chat", cache]) == 0
    out = capsys.readouterr().out
    assert "tokenised 185 rows" in out and "train total:" in out and "eval total:" in out

    assert main(["data", "inspect", "--recipe", "tiny-cpu-chat", "-n", "2", cache]) == 0
    out = capsys.readouterr().out
    assert "cache: tokenize hit, pack hit" in out  # prepared ahead of time
    for needle in ("packing efficiency", "row length (tokens) p50", "truncated 0", "trained on"):
        assert needle in out, needle
    samples = out.split("--- sample ")[1:]
    assert len(samples) == 2
    for sample in samples:
        # Only the assistant turn is marked: the user's question sits outside the brackets.
        assert "<|user|>\nExplain the Python topic" in sample.split("⟦")[0]
        assert sample.count("⟦") == 1 and sample.rstrip().endswith("<|eos|>⟧")


def test_inspect_counts_overlong_samples(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "data",
        "inspect",
        "--recipe",
        "tiny-cpu-chat",
        "-n",
        "0",
        f"data.cache_dir={tmp_path}",
        "data.seq_len=128",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    truncated = re.search(r"\(overlong: truncate\): truncated (\d+)", out)
    assert truncated and int(truncated.group(1)) > 0 and "--- sample" not in out


def test_a_streamed_corpus_is_not_tokenised_up_front(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text('{"text": "one"}\n{"text": "two"}\n')
    streamed = [
        f"data.train=[{{path: {corpus}, streaming: true}}]",
        "data.eval_fraction=0",
        f"data.cache_dir={tmp_path}",
    ]
    for command in ("prepare", "inspect"):
        assert main(["data", command, "--recipe", "tiny-cpu", *streamed]) == 0
        assert "nothing to prepare" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["docs.jsonl"]  # no tokenised cache was written
