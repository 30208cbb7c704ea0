"""Samples -> spans that fit seq_len (the over-long policy) -> sequences (packed or padded).

A span is a slice of a source's token store: (start, length, row). Packing assigns spans to
sequences of `seq_len` slots with best-fit decreasing, which leaves ~1% of slots empty on
typical length spreads where greedy concatenation in arrival order leaves 10-15%. Spans are
never cut to fill a sequence: a sample's tokens attend only to that sample (see model_inputs.py).

Preference pairs (`make_pair_spans`, `pair_placement`) are not packed: each pair is one unit
of two padded rows, its chosen and its rejected span, so the stream deals a pair whole to one
data-parallel rank and one micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llm_train.data.store import TokenStore
from llm_train.errors import UserError

_WINDOW = 1 << 24  # tokens of loss mask summed at a time (bounded memory on any corpus size)


@dataclass
class Spans:
    start: np.ndarray  # int64: offset into the store's flat arrays
    length: np.ndarray  # int64
    row: np.ndarray  # int64: the source row the span comes from

    def __len__(self) -> int:
        return len(self.start)

    def select(self, keep: np.ndarray) -> Spans:
        return Spans(self.start[keep], self.length[keep], self.row[keep])


def make_spans(
    store: TokenStore,
    rows: np.ndarray,
    seq_len: int,
    policy: str,
    key: str,
    fix: str = "set overlong: truncate, drop or split on this source, or raise data.seq_len",
) -> tuple[Spans, dict[str, int]]:
    """Apply the over-long policy to `rows` of `store`; drop samples with nothing to train on."""
    lengths = store.lengths[rows]
    counts = {"rows": len(rows), "empty": int((lengths == 0).sum())}
    keep = lengths > 0
    rows, lengths = rows[keep], lengths[keep]
    over = lengths > seq_len
    counts.update(truncated=0, dropped=0, split=0)
    if over.any():
        first = int(np.argmax(over))
        if policy == "error":
            raise UserError(
                f"{key}: row {int(rows[first]) + 1} has {int(lengths[first])} tokens, more than "
                f"data.seq_len={seq_len} ({int(over.sum())} such rows); {fix}"
            )
        counts[{"truncate": "truncated", "drop": "dropped", "split": "split"}[policy]] = int(over.sum())
    starts = store.offsets[rows]
    if policy == "drop":
        spans = Spans(starts[~over], lengths[~over], rows[~over])
    elif policy == "truncate":
        spans = Spans(starts, np.minimum(lengths, seq_len), rows)
    else:  # split (or nothing over-long): seq_len pieces, each a sample of its own
        pieces = -(-lengths // seq_len)
        row_of_piece = np.repeat(np.arange(len(rows)), pieces)
        first_piece = np.repeat(np.cumsum(pieces) - pieces, pieces)
        k = np.arange(len(row_of_piece)) - first_piece  # piece number within its row
        start = starts[row_of_piece] + k * seq_len
        length = np.minimum(seq_len, lengths[row_of_piece] - k * seq_len)
        spans = Spans(start, length, rows[row_of_piece])
    trained = trained_per_span(store, spans)
    counts["no_target"] = int((trained == 0).sum())
    return spans.select(trained > 0), counts


def make_pair_spans(
    store: TokenStore, pairs: np.ndarray, seq_len: int, policy: str, key: str
) -> tuple[Spans, dict[str, int]]:
    """Two spans per pair (chosen, rejected; `row` = the pair's source row) after the over-long policy.

    Store rows 2k and 2k + 1 are pair k: the same prompt tokens (untrained) then a response
    (trained), so the prompt length is the row length minus its trained tokens. A pair is over-long
    when prompt + longer response exceed seq_len. `truncate` cuts the prompt first, keeping its end
    (the part next to the response) and at least min(prompt, seq_len // 2) tokens of it, then the
    responses' ends; both rows keep the same prompt tokens.
    """
    chosen, rejected = 2 * pairs, 2 * pairs + 1
    lengths = store.lengths
    responses = np.stack([_row_sums(store, chosen), _row_sums(store, rejected)], axis=1)
    prompt = lengths[chosen] - responses[:, 0]
    longest = responses.max(axis=1)
    over = prompt + longest > seq_len
    counts = {"rows": len(pairs), "empty": 0, "truncated": 0, "dropped": 0, "split": 0, "no_target": 0}
    if over.any():
        first = int(np.argmax(over))
        if policy == "error":
            raise UserError(
                f"{key}: row {int(pairs[first]) + 1}: prompt {int(prompt[first])} + longest response "
                f"{int(longest[first])} tokens is more than data.seq_len={seq_len} ({int(over.sum())} such pairs); "
                "set overlong: truncate (the prompt is cut first) or drop on this source, or raise data.seq_len"
            )
        counts["truncated" if policy == "truncate" else "dropped"] = int(over.sum())
    keep = ~over if policy == "drop" else np.ones(len(pairs), dtype=bool)
    kept_prompt = np.minimum(prompt, np.maximum(seq_len - longest, seq_len // 2))
    cut = (prompt - kept_prompt)[keep]
    room = seq_len - kept_prompt[keep]
    start = np.stack([store.offsets[chosen][keep], store.offsets[rejected][keep]], axis=1) + cut[:, None]
    length = kept_prompt[keep][:, None] + np.minimum(responses[keep], room[:, None])
    row = np.repeat(pairs[keep], 2)
    return Spans(start.reshape(-1), length.reshape(-1), row), counts


def _row_sums(store: TokenStore, rows: np.ndarray) -> np.ndarray:
    """Trained tokens of whole store rows (sorted), their first token included."""
    return _mask_sums(store, store.offsets[rows], store.lengths[rows], skip_first=False)


def pair_placement(spans: Spans) -> Placement:
    """Each pair one unit of the stream: sequence k holds spans 2k (chosen) and 2k + 1 (rejected)."""
    return Placement(spans, np.arange(0, len(spans) + 1, 2, dtype=np.int64))


def trained_per_span(store: TokenStore, spans: Spans) -> np.ndarray:
    """Tokens each span trains on. A span's first token is never a target (nothing precedes it)."""
    if store.loss_mask is None:
        return np.maximum(spans.length - 1, 0)
    return _mask_sums(store, spans.start, spans.length, skip_first=True)


def _mask_sums(store: TokenStore, start: np.ndarray, length: np.ndarray, skip_first: bool) -> np.ndarray:
    """The loss mask summed over each range (sorted by start, disjoint), window by window."""
    assert store.loss_mask is not None
    out = np.zeros(len(start), dtype=np.int64)
    ends = start + length
    i = 0
    while i < len(start):
        lo = int(start[i])
        j = max(i + 1, int(np.searchsorted(ends, lo + _WINDOW, side="right")))
        window = np.asarray(store.loss_mask[lo : int(ends[j - 1])], dtype=np.int64)
        cumulative = np.concatenate(([0], np.cumsum(window)))
        a = start[i:j] - lo + int(skip_first)
        b = np.maximum(ends[i:j] - lo, a)
        out[i:j] = cumulative[b] - cumulative[a]
        i = j
    return out


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """The bin of each item: longest first, each into the fullest bin it still fits, else a new bin."""
    bin_of = np.empty(len(lengths), dtype=np.int64)
    full = lengths == capacity
    bin_of[full] = np.arange(int(full.sum()))  # a full-length item fills a bin alone
    n_bins = int(full.sum())
    rest = np.flatnonzero(~full)
    order = rest[np.argsort(-lengths[rest], kind="stable")]
    smallest = int(lengths[rest].min()) if len(rest) else capacity
    # Bins by remaining space; bit s of `open_spaces` is set while some bin has exactly s slots left,
    # so the tightest bin that fits L is the lowest set bit at or above L (a Python big-int scan in C).
    by_space: dict[int, list[int]] = {}
    open_spaces = 0
    for item, length in zip(order.tolist(), lengths[order].tolist(), strict=True):
        fits = open_spaces >> length
        if fits:
            space = length + (fits & -fits).bit_length() - 1
            stack = by_space[space]
            target = stack.pop()
            if not stack:
                open_spaces ^= 1 << space
        else:
            target, space = n_bins, capacity
            n_bins += 1
        bin_of[item] = target
        left = space - length
        if left >= smallest:  # gaps smaller than any sample can never be filled
            by_space.setdefault(left, []).append(target)
            open_spaces |= 1 << left
    return bin_of


@dataclass
class Placement:
    """Spans grouped into sequences: sequence b holds spans[bin_offsets[b]:bin_offsets[b + 1]]."""

    spans: Spans
    bin_offsets: np.ndarray

    @property
    def n_sequences(self) -> int:
        return len(self.bin_offsets) - 1

    def save(self, out: Path) -> None:
        np.save(out / "span_start.npy", self.spans.start)
        np.save(out / "span_length.npy", self.spans.length)
        np.save(out / "span_row.npy", self.spans.row)
        np.save(out / "bin_offsets.npy", self.bin_offsets)

    @classmethod
    def load(cls, path: Path) -> Placement:
        spans = Spans(
            np.load(path / "span_start.npy", mmap_mode="r"),
            np.load(path / "span_length.npy", mmap_mode="r"),
            np.load(path / "span_row.npy", mmap_mode="r"),
        )
        return cls(spans, np.load(path / "bin_offsets.npy"))


def placement(spans: Spans, seq_len: int, mode: str) -> Placement:
    if mode == "padded" or len(spans) == 0:
        return Placement(spans, np.arange(len(spans) + 1, dtype=np.int64))
    bin_of = best_fit_decreasing(spans.length, seq_len)
    order = np.lexsort((spans.start, bin_of))  # by sequence, samples in corpus order within one
    offsets = np.zeros(int(bin_of.max()) + 2, dtype=np.int64)
    np.cumsum(np.bincount(bin_of, minlength=len(offsets) - 1), out=offsets[1:])
    return Placement(spans.select(order), offsets)


def length_stats(lengths: np.ndarray) -> dict[str, int]:
    if len(lengths) == 0:
        return {"p50": 0, "p90": 0, "p99": 0, "max": 0}
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return {"p50": int(p50), "p90": int(p90), "p99": int(p99), "max": int(lengths.max())}


def packing_supported() -> bool:
    """Whether this transformers reads sample boundaries from restarting position ids (model_inputs.py)."""
    try:
        from transformers import masking_utils
    except ImportError:
        return False
    return hasattr(masking_utils, "find_packed_sequence_indices")


def require_packing_support(packing: str) -> None:
    """One line, not silently mixed samples, when packed rows cannot be kept apart by this transformers."""
    if packing == "packed" and not packing_supported():
        raise UserError(
            "data.packing=packed needs a transformers whose masks follow restarting position ids "
            "(masking_utils.find_packed_sequence_indices) so packed samples do not attend to each other; "
            "upgrade transformers or set data.packing=padded"
        )
