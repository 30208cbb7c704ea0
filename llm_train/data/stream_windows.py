"""Streaming sources (`streaming: true`): tokenise and pack on the fly, deal each sequence once, resume exactly.

A corpus too large to tokenise up front is read through `datasets.load_dataset(...,
streaming=True)` in windows of WINDOW_ROWS rows. Each window is tokenised by the format's
own function (formats/), cut by the source's over-long policy and packed best-fit
decreasing (packing.py), exactly as the tokenise-first path does, only per window instead
of per source; its sequences are then shuffled with a seed of (optim.seed, source, pass,
window). With several streaming sources a deterministic weighted round robin picks which
source each window comes from, so `weight` is the source's share of windows (of rows).
A source that runs out starts its next pass (local files in a new seeded order).

The result is one deterministic, endless global list of packed sequences, independent of
the number of ranks and of loader workers. It is dealt by the one dealer (dealer.py `Batches`):
global micro-step k hands positions [k*G, (k+1)*G), G = micro_batch x dp_size, to the
data-parallel ranks in order, so every sequence goes to exactly one dp rank and the ranks of
one TP / pipeline group get identical batches. The cost of that choice: every rank reads and
tokenises the whole stream and keeps its share (dp-fold redundant tokenisation; DataLoader
workers split the windows of one rank between them). Sharding files by rank would save it,
but the order would then depend on the world size and could not resume on another one.

Position: sequences consumed by all ranks together, plus a cursor to the window holding
the start of the last step served (each source's pass, window and `datasets`' own
IterableDataset.state_dict() at that window's start, which seeks inside a shard without
re-reading it). A resume seeks there and re-packs at most one step and one window to skip
to the exact position, on any number of ranks.

An "epoch" of a stream has no length known in advance: `per_epoch` is None, runs need
optim.max_steps, and `epoch` counts the passes every streaming source has completed.
Eval sets are never streamed: they come from data.eval sources, tokenised up front.
"""

from __future__ import annotations

import copy
import itertools
import os
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import llm_train.data.formats as formats  # by its own name: the package (__init__) names this module
from llm_train.config.recipe_sections import DataSection
from llm_train.config.source_schema import Source
from llm_train.data.dealer import Batches, Sequences, _fork_context
from llm_train.data.fingerprint import CODE_VERSION, digest, tokenizer_fingerprint
from llm_train.data.formats.base import TokenizeFn
from llm_train.data.formats.messages import chat_template_for
from llm_train.data.model_inputs import build_rows
from llm_train.data.packing import Placement, make_spans, placement, require_packing_support
from llm_train.data.prepare import PackedSplit, prepare_data
from llm_train.data.revision import resolve_revision
from llm_train.data.rows import IDS, MASK, to_arrow
from llm_train.data.sources import Located, check_revision, locate
from llm_train.data.store import TokenStore
from llm_train.data.workers import exit_with_parent
from llm_train.errors import UserError, first_line

if TYPE_CHECKING:
    import pyarrow as pa
    from transformers import PreTrainedTokenizerBase

# Rows per window: enough samples for best-fit decreasing to fill ~98% of slots on typical
# spreads, few enough that a resume re-packs little and the first batch comes quickly.
WINDOW_ROWS = 1000


def is_streaming(data: DataSection) -> bool:
    """Whether the training split is streamed (the recipe allows all-or-none)."""
    return any(s.streaming for s in data.sources("train"))


@dataclass(frozen=True)
class StreamSpec:
    """Everything a loader worker needs to produce the global window list (picklable, no open files)."""

    sources: list[Source]
    located: list[Located]
    tokenizer: PreTrainedTokenizerBase
    chat_template: str | None
    seq_len: int
    packing: str
    pad_id: int
    seed: int
    window_rows: int
    cache_dir: str
    fingerprint: str
    # Per source: the hub commit it is read at (data/revision.py); None for local files or unknown.
    revisions: list[str | None]
    tokenize_memo: bool = True  # data.tokenize_memo (formats.base.make_encoder)

    @classmethod
    def build(
        cls, data: DataSection, tokenizer: PreTrainedTokenizerBase, seed: int, window_rows: int = WINDOW_ROWS
    ) -> StreamSpec:
        if tokenizer.eos_token_id is None:
            raise UserError(
                f"model.tokenizer: '{tokenizer.name_or_path}' has no eos token; samples need one to end"
            )
        sources = data.sources("train")
        located = []
        for i, source in enumerate(sources):
            where = locate(source.path, f"data.train[{i}]")
            if where.kind == "disk":
                raise UserError(
                    f"data.train[{i}]: {source.path} was written by save_to_disk and is memory-mapped already; "
                    "remove streaming: true from this source"
                )
            check_revision(where, source, f"data.train[{i}]")
            located.append(where)
        # Each hub source is read at one commit, recorded in checkpoints: a resume must read the same rows.
        revisions = [
            resolve_revision(w.path, getattr(s, "revision", None)) if w.kind == "hub" else None
            for s, w in zip(sources, located, strict=True)
        ]
        template = None
        if any(formats.of(s).needs_chat_template(data.chat_template, tokenizer) for s in sources):
            template = chat_template_for(tokenizer, data.chat_template, "data.train (chat)")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        # Local files by name, size and mtime (hashing the edges of thousands of shards, as the cache key
        # does, would read gigabytes at every start); a hub id by its name (split and subset are in fields).
        # The revision is compared on its own (check_revisions), so that pinning the recorded one resumes.
        signatures = [_stat_signature(w.files) if w.files else w.path for w in located]
        fields = [s.model_dump(exclude={"revision"}) for s in sources]
        fingerprint = digest(
            "stream",
            CODE_VERSION,
            signatures,
            fields,
            tokenizer_fingerprint(tokenizer),
            template,
            data.seq_len,
            data.packing,
            window_rows,
        )
        return cls(
            sources,
            located,
            tokenizer,
            template,
            data.seq_len,
            data.packing,
            pad_id,
            seed,
            window_rows,
            str(Path(data.cache_dir).expanduser() / "hf"),
            fingerprint,
            revisions,
            data.tokenize_memo,
        )

    @property
    def weights(self) -> list[float]:
        return [s.weight for s in self.sources]


def eval_split(
    data: DataSection, tokenizer: PreTrainedTokenizerBase, seed: int, say: Callable[[str], None] | None = None
) -> PackedSplit | None:
    """The eval split of a streamed run: data.eval's sources, tokenised up front and cached (never streamed)."""
    if not data.eval:
        return None  # recipe.py refuses eval_fraction > 0 here: nothing is carved from a stream
    # prepare_data packs its train split; the eval sources take that place (eval_batches reads them in order).
    as_train = data.model_copy(update={"train": data.eval, "eval": [], "eval_fraction": 0.0})
    return prepare_data(as_train, tokenizer, seed, say).train


def next_source(taken: list[int], weights: list[float]) -> int:
    """Weighted round robin: the source furthest behind its share (ties: the first)."""
    return min(range(len(weights)), key=lambda i: ((taken[i] + 1) / weights[i], i))


def _initial_record(n_sources: int) -> dict[str, Any]:
    return {
        "g": 0,
        "start": 0,
        "taken": [0] * n_sources,
        "sources": [{"pass": 0, "window": 0, "state": None} for _ in range(n_sources)],
    }


class _SourceWindows:
    """One streaming source as endless windows of rows (Arrow tables), pass after pass, with a cursor."""

    def __init__(self, spec: StreamSpec, index: int, cursor: dict[str, Any]) -> None:
        self.spec, self.index = spec, index
        self.cursor = copy.deepcopy(cursor)  # where the next window starts
        self._rows: Iterator[Any] | None = None
        self._dataset: Any = None

    def _open(self) -> None:
        import datasets

        datasets.disable_progress_bars()
        spec, source, where = self.spec, self.spec.sources[self.index], self.spec.located[self.index]
        key = f"data.train[{self.index}]"
        try:
            if where.kind == "hub":
                dataset = datasets.load_dataset(
                    where.path,
                    name=source.subset,
                    split=source.split,
                    # The resolved commit, not the branch: what is read is what the checkpoint records.
                    revision=spec.revisions[self.index] or getattr(source, "revision", None),
                    streaming=True,
                    cache_dir=spec.cache_dir,
                )
            else:
                files = [str(f) for f in where.files]
                # A new seeded file order each pass; within a pass the files are read in that order.
                order = np.random.default_rng([spec.seed & 0xFFFF_FFFF, 3, self.index, self.cursor["pass"]])
                files = [files[i] for i in order.permutation(len(files))]
                options: dict[str, Any] = {}
                if where.builder == "text":
                    options["sample_by"] = getattr(source, "sample_by", "paragraph")
                dataset = datasets.load_dataset(
                    where.builder,
                    data_files=files,
                    split="train",
                    streaming=True,
                    cache_dir=spec.cache_dir,
                    **options,
                )
        except Exception as exc:
            raise UserError(f"{key}: cannot stream {where.describe()} ({first_line(exc)})") from None
        dataset = dataset.with_format("arrow")
        if self.cursor["state"] is not None:
            dataset.load_state_dict(self.cursor["state"])
        self._dataset = dataset
        self._rows = iter(dataset.iter(batch_size=self.spec.window_rows))

    def next_window(self) -> tuple[dict[str, Any], Any]:
        """(the window's cursor, its rows as an Arrow table); the cursor moves to the next window."""
        fresh_pass = False
        while True:
            if self._rows is None:
                fresh_pass = self.cursor["state"] is None
                self._open()
            here = copy.deepcopy(self.cursor)  # after a pass wrap: the new pass's start
            # _open() has just set it; mypy keeps the narrowing to None from the test above.
            table = next(self._rows, None)  # type: ignore[arg-type]
            if table is not None and len(table):
                self.cursor = {
                    "pass": self.cursor["pass"],
                    "window": self.cursor["window"] + 1,
                    "state": self._dataset.state_dict(),
                }
                return here, table
            if fresh_pass:
                raise UserError(
                    f"data.train[{self.index}]: {self.spec.located[self.index].describe()} has no rows"
                )
            self.cursor = {"pass": self.cursor["pass"] + 1, "window": 0, "state": None}
            self._rows = None


@dataclass
class PackedWindow:
    """One window, tokenised and packed: sequence b holds placement's spans of bin order[b]."""

    store: TokenStore
    placement: Placement
    order: np.ndarray
    stats: dict[str, int]

    @property
    def n_sequences(self) -> int:
        return len(self.order)


def tokenize_fns(spec: StreamSpec) -> list[TokenizeFn]:
    """Each source's tokenise function, built once per process (the per-word memo lives in it)."""
    return [
        formats.of(s).tokenize_fn(
            s, spec.tokenizer, spec.chat_template, f"data.train[{i}] {s.path}", spec.tokenize_memo
        )
        for i, s in enumerate(spec.sources)
    ]


def pack_window(
    spec: StreamSpec, index: int, table: pa.Table, cursor: dict[str, Any], tokenize: TokenizeFn
) -> PackedWindow:
    """Tokenise one window of rows and pack it with the tokenise-first path's rules."""
    source = spec.sources[index]
    key = f"data.train[{index}]"
    where = f"{key}: {spec.located[index].describe()} (pass {cursor['pass']}, window {cursor['window']})"
    formats.check_fields(table.column_names, source, key, spec.located[index].describe())
    columns = formats.of(source).fields_read(source, table.column_names)
    batch = {c: table.column(c).to_pylist() for c in columns}
    rows = len(table)
    out = tokenize(batch, list(range(rows)))
    ids_array = to_arrow(out["input_ids"], IDS)
    offsets = np.asarray(ids_array.offsets.to_numpy(), dtype=np.int64)
    ids = np.asarray(ids_array.flatten().to_numpy(zero_copy_only=False), dtype=np.int32)
    mask = None
    if formats.of(source).loss_mask:
        mask = np.asarray(to_arrow(out["loss_mask"], MASK).flatten().to_numpy(zero_copy_only=False), np.uint8)
    store = TokenStore(Path(where), ids, mask, offsets)
    spans, counts = make_spans(store, np.arange(rows), spec.seq_len, source.overlong, where)
    lay = placement(spans, spec.seq_len, spec.packing)
    rng = np.random.default_rng([spec.seed & 0xFFFF_FFFF, 2, index, cursor["pass"], cursor["window"]])
    return PackedWindow(store, lay, rng.permutation(lay.n_sequences), counts)


def windows(spec: StreamSpec, record: dict[str, Any], worker: int = 0, workers: int = 1) -> Iterator[Any]:
    """(record, PackedWindow) for global windows record['g'], +1, ...; packs only this worker's share.

    Every worker walks every window (reading rows is cheap next to tokenising them) so that
    each knows the cursors; worker w packs and yields the windows g with (g - g0) % workers == w.
    The DataLoader returns its workers' items round robin, so the main process receives every
    window once, in order, whatever the number of workers.
    """
    sources = [_SourceWindows(spec, i, c) for i, c in enumerate(record["sources"])]
    taken, g0 = list(record["taken"]), record["g"]
    tokenize = tokenize_fns(spec)
    for g in itertools.count(g0):
        i = next_source(taken, spec.weights)
        cursor, table = sources[i].next_window()
        # Where window g starts: source i at this window (a wrapped pass reads as the new pass), the others as they are.
        cursors = [cursor if j == i else copy.deepcopy(s.cursor) for j, s in enumerate(sources)]
        here = {"g": g, "taken": list(taken), "sources": cursors}
        taken[i] += 1
        if (g - g0) % workers == worker:
            yield here, pack_window(spec, i, table, cursor, tokenize[i])


class _WindowDataset(IterableDataset):
    """IterableDataset over packed windows; each DataLoader worker packs its share (see windows())."""

    def __init__(self, spec: StreamSpec, record: dict[str, Any]) -> None:
        self.spec, self.record = spec, record

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        try:
            yield from windows(self.spec, self.record, worker, workers)
        except UserError as exc:  # one line in the main process, not a worker traceback
            yield "error", str(exc)


def _keep(item: Any) -> Any:
    return item


class _WindowSplit:
    """The PackedSplit interface build_rows reads (seq_len, packing, pad_id, parts[i].store, spans)."""

    pairs = False  # preference pairs are never streamed (recipe.py refuses it)

    def __init__(self, spec: StreamSpec, packed: list[PackedWindow]) -> None:
        self.seq_len, self.packing, self.pad_id = spec.seq_len, spec.packing, spec.pad_id
        self.parts = packed

    def spans(self, part: int, sequence: int) -> tuple[np.ndarray, np.ndarray]:
        window = self.parts[part]
        lay, b = window.placement, int(window.order[sequence])
        lo, hi = int(lay.bin_offsets[b]), int(lay.bin_offsets[b + 1])
        return lay.spans.start[lo:hi], lay.spans.length[lo:hi]


class StreamedSequences(Sequences):
    """A stream's packed windows, in order: read, tokenised and packed by loader workers, assembled here."""

    kind = "stream"
    split: PackedSplit | None = None  # tokenised as it streams: no packed split (preference data is refused)
    epoch_len: int | None = None  # a stream's length is unknown

    def __init__(self, spec: StreamSpec) -> None:
        require_packing_support(spec.packing)
        self.spec, self.fingerprint, self.seed, self.revisions = (
            spec,
            spec.fingerprint,
            spec.seed,
            spec.revisions,
        )
        self.record = _initial_record(len(spec.sources))  # window holding the last served step's start

    def epoch(self, consumed: int) -> int:
        """Passes completed by every streaming source (as of the last step served)."""
        return min(int(c["pass"]) for c in self.record["sources"])

    def _loader(self, workers: int) -> Iterator[Any]:
        options: dict[str, Any] = {}
        if workers:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers are the parallelism
            options = {
                "prefetch_factor": 2,
                "multiprocessing_context": _fork_context(),
                "worker_init_fn": exit_with_parent,
            }
        loader = DataLoader(
            _WindowDataset(self.spec, self.record),
            batch_size=None,
            collate_fn=_keep,
            num_workers=workers,
            **options,
        )
        return iter(loader)

    def batches(
        self, start: int, offset: int, micro: int, stride: int, workers: int, pin_memory: bool
    ) -> Iterator[dict[str, Any]]:
        items = self._loader(workers)
        buffer: deque[tuple[dict[str, Any], PackedWindow]] = deque()
        end = int(self.record["start"])  # global position after the last window pulled
        for step_start in itertools.count(start, stride):
            first = step_start + offset
            while end < first + micro:
                item = next(items)
                if item[0] == "error":
                    raise UserError(item[1])
                record, window = item
                buffer.append(({**record, "start": end}, window))
                end += window.n_sequences
            # Forget windows that end before this step; keep the one holding its start for the state.
            while len(buffer) > 1 and buffer[1][0]["start"] <= step_start:
                buffer.popleft()
            windows_held = [w for _, w in buffer]
            starts = [r["start"] for r, _ in buffer]
            sequences = []
            for position in range(first, first + micro):
                part = int(np.searchsorted(starts, position, side="right")) - 1
                while windows_held[part].n_sequences <= position - starts[part]:  # skip empty windows
                    part += 1
                sequences.append((part, position - starts[part]))
            # _WindowSplit has the PackedSplit attributes build_rows reads, over the windows held.
            rows = build_rows(_WindowSplit(self.spec, windows_held), sequences)  # type: ignore[arg-type]
            self.record = buffer[0][0]
            yield _to_torch(rows, pin_memory)

    def state(self) -> dict[str, Any]:
        return {"data_revisions": list(self.spec.revisions), "window": copy.deepcopy(self.record)}

    def check(self, state: dict[str, Any], allow_revision_change: bool) -> list[str]:
        if "window" not in state:
            raise UserError(
                "the checkpoint's streaming data position has no window (written by another version of "
                "llm_train); resume with the llm_train that wrote it, or start a new run"
            )
        return check_revisions(self.spec, state.get("data_revisions"), allow_revision_change)

    def load(self, state: dict[str, Any]) -> None:
        self.record = copy.deepcopy(state["window"])  # the next batch is re-packed from the saved window on


class StreamingBatches(Batches):
    """The dealer over a streamed training split (the same `Batches`; `per_epoch` is None)."""

    def __init__(
        self,
        spec: StreamSpec,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        workers: int | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        super().__init__(StreamedSequences(spec), micro_batch, dp_rank, dp_size, workers, pin_memory)


def check_revisions(spec: StreamSpec, saved: list[str | None] | None, allow: bool) -> list[str]:
    """Refuse (one line) a hub source that now resolves to another commit than the checkpoint read.

    Its saved offsets would point at other rows. With `allow` (--allow-data-revision-change) the
    change is a notice instead. A side that does not know its commit (offline, no cache; or a
    checkpoint written before revisions were recorded) cannot be compared: also a notice.
    """
    notices = []
    saved = saved if saved is not None else [None] * len(spec.revisions)
    for i, (then, now) in enumerate(zip(saved, spec.revisions, strict=True)):
        if then == now or spec.located[i].kind != "hub":
            continue
        where = f"data.train[{i}] ({spec.located[i].path})"
        if then is None or now is None:
            notices.append(
                f"{where}: the checkpoint's dataset revision ({then or 'unknown'}) and this run's "
                f"({now or 'unknown'}) cannot be compared; pin data.train[{i}].revision to be sure"
            )
        elif allow:
            notices.append(f"{where}: dataset revision {then} -> {now} (--allow-data-revision-change)")
        else:
            raise UserError(
                f"{where}: the checkpoint read dataset revision {then}, the hub now gives {now}; its saved "
                f"stream offsets would point at other rows: pin the checkpoint's with "
                f"data.train[{i}].revision={then}, or pass --allow-data-revision-change to resume on the new one"
            )
    return notices


def _to_torch(rows: dict[str, Any], pin: bool) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    for k, v in rows.items():
        if isinstance(v, np.ndarray):
            t = torch.from_numpy(v)
            out[k] = t.pin_memory() if pin else t
        else:
            out[k] = v
    return out


def _stat_signature(files: tuple[Path, ...]) -> str:
    return digest([(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(files)])
