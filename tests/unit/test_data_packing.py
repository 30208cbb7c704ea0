"""Packing: bins respect seq_len and fill it; over-long policies; no attention across packed samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from llm_train.data import prepare_data
from llm_train.data.model_inputs import build_rows
from llm_train.data.packing import best_fit_decreasing, make_spans, placement
from llm_train.data.store import TokenStore
from llm_train.errors import UserError
from tests.helpers import tiny_llama_config
from tests.unit.data_fixtures import data_section, get_tokenizer, text_rows, write_jsonl


def _next_fit_bins(lengths: np.ndarray, capacity: int) -> int:
    bins, used = 0, capacity
    for length in lengths.tolist():
        if used + length > capacity:
            bins, used = bins + 1, 0
        used += length
    return bins


def test_best_fit_decreasing_respects_capacity_and_fills_bins() -> None:
    rng = np.random.default_rng(0)
    capacity = 2048
    lengths = np.clip(rng.lognormal(np.log(230), 1.0, size=20_000), 2, capacity).astype(np.int64)
    bin_of = best_fit_decreasing(lengths, capacity)
    fill = np.bincount(bin_of, weights=lengths)
    assert fill.max() <= capacity
    assert len(np.unique(bin_of)) == len(fill)  # bins numbered without gaps
    efficiency = lengths.sum() / (len(fill) * capacity)
    assert efficiency >= 0.97, efficiency
    assert len(fill) < _next_fit_bins(lengths, capacity)  # better than packing in arrival order


def _store(tmp_path: Path, lengths: list[int], mask: list[int] | None = None) -> TokenStore:
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    total = int(offsets[-1])
    np.save(tmp_path / "input_ids.npy", np.arange(total, dtype=np.int32))
    np.save(tmp_path / "offsets.npy", offsets)
    if mask is not None:
        np.save(tmp_path / "loss_mask.npy", np.asarray(mask, dtype=np.uint8))
    return TokenStore.open(tmp_path)


@pytest.mark.parametrize(
    ("policy", "lengths", "counts"),
    [
        ("truncate", [4, 10, 0, 3], {"truncated": 1, "empty": 1}),
        ("drop", [4, 10, 0, 3], {"dropped": 1, "empty": 1}),
        ("split", [4, 10, 0, 3], {"split": 1, "empty": 1}),
    ],
)
def test_overlong_policies(tmp_path: Path, policy: str, lengths: list[int], counts: dict[str, int]) -> None:
    store = _store(tmp_path, lengths)
    spans, got = make_spans(store, np.arange(len(lengths)), 6, policy, "data.train")
    for key in ("truncated", "dropped", "split", "empty"):
        assert got[key] == counts.get(key, 0), (key, got)
    assert (spans.length <= 6).all()
    kept = {"truncate": [4, 6, 3], "drop": [4, 3], "split": [4, 6, 4, 3]}[policy]
    assert spans.length.tolist() == kept
    if policy == "split":  # the pieces cover the row exactly, in order
        assert spans.start.tolist() == [0, 4, 10, 14] and spans.row.tolist() == [0, 1, 1, 3]


def test_overlong_error_names_the_row(tmp_path: Path) -> None:
    store = _store(tmp_path, [4, 10, 3])
    with pytest.raises(UserError, match=r"row 2 has 10 tokens, more than data.seq_len=6"):
        make_spans(store, np.arange(3), 6, "error", "data.train")


def test_samples_without_trained_tokens_are_dropped(tmp_path: Path) -> None:
    # Row 0 trains on its last token; row 1 only on its first (never a target); row 2 is one token.
    store = _store(tmp_path, [3, 3, 1], mask=[0, 0, 1, 1, 0, 0, 1])
    spans, counts = make_spans(store, np.arange(3), 8, "truncate", "data.train")
    assert spans.row.tolist() == [0] and counts["no_target"] == 2


def test_layout_groups_spans_into_sequences(tmp_path: Path) -> None:
    store = _store(tmp_path, [5, 3, 8, 2, 6])
    spans, _ = make_spans(store, np.arange(5), 8, "truncate", "data.train")
    lay = placement(spans, 8, "packed")
    seen = []
    for b in range(lay.n_sequences):
        lo, hi = lay.bin_offsets[b], lay.bin_offsets[b + 1]
        assert lay.spans.length[lo:hi].sum() <= 8
        seen += lay.spans.row[lo:hi].tolist()
    assert sorted(seen) == [0, 1, 2, 3, 4] and lay.n_sequences == 3  # 8 | 5+3 | 6+2


def _tiny_model(attention: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_llama_config(vocab_size=len(get_tokenizer()), max_position_embeddings=256)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=torch.float32).eval()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logits_equal_each_sample_run_alone(tmp_path: Path, attention: str) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", text_rows(24, max_words=40))
    split = prepare_data(data_section(tmp_path, train=[str(path)], seq_len=96), get_tokenizer(), seed=0).train
    assert split.n_sequences < 24  # several samples really share sequences
    model = _tiny_model(attention)
    batch = {
        k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
        for k, v in build_rows(split, [(0, 0), (0, 1)]).items()
    }
    with torch.no_grad():
        packed = model(**batch)
    checked = 0
    weighted_loss, targets = 0.0, 0
    for row in range(2):
        positions = batch["position_ids"][row].tolist()
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        for lo, hi in zip(starts, starts[1:], strict=False):
            labels = batch["labels"][row, lo:hi]
            if (labels == -100).all():
                continue  # padding tail
            ids = batch["input_ids"][row, lo:hi].unsqueeze(0)
            with torch.no_grad():
                alone = model(input_ids=ids, labels=ids)
            torch.testing.assert_close(packed.logits[row, lo:hi], alone.logits[0], atol=1e-5, rtol=0)
            weighted_loss += float(alone.loss) * (hi - lo - 1)
            targets += hi - lo - 1
            checked += 1
    assert checked >= 4
    # And the packed loss is the token-weighted mean of the samples' own losses (no cross-sample targets).
    assert float(packed.loss) == pytest.approx(weighted_loss / targets, abs=1e-5)


def test_padded_rows_give_the_unpadded_logits(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", text_rows(6))
    section = data_section(tmp_path, train=[str(path)], seq_len=96, packing="padded")
    split = prepare_data(section, get_tokenizer(), seed=0).train
    batch = {k: torch.from_numpy(v) for k, v in build_rows(split, [(0, 0), (0, 1)]).items()}
    model = _tiny_model("sdpa")
    with torch.no_grad():
        padded = model(**batch).logits
        for row in range(2):
            used = int(batch["attention_mask"][row].sum())
            alone = model(input_ids=batch["input_ids"][row, :used].unsqueeze(0)).logits[0]
            torch.testing.assert_close(padded[row, :used], alone, atol=1e-5, rtol=0)
