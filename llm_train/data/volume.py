"""How many passes over its training data a run makes, and the guard that refuses too many.

A recipe counts optimizer steps, not epochs, and nothing else ties the two together: 2000 steps
of 128 sequences of 4096 tokens is a billion tokens, which on the bundled 466 KB corpus (about
30 such sequences) is thousands of epochs of memorising, with nothing printed to say so. One
optimizer step consumes micro_batch x grad_accum x dp sequences (dealer.py serves every
sequence of an epoch exactly once over the data-parallel ranks; tensor- and pipeline-parallel
ranks share theirs), and an epoch is the weighted sum of the sources' sequences
(`EpochOrder.epoch_len`), so

    epochs = max_steps x sequences per step / sequences per epoch

The training session (once the data is packed) and `--dry-run` (when every source is local)
both call `check_volume`, so they print the same number and refuse the same runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llm_train.config.layout import Layout
from llm_train.config.recipe_sections import DataSection, OptimSection
from llm_train.config.resolution import steps_for_epochs
from llm_train.data.dealer import EpochOrder
from llm_train.data.prepare import PackedSplit, load_blocks
from llm_train.data.sources import locate
from llm_train.errors import UserError

# Float slack: optim.epochs=3 with data.max_epochs=3 is allowed, whatever the rounding.
_SLACK = 1e-9


@dataclass(frozen=True)
class DataVolume:
    """The numbers behind a run's epoch count."""

    max_steps: int
    sequences_per_step: int  # the global batch: micro_batch x grad_accum x dp
    sequences_per_epoch: int
    seq_len: int
    unit: str = "sequences"  # "pairs" for preference data (two sequences each, counted as one)

    @classmethod
    def of(
        cls, layout: Layout, sequences_per_epoch: int, max_steps: int, seq_len: int, pairs: bool = False
    ) -> DataVolume:
        unit = "pairs" if pairs else "sequences"
        return cls(max_steps, layout.global_batch_size, sequences_per_epoch, seq_len, unit)

    @property
    def epochs(self) -> float:
        return self.max_steps * self.sequences_per_step / self.sequences_per_epoch

    def steps_within(self, epochs: float) -> int:
        """The most optimizer steps that stay within `epochs` passes over the data."""
        return math.floor(epochs * self.sequences_per_epoch / self.sequences_per_step + _SLACK)

    def describe(self) -> str:
        return (
            f"{self.max_steps} steps x {self.sequences_per_step} {self.unit} of {self.seq_len} tokens = "
            f"{self.epochs:.2f} epochs of the {self.sequences_per_epoch} training {self.unit}"
        )


def sequences_per_epoch(split: PackedSplit) -> int:
    """Sequences in one epoch of the mixture: every source's sequences times its weight (as dealer.py deals them)."""
    return EpochOrder([p.n_sequences for p in split.parts], split.weights, 0).epoch_len


def check_volume(volume: DataVolume, max_epochs: float, requested_epochs: float | None = None) -> str:
    """The line to print about the run's epochs; a UserError when they are more than data.max_epochs.

    `requested_epochs` is optim.epochs when the steps were derived from it: that number is the one
    compared, because rounding the steps up to whole optimizer steps may add a fraction of a step.
    """
    line = f"data: {volume.describe()} (data.max_epochs={max_epochs:g})"
    epochs = requested_epochs if requested_epochs is not None else volume.epochs
    if epochs <= max_epochs * (1 + _SLACK):
        return line
    if requested_epochs is not None:
        raise UserError(
            f"data: optim.epochs={requested_epochs:g} is more than data.max_epochs={max_epochs:g}; "
            f"lower optim.epochs, add training data, or raise data.max_epochs"
        )
    allowed = volume.steps_within(max_epochs)
    lower = f"lower optim.max_steps to {allowed} or fewer, " if allowed >= 1 else ""
    raise UserError(
        f"data: optim.max_steps={volume.max_steps} x {volume.sequences_per_step} {volume.unit} per step is "
        f"{volume.epochs:.1f} epochs of the {volume.sequences_per_epoch} training {volume.unit} of "
        f"{volume.seq_len} tokens, more than data.max_epochs={max_epochs:g}; {lower}add training data, "
        f"or raise data.max_epochs to {math.ceil(volume.epochs * 10) / 10:g}"
    )


def hub_sources(data: DataSection) -> list[str]:
    """The training sources that name a hub dataset: their size is known only once they are downloaded."""
    return [
        source.path
        for i, source in enumerate(data.sources("train"))
        if locate(source.path, f"data.train[{i}]").kind == "hub"
    ]


def planned_volume(
    data: DataSection,
    optim: OptimSection,
    layout: Layout,
    tokenizer: Callable[[], Any],
    say: Callable[[str], None],
) -> str:
    """For `--dry-run`: the epochs line (or why it cannot be known yet); a UserError when too many.

    Local data is tokenised and packed into the same cache the run then reads, so this costs
    only the first time. Hub datasets are not downloaded by a dry run, and streamed ones have no
    length to count.
    """
    if any(s.streaming for s in data.sources("train")):
        return "data: epochs not counted: data.train is streamed (its length is unknown until it is read)"
    remote = hub_sources(data)
    if remote:
        return (
            f"data: epochs not computed before the run: data.train names the hub dataset {remote[0]} "
            "(the run prints them once it has tokenised the data)"
        )
    try:
        loaded = tokenizer()
    except UserError as exc:  # e.g. a hub tokenizer on a machine without network: the plan still prints
        return f"data: epochs not computed: {exc}"
    train, _ = load_blocks(data, loaded, optim.seed, say)
    per_epoch = sequences_per_epoch(train)
    requested = optim.epochs if optim.max_steps is None else None
    max_steps = optim.max_steps or steps_for_epochs(
        requested or 1.0, per_epoch // (layout.micro_batch_size * layout.dp), layout.grad_accum
    )
    volume = DataVolume.of(layout, per_epoch, max_steps, data.seq_len, train.pairs)
    return check_volume(volume, data.max_epochs, requested)
