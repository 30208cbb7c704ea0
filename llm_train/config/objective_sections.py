"""What each objective is told: the preference (dpo, simpo), reward-model and GRPO sections, and GRPO's rewards.

`objective` (recipe.py) picks how the model is trained; these are the sections only some objectives
read, and recipe.py refuses one that is set under another objective. GRPO's rewards are a list of
tagged mappings (`kind:`), each parsed by its class so that a mistake names `grpo.rewards[i].key`.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal, get_args

from pydantic import Field, field_validator, model_validator

from llm_train.config.section import Section, validate_entry

Objective = Literal["lm", "dpo", "simpo", "grpo", "reward"]
# GRPO's loss types (TRL 1.16's names), the one list of them: `grpo.loss_type` admits these, runtime/loss/grpo.py
# `LOSS_TYPES` maps each to its per-token term and its reduction (keyed by this Literal, so mypy refuses a key
# that is not here), and tests/unit/test_grpo_loss_types.py fails while a name lacks either, its TRL comparison
# in test_grpo_loss.py or its row in docs/rl.md. Torch-free: the recipe is validated before torch loads.
LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
# The beta each preference objective is usually run with: DPO's paper and TRL use 0.1; SimPO's paper
# (Meng et al. 2024, section 4) tunes it in [2.0, 2.5] because its rewards are per-token averages.
DEFAULT_BETA = {"dpo": 0.1, "simpo": 2.0}


class PreferenceSection(Section):
    """Preference tuning on `format: preference` pairs (objective dpo or simpo; runtime/loss/preference_tuning.py)."""

    beta: float | None = Field(
        None,
        gt=0,
        description="Reward scale: how far the policy may move from the reference (dpo) or the per-token "
        "reward scale (simpo); default 0.1 for dpo, 2.0 for simpo.",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="Probability that a pair's preference is flipped (conservative DPO, Mitchell 2023): "
        "the loss is (1-e) of the sigmoid loss plus e of the reversed one; 0 = plain sigmoid loss.",
    )
    simpo_gamma: float = Field(
        0.5,
        ge=0,
        description="SimPO's target reward margin gamma (objective simpo only; TRL's simpo_gamma).",
    )
    reference: Literal["cached", "live"] = Field(
        "cached",
        description="dpo only. 'cached': the reference model's log-probs of every pair are computed in one "
        "pass before training and cached beside the data (training holds one model); 'live': computed "
        "every step, by the base model with the adapters disabled under LoRA, else by a frozen copy of "
        "the model (sharded like the policy under ZeRO-3; the planner counts its memory).",
    )


class RewardSection(Section):
    """Reward-model training on `format: preference` pairs (objective reward; runtime/loss/reward.py)."""

    margin: float = Field(
        0.0,
        allow_inf_nan=False,
        description="Margin m in -log sigmoid(r_chosen - r_rejected - m): how much higher the chosen answer must "
        "score before a pair stops contributing; one constant for every pair (the preference format has no "
        "per-pair margin column).",
    )
    center_rewards_coefficient: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Adds this times mean((r_chosen + r_rejected)^2) to the loss, which keeps the rewards centred "
        "on 0 (the pairwise loss only fixes their differences); Eisenstein et al. 2023 use 0.01. None = off.",
    )


class _RewardFields(Section):
    weight: float = Field(
        1.0,
        allow_inf_nan=False,
        description="This reward's weight in the sum the advantages are computed from (grpo.reward_weights, TRL's "
        "list, overrides it).",
    )
    name: str | None = Field(
        None,
        description="Its name in metrics.jsonl (reward_<name>_mean); default the kind or the function's name.",
    )


class FormatReward(_RewardFields):
    """1.0 when the completion matches `pattern`, else 0.0: a verifiable format reward."""

    kind: Literal["format"] = "format"
    pattern: str = Field(description="A Python regular expression the completion must match.")
    match: Literal["full", "search"] = Field(
        "full",
        description="'full': the whole completion (outer whitespace stripped) matches; 'search': a part does.",
    )

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        return _compiled(pattern)


class ExactMatchReward(_RewardFields):
    """1.0 when the completion's final answer equals the row's `column`, else 0.0 (numbers compared as numbers)."""

    kind: Literal["exact_match"] = "exact_match"
    column: str = Field("answer", description="The prompt row's field that holds the right answer.")
    pattern: str | None = Field(
        None,
        description="A regular expression that finds the final answer in the completion (its first group if it "
        "has one; the last match counts; no match scores 0); default: the whole completion, stripped.",
    )
    column_pattern: str | None = Field(
        None,
        description="A regular expression that finds the right answer in the column's value, as `pattern` does in "
        "the completion (e.g. GSM8K's '#### (.*)'); default: the whole value, stripped.",
    )

    @field_validator("pattern", "column_pattern")
    @classmethod
    def _compiles(cls, pattern: str | None) -> str | None:
        return None if pattern is None else _compiled(pattern)


class OverlongReward(_RewardFields):
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), by completion tokens: 0 up to
    max_completion_length - buffer, then falling linearly to -1 at max_completion_length."""

    kind: Literal["overlong"] = "overlong"
    buffer: int = Field(
        gt=0, description="Tokens before grpo.max_completion_length over which the penalty grows."
    )


class FunctionReward(_RewardFields):
    """A reward function of yours: `module:function`, called as function(prompts=..., completions=...,
    completion_ids=..., **columns) with one list entry per completion, returning a float or None for each."""

    kind: Literal["function"] = "function"
    function: str = Field(
        description="'module:function' importable from the working directory or PYTHONPATH (e.g. my_rewards:correct)."
    )

    @field_validator("function")
    @classmethod
    def _is_a_path(cls, path: str) -> str:
        if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", path):
            raise ValueError(f"'{path}' is not 'module:function' (e.g. my_rewards:correct)")
        return path


class RewardModelReward(_RewardFields):
    """The score a trained reward model (an objective reward run's final/) gives prompt + completion."""

    kind: Literal["reward_model"] = "reward_model"
    path: str = Field(
        description="A directory AutoModelForSequenceClassification loads with num_labels=1 and a pad id, e.g. "
        "runs/tiny-cpu-reward/final; it scores each prompt text followed by its completion, on the CPU of "
        "every rank."
    )


def _compiled(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"not a regular expression ({exc}): {pattern!r}") from None
    return pattern


# Every reward kind's schema class, the one list of them: `grpo.rewards` admits these, REWARD_CLASSES (by `kind`)
# is read from it, and runtime/rl/rewards.py `REWARD_KINDS` holds how each is built; tests/unit/test_reward_kinds.py
# fails while a kind lacks its builder or its row in docs/rl.md (docs/development.md, "Adding a reward kind").
Reward = FormatReward | ExactMatchReward | OverlongReward | FunctionReward | RewardModelReward
REWARD_CLASSES: dict[str, type[Section]] = {cls.model_fields["kind"].default: cls for cls in get_args(Reward)}


def parse_reward(item: Any, where: str) -> Any:
    """One entry of grpo.rewards, parsed by its `kind` so that a mistake names `grpo.rewards[i].key` in one line."""
    if isinstance(item, tuple(REWARD_CLASSES.values())):
        return item
    if not isinstance(item, dict):
        raise ValueError(
            f"{where}: expected a mapping with 'kind' ({', '.join(REWARD_CLASSES)}), got {item!r}"
        )
    kind = item.get("kind")
    cls = REWARD_CLASSES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"{where}.kind: {kind!r} is not one of {', '.join(REWARD_CLASSES)}")
    return validate_entry(cls, item, where, f"kind {kind}")


class GrpoSection(Section):
    """Online RL with GRPO (objective grpo; runtime/rl/grpo.py): each step the model writes num_generations
    completions per prompt, the rewards score them, and the loss is TRL's GRPO loss (runtime/loss/grpo.py).
    optim.micro_batch_size counts completions; the step's completions over every rank form whole groups (a group may
    span ranks, as in TRL)."""

    num_generations: int = Field(8, ge=2, description="Completions sampled per prompt (the group G).")
    max_completion_length: int = Field(
        512, ge=1, description="Most tokens a completion may have (TRL's default, 512)."
    )
    temperature: float = Field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        description="Sampling temperature (the log-probs are taken at it too).",
    )
    top_p: float = Field(
        1.0, gt=0, le=1, description="Nucleus sampling: keep the smallest set of tokens of this mass."
    )
    top_k: int = Field(0, ge=0, description="Sample among the k likeliest tokens; 0 = no limit.")
    min_p: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Keep tokens at least min_p times as likely as the likeliest one; None = off (TRL's default).",
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        description="Divides the logits of tokens already in the prompt or completion (>1 discourages repeats); 1 = off.",
    )
    generation_kwargs: dict[str, Any] | None = Field(
        None,
        description="More keyword arguments of transformers' GenerationConfig for the rollouts (TRL's option): they "
        "override the sampling options above.",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="Extra variables for the chat template when conversational prompts are rendered, e.g. "
        "{enable_thinking: false} (TRL's option).",
    )
    use_transformers_continuous_batching: bool = Field(
        False,
        description="Generate the rollouts with transformers' continuous batching (generate_batch, paged attention) "
        "instead of generate over left-padded batches; TRL's option of the same name.",
    )
    loss_type: LossType = Field(
        "dapo",
        description="How token losses are formed and averaged (TRL 1.16's loss types; runtime/loss/grpo.py): grpo (per "
        "completion, then over completions), bnpo (per micro-batch token), dr_grpo (sum / (completions x "
        "max_completion_length)), dapo (per token of the step), luspo (sum per completion), cispo (clipped "
        "importance weight on the gradient), sapo (soft, sigmoid-gated clip), vespo (gamma-weighted sequences).",
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="'token': a ratio per token (GRPO); 'sequence': one per completion (GSPO)."
    )
    epsilon: float = Field(0.2, gt=0, lt=1, description="Lower clip of the ratio: 1 - epsilon.")
    epsilon_high: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Upper clip: 1 + epsilon_high (DAPO's clip-higher uses 0.28); default epsilon. loss_type cispo "
        "caps the ratio at epsilon_high itself (TRL).",
    )
    delta: float | None = Field(
        None,
        gt=1,
        allow_inf_nan=False,
        description="Two-sided clipping: the ratio is also capped at delta (TRL recommends > 1 + epsilon); None = off.",
    )
    sapo_temperature_pos: float = Field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        description="loss_type sapo: gate temperature for positive advantages.",
    )
    sapo_temperature_neg: float = Field(
        1.05, gt=0, allow_inf_nan=False, description="loss_type sapo: gate temperature for other advantages."
    )
    vespo_k_pos: float = Field(2.0, ge=0, allow_inf_nan=False, description="loss_type vespo: k for A >= 0.")
    vespo_lambda_pos: float = Field(
        3.0, ge=0, allow_inf_nan=False, description="loss_type vespo: lambda, A >= 0."
    )
    vespo_k_neg: float = Field(3.0, ge=0, allow_inf_nan=False, description="loss_type vespo: k for A < 0.")
    vespo_lambda_neg: float = Field(
        2.0, ge=0, allow_inf_nan=False, description="loss_type vespo: lambda, A < 0."
    )
    beta: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="Weight of the k3 KL to the initial model; 0 = no reference model (TRL's default).",
    )
    num_iterations: int = Field(
        1,
        ge=1,
        description="Optimizer steps per generated batch; above 1 the log-probs at generation are kept for the ratio.",
    )
    mask_truncated_completions: bool = Field(
        False, description="Leave completions cut at max_completion_length (no EOS) out of the loss."
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="Divide advantages by the group's reward std (group, or true), the batch's (batch), or not "
        "(none, or false: Dr. GRPO); TRL's values.",
    )
    reward_weights: list[float] | None = Field(
        None,
        description="TRL's list of weights, one per grpo.rewards entry in order; overrides each reward's weight.",
    )
    disable_dropout: bool = Field(
        False, description="Set every dropout of the model to 0 for training and generation (TRL's option)."
    )
    log_completions: bool = Field(
        False,
        description="Log a few completions of each logged generation with their rewards to completions.jsonl "
        "(and W&B's table), and print num_completions_to_print of them; TRL's option.",
    )
    num_completions_to_print: int | None = Field(
        None,
        ge=0,
        description="With log_completions: how many of the logged completions to print on screen; None = all logged.",
    )
    generation_batch_size: int | None = Field(
        None, ge=1, description="Not yet built (docs/rl.md): one generation per optimizer step."
    )
    steps_per_generation: int | None = Field(
        None, ge=1, description="Not yet built (docs/rl.md): one generation per optimizer step."
    )
    sync_ref_model: bool = Field(
        False, description="Not yet built (docs/rl.md): the reference stays the initial model."
    )
    ref_model_mixup_alpha: float = Field(0.6, description="Not yet built: read with sync_ref_model only.")
    ref_model_sync_steps: int = Field(512, description="Not yet built: read with sync_ref_model only.")
    num_generations_eval: int | None = Field(
        None, ge=1, description="Not yet built (docs/rl.md): objective grpo has no evaluation set yet."
    )
    ds3_gather_for_generation: bool = Field(
        True,
        description="ZeRO-3 only: gather the whole model on every rank while it generates (fast; each GPU needs the "
        "model's full size free beside its shard). false: generate through ZeRO-3's own layer-by-layer gathering, "
        "which gathers every layer again for each new token (slow, but a model that does not fit one GPU whole "
        "can generate). TRL's option of the same name.",
    )
    rewards: list[Reward] = Field(
        default_factory=list,
        description=f"Reward functions, each {{kind: {'|'.join(REWARD_CLASSES)}, weight, ...}}; see docs/rl.md.",
    )

    @model_validator(mode="before")
    @classmethod
    def _reward_kinds(cls, values: Any) -> Any:
        if isinstance(values, dict) and isinstance(values.get("rewards"), list):
            values = {
                **values,
                "rewards": [parse_reward(r, f"grpo.rewards[{i}]") for i, r in enumerate(values["rewards"])],
            }
        return values

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _scale_booleans(cls, value: Any) -> Any:
        # TRL accepts booleans: true is 'group', false is 'none' (GRPOConfig.scale_rewards).
        if value is True:
            return "group"
        if value is False:
            return "none"
        return value

    @field_validator("reward_weights")
    @classmethod
    def _finite_weights(cls, weights: list[float] | None) -> list[float] | None:
        for i, w in enumerate(weights or []):
            if not math.isfinite(w):
                raise ValueError(f"grpo.reward_weights[{i}]={w} is not a finite number; give finite weights")
        return weights

    @model_validator(mode="after")
    def _not_yet_and_consistent(self) -> GrpoSection:
        """TRL options llm_train does not build yet (docs/rl.md, "Not yet"): refused in one line, never ignored."""
        not_yet = {
            "generation_batch_size": self.generation_batch_size is not None,
            "steps_per_generation": self.steps_per_generation is not None,
            "sync_ref_model": self.sync_ref_model,
            "ref_model_mixup_alpha": self.ref_model_mixup_alpha != 0.6,
            "ref_model_sync_steps": self.ref_model_sync_steps != 512,
            "num_generations_eval": self.num_generations_eval is not None,
        }
        for key, set_ in not_yet.items():
            if set_:
                raise ValueError(
                    f"grpo.{key} is not built yet (docs/rl.md lists what is not yet); remove it (llm_train generates "
                    "once per optimizer step, keeps the initial model as the reference and has no GRPO evaluation set)"
                )
        if self.use_transformers_continuous_batching:
            # transformers' continuous batching drops the logits processors it does not support
            # (repetition_penalty among them) or runs them on its packed rows: not one of ours runs silently wrong.
            for key, set_ in (
                ("repetition_penalty", self.repetition_penalty != 1.0),
                ("generation_kwargs", bool(self.generation_kwargs)),
            ):
                if set_:
                    raise ValueError(
                        f"grpo.{key} is not built yet with grpo.use_transformers_continuous_batching (its paged "
                        f"sampler supports temperature, top_k, top_p and min_p); remove one of them"
                    )
        if self.reward_weights is not None and self.rewards and len(self.reward_weights) != len(self.rewards):
            raise ValueError(
                f"grpo.reward_weights has {len(self.reward_weights)} weights for {len(self.rewards)} rewards; give one "
                "per grpo.rewards entry, or set each reward's weight instead"
            )
        return self
