"""Sequences -> the micro-batch dict a Hugging Face causal LM's forward takes.

Packed rows carry `position_ids` that restart at 0 for every sample and no attention
mask: transformers (>= 4.56's masking utilities) reads the restarts as sample boundaries
and builds a block-diagonal causal mask for sdpa/eager, and flash-attention-2 runs
padding-free varlen kernels from the same position ids. It does so only when no KV cache
is passed, hence `use_cache=False` in every packed batch. The label of each sample's
first token is -100: it would otherwise be predicted from the previous sample's last
token, which the mask (rightly) hides. The unused tail of a row is padding with labels
-100 and its own restarting positions, so it attends only to itself.

Padded rows hold one sample, right-padded, with a 0/1 `attention_mask`.

A micro-batch of m preference pairs is 2m padded rows, the m chosen rows first and then the m
rejected ones in the same order (TRL's concatenated batch), labels on the responses only; a
split with reference log-probs attached adds `reference_logps` [2m] in that row order. Pair
rows are padded to the micro-batch's longest row rounded up to PAIR_WIDTH_STEP (at most
seq_len), not to seq_len: preference data is padded, and short pairs would otherwise pay for
seq_len; the rounding bounds the number of shapes (torch.compile compiles one per shape).
"""

from __future__ import annotations

import numpy as np

from llm_train.data.prepare import PackedSplit

IGNORE = -100
PAIR_WIDTH_STEP = 64


def build_rows(split: PackedSplit, sequences: list[tuple[int, int]]) -> dict[str, np.ndarray | bool]:
    """The micro-batch of the given (part, sequence) pairs, as int64 numpy arrays [rows, seq_len]."""
    if split.pairs:
        return build_pair_rows(split, sequences)
    rows, width = len(sequences), split.seq_len
    input_ids = np.full((rows, width), split.pad_id, dtype=np.int64)
    labels = np.full((rows, width), IGNORE, dtype=np.int64)
    positions = np.zeros((rows, width), dtype=np.int64)
    used = np.zeros(rows, dtype=np.int64)
    for r, (part, sequence) in enumerate(sequences):
        store = split.parts[part].store
        starts, lengths = split.spans(part, sequence)
        col = 0
        for start, length in zip(starts.tolist(), lengths.tolist(), strict=True):
            ids, mask = store.tokens(start, length)
            end = col + length
            input_ids[r, col:end] = ids
            labels[r, col:end] = np.where(mask != 0, ids, IGNORE)
            labels[r, col] = IGNORE
            positions[r, col:end] = np.arange(length)
            col = end
        positions[r, col:] = np.arange(width - col)
        used[r] = col
    if split.packing == "padded":
        attention = (np.arange(width)[None, :] < used[:, None]).astype(np.int64)
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention}
    return {"input_ids": input_ids, "labels": labels, "position_ids": positions, "use_cache": False}


def build_pair_rows(split: PackedSplit, pairs: list[tuple[int, int]]) -> dict[str, np.ndarray | bool]:
    """The micro-batch of the given (part, pair) units: chosen rows, then rejected rows, right-padded."""
    spans = [split.spans(part, pair) for part, pair in pairs]
    longest = max(int(lengths.max()) for _, lengths in spans)
    m, width = len(pairs), min(split.seq_len, -(-longest // PAIR_WIDTH_STEP) * PAIR_WIDTH_STEP)
    input_ids = np.full((2 * m, width), split.pad_id, dtype=np.int64)
    labels = np.full((2 * m, width), IGNORE, dtype=np.int64)
    attention = np.zeros((2 * m, width), dtype=np.int64)
    reference = np.zeros(2 * m, dtype=np.float32)
    with_reference = all(split.parts[part].reference is not None for part, _ in pairs)
    for r, ((part, pair), (starts, lengths)) in enumerate(zip(pairs, spans, strict=True)):
        source = split.parts[part]
        for side, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
            row = r + side * m
            ids, mask = source.store.tokens(start, length)
            input_ids[row, :length] = ids
            labels[row, :length] = np.where(mask != 0, ids, IGNORE)
            labels[row, 0] = IGNORE
            attention[row, :length] = 1
        if with_reference:
            reference[[r, r + m]] = source.reference[pair]  # type: ignore[index]
    batch: dict[str, np.ndarray | bool] = {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": attention,
    }
    if with_reference:
        batch["reference_logps"] = reference
    return batch
