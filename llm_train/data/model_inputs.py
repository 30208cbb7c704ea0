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

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from llm_train.data.prepare import PackedSplit

IGNORE = -100
PAIR_WIDTH_STEP = 64
# Processor outputs with one value per token (transformers' names), padded with their row.
PER_TOKEN_ARRAYS = frozenset({"token_type_ids", "mm_token_type_ids"})


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
        batch = {"input_ids": input_ids, "labels": labels, "attention_mask": attention}
        arrays = row_arrays(split, sequences, width)
        filler = next((p.store.filler for p in split.parts if p.store.filler is not None), None)
        if filler is not None and not any(name not in PER_TOKEN_ARRAYS for name in arrays):
            return with_filler(batch, arrays, filler, split.pad_id, width)
        return {**batch, **arrays}
    return {"input_ids": input_ids, "labels": labels, "position_ids": positions, "use_cache": False}


def row_arrays(split: PackedSplit, sequences: list[tuple[int, int]], width: int) -> dict[str, np.ndarray]:
    """The rows' other model inputs (image formats: pixel values, grid sizes ...; formats/image_chat.py).

    Per-image arrays are concatenated over the rows in row order, which is the order the model meets the
    image tokens in input_ids and so reads the images in; per-token ones ([1, row length]: Gemma 3's
    token_type_ids) are laid into [rows, width], zero on padding. Image rows are never packed or split
    (config/recipe_sections.py), so a sequence is exactly one row.
    """
    per_image: dict[str, list[np.ndarray]] = {}
    per_token: dict[str, np.ndarray] = {}
    for r, (part, sequence) in enumerate(sequences):
        store = split.parts[part].store
        if store.blobs is None:
            continue
        starts, lengths = split.spans(part, sequence)
        row = store.row_of(int(starts[0]))
        for name, value in store.arrays(row).items():
            if name in PER_TOKEN_ARRAYS:
                per_token.setdefault(name, np.zeros((len(sequences), width), dtype=value.dtype))
                per_token[name][r, : value.shape[-1]] = value.reshape(-1)[:width]
            else:
                per_image.setdefault(name, []).append(value)
    out = {name: np.concatenate(values) for name, values in per_image.items()}
    out.update(per_token)
    return out


def with_filler(
    batch: dict[str, np.ndarray],
    arrays: dict[str, np.ndarray],
    filler: dict[str, np.ndarray],
    pad_id: int,
    width: int,
) -> dict[str, np.ndarray | bool]:
    """An image split's micro-batch that holds no image, plus one row of a blank image that trains nothing
    (labels -100): every rank then runs the vision tower, which ZeRO-3's collectives need
    (formats/image_chat.py `filler_row`). The loss, a mean over labelled tokens, is unchanged."""
    ids = filler["input_ids"]
    rows = len(batch["input_ids"])
    row = np.full((1, width), pad_id, dtype=np.int64)
    row[0, : len(ids)] = ids
    out: dict[str, np.ndarray | bool] = {
        "input_ids": np.concatenate([batch["input_ids"], row]),
        "labels": np.concatenate([batch["labels"], np.full((1, width), IGNORE, dtype=np.int64)]),
        "attention_mask": np.concatenate(
            [batch["attention_mask"], (np.arange(width) < len(ids)).astype(np.int64)[None, :]]
        ),
    }
    for name, value in filler.items():
        if name in PER_TOKEN_ARRAYS:
            tail = np.zeros((1, width), dtype=value.dtype)
            tail[0, : value.shape[-1]] = value.reshape(-1)[:width]
            out[name] = np.concatenate([arrays.get(name, np.zeros((rows, width), dtype=value.dtype)), tail])
        elif name != "input_ids":
            out[name] = value
    return out


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
        if with_reference:  # then every part's reference is set (mypy sees Optional)
            reference[[r, r + m]] = source.reference[pair]  # type: ignore[index]
    batch: dict[str, np.ndarray | bool] = {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": attention,
    }
    if with_reference:
        batch["reference_logps"] = reference
    return batch


def document_starts(pos: np.ndarray) -> np.ndarray:
    """True where a packed row's token starts a document: its position id does not follow the previous one's
    (every row's first token starts one, so documents never run across rows)."""
    new = np.ones(pos.shape, dtype=bool)
    new[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    return new


def span_sums(batch: Mapping[str, Any]) -> tuple[int, int]:
    """(sum of n^2, sum of n) over the documents of a micro-batch's rows: the attention they really span.

    A document is a run of consecutive position ids (transformers' packed-sequence rule,
    masking_utils.find_packed_sequence_indices): each packed sample, and the padding tail, which
    restarts its positions and attends to itself. Padded rows are their sample and their padding
    (the 0/1 mask); a row with neither is one document. n counts every slot, as tokens/s does.
    planning/speed/flops.py turns the two sums into MFU's span.
    """
    positions = batch.get("position_ids")
    if positions is not None:
        pos = np.asarray(positions)
        starts = np.flatnonzero(
            document_starts(pos).reshape(-1)
        )  # every row starts a document, so rows never merge
        lengths = np.diff(np.append(starts, pos.size))
        return int(np.square(lengths).sum()), int(pos.size)
    mask = batch.get("attention_mask")
    if mask is not None:
        used = np.asarray(mask).sum(axis=1).astype(np.int64)
        width = np.asarray(mask).shape[1]
        return int((np.square(used) + np.square(width - used)).sum()), int(used.size * width)
    rows, width = np.asarray(batch["input_ids"]).shape
    return rows * width * width, rows * width


def real_tokens(batch: Mapping[str, Any]) -> int:
    """Tokens of the micro-batch's rows that are not padding: what tokens/s and MFU count (not its slots).

    Padded rows (and preference pairs, at the width they were built to): their 0/1 attention mask. Packed
    rows: the documents (runs of consecutive position ids) that carry a trained label; the unused tail of
    a row restarts its positions and is all IGNORE, a sample never is (its labels are its tokens, or its
    responses). A row with neither: every token.
    """
    mask = batch.get("attention_mask")
    if mask is not None:
        return int(np.asarray(mask).sum())
    positions, labels = batch.get("position_ids"), batch.get("labels")
    if positions is None or labels is None:
        return int(np.asarray(batch["input_ids"] if positions is None else positions).size)
    pos, labels = np.asarray(positions), np.asarray(labels)
    document = (
        np.cumsum(document_starts(pos).reshape(-1)) - 1
    )  # each token's document number (rows never merge)
    trained = np.zeros(int(document[-1]) + 1, dtype=bool)
    trained[document[labels.reshape(-1) != IGNORE]] = True
    return int(trained[document].sum())


class SpanTally:
    """Passes micro-batches through unchanged and sums their `span_sums` and `real_tokens` until `take`
    (one per logged window)."""

    def __init__(self, batches: Iterator[dict[str, Any]]) -> None:
        self.batches = batches
        self.squared = 0
        self.tokens = 0
        self.real = 0

    def __iter__(self) -> SpanTally:
        return self

    def __next__(self) -> dict[str, Any]:
        batch = next(self.batches)
        squared, tokens = span_sums(batch)
        self.squared += squared
        self.tokens += tokens
        self.real += real_tokens(batch)
        return batch

    def take(self) -> tuple[int, int, int]:
        """(sum of n^2, sum of n, real tokens) since the last take."""
        out = (self.squared, self.tokens, self.real)
        self.squared = self.tokens = self.real = 0
        return out
