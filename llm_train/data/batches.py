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
"""

from __future__ import annotations

import numpy as np

from llm_train.data.prepare import PackedSplit

IGNORE = -100


def build_rows(split: PackedSplit, sequences: list[tuple[int, int]]) -> dict[str, np.ndarray | bool]:
    """The micro-batch of the given (part, sequence) pairs, as int64 numpy arrays [rows, seq_len]."""
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
