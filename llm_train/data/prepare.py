"""A recipe's data section -> packed train and eval splits, cached on disk.

Per source, two cache entries under data.cache_dir:

    tokens-<key>/   the tokenised rows (store.py); key: source content, tokenizer, format fields
    packed-<key>/   the spans and sequences (packing.py); key: the tokens key, train/eval role,
                    seq_len, over-long policy, packing mode (and eval_fraction + seed when carved)

so changing seq_len re-packs without re-tokenising, and a second run of the same recipe reads
both entries without touching the source. The eval split is carved by rows, before packing,
so no packed sequence mixes train and eval samples.

A preference source's unit is the pair (two store rows, packing.py): it is carved, counted
and dealt by pair, and each of its "sequences" is one pair of padded rows. A preference
objective also attaches the reference model's log-probs of every pair to each part
(`PackedSource.reference`, runtime/engines/reference.py), which model_inputs.py hands out with the pairs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

import llm_train.data.formats as formats  # by its own name: the package (__init__) names this module
from llm_train.config.recipe_sections import DataSection
from llm_train.config.source_schema import Source
from llm_train.data.cache import cached
from llm_train.data.fingerprint import CODE_VERSION, digest, tokenizer_fingerprint
from llm_train.data.formats.messages import chat_template_for
from llm_train.data.packing import (
    Placement,
    length_stats,
    make_pair_spans,
    make_spans,
    pair_placement,
    placement,
    trained_per_span,
)
from llm_train.data.sources import check_revision, load_rows, locate
from llm_train.data.store import FILLER, TokenStore, auto_num_proc, build_store
from llm_train.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Say = Callable[[str], None]


@dataclass
class PackedSource:
    """One source of one split, tokenised and laid out in sequences."""

    label: str
    source: Source
    store: TokenStore
    placement: Placement
    stats: dict[str, Any]
    cache: dict[str, str]
    key: str
    reference: np.ndarray | None = None
    """Preference pairs: the reference model's summed log-probs, float32 [pairs, 2] (chosen, rejected)."""

    @property
    def n_sequences(self) -> int:
        return self.placement.n_sequences

    @property
    def pairs(self) -> bool:
        return formats.of(self.source).pairs


@dataclass
class PackedSplit:
    """The sequences of one split, in source order; the stream decides the order they are served in."""

    name: str
    parts: list[PackedSource]
    seq_len: int
    packing: str
    pad_id: int
    loader_workers: int | None = None
    weights: list[float] = field(default_factory=list)

    @property
    def n_sequences(self) -> int:
        return sum(p.n_sequences for p in self.parts)

    @property
    def fingerprint(self) -> str:
        """Identifies the exact sequences and mixture: a resumed stream checks it is reading the same data."""
        return digest([p.key for p in self.parts], self.weights)

    @property
    def pairs(self) -> bool:
        """Preference pairs: each sequence of the split is a pair of rows (recipe.py allows no mixing)."""
        return bool(self.parts) and all(p.pairs for p in self.parts)

    @property
    def reference_digest(self) -> str | None:
        """The attached reference log-probs, hashed: a resumed run checks it trains against the same ones."""
        if not self.pairs or any(p.reference is None for p in self.parts):
            return None
        import hashlib

        return digest(
            [hashlib.sha256(np.ascontiguousarray(p.reference).tobytes()).hexdigest() for p in self.parts]
        )

    def spans(self, part: int, sequence: int) -> tuple[np.ndarray, np.ndarray]:
        lay = self.parts[part].placement
        lo, hi = int(lay.bin_offsets[sequence]), int(lay.bin_offsets[sequence + 1])
        return lay.spans.start[lo:hi], lay.spans.length[lo:hi]


@dataclass
class PreparedData:
    train: PackedSplit
    eval: PackedSplit | None


def prepare_data(
    data: DataSection, tokenizer: PreTrainedTokenizerBase, seed: int, say: Say | None = None
) -> PreparedData:
    """Tokenise (or read from the cache) and pack every source of the recipe's data section."""
    if tokenizer.eos_token_id is None:
        raise UserError(
            f"model.tokenizer: '{tokenizer.name_or_path}' has no eos token; samples need one to end"
        )
    job = _Job(data, tokenizer, seed, say or (lambda _: None))
    carve = not data.eval and data.eval_fraction > 0
    train_parts, eval_parts = [], []
    for i, source in enumerate(data.sources("train")):
        tokens = job.tokens(source, "data.train", f"data.train[{i}] {source.path} ({source.format})")
        rows = np.arange(tokens.samples)
        if carve:
            rows, held = _carve(rows, data.eval_fraction, seed, i)
            if len(held):
                eval_parts.append(job.pack(tokens, "eval", held, carved=True))
        train_parts.append(job.pack(tokens, "train", rows, carved=carve))
        _check_filler(tokens, data.seq_len, f"data.train[{i}]")  # after the rows' own length check
    for i, source in enumerate(data.sources("eval")):
        tokens = job.tokens(source, "data.eval", f"data.eval[{i}] {source.path} ({source.format})")
        eval_parts.append(job.pack(tokens, "eval", np.arange(tokens.samples), carved=False))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train = _split("train", train_parts, data, pad_id)
    if train.n_sequences == 0:
        raise UserError("data.train: no training samples remain (every row was empty, dropped or held out)")
    evals = [p for p in eval_parts if p.n_sequences]
    return PreparedData(train, _split("eval", evals, data, pad_id) if evals else None)


def load_blocks(
    data: DataSection, tokenizer: PreTrainedTokenizerBase, seed: int, say: Say | None = None
) -> tuple[PackedSplit, PackedSplit | None]:
    """(train, eval): the names the training session has used since the first, text-only pipeline."""
    prepared = prepare_data(data, tokenizer, seed, say)
    return prepared.train, prepared.eval


def _split(name: str, parts: list[PackedSource], data: DataSection, pad_id: int) -> PackedSplit:
    weights = [p.source.weight if name == "train" else 1.0 for p in parts]
    return PackedSplit(name, parts, data.seq_len, data.packing, pad_id, data.loader_workers, weights)


def _carve(rows: np.ndarray, fraction: float, seed: int, index: int) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, eval rows): a seeded share of the rows, so eval comes from the whole source."""
    n_eval = max(1, round(fraction * len(rows))) if len(rows) >= 2 else 0
    order = np.random.default_rng([abs(seed), index]).permutation(len(rows))
    return np.sort(rows[order[n_eval:]]), np.sort(rows[order[:n_eval]])


@dataclass
class _Tokens:
    """One source, tokenised: where it came from and under which cache key."""

    source: Source
    label: str
    key: str
    store: TokenStore
    status: str  # cache status: hit | miss | waited

    @property
    def samples(self) -> int:
        """Source rows: store rows, or half of them for pairs (two store rows each)."""
        return self.store.rows // 2 if formats.of(self.source).pairs else self.store.rows


class _Job:
    """What every source of one prepare_data call shares: settings, tokenizer, cache, output."""

    def __init__(self, data: DataSection, tokenizer: PreTrainedTokenizerBase, seed: int, say: Say) -> None:
        self.data, self.tokenizer, self.seed, self.say = data, tokenizer, seed, say
        self.cache_dir = Path(data.cache_dir).expanduser()
        self.template = _chat_template_if_needed(data, tokenizer)
        self.tokenizer_key = tokenizer_fingerprint(tokenizer)

    def tokens(self, source: Source, key: str, label: str) -> _Tokens:
        fmt = formats.of(source)
        located = locate(source.path, key)
        check_revision(located, source, key)
        rows = None
        signature = located.signature()
        if signature is None:  # hub dataset: datasets' own fingerprint of what it downloaded (its revision)
            rows = load_rows(located, source, key, self.cache_dir)
            signature = rows._fingerprint
        fields = source.model_dump(exclude={"path", "weight", "overlong", "revision"})
        # Formats that never render messages ignore the template: it is not part of their key.
        chat = self.template if fmt.uses_chat_template != "never" else None
        parts = ["tokens", CODE_VERSION, located.kind, signature, fields, self.tokenizer_key, chat]
        extra = fmt.cache_key(self.tokenizer)  # image_chat: the processor's settings (None: nothing more)
        tok_key = digest(*parts, *([extra] if extra is not None else []))
        entry = self.cache_dir / f"tokens-{tok_key}"
        where = f"{key}: {located.describe()}"

        def build(out: Path) -> dict[str, Any]:
            started = time.perf_counter()
            loaded = rows if rows is not None else load_rows(located, source, key, self.cache_dir)
            formats.check_fields(loaded.column_names, source, key, located.describe())
            fn = fmt.tokenize_fn(source, self.tokenizer, self.template, where, self.data.tokenize_memo)
            procs = auto_num_proc(len(loaded), loaded.data.nbytes, self.data.num_proc)
            columns = fmt.fields_read(source, loaded.column_names)
            meta = build_store(out, loaded, fn, columns, fmt.loss_mask, procs, tok_key, fmt.arrays)
            if meta["tokens"] == 0:
                raise UserError(f"{where}: every row is empty after tokenisation")
            filler = fmt.filler(source, self.tokenizer, self.template, where) if fmt.arrays else None
            if filler is not None:
                (out / FILLER).write_bytes(filler)
            if fmt.pairs:
                meta["rows"] //= 2  # source rows; the store holds two (chosen, rejected) per pair
            self.say(
                f"data: {label}: tokenised {meta['rows']:,} {fmt.unit} -> {meta['tokens']:,} tokens "
                f"in {time.perf_counter() - started:.1f}s ({procs} process{'es' if procs > 1 else ''})"
            )
            return {**meta, "source": located.describe(), "format": source.format}

        meta, status = cached(entry, build)
        if status != "miss":
            how = "cached" if status == "hit" else "tokenised by another process"
            self.say(f"data: {label}: {meta['rows']:,} {fmt.unit}, {meta['tokens']:,} tokens ({how})")
        return _Tokens(source, label, tok_key, TokenStore.open(entry), status)

    def pack(
        self, tokens: _Tokens, role: Literal["train", "eval"], rows: np.ndarray, carved: bool
    ) -> PackedSource:
        data, source, store = self.data, tokens.source, tokens.store
        pairs = formats.of(source).pairs
        carve_key = (data.eval_fraction, self.seed) if carved else None
        key = digest(
            "packed", CODE_VERSION, tokens.key, role, carve_key, data.seq_len, source.overlong, data.packing
        )
        entry = self.cache_dir / f"packed-{key}"

        def build(out: Path) -> dict[str, Any]:
            if pairs:
                spans, counts = make_pair_spans(store, rows, data.seq_len, source.overlong, tokens.label)
                lay, row_count = pair_placement(spans), len(spans)  # two padded rows per pair
                lengths = _pair_lengths(store, rows)
            else:
                spans, counts = make_spans(
                    store, rows, data.seq_len, source.overlong, tokens.label, *formats.of(source).overlong_fix
                )
                lay = placement(spans, data.seq_len, data.packing)
                row_count = lay.n_sequences
                lengths = store.lengths[rows]
            lay.save(out)
            n_tokens = int(spans.length.sum())
            slots = row_count * data.seq_len
            return {
                **counts,
                "role": role,
                "samples": lay.n_sequences if pairs else len(spans),
                "tokens": n_tokens,
                "trained_tokens": int(trained_per_span(store, spans).sum()),
                "sequences": lay.n_sequences,
                "efficiency": n_tokens / slots if slots else 0.0,
                "row_lengths": length_stats(lengths[lengths > 0]),
                "sample_lengths": length_stats(spans.length),
            }

        stats, status = cached(entry, build)
        if role == "train" and status == "miss" and stats["samples"] and pairs:
            self.say(
                f"data: {tokens.label}: {stats['samples']:,} pairs as {2 * stats['samples']:,} padded rows of "
                f"{data.seq_len} ({stats['efficiency']:.1%} of slots used; truncated {stats['truncated']}, "
                f"dropped {stats['dropped']})"
            )
        elif role == "train" and status == "miss" and stats["samples"]:
            self.say(
                f"data: {tokens.label}: {stats['samples']:,} samples in {stats['sequences']:,} sequences of "
                f"{data.seq_len} ({stats['efficiency']:.1%} of slots used; truncated {stats['truncated']}, "
                f"dropped {stats['dropped']}, split {stats['split']})"
            )
        cache = {"tokenize": tokens.status, "pack": status}
        return PackedSource(tokens.label, source, store, Placement.load(entry), stats, cache, key)


def _check_filler(tokens: _Tokens, seq_len: int, key: str) -> None:
    """An image split's blank-image row (model_inputs.py) must fit a sequence, as every image row must."""
    filler = tokens.store.filler
    if filler is not None and len(filler["input_ids"]) > seq_len:
        raise UserError(
            f"{key}: data.seq_len={seq_len} cannot hold one image ({len(filler['input_ids'])} tokens for a 64 x 64 "
            "image with the chat template); raise data.seq_len"
        )


def _chat_template_if_needed(data: DataSection, tokenizer: PreTrainedTokenizerBase) -> str | None:
    for split in ("train", "eval"):
        for source in data.sources(split):
            # Formats whose text rows need none ask only when there is one; their message rows fail without.
            if formats.of(source).needs_chat_template(data.chat_template, tokenizer):
                return chat_template_for(tokenizer, data.chat_template, f"data.{split} {source.path}")
    return None


def _pair_lengths(store: TokenStore, pairs: np.ndarray) -> np.ndarray:
    """Tokens of each pair as a sequence sees it: the prompt and the longer response (its longer row)."""
    return np.maximum(store.lengths[2 * pairs], store.lengths[2 * pairs + 1])
