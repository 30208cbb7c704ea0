"""Bad input gets one line that names the file / row / key and the fix (UserError, exit 2, no traceback)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llm_train.config.recipe import load_recipe
from llm_train.data import prepare_data
from llm_train.errors import UserError
from tests.unit.data_fixtures import data_section, fresh_tokenizer, get_tokenizer, write_jsonl


def _fails(tmp_path: Path, match: str, tokenizer: Any = None, **fields: Any) -> str:
    with pytest.raises(UserError, match=match) as info:
        prepare_data(data_section(tmp_path, seq_len=64, **fields), tokenizer or get_tokenizer(), seed=0)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_file(tmp_path: Path) -> None:
    _fails(tmp_path, r"data.train: file not found: .*none.jsonl", train=[str(tmp_path / "none.jsonl")])


def test_glob_without_matches(tmp_path: Path) -> None:
    _fails(tmp_path, r"data.train: no files match", train=[str(tmp_path / "*.parquet")])


def test_empty_file(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    _fails(tmp_path, r"empty.jsonl is empty", train=[str(tmp_path / "empty.jsonl")])


def test_dataset_of_blank_documents(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "blank.jsonl", [{"text": ""}, {"text": "   "}])
    _fails(tmp_path, r"every row is empty", train=[str(path)])


def test_json_line_that_does_not_parse_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "fine too"}\n{"text": "broken\n{"text": "never read"}\n')
    _fails(tmp_path, rf"{path}:3: not valid JSON", train=[str(path)])


def test_missing_field_is_named_with_the_fields_present(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}], "id": 1}])
    message = _fails(tmp_path, r"no field 'text' for format text \(fields: messages, id\)", train=[str(path)])
    assert "format: chat" in message  # the columns say what the user probably meant

    rows = [{"instruction": "Say hi", "response": "hi"}]
    path = write_jsonl(tmp_path / "alpaca.jsonl", rows)
    _fails(
        tmp_path,
        r"no field 'output' for format instruction \(fields: instruction, response\); set prompt_field / response_field",
        train=[{"path": str(path), "format": "instruction"}],
    )


def test_chat_dataset_without_a_chat_template(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    tokenizer = fresh_tokenizer()
    tokenizer.chat_template = None
    _fails(
        tmp_path,
        r"format chat needs a chat template .* has none; set data.chat_template",
        tokenizer=tokenizer,
        train=[{"path": str(path), "format": "chat"}],
    )


def test_malformed_messages_name_the_row(tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "user", "content": "ok"}]}, {"messages": [{"role": "user", "text": "x"}]}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    _fails(
        tmp_path,
        r"row 2: message 0 has no 'content' \(has: role, text\); set role_field / content_field on this source",
        train=[{"path": str(path), "format": "chat"}],
    )


def test_chat_template_failure_names_the_row(tmp_path: Path) -> None:
    rows = [
        {"messages": [{"role": "user", "content": "ok"}]},
        {"messages": [{"role": "developer", "content": "x"}]},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    _fails(
        tmp_path,
        r"row 2: the chat template failed \(Unsupported chat role: developer\)",
        train=[{"path": str(path), "format": "chat"}],
    )


def test_tokenized_labels_must_match_input_ids(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "tok.jsonl", [{"input_ids": [5, 6, 7], "labels": [5, 9, 7]}])
    _fails(
        tmp_path,
        r"row 1: labels must equal input_ids or be -100",
        train=[{"path": str(path), "format": "tokenized"}],
    )
    path = write_jsonl(tmp_path / "tok.jsonl", [{"input_ids": [5, 6, 99999]}])
    _fails(tmp_path, r"row 1: token id 99999 is outside", train=[{"path": str(path), "format": "tokenized"}])


def test_overlong_error_policy(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "long.jsonl", [{"text": "short"}, {"text": "word " * 200}])
    _fails(
        tmp_path,
        r"row 2 has \d+ tokens, more than data.seq_len=64",
        train=[{"path": str(path), "overlong": "error"}],
    )


@pytest.mark.parametrize("weight", [0, -1.5])
def test_mixture_weight_must_be_positive(weight: float) -> None:
    with pytest.raises(UserError, match=rf"data.train\[1\]: weight must be > 0 \(got {float(weight)}\)"):
        load_recipe("tiny-cpu", [f"data.train=[a.txt, {{path: b.jsonl, format: chat, weight: {weight}}}]"])


def test_unknown_source_key_lists_the_valid_ones() -> None:
    with pytest.raises(
        UserError,
        match=r"data.train\[0\]: unknown key 'messages' for format chat; did you mean 'messages_field'\?",
    ):
        load_recipe("tiny-cpu", ["data.train=[{path: b.jsonl, format: chat, messages: conv}]"])
    with pytest.raises(
        UserError,
        match=r"data.eval\[0\].format: unknown format 'sharegpt'; use one of text, instruction, chat, tokenized",
    ):
        load_recipe("tiny-cpu", ["data.eval=[{path: b.jsonl, format: sharegpt}]"])


def test_cli_prints_one_line_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from llm_train.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{oops}\n')
    code = main(
        ["data", "prepare", "--recipe", "tiny-cpu", f"data.train=[{bad}]", f"data.cache_dir={tmp_path / 'c'}"]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("llm-train: error: ") and f"{bad}:2: not valid JSON" in err
    assert "Traceback" not in err
