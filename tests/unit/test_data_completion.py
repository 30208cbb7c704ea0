"""The `completion` format: TRL's prompt-completion rows, text or conversational, trained on the completion only.

Text rows against an independent tokenisation; the bundled chat examples written as TRL's
conversational rows give the chat format's ids and masks token for token; empty completions are
dropped and counted; the one-line errors; and the objectives that train on it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llm_train.config.recipe import load_recipe
from llm_train.data import prepare_data
from llm_train.errors import UserError
from tests.unit.data_fixtures import CHAT_JSONL, data_section, get_tokenizer, write_jsonl


def _store(tmp_path: Path, rows: list[Any] | Path, seq_len: int = 128, **source: Any) -> Any:
    """The single source's part after prepare_data (padded, nothing held out)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = rows if isinstance(rows, Path) else write_jsonl(tmp_path / "rows.jsonl", rows)
    source = {"path": str(path), "format": "completion", **source}
    section = data_section(tmp_path, train=[source], seq_len=seq_len, packing="padded")
    return prepare_data(section, get_tokenizer(), seed=0).train.parts[0]


def _rows(part: Any) -> list[tuple[list[int], list[int]]]:
    """Each stored row as (ids, loss mask)."""
    offsets = part.store.offsets
    return [
        (
            part.store.input_ids[offsets[i] : offsets[i + 1]].tolist(),
            part.store.loss_mask[offsets[i] : offsets[i + 1]].tolist(),
        )
        for i in range(len(offsets) - 1)
    ]


def test_text_rows_train_on_the_completion_and_its_eos(tmp_path: Path) -> None:
    tok = get_tokenizer()
    part = _store(
        tmp_path,
        [{"prompt": "Name a mutable type.", "completion": "A list."}],
        prompt_template="Q: {prompt}\nA: ",
    )
    [(ids, mask)] = _rows(part)
    prompt = tok.encode("Q: Name a mutable type.\nA: ", add_special_tokens=False)
    completion = tok.encode("A list.", add_special_tokens=False) + [tok.eos_token_id]
    assert ids == prompt + completion
    assert mask == [0] * len(prompt) + [1] * len(completion)


def test_conversational_rows_train_on_the_tokens_a_chat_row_trains_on(tmp_path: Path) -> None:
    # Every bundled conversation ends with its one assistant turn: as TRL's prompt-completion rows
    # (the turns before it as the prompt, it as the completion) the loss covers the same tokens.
    conversations = [json.loads(line)["messages"] for line in CHAT_JSONL.read_text().splitlines()]
    assert all([m["role"] for m in c].count("assistant") == 1 for c in conversations)
    rows = [{"prompt": c[:-1], "completion": c[-1:]} for c in conversations]
    completion = _store(tmp_path / "completion", rows, seq_len=256)
    section = data_section(
        tmp_path / "chat", train=[{"path": str(CHAT_JSONL), "format": "chat"}], seq_len=256, packing="padded"
    )
    chat = prepare_data(section, get_tokenizer(), seed=0).train.parts[0]
    for name in ("offsets", "input_ids", "loss_mask"):
        assert np.array_equal(getattr(completion.store, name), getattr(chat.store, name)), name
    assert completion.stats == chat.stats


def test_a_text_completion_after_a_message_prompt_is_the_assistant_turn(tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "What is a tuple?"}]
    as_text = _rows(_store(tmp_path / "a", [{"prompt": messages, "completion": "An immutable sequence."}]))
    as_messages = [{"role": "assistant", "content": "An immutable sequence."}]
    assert as_text == _rows(_store(tmp_path / "b", [{"prompt": messages, "completion": as_messages}]))
    tok = get_tokenizer()
    [(ids, mask)] = as_text
    assert tok.decode([t for t, m in zip(ids, mask, strict=True) if m]) == "An immutable sequence.<|eos|>"


def test_rows_with_an_empty_completion_are_dropped_and_counted(tmp_path: Path) -> None:
    user = [{"role": "user", "content": "Anything?"}]
    rows = [
        {"prompt": "Say nothing.", "completion": "  "},
        {"prompt": "Say yes.", "completion": "Yes."},
        {"prompt": user, "completion": []},
        {"prompt": user, "completion": [{"role": "assistant", "content": ""}]},
    ]
    part = _store(tmp_path, rows)
    assert part.stats["rows"] == 4 and part.stats["empty"] == 3 and part.stats["samples"] == 1


@pytest.mark.parametrize(
    ("rows", "source", "match"),
    [
        (
            [{"instruction": "Add.", "output": "3"}],
            {},
            r"data.train: .*rows.jsonl: no field 'prompt' for format completion \(fields: instruction, output\); "
            r"set prompt_field / completion_field; these columns look like format: instruction$",
        ),
        (
            [{"prompt": "Add.", "completion": "3"}],
            {"format": "instruction"},
            r"no field 'instruction' for format instruction \(fields: prompt, completion\); set prompt_field / "
            r"response_field; these columns look like format: completion$",
        ),
        (
            [{"prompt": "Add.", "completion": "3"}, {"prompt": None, "completion": "4"}],
            {},
            r"data.train: .*rows.jsonl: row 2: no 'prompt' \(the prompt\); fill it in or remove the row$",
        ),
    ],
)
def test_mistakes_are_one_line_naming_the_field_and_the_fix(
    tmp_path: Path, rows: list[Any], source: dict[str, Any], match: str
) -> None:
    with pytest.raises(UserError, match=match) as info:
        _store(tmp_path, rows, **source)
    assert "\n" not in str(info.value)


def test_it_trains_with_objective_lm_and_is_refused_by_the_pair_objectives(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "Add.", "completion": "3"}])
    source = f"data.train=[{{path: {path}, format: completion}}]"
    assert load_recipe("tiny-cpu", [source]).data.sources("train")[0].format == "completion"
    with pytest.raises(
        UserError, match=r"data.train\[0\] is format completion, but objective=dpo trains on pairs"
    ):
        load_recipe("tiny-cpu", [source, "objective=dpo", "data.packing=padded"])
