"""Preference tuning on pairs of rows (`objective: dpo | simpo`).

    dpo    Direct Preference Optimization (Rafailov et al. 2023, eq. 7), the sigmoid loss
           -log sigmoid(beta * ((pi_c - pi_r) - (ref_c - ref_r))) on summed response log-probs,
           with optional label smoothing: the conservative DPO of Mitchell 2023 ("A note on DPO
           with noisy preferences"), (1 - e) of that loss plus e of the reversed pair's
    simpo  SimPO (Meng et al. 2024, eq. 6), reference-free:
           -log sigmoid(beta * (avg_c - avg_r) - gamma) on per-token average log-probs

Why SimPO as the reference-free objective, not ORPO: llm_train runs preference tuning as the
step after SFT (Zephyr: SFT, then DPO), and SimPO is the drop-in replacement for DPO at that
step: the same pairs, the same one forward of chosen and rejected, no reference pass and no
second model. ORPO (Hong et al. 2024) exists to fold SFT into the preference stage (an NLL
term on the chosen response plus an odds-ratio term), which duplicates the SFT recipes.

The engine calls `score(model, batch)` for every micro-batch (interface.py); the step loop stays the
same for every objective. A pair batch holds its m chosen rows, then its m rejected rows
(data/model_inputs.py). Rewards and metrics follow TRL's definitions (DPOTrainer, CPOTrainer with
loss_type="simpo"): rewards are beta times the policy's log-ratio to the reference (DPO) or
times the average log-prob (SimPO); accuracy counts pairs whose chosen reward is strictly
higher. tests/unit/test_objectives.py checks losses, rewards and gradients against TRL 1.16's
own code within 1e-5 in fp32.

Log-probs are summed in fp32 from the model's logits, as transformers' own loss upcasts them, or,
under `memory.tiled_loss`, from the per-token log-probs of the chunked loss (chunked.py):
the same numbers to fp32 rounding, without the [tokens x vocabulary] logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from llm_train.config.objective_sections import PreferenceSection
from llm_train.runtime.loss.interface import Batch, Scored

if TYPE_CHECKING:
    from llm_train.data.prepare import PackedSplit

# Names of the per-step preference metrics (metrics.jsonl, W&B, TensorBoard; eval_ + name at evaluation).
PREFERENCE_METRICS = (
    "reward_accuracy",
    "reward_chosen",
    "reward_rejected",
    "reward_margin",
    "logp_chosen",
    "logp_rejected",
)


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probs, token counts) per row over the labelled tokens, labels shifted by one.

    cross_entropy with reduction="none" gives -log p of each label in fp32 without a second
    [tokens x vocabulary] tensor, and 0 where the label is -100.
    """
    shifted, targets = logits[:, :-1, :].float(), labels[:, 1:]
    token = -F.cross_entropy(
        shifted.reshape(-1, shifted.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="none"
    ).view(targets.shape)
    return token.sum(-1), (targets != -100).sum(-1)


def model_logps(
    model: torch.nn.Module, inputs: Batch, labels: torch.Tensor, chunked: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sequence_logps` of the model's forward on `inputs`: from its logits, or, when `chunked` (the model's
    forward patched by memory.tiled_loss), from the token log-probs it returns for `labels`."""
    if not chunked:
        return sequence_logps(model(**inputs, use_cache=False).logits, labels)
    token = model(**inputs, labels=labels, use_cache=False).token_logps  # [rows, s], 0 where not labelled
    return token.sum(-1), (labels[:, 1:] != -100).sum(-1)


def dpo_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair losses, chosen rewards, rejected rewards) of DPO's sigmoid loss on summed log-probs."""
    logits = (chosen - rejected) - (ref_chosen - ref_rejected)
    losses = (
        -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    )
    return losses, beta * (chosen - ref_chosen).detach(), beta * (rejected - ref_rejected).detach()


def simpo_loss(
    chosen_avg: torch.Tensor,
    rejected_avg: torch.Tensor,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair losses, chosen rewards, rejected rewards) of SimPO on per-token average log-probs."""
    logits = beta * (chosen_avg - rejected_avg) - gamma
    losses = -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing
    return losses, beta * chosen_avg.detach(), beta * rejected_avg.detach()


def pair_metrics(
    chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The logged means of one micro-batch of pairs (TRL's rewards/* and logps/*)."""
    return {
        "reward_accuracy": (chosen_rewards > rejected_rewards).float().mean(),
        "reward_chosen": chosen_rewards.mean(),
        "reward_rejected": rejected_rewards.mean(),
        "reward_margin": (chosen_rewards - rejected_rewards).mean(),
        "logp_chosen": chosen.detach().mean(),
        "logp_rejected": rejected.detach().mean(),
    }


# A model's summed log-probs per row of a batch (input_ids, attention_mask) for its labels.
Forward = Callable[[Batch, torch.Tensor], torch.Tensor]
# Scores what the objective needs before training (DPO's cached reference log-probs):
# (the train and eval splits, either possibly absent; dp rank; dp size; say).
PrepareReference = Callable[[list["PackedSplit | None"], int, int, Callable[[str], None]], None]


class Preference:
    """DPO or SimPO on batches of pairs. DPO's reference log-probs come with the batch (cached, see
    runtime/engines/reference.py) or from `live_reference`, a no-grad forward of the reference model."""

    def __init__(
        self,
        name: str,
        settings: PreferenceSection,
        live_reference: Forward | None = None,
        prepare_reference: PrepareReference | None = None,
        chunked: bool = False,
    ) -> None:
        assert settings.beta is not None  # recipe.py fills the objective's default in
        self.name, self.settings, self.beta = name, settings, settings.beta
        self.live_reference, self._prepare, self.chunked = live_reference, prepare_reference, chunked

    def prepare(
        self, splits: list[PackedSplit | None], dp_rank: int, dp_size: int, say: Callable[[str], None]
    ) -> None:
        """DPO with a cached reference: its log-probs of every pair, before any checkpoint is loaded."""
        if self._prepare is not None:
            self._prepare(splits, dp_rank, dp_size, say)

    def score(self, model: torch.nn.Module, batch: Batch) -> Scored:
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "reference_logps")}
        labels = batch["labels"]
        sums, counts = model_logps(model, inputs, labels, self.chunked)
        m = sums.shape[0] // 2
        if self.name == "simpo":
            average = sums / counts.clamp(min=1)
            losses, chosen_r, rejected_r = simpo_loss(
                average[:m], average[m:], self.beta, self.settings.simpo_gamma, self.settings.label_smoothing
            )
            return Scored(losses.mean(), pair_metrics(chosen_r, rejected_r, average[:m], average[m:]))
        reference = batch.get("reference_logps")
        if reference is None:
            assert self.live_reference is not None, "a cached reference is attached to every batch"
            with torch.no_grad():
                reference = self.live_reference(inputs, labels)
        reference = reference.to(sums.device, torch.float32)
        losses, chosen_r, rejected_r = dpo_loss(
            sums[:m], sums[m:], reference[:m], reference[m:], self.beta, self.settings.label_smoothing
        )
        return Scored(losses.mean(), pair_metrics(chosen_r, rejected_r, sums[:m], sums[m:]))

    def eval_summary(self, means: dict[str, float]) -> dict[str, float]:
        return {"eval_loss": means["loss"], **{f"eval_{k}": means[k] for k in PREFERENCE_METRICS}}


def reference_forward(
    model: torch.nn.Module,
    switch: Callable[[], AbstractContextManager[Any]] | None = None,
    chunked: bool = False,
) -> Forward:
    """Summed log-probs per row by a no-grad, eval-mode forward of `model` (e.g. the policy's engine under
    `switch`, PEFT's disable_adapter), back in its previous mode afterwards: the reference has no dropout.
    `chunked`: the model's forward is patched by memory.tiled_loss (see `model_logps`)."""

    def forward(inputs: Batch, labels: torch.Tensor) -> torch.Tensor:
        module = getattr(model, "module", model)
        was_training = module.training
        model.eval()
        try:
            with torch.no_grad(), switch() if switch is not None else nullcontext():
                return model_logps(model, inputs, labels, chunked)[0]
        finally:
            if was_training:
                model.train()

    return forward


def iter_pairs(n: int, micro: int, dp_rank: int, dp_size: int) -> Iterator[list[int]]:
    """This rank's micro-batches of unit indices over 0..n-1, dealt like the stream; the last step wraps
    around so every rank runs the same number of forwards (a ZeRO-3 forward is a collective)."""
    step = micro * dp_size
    for first in range(0, n, step):
        yield [(first + dp_rank * micro + j) % n for j in range(micro)]
