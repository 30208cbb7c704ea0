"""The interface every loss is reached through: an `Objective` scores one micro-batch into a `Scored`.

The ZeRO engine calls `objective.score(model, batch)` for every micro-batch it trains or evaluates on,
backpropagates `Scored.loss` and logs `Scored.logged` (the loss itself unless the objective says
otherwise) with the metrics; the step loop (runtime/loop.py) sees only their means (`mean_scores`). The
pipeline engine runs DeepSpeed's schedule, which calls a loss function on the last stage instead
(language_modeling.py `causal_lm_loss`, `ChunkedCausalLMLoss`), and asks the objective for its
evaluation summary only. Which objective a recipe asks for: objective_losses.py `make_objective`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from llm_train.data.prepare import PackedSplit

Batch = dict[str, Any]


@dataclass
class Scored:
    """One micro-batch: the loss to backpropagate (its mean) and detached metrics (its means)."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    logged: torch.Tensor | None = None
    """The loss to log where it is not `loss` (detached): a sequence-parallel rank backpropagates its share
    of the group's loss and logs the group's whole loss (language_modeling.py `SequenceParallelLM`)."""


def mean_scores(scored: list[Scored]) -> dict[str, torch.Tensor]:
    """The mean logged loss and metrics of several micro-batches (this rank's), as detached scalars."""
    losses = [s.loss if s.logged is None else s.logged for s in scored]
    out = {"loss": torch.stack([loss.detach().float() for loss in losses]).mean()}
    for name in scored[0].metrics:
        out[name] = torch.stack([s.metrics[name].float() for s in scored]).mean()
    return out


class Objective(Protocol):
    """What the engines score micro-batches by: LanguageModeling, SequenceParallelLM, Preference,
    RewardModelling, or GRPO's (runtime/rl/grpo.py, its arithmetic in grpo.py here)."""

    name: str

    def score(self, model: torch.nn.Module, batch: Batch) -> Scored: ...

    def prepare(
        self, splits: list[PackedSplit | None], dp_rank: int, dp_size: int, say: Callable[[str], None]
    ) -> None: ...

    def eval_summary(self, means: dict[str, float]) -> dict[str, float]: ...
