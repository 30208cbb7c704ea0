"""Each format's tokens and loss mask, checked token by token against an independent tokenisation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llm_train.data import prepare_data
from llm_train.data.formats.base import make_encoder
from llm_train.data.model_inputs import build_rows
from tests.unit.data_fixtures import data_section, get_tokenizer, write_jsonl

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is a list?"},
    {"role": "assistant", "content": "A mutable sequence."},
    {"role": "user", "content": "And a tuple?"},
    {"role": "assistant", "content": "An immutable one."},
]


def _expected(segments: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """Token ids and loss mask built segment by segment (segments end at special tokens, so BPE agrees)."""
    tok = get_tokenizer()
    ids, mask = [], []
    for text, trained in segments:
        piece = tok.encode(text, add_special_tokens=False)
        ids += piece
        mask += [int(trained)] * len(piece)
    return ids, mask


def _only_sample(tmp_path: Path, source: dict[str, Any], **data: Any) -> tuple[list[int], list[int], dict]:
    """Prepare one single-row source; return (ids, mask) from the store and the packed micro-batch."""
    section = data_section(tmp_path, train=[source], seq_len=128, **data)
    split = prepare_data(section, get_tokenizer(), seed=0).train
    part = split.parts[0]
    start, length = int(part.placement.spans.start[0]), int(part.placement.spans.length[0])
    ids, mask = part.store.tokens(start, length)
    return ids.tolist(), mask.tolist(), build_rows(split, [(0, 0)])


def _assert_labels(batch: dict, ids: list[int], mask: list[int]) -> None:
    labels = batch["labels"][0]
    expected = [t if m else -100 for t, m in zip(ids, mask, strict=True)]
    expected[0] = -100  # nothing precedes a sample's first token
    assert labels[: len(ids)].tolist() == expected
    assert (labels[len(ids) :] == -100).all()
    assert batch["input_ids"][0][: len(ids)].tolist() == ids


def _chat_segments() -> list[tuple[str, bool]]:
    return [
        ("<|bos|>", False),
        ("<|system|>", False),
        ("\nBe brief.", False),
        ("<|eos|>", False),
        ("<|user|>", False),
        ("\nWhat is a list?", False),
        ("<|eos|>", False),
        ("<|assistant|>", False),
        ("\n", False),
        ("A mutable sequence.", True),
        ("<|eos|>", True),
        ("<|user|>", False),
        ("\nAnd a tuple?", False),
        ("<|eos|>", False),
        ("<|assistant|>", False),
        ("\n", False),
        ("An immutable one.", True),
        ("<|eos|>", True),
    ]


def test_chat_trains_only_on_assistant_turns(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    ids, mask, batch = _only_sample(tmp_path, {"path": str(path), "format": "chat"})
    want_ids, want_mask = _expected(_chat_segments())
    assert ids == want_ids
    assert mask == want_mask
    _assert_labels(batch, ids, mask)
    tok = get_tokenizer()
    trained = [t for t, m in zip(ids, mask, strict=True) if m]
    assert tok.decode(trained) == "A mutable sequence.<|eos|>An immutable one.<|eos|>"


def test_chat_template_without_generation_block_gives_the_same_mask(tmp_path: Path) -> None:
    # The same template with the {% generation %} markers removed: masks come from prefix renderings.
    template = (Path(get_tokenizer().name_or_path) / "chat_template.jinja").read_text()
    plain = template.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    assert "endgeneration" not in plain
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    ids, mask, _ = _only_sample(tmp_path, {"path": str(path), "format": "chat"}, chat_template=plain)
    assert (ids, mask) == _expected(_chat_segments())


def test_instruction_trains_only_on_the_response(tmp_path: Path) -> None:
    rows = [{"instruction": "Add the numbers.", "input": "1 and 2", "output": "3"}]
    path = write_jsonl(tmp_path / "alpaca.jsonl", rows)
    ids, mask, batch = _only_sample(tmp_path, {"path": str(path), "format": "instruction"})
    prompt = "### Instruction:\nAdd the numbers.\n\n1 and 2\n\n### Response:\n"
    tok = get_tokenizer()
    want_prompt = tok.encode(prompt, add_special_tokens=False)
    want_response = tok.encode("3", add_special_tokens=False) + [tok.eos_token_id]
    assert ids == want_prompt + want_response
    assert mask == [0] * len(want_prompt) + [1] * len(want_response)
    _assert_labels(batch, ids, mask)


def test_instruction_custom_fields_and_no_input(tmp_path: Path) -> None:
    rows = [{"question": "Name a mutable type.", "answer": "list"}]
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    source = {
        "path": str(path),
        "format": "instruction",
        "prompt_field": "question",
        "response_field": "answer",
        "input_field": None,
        "prompt_template": "Q: {prompt}\nA: ",
    }
    ids, mask, _ = _only_sample(tmp_path, source)
    tok = get_tokenizer()
    want_prompt = tok.encode("Q: Name a mutable type.\nA: ", add_special_tokens=False)
    assert ids[: len(want_prompt)] == want_prompt
    assert tok.decode([t for t, m in zip(ids, mask, strict=True) if m]) == "list<|eos|>"


def test_tokenized_rows_keep_their_labels(tmp_path: Path) -> None:
    rows = [{"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9]}, {"input_ids": [10, 11, 12]}]
    path = write_jsonl(tmp_path / "tok.jsonl", rows)
    section = data_section(tmp_path, train=[{"path": str(path), "format": "tokenized"}], seq_len=16)
    part = prepare_data(section, get_tokenizer(), seed=0).train.parts[0]
    assert part.store.input_ids[: int(part.store.offsets[-1])].tolist() == [5, 6, 7, 8, 9, 10, 11, 12]
    assert part.store.loss_mask[:8].tolist() == [0, 0, 1, 1, 1, 1, 1, 1]


def test_text_documents_end_with_eos_and_train_everywhere(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "The import statement."}, {"text": "   "}])
    ids, mask, batch = _only_sample(tmp_path, {"path": str(path), "format": "text"})
    tok = get_tokenizer()
    assert ids == tok.encode("The import statement.") + [tok.eos_token_id]
    assert mask == [1] * len(ids)
    _assert_labels(batch, ids, mask)


def test_fast_encode_matches_the_tokenizer_call() -> None:
    tok = get_tokenizer()
    texts = ["héllo wörld 🙂", "  indented\n\ttabs", "<|user|>\nspecial tokens inline<|eos|>", ""]
    for special in (True, False):
        rows = make_encoder(tok)(texts, special)
        assert [np.frombuffer(r, np.int32).tolist() for r in rows] == tok(texts, add_special_tokens=special)[
            "input_ids"
        ]


@pytest.mark.parametrize("packing", ["packed", "padded"])
def test_batch_keys_follow_the_packing_mode(tmp_path: Path, packing: str) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": f"document number {i}"} for i in range(6)])
    section = data_section(tmp_path, train=[str(path)], seq_len=64, packing=packing)
    split = prepare_data(section, get_tokenizer(), seed=0).train
    batch = build_rows(split, [(0, 0)])
    if packing == "packed":
        assert (
            set(batch) == {"input_ids", "labels", "position_ids", "use_cache"} and batch["use_cache"] is False
        )
        assert split.n_sequences == 1  # six short documents share one sequence
    else:
        assert set(batch) == {"input_ids", "labels", "attention_mask"}
        used = int(np.asarray(batch["attention_mask"][0]).sum())
        assert (batch["labels"][0][used:] == -100).all() and split.n_sequences == 6
