"""What `llm-train data inspect` prints: per-source statistics and decoded samples.

Trained-on text is shown between ⟦ and ⟧, so a user sees at a glance that a chat sample
trains only on assistant turns, an instruction sample only on its response, and a
preference pair only on its two responses after their shared prompt.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from llm_train.config.recipe_sections import DataSection
from llm_train.config.source_schema import Source
from llm_train.data import formats
from llm_train.data.prepare import PackedSource, PackedSplit
from llm_train.data.sources import load_rows, locate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from llm_train.data.dealer import EpochOrder

OPEN, CLOSE = "⟦", "⟧"


def describe_split(split: PackedSplit) -> list[str]:
    lines = []
    total_weighted = sum(p.stats["tokens"] * w for p, w in zip(split.parts, split.weights, strict=True)) or 1
    for part, weight in zip(split.parts, split.weights, strict=True):
        lines += _describe_part(part, weight, part.stats["tokens"] * weight / total_weighted, split)
    tokens = sum(p.stats["tokens"] for p in split.parts)
    samples = sum(p.stats["samples"] for p in split.parts)
    if split.pairs:
        rows, what = (
            2 * split.n_sequences,
            f"{samples:,} pairs, {tokens:,} tokens in {2 * split.n_sequences:,} rows",
        )
    else:
        rows, what = (
            split.n_sequences,
            f"{samples:,} samples, {tokens:,} tokens in {split.n_sequences:,} sequences",
        )
    lines.append(
        f"{split.name} total: {what} of {split.seq_len} ({split.packing}); "
        f"efficiency {tokens / max(1, rows * split.seq_len):.1%}"
    )
    return lines


def _describe_part(part: PackedSource, weight: float, share: float, split: PackedSplit) -> list[str]:
    s = part.stats
    lengths = s["row_lengths"]
    trained = s["trained_tokens"] / s["tokens"] if s["tokens"] else 0.0
    samples = f"pairs {s['samples']:,} (two padded rows each)" if part.pairs else f"samples {s['samples']:,}"
    length = "pair length (prompt + longer response)" if part.pairs else "row length"
    return [
        f"{part.label}{'' if split.name == 'train' else ' [eval]'}  weight {weight:g}",
        f"  rows {s['rows']:,} (empty {s['empty']})  {samples}  tokens {s['tokens']:,}  "
        f"trained on {s['trained_tokens']:,} ({trained:.1%})",
        f"  {length} (tokens) p50 {lengths['p50']}  p90 {lengths['p90']}  p99 {lengths['p99']}  max {lengths['max']}",
        f"  over seq_len {split.seq_len} (overlong: {part.source.overlong}): truncated {s['truncated']}  "
        f"dropped {s['dropped']}  split {s['split']};  without trained-on tokens (dropped) {s['no_target']}",
        f"  sequences {s['sequences']:,}  packing efficiency {s['efficiency']:.1%}  "
        f"share of an epoch's tokens {share:.1%}  cache: tokenize {part.cache['tokenize']}, pack {part.cache['pack']}",
    ]


def marked_text(tokenizer: PreTrainedTokenizerBase, ids: np.ndarray, trained: np.ndarray) -> str:
    """Decoded tokens with each trained-on run between ⟦ and ⟧."""
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or trained[i] != trained[start]:
            # One sequence decodes to one str (the annotation also covers a batch's list).
            text = cast(str, tokenizer.decode([int(t) for t in ids[start:i]], skip_special_tokens=False))
            out.append(f"{OPEN}{text}{CLOSE}" if trained[start] else text)
            start = i
    return "".join(out)


def sample_views(
    split: PackedSplit, tokenizer: PreTrainedTokenizerBase, order: EpochOrder, n: int
) -> list[str]:
    """The first n samples training sees (epoch 0 order), decoded and marked; a pair counts its two rows."""
    views: list[str] = []
    position = 0
    while len(views) < n and position < order.epoch_len:
        part_index, sequence = order.at(position)
        part = split.parts[part_index]
        lay = part.placement
        lo, hi = int(lay.bin_offsets[sequence]), int(lay.bin_offsets[sequence + 1])
        for k in range(lo, hi):
            if len(views) == n:
                break
            start, length, row = int(lay.spans.start[k]), int(lay.spans.length[k]), int(lay.spans.row[k])
            ids, mask = part.store.tokens(start, length)
            trained = np.asarray(mask, dtype=bool).copy()
            trained[0] = False  # a sample's first token is never a target
            what = f"pair {len(views) // 2 + 1} {('chosen', 'rejected')[k - lo]}" if part.pairs else "sample"
            number = "" if part.pairs else f" {len(views) + 1}"
            views.append(
                f"--- {what}{number}: {part.label} row {row + 1}, {length} tokens, "
                f"{int(trained.sum())} trained on (sequence {position} of epoch 0)\n"
                f"{marked_text(tokenizer, ids, trained)}"
            )
        position += 1
    return views


def mapped_conversations(data: DataSection) -> list[str]:
    """Per source whose format maps its rows (chat): the mapping, and its first row as the template receives it.

    What a field or role mapping did is visible here before it is rendered (the samples below show
    the rendered text): `[role] content`, tool calls as `name(arguments)`.
    """
    lines: list[str] = []
    for split in ("train", "eval"):
        for i, source in enumerate(data.sources(split)):
            key = f"data.{split}[{i}]"
            first_row = functools.partial(_first_row, source, key, Path(data.cache_dir).expanduser())
            lines += formats.of(source).mapping_lines(source, key, first_row)
    return lines


def _first_row(source: Source, key: str, cache_dir: Path) -> tuple[dict[str, Any], str]:
    """A source's first row, and where it was read from."""
    located = locate(source.path, key)
    return dict(load_rows(located, source, key, cache_dir)[0]), located.describe()
