"""GRPO's arithmetic: group advantages from rewards, per-token log-probs, and the clipped policy loss.

Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath, section 4.1) samples G completions
per prompt, scores each with rewards, and uses each completion's reward relative to its group as the
advantage of every one of its tokens:

    A_i = (R_i - mean(R_group)) / (std(R_group) + 1e-4)       std unbiased (n - 1), as TRL's nanstd

`scale_rewards`: 'group' divides by the group's std (the paper), 'batch' by the std of the whole
generation batch, 'none' not at all (Dr. GRPO, Liu et al. 2025, argues the division biases towards
easy and hard prompts). A reward function may return None for a completion: it is left out of that
function's sum; a completion no function scored gets advantage 0. Rewards must be gathered over every
rank first: a group's G completions may be spread over ranks.

The loss is PPO's clipped surrogate per completion token, with r = pi / pi_old:

    -min(r * A, clip(r, 1 - epsilon, 1 + epsilon_high) * A)  (+ beta * KL)

`importance_sampling_level`: 'token' takes r per token; 'sequence' (GSPO, Zheng et al. 2025) one r per
completion, exp of the mean token log-ratio. pi_old is the policy that generated the completions: with
`num_iterations` 1 every batch is trained on once, right after generation, so pi_old = pi and r =
exp(0) = 1 with the gradient of pi (`old_logps` None); with more iterations the log-probs stored at
generation time are passed in. `beta` > 0 adds the k3 estimator of KL(pi || pi_ref) (Schulman 2020),
exp(ref - logp) - (ref - logp) - 1, weighted by r (TRL's `use_bias_correction_kl`, its default).

How the per-token terms are reduced (`loss_type`, TRL's names):

    grpo     mean over each completion's tokens, then over completions (the paper; favours short answers)
    bnpo     mean over the micro-batch's tokens
    dr_grpo  sum over tokens / (completions x max_completion_length): a constant, no length bias
    dapo     sum over tokens / the step's mean tokens per micro-batch (DAPO, Yu et al. 2025): every token
             of the step weighs the same whichever micro-batch or rank it landed on. The default.
    luspo    sum over each completion's tokens, mean over completions (length-unbiased sequence loss)

and three loss types that change the per-token term itself (TRL 1.16's, same formulas):

    cispo    -min(r, epsilon_high).detach() * A * logp (MiniMax-M1's CISPO: the clip bounds the weight of
             the token's gradient, never drops it), reduced as dapo
    sapo     -(4 / t) * sigmoid(t * (r - 1)) * A, t = sapo_temperature_pos for A > 0 else _neg (a soft clip),
             reduced as grpo
    vespo    -phi(w) * A * logp with phi(w) = exp(lambda + k log w - lambda w) of the completion's summed
             log-ratio w, detached (k, lambda by the advantage's sign), reduced as dapo

Each loss type is one row of `LOSS_TYPES` below (its per-token term, its reduction), keyed by the one list of
names, config/objective_sections.py `LossType` (the schema admits those; docs/development.md, "Adding a loss type").

`delta` (two-sided clipping, TRL's option) caps r at delta in the clipped surrogate's first term, so a
negative advantage cannot push an already large ratio without bound.

Scaling against gradient accumulation: the value returned is the micro-batch's loss *before* accumulation.
DeepSpeed's `engine.backward` divides it by the accumulation steps and its reduction averages gradients
over data-parallel ranks. TRL divides by the accumulation steps inside its loss instead (and transformers
calls DeepSpeed's backward with scale_wrt_gas=False), so this loss / accumulation = TRL's loss at that
accumulation, and the gradients are divided once. For dapo, `dapo_tokens` is the step's completion tokens
over all ranks / (ranks x accumulation steps): after DeepSpeed's two divisions the step's gradient is the
sum over every token of the step / the step's token count, TRL's normaliser.

Log-probs follow TRL's `_get_per_token_logps_and_entropies`: logits divided by the sampling temperature
(the distribution the completions were drawn from), taken in fp32, on the concatenated left-padded
prompt and right-padded completion with its attention mask and no position ids: the model numbers the
padded row 0..L-1, pads included, exactly as TRL's training forward does (generation numbers real tokens
from the mask, a small mismatch both share). tests/unit/test_grpo_loss.py checks the loss, the gradients
and the advantages against TRL 1.16's GRPOTrainer within 1e-5.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from llm_train.config.objective_sections import LossType

SamplingLevel = Literal["token", "sequence"]
ScaleRewards = Literal["group", "batch", "none"]

STD_EPSILON = 1e-4  # TRL's, added to the std so a group of equal rewards gives advantages 0, not NaN


@dataclass(frozen=True)
class LossSettings:
    """The loss's options (the recipe's `grpo:` section; TRL's names and defaults)."""

    loss_type: LossType = "dapo"
    importance_sampling_level: SamplingLevel = "token"
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon (symmetric clipping)
    beta: float = 0.0
    temperature: float = 1.0
    max_completion_length: int = 512  # dr_grpo's constant denominator
    delta: float | None = None  # two-sided clipping's cap on the ratio; None: off
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

    @property
    def upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def _unbiased_std(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The std ignoring NaN, with Bessel's correction (n - 1); NaN where fewer than two values."""
    keep = dim is not None
    mean = torch.nanmean(x, dim=dim, keepdim=True) if keep else torch.nanmean(x)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=keep) if keep else (~torch.isnan(x)).sum()
    squares = torch.nansum((x - mean) ** 2, dim=dim, keepdim=keep) if keep else torch.nansum((x - mean) ** 2)
    variance = torch.where(
        count > 1, squares / (count - 1).clamp(min=1), torch.full_like(squares, float("nan"))
    )
    return variance.sqrt()


@dataclass(frozen=True)
class Advantages:
    """Per completion: its weighted reward (NaN if nothing scored it), its advantage, its group's std is 0."""

    rewards: torch.Tensor
    advantages: torch.Tensor
    zero_std: torch.Tensor


def group_advantages(
    rewards_per_function: torch.Tensor, weights: torch.Tensor, group: int, scale: ScaleRewards = "group"
) -> Advantages:
    """Advantages of a whole generation batch, [completions, functions] rewards (NaN = None), each
    prompt's `group` completions consecutive. Call on the rewards of every rank (see the module docstring)."""
    n = rewards_per_function.shape[0]
    if n % group:
        raise ValueError(f"{n} completions do not form groups of {group}")
    unscored = torch.isnan(rewards_per_function).all(dim=1)
    rewards = (rewards_per_function * weights.to(rewards_per_function).unsqueeze(0)).nansum(dim=1)
    rewards = rewards.masked_fill(unscored, float("nan"))
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    if scale == "batch":
        std = _unbiased_std(rewards).expand_as(rewards) if n > 1 else torch.zeros_like(rewards)
    else:  # 'none' still measures the group's std: the fraction of groups that teach nothing is logged
        std = (
            _unbiased_std(grouped, dim=1).repeat_interleave(group) if group > 1 else torch.zeros_like(rewards)
        )
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + STD_EPSILON)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return Advantages(rewards, torch.nan_to_num(advantages, nan=0.0), zero_std)


def completion_logps(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """[rows, completion length] fp32 log-probs of each completion token under `model` at `temperature`."""
    logps, _ = completion_logps_and_entropy(
        model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature, entropy=False
    )
    return logps


def completion_logps_and_entropy(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float,
    entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs as `completion_logps`, with `entropy` the detached entropy of each position's distribution).

    Only the last completion-length + 1 positions' logits are computed (`logits_to_keep`): the prompt's
    are never needed, and the [rows x length x vocabulary] tensor is the largest one of the step.
    """
    width = completion_ids.shape[1]
    logits = model(
        input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
        attention_mask=torch.cat([prompt_mask, completion_mask], dim=1),
        logits_to_keep=width + 1,
        use_cache=False,
    ).logits[:, :-1]  # position t predicts token t + 1: the last one predicts nothing we scored
    logits = logits.float() / temperature
    token = -F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), completion_ids.reshape(-1), reduction="none"
    )
    return token.view(completion_ids.shape), token_entropy(logits) if entropy else None


@torch.no_grad()
def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """[rows, length] entropy -sum p log p of each position's distribution, one row at a time.

    A metric (TRL's `entropy`: how far the policy is from collapsing onto one answer), never a loss term,
    so no graph is kept; row by row, the extra fp32 [length x vocabulary] buffer is one row's (a 256-token
    completion over a 128k vocabulary: 128 MiB), not the micro-batch's.
    """
    out = torch.empty(logits.shape[:2], dtype=torch.float32, device=logits.device)
    for i, row in enumerate(logits.detach()):
        logp = torch.log_softmax(row.float(), dim=-1)
        out[i] = -(logp.exp() * logp).sum(-1)
    return out


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over completion tokens, or over completions when `x` holds one value per completion (GSPO)."""
    if x.shape[1] == 1:
        return x.mean()
    return (x * mask).sum() / mask.sum().clamp(min=1)


# (log-probs, ratio, token log-ratio, advantages, mask, settings) -> the per-token policy term, before the KL.
Term = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "LossSettings"], torch.Tensor
]
# (per-token terms, mask, settings, dapo_tokens) -> the micro-batch's loss before accumulation.
Reduce = Callable[[torch.Tensor, torch.Tensor, "LossSettings", float | torch.Tensor | None], torch.Tensor]


def _clipped_surrogate(
    logps: torch.Tensor,
    ratio: torch.Tensor,
    token_log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
) -> torch.Tensor:
    """PPO's clipped surrogate, with `delta`'s cap on the first term (grpo, bnpo, dr_grpo, dapo, luspo)."""
    clipped = torch.clamp(ratio, 1 - settings.epsilon, 1 + settings.upper)
    first = ratio if settings.delta is None else torch.clamp(ratio, max=settings.delta)
    return -torch.min(first * advantages, clipped * advantages)


def _cispo_term(
    logps: torch.Tensor,
    ratio: torch.Tensor,
    token_log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
) -> torch.Tensor:
    return -torch.clamp(ratio, max=settings.upper).detach() * advantages * logps


def _sapo_term(
    logps: torch.Tensor,
    ratio: torch.Tensor,
    token_log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
) -> torch.Tensor:
    t = torch.where(
        advantages > 0,
        torch.tensor(settings.sapo_temperature_pos, dtype=logps.dtype),
        torch.tensor(settings.sapo_temperature_neg, dtype=logps.dtype),
    )
    return -(torch.sigmoid(t * (ratio - 1)) * 4 / t) * advantages


def _vespo_term(
    logps: torch.Tensor,
    ratio: torch.Tensor,
    token_log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
) -> torch.Tensor:
    return -vespo_weights(token_log_ratio, advantages, mask, settings) * advantages * logps


@torch.no_grad()
def vespo_weights(
    token_log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, settings: LossSettings
) -> torch.Tensor:
    """[rows, 1] VESPO's gamma weights phi(w) = exp(lambda + k log w - lambda w), phi(1) = 1, of each completion's
    summed token log-ratio (clamped to [log 1e-8, 20] as TRL's `get_gamma_weights`); detached: a gradient scale."""
    lower = math.log(1e-8)
    log_w = torch.clamp((torch.clamp(token_log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True), lower, 20.0)
    non_negative = advantages >= 0
    k = torch.where(non_negative, settings.vespo_k_pos, settings.vespo_k_neg)
    lam = torch.where(non_negative, settings.vespo_lambda_pos, settings.vespo_lambda_neg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def policy_loss(
    logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    dapo_tokens: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the micro-batch's loss before accumulation, its detached metrics): see the module docstring.

    logps, old_logps, ref_logps: [rows, completion length] (`completion_logps`); advantages: [rows];
    mask: the completion mask (1 = a scored token); dapo_tokens: loss_type dapo's normaliser.
    """
    mask = mask.to(logps.dtype)
    advantages = advantages.to(logps.dtype).unsqueeze(1)
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    if settings.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    per_token = LOSS_TYPES[settings.loss_type].term(logps, ratio, logps - old, advantages, mask, settings)
    metrics: dict[str, torch.Tensor] = {}
    if settings.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference model's log-probs")
        delta = ref_logps - logps
        kl = (torch.exp(delta) - delta - 1) * ratio
        per_token = per_token + settings.beta * kl
        metrics["kl"] = _masked_mean(kl.detach(), mask)

    loss = LOSS_TYPES[settings.loss_type].reduce(per_token, mask, settings, dapo_tokens)

    ratio = ratio.detach()
    low = (ratio < 1 - settings.epsilon) & (advantages < 0)
    high = (ratio > 1 + settings.upper) & (advantages > 0)
    # TRL's metric names (grpo_trainer.py), so a dashboard of a TRL run reads ours.
    metrics["clip_ratio/low_mean"] = _masked_mean(low.to(logps.dtype), mask)
    metrics["clip_ratio/high_mean"] = _masked_mean(high.to(logps.dtype), mask)
    metrics["clip_ratio/region_mean"] = _masked_mean((low | high).to(logps.dtype), mask)
    return loss, metrics


def _per_completion_mean(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
    dapo_tokens: float | torch.Tensor | None,
) -> torch.Tensor:
    """Mean over each completion's tokens, then over completions (grpo, sapo)."""
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def _token_mean(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
    dapo_tokens: float | torch.Tensor | None,
) -> torch.Tensor:
    """Mean over the micro-batch's tokens (bnpo)."""
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def _constant_denominator(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
    dapo_tokens: float | torch.Tensor | None,
) -> torch.Tensor:
    """Sum / (completions x max_completion_length) (dr_grpo)."""
    return (per_token * mask).sum() / (per_token.shape[0] * settings.max_completion_length)


def _per_completion_sum(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
    dapo_tokens: float | torch.Tensor | None,
) -> torch.Tensor:
    """Sum over each completion's tokens, mean over completions (luspo)."""
    return (per_token * mask).sum(-1).mean()


def _step_tokens(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
    dapo_tokens: float | torch.Tensor | None,
) -> torch.Tensor:
    """Sum / the step's mean completion tokens per micro-batch (dapo, cispo, vespo; the module docstring)."""
    if dapo_tokens is None:
        raise ValueError(
            f"loss_type {settings.loss_type} needs dapo_tokens, the step's mean completion tokens per micro-batch"
        )
    return (per_token * mask).sum() / torch.as_tensor(dapo_tokens, dtype=per_token.dtype).clamp(min=1.0)


@dataclass(frozen=True)
class LossTypeFunctions:
    """One loss type's two halves: the per-token policy term (before the KL) and how the terms are reduced."""

    term: Term
    reduce: Reduce


# Every loss type, one row each, keyed by config/objective_sections.py `LossType` (the schema's list of names;
# tests/unit/test_grpo_loss_types.py fails while the two differ). TRL 1.16's `_compute_loss`, same formulas.
LOSS_TYPES: dict[LossType, LossTypeFunctions] = {
    "grpo": LossTypeFunctions(_clipped_surrogate, _per_completion_mean),
    "bnpo": LossTypeFunctions(_clipped_surrogate, _token_mean),
    "dr_grpo": LossTypeFunctions(_clipped_surrogate, _constant_denominator),
    "dapo": LossTypeFunctions(_clipped_surrogate, _step_tokens),
    "cispo": LossTypeFunctions(_cispo_term, _step_tokens),
    "sapo": LossTypeFunctions(_sapo_term, _per_completion_mean),
    "luspo": LossTypeFunctions(_clipped_surrogate, _per_completion_sum),
    "vespo": LossTypeFunctions(_vespo_term, _step_tokens),
}
