"""The interface between one run and the DeepSpeed engine that trains it.

Two engines exist: ZeRO through Accelerate (zero_engine.py) and DeepSpeed's pipeline engine
(pipeline_engine.py). The session and the step loop are written once against this
interface; whatever an engine cannot do is refused when the run is resolved
(parallel.check_parallel), never skipped here.

Life of an engine: `start` joins the process group (the world exists from then on),
`build` creates the model and the DeepSpeed engine (and `objective`, what a forward is scored by:
runtime/loss/), then `train_step` / `evaluate` run,
`export` writes final/ (a collective), and `finish` tears the world down.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from llm_train.errors import EXIT_NONFINITE, UserError
from llm_train.planning.speed.flops import TokenFlops

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from transformers import PreTrainedTokenizerBase

    from llm_train.runtime.loss.interface import Objective


class NonFiniteLoss(UserError):
    exit_code = EXIT_NONFINITE


def process_group_timeout(timeout_minutes: float) -> timedelta:
    """deepspeed.timeout_minutes as the process group's timeout (every engine's `start` passes it on)."""
    return timedelta(minutes=timeout_minutes)


Batch = dict[str, Any]


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor
    """This rank's loss for the step (mean over its micro-batches), or the global one (`loss_is_global`)."""
    loss_is_global: bool = False
    """True when the engine already averaged the loss over data-parallel ranks (the pipeline engine)."""
    grad_norm: float | None = None
    """A norm the engine measured itself this step; None: ask DeepSpeed (`Engine.grad_norm`)."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """The objective's own metrics (e.g. DPO's reward accuracy), this rank's means over its micro-batches."""


class Engine(Protocol):
    ds: DeepSpeedEngine
    """The DeepSpeed engine: checkpoints (save/load_checkpoint), LR, ZeRO stage, module."""
    skipped_microbatches: int
    """Micro-batches dropped so far for a non-finite loss (checkpoint.on_nonfinite=skip)."""
    objective: Objective
    """What a forward is scored by (runtime/loss/); set by `build`. Its `prepare` runs before
    a checkpoint is loaded (DPO's cached reference scores the initial model)."""

    def start(self) -> None:
        """Join the process group (and pin this rank's device)."""

    def build(self, max_steps: int, mark: Callable[[str], None]) -> None:
        """The model, optimizer, LR schedule and DeepSpeed engine; `mark` times "model build", "deepspeed init"."""

    def world_info(self) -> dict[str, Any]:
        """What this rank holds, for world.json (beyond rank and data-parallel rank)."""

    def summary_rows(self, ranks: list[dict[str, Any]]) -> list[tuple[str, str]]:
        """Extra start-up lines from every rank's world info (e.g. the pipeline's stage split)."""

    def token_flops(self) -> TokenFlops | None:
        """Training FLOPs per token of the model as a function of the attention span, for MFU."""

    def train_step(self, batches: Iterator[Batch], measure_grad_norm: bool) -> StepResult:
        """One optimizer step: forward and backward over the accumulation steps, then the update."""

    def grad_norm(self) -> float | None:
        """The global gradient norm of the last step, as DeepSpeed tracks it."""

    def evaluate(self, batches: list[Batch]) -> dict[str, float]:
        """`eval_loss` (the mean over the eval batches and all data-parallel ranks) and the objective's
        own eval metrics (`eval_ppl`, or DPO's `eval_reward_accuracy`, ...)."""

    def reference_logits(self, tokenizer: PreTrainedTokenizerBase) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, logits) of the live model on the export check's fixed batch (every rank takes part).

        Recorded with each checkpoint and next to final/: the reference the export checks compare with.
        """

    def export(self, final: Path, tokenizer: PreTrainedTokenizerBase) -> None:
        """Write a plain Hugging Face model directory (every rank takes part)."""

    def benchmark_model(self) -> AbstractContextManager[Any]:
        """The model as it trains now, in eval mode, for rank 0 to run lm-eval on (None on the other ranks).

        Every rank enters it (under ZeRO-3 the weights are gathered, a collective); training resumes
        unchanged when it exits. Only for layouts runtime/benchmark.py `unavailable` lets through.
        """

    def finish(self) -> None:
        """End training and tear the process group down."""


def to_device(batch: Batch, device: torch.device) -> Batch:
    # Non-tensor entries are forward flags (packed batches carry use_cache=False).
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
    }
