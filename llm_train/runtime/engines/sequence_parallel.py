"""Ulysses sequence parallelism (DeepSpeed ALST) for the ZeRO engine: each sequence split over `sp` ranks.

How a run uses it (measured on CPU/gloo: bench/results/ulysses-probe-20261130.txt and
tests/e2e/test_sequence_parallel.py):

- Accelerate's `ParallelismConfig(sp_backend="deepspeed")` makes `prepare` register DeepSpeed's
  Ulysses attention in place of the model's sdpa / flash-attention kernel and hand DeepSpeed
  the sequence-parallel groups: consecutive ranks (rank = dp_rank * sp + sp_rank).
- The data: every rank of a group gets the same micro-batch (the stream deals by
  `Layout.dp_rank`), and `shard` keeps this rank's contiguous slice of the sequence with its
  global position ids. The attention all-to-all regathers whole sequences head by head.
  Labels are shifted over the *whole* row first, so the last token of a slice still predicts
  the first token of the next one.
- The loss is each rank's share of the group's token-weighted mean: the sum of its token
  losses over the group's token count (`shard` passes that count as num_items_in_batch; the loss
  itself, and the one non-differentiable all-reduce that logs the group's sum, are
  runtime/loss/language_modeling.py `SequenceParallelLM`). Summing the
  gradients of the shares over the group gives the gradient of the sp=1 loss, whatever the
  split of masked tokens. DeepSpeed sums gradients over the sequence ranks and averages over
  the data-parallel ones under ZeRO-1/2, and so does ZeRO-3 once its reduce-scatter path is
  off (`resolution` sets zero_optimization.reduce_scatter=false: with it, ZeRO-3 averaged
  over all ranks and the gradients came out 1/sp of sp=1's).
- Padded rows drop their attention mask: padding sits at the end, so under causal attention no
  real token sees it, and its labels are -100. Packed rows would need the mask (refused
  unless flash-attention-2 runs them varlen from the position ids: parallel.py).
- Evaluation is sharded like training (a whole row of a long-context run fits no single GPU):
  Accelerate registers the attention with `disable_in_eval`, which would make every rank compute
  the full row in eval mode, so `evaluating` keeps the modules in training mode and switches off
  what training mode adds, dropout (nn.Dropout modules and HF attention's `attention_dropout`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from llm_train.config.layout import Layout
from llm_train.errors import UserError
from llm_train.runtime.base.collectives import Collectives

if TYPE_CHECKING:
    from accelerate.utils import ParallelismConfig

IGNORE = -100


def parallelism_config(layout: Layout, seq_len: int, attention: str) -> ParallelismConfig | None:
    """What Accelerate needs to wire Ulysses into `prepare`; None without sequence parallelism."""
    if layout.sp == 1:
        return None
    try:
        from accelerate.utils import ParallelismConfig
        from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig
    except ImportError:
        import accelerate

        raise UserError(
            f"deepspeed.sequence_parallel={layout.sp} needs accelerate >= 1.12 (Ulysses through "
            f"ParallelismConfig), this environment has {accelerate.__version__}; pip install -U accelerate"
        ) from None

    return ParallelismConfig(
        sp_backend="deepspeed",
        sp_size=layout.sp,
        # Accelerate rewrites DeepSpeed's train_batch_size as micro x accumulation x this (1 if unset).
        dp_replicate_size=layout.dp,
        sp_handler=DeepSpeedSequenceParallelConfig(
            sp_seq_length=seq_len, sp_seq_length_is_variable=False, sp_attn_implementation=attention
        ),
    )


class SequenceShard:
    """This rank's slice of every micro-batch (its loss: runtime/loss/language_modeling.py SequenceParallelLM)."""

    def __init__(self, sp: int, sp_rank: int, group: Collectives) -> None:
        self.sp, self.sp_rank, self.group = sp, sp_rank, group

    def shard(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The forward arguments for this rank: its tokens, their global positions and shifted labels."""
        input_ids, labels = batch["input_ids"], batch["labels"]
        rows, width = input_ids.shape
        chunk = width // self.sp  # parallel.py checked that seq_len divides
        start, end = self.sp_rank * chunk, (self.sp_rank + 1) * chunk
        positions = batch.get("position_ids")
        if positions is None:  # padded rows: one sample from position 0
            positions = torch.arange(width, device=input_ids.device).expand(rows, width)
        shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[:, 1:]
        local = shifted[:, start:end].contiguous()
        tokens = (local != IGNORE).sum()
        group_tokens = self.group.sum(tokens).clamp(min=1)
        return {
            "input_ids": input_ids[:, start:end].contiguous(),
            "position_ids": positions[:, start:end].contiguous(),
            # transformers' causal-LM loss takes already-shifted labels as shift_labels (it computes a
            # loss only when labels is set) and divides the summed token losses by
            # num_items_in_batch when given: this rank's share of the group's mean.
            "labels": local,
            "shift_labels": local,
            "num_items_in_batch": group_tokens,
            "use_cache": False,
        }


@contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """No gradients and no dropout, with the modules left in training mode so Ulysses stays on."""
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.training]
    # A float attribute, not a submodule: Module's typed __setattr__ takes only tensors and modules,
    # hence setattr below.
    attention: list[tuple[torch.nn.Module, float]] = [
        (m, rate)
        for m in model.modules()
        if isinstance(rate := getattr(m, "attention_dropout", None), float) and rate > 0
    ]
    try:
        for dropout in dropouts:
            dropout.eval()
        for module, _ in attention:
            setattr(module, "attention_dropout", 0.0)  # noqa: B010 - see above
        with torch.no_grad():
            yield
    finally:
        for dropout in dropouts:
            dropout.train()
        for module, rate in attention:
            setattr(module, "attention_dropout", rate)  # noqa: B010 - see above
