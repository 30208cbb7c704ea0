"""Reward-model training (`objective: reward`): the Bradley-Terry pairwise loss on a classifier's scores.

As in Ouyang et al. 2022: a one-output sequence-classification head scores each row at its last non-pad
token, and the loss is -log sigmoid(r_c - r_r - margin), plus, optionally, c * mean((r_c + r_r)^2), which
keeps the rewards centred on 0 (Eisenstein et al. 2023) since the loss only sees differences. A pair batch
holds its m chosen rows, then its m rejected rows (data/model_inputs.py). Metrics follow TRL's
RewardTrainer; tests/unit/test_objectives.py checks them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from llm_train.runtime.loss.interface import Batch, Scored

if TYPE_CHECKING:
    from llm_train.data.prepare import PackedSplit

# Names of the per-step reward-model metrics (eval_ + name at evaluation): the share of pairs scored the right
# way round, the mean reward of each side, and the mean of r_c - r_r.
REWARD_METRICS = ("reward_accuracy", "reward_chosen", "reward_rejected", "reward_margin")


def bradley_terry_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: float | torch.Tensor = 0.0,
    center_coefficient: float | None = None,
) -> torch.Tensor:
    """The mean pairwise loss of a reward model's scores: -log sigmoid(r_c - r_r - margin), plus the centring
    term c * mean((r_c + r_r)^2) when `center_coefficient` is set (the scale of the rewards is otherwise free)."""
    loss = -F.logsigmoid(chosen - rejected - margin).mean()
    if center_coefficient is not None:
        loss = loss + center_coefficient * torch.mean((chosen + rejected) ** 2)
    return loss


class RewardModelling:
    """Trains a one-output sequence classifier on batches of pairs: `model` returns one score per row
    (transformers' *ForSequenceClassification with num_labels=1 reads it at the last non-pad token)."""

    name = "reward"

    def __init__(self, margin: float = 0.0, center_coefficient: float | None = None) -> None:
        self.margin, self.center_coefficient = margin, center_coefficient

    def prepare(
        self, splits: list[PackedSplit | None], dp_rank: int, dp_size: int, say: Callable[[str], None]
    ) -> None:
        """Nothing to compute before training: the model is its own and only scorer."""

    def score(self, model: torch.nn.Module, batch: Batch) -> Scored:
        # Labels stay out of the forward: with them the head computes its own (regression) loss.
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "reference_logps")}
        rewards = model(**inputs, use_cache=False).logits.squeeze(-1).float()
        m = rewards.shape[0] // 2
        chosen, rejected = rewards[:m], rewards[m:]
        loss = bradley_terry_loss(chosen, rejected, self.margin, self.center_coefficient)
        chosen, rejected = chosen.detach(), rejected.detach()
        return Scored(
            loss,
            {
                "reward_accuracy": (chosen > rejected).float().mean(),
                "reward_chosen": chosen.mean(),
                "reward_rejected": rejected.mean(),
                "reward_margin": (chosen - rejected).mean(),
            },
        )

    def eval_summary(self, means: dict[str, float]) -> dict[str, float]:
        return {"eval_loss": means["loss"], **{f"eval_{k}": means[k] for k in REWARD_METRICS}}
