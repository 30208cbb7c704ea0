"""The one data dealer: global position -> this data-parallel rank's micro-batches, for every kind of data.

The training data is one endless list of sequences. Tokenised up front (a packed split, here)
it is epoch after epoch, each a seeded permutation of every source's share (weight x its
sequences; a fractional share takes the next slice of a per-source permutation, so weight 0.5
covers the source every two epochs). Streamed (data/stream_windows.py) it is the packed windows of
the stream, in order. Either way global micro-step k hands positions [k*G, (k+1)*G),
G = micro_batch x dp_size, to the data-parallel ranks in order: across ranks each sequence is
served exactly once, ranks of one tensor/pipeline group (same dp rank) get identical batches,
and an epoch that does not divide into micro-steps runs on into the next one instead of
dropping its remainder.

`Batches` deals; what it deals from is a `Sequences` (PackedSequences here, streaming's
StreamedSequences). The position is one number, the sequences consumed by all ranks together,
so a resumed run continues exactly, even on a different number of ranks; the state a checkpoint
holds has one format for both kinds (`Batches.state_dict`), with what a stream needs beside it.
How many loader workers build the next batches is one policy (`loader_workers`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from llm_train.data.model_inputs import build_rows
from llm_train.data.packing import require_packing_support
from llm_train.data.prepare import PackedSplit
from llm_train.data.workers import exit_with_parent
from llm_train.errors import UserError

if TYPE_CHECKING:
    from multiprocessing.context import BaseContext


_STATE_VERSION = 1


def _seed(seed: int) -> int:
    return seed & 0xFFFF_FFFF_FFFF_FFFF  # numpy seeds are non-negative; keep negative seeds distinct


class EpochOrder:
    """Global position -> (part, sequence): the per-epoch mixture and shuffle, computed lazily."""

    def __init__(self, sizes: list[int], weights: list[float], seed: int) -> None:
        self.sizes = sizes
        self.shares = [max(1, round(w * n)) if n else 0 for n, w in zip(sizes, weights, strict=True)]
        self.epoch_len = sum(self.shares)
        self.base = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        self.seed = _seed(seed)
        self._epochs: dict[int, np.ndarray] = {}

    def epoch(self, e: int) -> np.ndarray:
        """Global sequence ids of epoch e, in the order they are served."""
        if e not in self._epochs:
            parts = [self._share(i, e) + self.base[i] for i in range(len(self.sizes)) if self.shares[i]]
            ids = np.concatenate(parts)
            ids = ids[np.random.default_rng([self.seed, 0, e]).permutation(len(ids))]
            if len(self._epochs) >= 2:  # a micro-step spans at most two epochs
                del self._epochs[min(self._epochs)]
            self._epochs[e] = ids
        return self._epochs[e]

    def _share(self, part: int, e: int) -> np.ndarray:
        size, share = self.sizes[part], self.shares[part]
        if share == size:
            return np.arange(size)
        # Endless per-source stream: cycle c is a seeded permutation; epoch e takes items [e*share, (e+1)*share).
        lo, hi = e * share, (e + 1) * share
        out = []
        for cycle in range(lo // size, (hi - 1) // size + 1):
            perm = np.random.default_rng([self.seed, 1, part, cycle]).permutation(size)
            out.append(
                perm[max(lo, cycle * size) - cycle * size : min(hi, (cycle + 1) * size) - cycle * size]
            )
        return np.concatenate(out)

    def at(self, position: int) -> tuple[int, int]:
        e, i = divmod(position, self.epoch_len)
        gid = int(self.epoch(e)[i])
        part = int(np.searchsorted(self.base, gid, side="right")) - 1
        return part, gid - int(self.base[part])


def loader_workers(requested: int | None, streamed: bool, cuda: bool) -> int:
    """DataLoader worker processes per rank: `requested` when given, else 2 on CUDA; on CPU none for a
    packed split (a batch is a few array copies) and one for a stream (tokenising is the work there,
    so the model does not wait for it).

    The session asks with data.loader_workers, or 0 when the optimizer lives in host RAM
    (config/layout.py `workers_for`: forked workers copy the CPU optimizer's pages).
    """
    if requested is not None:
        return requested
    return 2 if cuda else (1 if streamed else 0)


class Sequences(Protocol):
    """What the dealer deals from: the endless global list of packed sequences, by position."""

    kind: str
    """"packed" (tokenised up front) or "stream": which position a saved state holds."""
    fingerprint: str
    """What the sequences are: sources, tokenizer, packing (a saved state must match it)."""
    seed: int
    revisions: list[str | None]
    """Per source, the hub commit read (streams resolve it at start-up; None: local or unknown);
    empty for a packed split, whose fingerprint follows the content it was tokenised from."""
    split: PackedSplit | None
    """The packed, tokenised split (what a cached DPO reference scores); None for a stream."""
    epoch_len: int | None
    """Sequences per epoch; None: a stream has no known length."""

    def epoch(self, consumed: int) -> int:
        """The epoch the next sequence belongs to (for a stream: passes completed by every source)."""
        ...

    def batches(
        self, start: int, offset: int, micro: int, stride: int, workers: int, pin_memory: bool
    ) -> Iterator[dict[str, Any]]:
        """This rank's micro-batches: positions [p + offset, p + offset + micro) for p = start, start + stride, ..."""
        ...

    def state(self) -> dict[str, Any]:
        """What a saved position needs beside the count of sequences consumed (JSON-serialisable)."""
        ...

    def check(self, state: dict[str, Any], allow_revision_change: bool) -> list[str]:
        """Refuse (UserError, one line) a saved state these sequences cannot continue; else notices."""
        ...

    def load(self, state: dict[str, Any]) -> None:
        """Continue from `state` (checked already)."""
        ...


# A saved position's kind as a user reads it.
_KINDS = {"packed": "not a streaming one", "stream": "a streaming one"}


class Batches(Iterator[dict[str, Any]]):
    """Endless training micro-batches for one data-parallel rank, and the position to resume them from."""

    def __init__(
        self,
        sequences: Sequences,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        workers: int | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        import torch

        self.sequences, self.micro, self.rank, self.size = sequences, micro_batch, dp_rank, dp_size
        self.global_micro = micro_batch * dp_size
        self.epoch_len = sequences.epoch_len
        # Micro-batches per epoch on this rank; None when the data has no known length (a stream).
        self.per_epoch = None if self.epoch_len is None else self.epoch_len // self.global_micro
        if self.per_epoch == 0:
            raise UserError(
                f"data: {self.epoch_len} training sequences per epoch are fewer than one global micro-step "
                f"(micro_batch_size {micro_batch} x data-parallel size {dp_size}); add data or shrink the batch"
            )
        cuda = torch.cuda.is_available()
        self.workers = loader_workers(workers, sequences.kind == "stream", cuda)
        self.pin_memory = cuda if pin_memory is None else pin_memory
        # Sequences served to all ranks together: the position, valid on any number of ranks.
        self.consumed = 0
        self._batches: Iterator[dict[str, Any]] | None = None

    @property
    def split(self) -> PackedSplit | None:
        return self.sequences.split

    @property
    def revisions(self) -> list[str | None]:
        return self.sequences.revisions

    @property
    def epoch(self) -> int:
        return self.sequences.epoch(self.consumed)

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._batches is None:
            self._batches = self.sequences.batches(
                self.consumed,
                self.rank * self.micro,
                self.micro,
                self.global_micro,
                self.workers,
                self.pin_memory,
            )
        batch = next(self._batches)
        self.consumed += self.global_micro
        return batch

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position, the same on every rank, plus what it is valid for."""
        sequences = self.sequences
        return {
            "version": _STATE_VERSION,
            "kind": sequences.kind,
            "sequences_consumed": self.consumed,
            "epoch": self.epoch,
            "sequences_per_epoch": self.epoch_len,
            "data_fingerprint": sequences.fingerprint,
            "seed": sequences.seed,
            **sequences.state(),
        }

    def check_state(self, state: dict[str, Any], allow_revision_change: bool = False) -> list[str]:
        """Refuse (UserError, one line) a saved position this data cannot continue; else the notices to print."""
        ours = self.sequences.kind
        saved = state.get("kind", "packed")  # tokenise-first states written before "kind" existed
        if saved != ours:
            raise UserError(
                f"the checkpoint's data position is {_KINDS.get(saved, saved)}, this run's data is "
                f"{_KINDS[ours]}; resume with the recipe's original data section (streaming as it was), "
                "or start a new run"
            )
        if state.get("version") != _STATE_VERSION or "sequences_consumed" not in state:
            raise UserError(f"checkpoint data position {state!r} was written by another version of llm_train")
        if (
            state.get("data_fingerprint") != self.sequences.fingerprint
            or state.get("seed") != self.sequences.seed
        ):
            what = "streamed training data" if ours == "stream" else "training data"
            raise UserError(
                f"the {what}, its mixture, packing or the seed differ from the checkpoint's; resuming would "
                "repeat or skip samples: resume with the recipe's original data section, or start a new run"
            )
        return self.sequences.check(state, allow_revision_change)

    def load_state_dict(self, state: dict[str, Any], allow_revision_change: bool = False) -> None:
        """Continue from `state` (checked as check_state does): the next batch is the one after it."""
        self.check_state(state, allow_revision_change)
        self.consumed = int(state["sequences_consumed"])
        self.sequences.load(state)
        self._batches = None  # the next batch is built from the restored position


class _MicroBatches:
    """Map-style dataset for a DataLoader: index = first global position of this rank's micro-batch."""

    def __init__(self, split: PackedSplit, order: EpochOrder, micro_batch: int) -> None:
        self.split, self.order, self.micro = split, order, micro_batch

    def __getitem__(self, position: int) -> dict[str, Any]:
        return build_rows(self.split, [self.order.at(position + j) for j in range(self.micro)])


class PackedSequences(Sequences):
    """A packed split's sequences in epoch order (EpochOrder): random access, so workers build whole batches."""

    kind = "packed"
    revisions: list[str | None] = []  # the fingerprint follows the content tokenised

    def __init__(self, split: PackedSplit, seed: int) -> None:
        require_packing_support(split.packing)
        self.split: PackedSplit = split
        self.seed, self.fingerprint = seed, split.fingerprint
        self.order = EpochOrder([p.n_sequences for p in split.parts], split.weights, seed)
        self.epoch_len: int = self.order.epoch_len

    def epoch(self, consumed: int) -> int:
        return consumed // self.epoch_len

    def batches(
        self, start: int, offset: int, micro: int, stride: int, workers: int, pin_memory: bool
    ) -> Iterator[dict[str, Any]]:
        from torch.utils.data import DataLoader

        options: dict[str, Any] = {}
        if workers:
            # Workers build the next micro-batches while the model computes; fork shares the memory maps.
            options = {
                "prefetch_factor": 4,
                "multiprocessing_context": _fork_context(),
                "worker_init_fn": exit_with_parent,  # train.py ends with os._exit: no loader shutdown
            }
        # _MicroBatches is map-style by duck typing: torch's Dataset base would import torch with this module.
        loader: DataLoader[dict[str, Any]] = DataLoader(
            _MicroBatches(self.split, self.order, micro),  # type: ignore[arg-type]
            batch_size=None,  # each item is already a whole micro-batch
            sampler=itertools.count(start + offset, stride),
            num_workers=workers,
            pin_memory=pin_memory,
            **options,
        )
        return iter(loader)

    def state(self) -> dict[str, Any]:
        return {"reference_digest": self.split.reference_digest}  # DPO's cached reference log-probs, or None

    def check(self, state: dict[str, Any], allow_revision_change: bool) -> list[str]:
        """Tokenised up front, a hub source is identified by `datasets`' fingerprint of what it loaded,
        which follows its content: another revision fails the fingerprint check, always (the position
        counts sequences of the old packing, which no longer exist)."""
        saved, ours = state.get("reference_digest"), self.split.reference_digest
        if saved is not None and ours is not None and saved != ours:
            raise UserError(
                "the reference log-probs differ from the ones the checkpoint trained with (another model, "
                "precision or data under data.cache_dir/reference-*); resuming would train against another "
                "reference: resume with the original model and data (copy that cache entry along), or start a new run"
            )
        return []

    def load(self, state: dict[str, Any]) -> None:
        pass  # the position is the count of sequences consumed, which the dealer holds


class BatchStream(Batches):
    """The dealer over a packed split: what every tokenise-first run trains on."""

    def __init__(
        self,
        split: PackedSplit,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        workers: int | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        asked = split.loader_workers if workers is None else workers
        packed = PackedSequences(split, seed)
        super().__init__(packed, micro_batch, dp_rank, dp_size, asked, pin_memory)
        self.epoch_len: int = packed.epoch_len  # a packed split's length is known
        self.per_epoch: int = packed.epoch_len // self.global_micro


def _fork_context() -> BaseContext:
    """fork where the platform has it (workers then share the memory maps), else its default."""
    import multiprocessing

    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else methods[0])


def eval_batches(
    split: PackedSplit | None, micro_batch: int, dp_rank: int, dp_size: int, limit: int
) -> list[dict[str, Any]]:
    """The same fixed eval micro-batches at every evaluation, dealt by data-parallel rank.

    Every rank gets the same number of batches (a rank with none would leave the others
    waiting in the loss all-reduce): a short eval set wraps around to fill the last step.
    """
    import torch

    if split is None or split.n_sequences == 0:
        return []
    base = np.concatenate(([0], np.cumsum([p.n_sequences for p in split.parts])))
    total, step = split.n_sequences, micro_batch * dp_size
    batches = []
    for k in range(min(limit, -(-total // step))):
        first = k * step + dp_rank * micro_batch
        sequences = []
        for j in range(micro_batch):
            gid = (first + j) % total  # in source order: the same eval set whatever the seed
            part = int(np.searchsorted(base, gid, side="right")) - 1
            sequences.append((part, gid - int(base[part])))
        rows = build_rows(split, sequences)
        batches.append(
            {k2: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k2, v in rows.items()}
        )
    return batches
