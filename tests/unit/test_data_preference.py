"""The `preference` format: pairs tokenised with a shared prompt, masked on the responses, kept together.

Text pairs and UltraFeedback-shaped conversation pairs; the over-long policy (prompt cut first);
batches of m pairs as 2m rows (chosen first) with the reference log-probs attached; the stream
dealing whole pairs to one data-parallel rank and one micro-batch; `data inspect`; and the
one-line errors for bad pairs (source, row, fix).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llm_train.data import prepare_data
from llm_train.data.dealer import BatchStream, EpochOrder, eval_batches
from llm_train.data.model_inputs import build_rows
from llm_train.data.summary import sample_views
from llm_train.errors import UserError
from tests.unit.data_fixtures import data_section, get_tokenizer, write_jsonl

PAIRS = [
    {"prompt": "What does yield do?", "chosen": "It makes a generator.", "rejected": "generator It a makes."},
    {"prompt": "Name a mutable sequence.", "chosen": "A list.", "rejected": "list. A"},
    {"prompt": "What is a tuple?", "chosen": "An immutable sequence.", "rejected": "sequence. immutable An"},
]


def _conversation(prompt: str, answer: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


def _ultrafeedback(pairs: list[dict[str, str]]) -> list[dict[str, Any]]:
    """HuggingFaceH4/ultrafeedback_binarized's train_prefs shape: chosen/rejected are whole conversations."""
    return [
        {
            "prompt": p["prompt"],
            "chosen": _conversation(p["prompt"], p["chosen"]),
            "rejected": _conversation(p["prompt"], p["rejected"]),
            "score_chosen": 8.0,
            "score_rejected": 3.0,
        }
        for p in pairs
    ]


def _prepare(tmp_path: Path, rows: list[Any], seq_len: int = 64, **source: Any) -> Any:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = write_jsonl(tmp_path / "prefs.jsonl", rows)
    data = data_section(
        tmp_path,
        seq_len=seq_len,
        packing="padded",
        train=[{"path": str(path), "format": "preference", **source}],
    )
    return prepare_data(data, get_tokenizer(), seed=0).train


def _rows(split: Any, pair: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, mask) of the chosen and the rejected row of `pair` (in source order)."""
    part = split.parts[0]
    starts, lengths = split.spans(0, pair)
    return [
        tuple(np.asarray(a) for a in part.store.tokens(s, n)) for s, n in zip(starts, lengths, strict=True)
    ]


def _decode(ids: np.ndarray) -> str:
    return get_tokenizer().decode([int(t) for t in ids])


def test_text_pairs_share_the_prompt_and_train_on_the_responses_only(tmp_path: Path) -> None:
    split = _prepare(tmp_path, PAIRS, prompt_template="Q: {prompt}\nA: ")
    assert split.pairs and split.n_sequences == len(PAIRS)
    tokenizer = get_tokenizer()
    for k, pair in enumerate(PAIRS):
        (c_ids, c_mask), (r_ids, r_mask) = _rows(split, k)
        prompt = tokenizer(f"Q: {pair['prompt']}\nA: ")["input_ids"]
        for ids, mask, side in ((c_ids, c_mask, "chosen"), (r_ids, r_mask, "rejected")):
            assert ids[: len(prompt)].tolist() == prompt  # the same prompt tokens in both rows
            assert not mask[: len(prompt)].any() and mask[len(prompt) :].all()
            assert _decode(ids[len(prompt) :]) == pair[side] + "<|eos|>"  # the response, then eos


def test_ultrafeedback_conversations_are_rendered_with_the_chat_template(tmp_path: Path) -> None:
    split = _prepare(tmp_path, _ultrafeedback(PAIRS))
    tokenizer = get_tokenizer()
    for k, pair in enumerate(PAIRS):
        prompt_text = tokenizer.apply_chat_template(
            [{"role": "user", "content": pair["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        for (ids, mask), side in zip(_rows(split, k), ("chosen", "rejected"), strict=True):
            assert ids[: len(prompt)].tolist() == prompt
            assert not mask[: len(prompt)].any() and mask[len(prompt) :].all()
            # The response is what the template adds for the assistant turn, end-of-turn token included.
            assert _decode(ids[len(prompt) :]) == pair[side] + "<|eos|>"


def test_a_message_prompt_with_text_responses(tmp_path: Path) -> None:
    rows = [
        {"question": [{"role": "user", "content": p["prompt"]}], "good": p["chosen"], "bad": p["rejected"]}
        for p in PAIRS
    ]
    split = _prepare(tmp_path, rows, prompt_field="question", chosen_field="good", rejected_field="bad")
    (ids, mask), _ = _rows(split, 0)
    assert _decode(ids[~mask.astype(bool)]) == f"<|bos|><|user|>\n{PAIRS[0]['prompt']}<|eos|><|assistant|>\n"
    assert _decode(ids[mask.astype(bool)]) == PAIRS[0]["chosen"] + "<|eos|>"


def test_overlong_pairs_lose_their_prompt_start_first_then_the_response_ends(tmp_path: Path) -> None:
    long_prompt = " ".join(f"word{i}" for i in range(60))
    rows = [{"prompt": long_prompt, "chosen": "short answer", "rejected": "an answer " * 30}]
    full = _prepare(tmp_path / "full", rows, seq_len=1024)
    (c_full, c_mask_full), (r_full, r_mask_full) = _rows(full, 0)
    prompt_len, chosen_len = int((c_mask_full == 0).sum()), int(c_mask_full.sum())
    rejected_len = int(r_mask_full.sum())
    seq_len = 64
    assert prompt_len > seq_len // 2 and rejected_len > seq_len // 2  # both must give way
    cut = _prepare(tmp_path / "cut", rows, seq_len=seq_len)
    part = cut.parts[0]
    assert part.stats["truncated"] == 1 and part.stats["samples"] == 1
    (c_ids, c_mask), (r_ids, r_mask) = _rows(cut, 0)
    kept = seq_len // 2  # the prompt keeps its last seq_len // 2 tokens: the part next to the response
    assert int((c_mask == 0).sum()) == int((r_mask == 0).sum()) == kept
    assert c_ids[:kept].tolist() == r_ids[:kept].tolist() == c_full[prompt_len - kept : prompt_len].tolist()
    assert c_ids[kept:].tolist() == c_full[prompt_len:].tolist()  # the short response is whole
    assert (
        len(r_ids) == seq_len
        and r_ids[kept:].tolist() == r_full[prompt_len : prompt_len + seq_len - kept].tolist()
    )
    assert chosen_len < seq_len - kept

    dropped = _prepare(tmp_path / "drop", [*rows, PAIRS[0]], seq_len=seq_len, overlong="drop")
    assert dropped.parts[0].stats["dropped"] == 1 and dropped.n_sequences == 1


def test_a_pair_longer_than_seq_len_under_overlong_error_names_source_row_and_fix(tmp_path: Path) -> None:
    rows = [PAIRS[0], {"prompt": "Explain.", "chosen": "fine", "rejected": "word " * 100}]
    with pytest.raises(UserError) as info:
        _prepare(tmp_path, rows, seq_len=64, overlong="error")
    message = str(info.value)
    assert "\n" not in message
    assert "prefs.jsonl (preference): row 2: prompt" in message and "more than data.seq_len=64" in message
    assert (
        "set overlong: truncate (the prompt is cut first) or drop on this source, or raise data.seq_len"
        in message
    )


@pytest.mark.parametrize(
    ("row", "match"),
    [
        (
            {"prompt": "Say hi.", "rejected": "bye"},
            r"prefs.jsonl: row 2: no 'chosen' \(the chosen response\); every pair needs chosen and rejected: "
            r"fill it in or remove the row",
        ),
        (
            {"prompt": "Say hi.", "chosen": "hi", "rejected": "  "},
            r"prefs.jsonl: row 2: the rejected response is empty",
        ),
        (
            {
                "prompt": "Say hi.",
                "chosen": _conversation("Say hi.", "hi"),
                "rejected": _conversation("Say hi.", ""),
            },
            r"row 2: the rejected response is empty; fill it in or remove the pair",
        ),
        (
            {"prompt": "Hi", "chosen": _conversation("Hi", "a"), "rejected": _conversation("Hello", "b")},
            r"row 2: the chosen and rejected conversations differ before their last message",
        ),
        ({"prompt": "", "chosen": "a", "rejected": "b"}, r"row 2: the prompt is empty \(0 tokens\)"),
        (
            {"prompt": "Hi", "chosen": _conversation("Hi", "a"), "rejected": "b"},
            r"row 2: chosen and rejected must both",
        ),
    ],
    ids=["missing-chosen", "empty-text", "empty-message", "different-prompts", "empty-prompt", "mixed-forms"],
)
def test_bad_pairs_name_the_source_the_row_and_the_fix(
    tmp_path: Path, row: dict[str, Any], match: str
) -> None:
    with pytest.raises(UserError, match=match) as info:
        _prepare(tmp_path, [PAIRS[0], row])
    assert "\n" not in str(info.value) and "data.train" in str(info.value)


def test_a_missing_chosen_column_is_named_with_the_fields_present(tmp_path: Path) -> None:
    rows = [{"prompt": p["prompt"], "preferred": p["chosen"], "rejected": p["rejected"]} for p in PAIRS]
    with pytest.raises(
        UserError,
        match=r"no field 'chosen' for format preference \(fields: prompt, preferred, rejected\); "
        r"set chosen_field / rejected_field",
    ):
        _prepare(tmp_path, rows)


def _many_pairs(n: int) -> list[dict[str, str]]:
    return [
        {"prompt": f"Question {i}?", "chosen": f"answer {i} " * (1 + i % 5), "rejected": f"wrong {i}"}
        for i in range(n)
    ]


def test_batches_keep_each_pair_together_on_one_rank_in_one_micro_batch(tmp_path: Path) -> None:
    split = _prepare(tmp_path, _many_pairs(24))
    micro, dp = 3, 2
    seen: list[int] = []
    for rank in range(dp):
        stream = BatchStream(split, micro, rank, dp, seed=5, workers=0)
        for _ in range(split.n_sequences // (micro * dp)):  # one epoch
            batch = next(stream)
            ids, labels, attention = batch["input_ids"], batch["labels"], batch["attention_mask"]
            assert ids.shape[0] == 2 * micro  # chosen rows, then the rejected rows of the same pairs
            for r in range(micro):
                chosen, rejected = r, r + micro
                prompt = int((labels[chosen] == -100).logical_and(attention[chosen] == 1).sum())
                assert prompt == int((labels[rejected] == -100).logical_and(attention[rejected] == 1).sum())
                assert ids[chosen, :prompt].tolist() == ids[rejected, :prompt].tolist()
                question = get_tokenizer().decode(ids[chosen, :prompt].tolist())
                seen.append(int(question.split()[1].rstrip("?")))
                assert "answer" in get_tokenizer().decode(ids[chosen][labels[chosen] != -100].tolist())
                assert "wrong" in get_tokenizer().decode(ids[rejected][labels[rejected] != -100].tolist())
    assert sorted(seen) == list(range(24))  # every pair exactly once per epoch, over both ranks


def test_rows_are_padded_to_the_longest_pair_of_the_batch_and_carry_the_reference(tmp_path: Path) -> None:
    split = _prepare(tmp_path, _many_pairs(4), seq_len=512)
    split.parts[0].reference = np.arange(8, dtype=np.float32).reshape(4, 2)  # (chosen, rejected) per pair
    batch = build_rows(split, [(0, 2), (0, 0)])
    longest = int(batch["attention_mask"].sum(1).max())
    assert batch["input_ids"].shape == (4, 64) and longest <= 64  # rounded up to 64, not seq_len
    assert batch["reference_logps"].tolist() == [4.0, 0.0, 5.0, 1.0]  # chosen of pairs 2, 0; then rejected
    assert "position_ids" not in batch and batch["labels"][:, 0].tolist() == [-100] * 4


def test_eval_pairs_are_carved_whole_and_served_with_every_rank_busy(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "prefs.jsonl", _many_pairs(40))
    data = data_section(
        tmp_path,
        seq_len=64,
        packing="padded",
        eval_fraction=0.1,
        train=[{"path": str(path), "format": "preference"}],
    )
    prepared = prepare_data(data, get_tokenizer(), seed=3)
    assert prepared.train.n_sequences == 36 and prepared.eval is not None and prepared.eval.n_sequences == 4
    held = {int(r) for r in prepared.eval.parts[0].placement.spans.row}
    kept = {int(r) for r in prepared.train.parts[0].placement.spans.row}
    assert len(held) == 4 and not held & kept and held | kept == set(range(40))
    batches = eval_batches(prepared.eval, micro_batch=3, dp_rank=1, dp_size=2, limit=8)
    assert len(batches) == 1 and batches[0]["input_ids"].shape[0] == 6


def test_inspect_shows_each_pair_with_the_trained_on_text_marked(tmp_path: Path) -> None:
    split = _prepare(tmp_path, PAIRS, prompt_template="Q: {prompt}\nA: ")
    order = EpochOrder([split.n_sequences], [1.0], 0)
    chosen, rejected = sample_views(split, get_tokenizer(), order, 2)
    pair = PAIRS[int(chosen.split(" row ")[1].split(",")[0]) - 1]
    assert chosen.startswith("--- pair 1 chosen: ") and rejected.startswith("--- pair 1 rejected: ")
    assert chosen.endswith(f"Q: {pair['prompt']}\nA: ⟦{pair['chosen']}<|eos|>⟧")
    assert rejected.endswith(f"Q: {pair['prompt']}\nA: ⟦{pair['rejected']}<|eos|>⟧")


def test_the_stream_refuses_a_resume_against_other_reference_log_probs(tmp_path: Path) -> None:
    split = _prepare(tmp_path, _many_pairs(8))
    split.parts[0].reference = np.zeros((8, 2), dtype=np.float32)
    stream = BatchStream(split, 2, 0, 1, seed=0, workers=0)
    next(stream)
    state = stream.state_dict()
    assert state["reference_digest"] is not None
    resumed = BatchStream(split, 2, 0, 1, seed=0, workers=0)
    resumed.load_state_dict(state)  # the same log-probs: fine
    assert resumed.consumed == stream.consumed
    split.parts[0].reference = np.ones((8, 2), dtype=np.float32)  # e.g. recomputed against another model
    with pytest.raises(
        UserError, match=r"the reference log-probs differ from the ones the checkpoint trained with"
    ):
        BatchStream(split, 2, 0, 1, seed=0, workers=0).load_state_dict(state)
