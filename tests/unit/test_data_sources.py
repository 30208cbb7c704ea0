"""Every kind of source loads through the same path; several sources mix; eval is carved or its own source."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llm_train.config.recipe import load_recipe
from llm_train.data import prepare_data
from llm_train.errors import UserError
from tests.unit.data_fixtures import CHAT_JSONL, data_section, get_tokenizer, text_rows, write_jsonl

ROWS = text_rows(12)


def _tokens(tmp_path: Path, **fields: Any) -> list[int]:
    split = prepare_data(data_section(tmp_path, seq_len=64, **fields), get_tokenizer(), seed=0).train
    store = split.parts[0].store
    return store.input_ids[: int(store.offsets[-1])].tolist()


@pytest.fixture
def expected(tmp_path: Path) -> list[int]:
    return _tokens(tmp_path / "ref", train=[str(write_jsonl(tmp_path / "rows.jsonl", ROWS))])


def test_parquet_csv_json_array_and_text(tmp_path: Path, expected: list[int]) -> None:
    import pandas as pd

    frame = pd.DataFrame(ROWS)
    frame.to_parquet(tmp_path / "rows.parquet")
    frame.to_csv(tmp_path / "rows.csv", index=False)
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    for name in ("rows.parquet", "rows.csv", "rows.json"):
        assert _tokens(tmp_path / name.replace(".", "_"), train=[str(tmp_path / name)]) == expected, name
    (tmp_path / "docs.txt").write_text("\n\n".join(r["text"] for r in ROWS))
    assert (
        _tokens(tmp_path / "txt", train=[str(tmp_path / "docs.txt")]) == expected
    )  # paragraphs are documents


def test_globs_and_folders_of_files(tmp_path: Path, expected: list[int]) -> None:
    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(shards / "part-0.jsonl", ROWS[:5])
    write_jsonl(shards / "part-1.jsonl", ROWS[5:])
    assert _tokens(tmp_path / "glob", train=[str(shards / "part-*.jsonl")]) == expected
    assert _tokens(tmp_path / "dir", train=[str(shards)]) == expected


def test_save_to_disk_folders(tmp_path: Path, expected: list[int]) -> None:
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "single"))
    assert _tokens(tmp_path / "c1", train=[str(tmp_path / "single")]) == expected
    datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(str(tmp_path / "dict"))
    assert _tokens(tmp_path / "c2", train=[{"path": str(tmp_path / "dict"), "split": "train"}]) == expected
    with pytest.raises(UserError, match=r"has no split 'validation' \(splits: train, test\)"):
        _tokens(tmp_path / "c3", train=[{"path": str(tmp_path / "dict"), "split": "validation"}])


def test_hub_id_offline_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets.config
    import huggingface_hub.constants

    # The libraries read these at import time; patch the values they use, not just the environment.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        UserError, match=r"cannot load 'nobody/no-such-dataset' as a local path or a hub dataset"
    ):
        _tokens(tmp_path, train=["nobody/no-such-dataset"])


def test_mixture_of_formats_and_weights(tmp_path: Path) -> None:
    text = write_jsonl(tmp_path / "t.jsonl", ROWS)
    alpaca = write_jsonl(
        tmp_path / "a.jsonl", [{"instruction": f"Say {i}", "output": str(i)} for i in range(8)]
    )
    section = data_section(
        tmp_path,
        train=[
            str(text),
            {"path": str(CHAT_JSONL), "format": "chat", "weight": 0.5},
            {"path": str(alpaca), "format": "instruction", "weight": 3},
        ],
        seq_len=256,
    )
    split = prepare_data(section, get_tokenizer(), seed=0).train
    assert [p.source.format for p in split.parts] == ["text", "chat", "instruction"]
    assert split.weights == [1.0, 0.5, 3.0]


def test_eval_fraction_carves_rows_and_eval_sources_replace_it(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", text_rows(40))
    carved = prepare_data(
        data_section(tmp_path, train=[str(path)], seq_len=64, eval_fraction=0.1), get_tokenizer(), 0
    )
    assert carved.eval is not None
    train_rows = set(carved.train.parts[0].placement.spans.row.tolist())
    eval_rows = set(carved.eval.parts[0].placement.spans.row.tolist())
    assert len(eval_rows) == 4 and not train_rows & eval_rows and len(train_rows | eval_rows) == 40
    held = write_jsonl(tmp_path / "held.jsonl", text_rows(5, seed=9))
    own = prepare_data(
        data_section(tmp_path, train=[str(path)], eval=[str(held)], seq_len=64, eval_fraction=0.1),
        get_tokenizer(),
        0,
    )
    assert len(set(own.train.parts[0].placement.spans.row.tolist())) == 40  # nothing carved
    assert own.eval is not None and own.eval.parts[0].stats["rows"] == 5


def test_source_paths_in_a_recipe_are_relative_to_its_file(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    text = (Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu-chat.yaml").read_text()
    recipe.write_text(
        text.replace("../llm_train/assets/tiny/tokenizer", str(CHAT_JSONL.parent / "tokenizer")).replace(
            "../llm_train/assets/tiny/chat.jsonl", "./data/chat.jsonl"
        )
    )
    loaded = load_recipe(str(recipe))
    assert loaded.data.sources("train")[0].path == str(tmp_path / "data" / "chat.jsonl")
