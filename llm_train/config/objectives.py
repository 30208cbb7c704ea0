"""Every objective, one row each: what a recipe's `objective:` reads, trains on, scores by and runs under.

The torch-free half of the objective registry, so config/ and planning/ can ask it without importing torch.
The runtime half (the loss each objective builds) is runtime/loss/objective_losses.py `LOSSES`, and GRPO's
rollouts and reference are runtime/rl/; tests/unit/test_objective_registry.py fails while an objective lacks
a row in either, or while code outside this module compares `objective` with a string.

    name    section      data     loss (runtime/)                        reference                      layouts
    lm      -            text     loss/language_modeling.py              none                           all
    dpo     preference   pairs    loss/preference_tuning.py              cached, live, adapter-disabled ZeRO, LoRA
    simpo   preference   pairs    loss/preference_tuning.py              none                           ZeRO, LoRA
    reward  reward       pairs    loss/reward.py (score head)            none                           ZeRO
    grpo    grpo         prompts  rl/grpo.py, loss/grpo.py (generates)   none, live, adapter-disabled   ZeRO, LoRA

The image-text SFT of issue 50 is not an objective of its own: it is `lm` on `format: image_chat` rows. Its
loss, reference (none), metrics and layout rules are lm's; what differs is the model (an image-text
checkpoint, config/model_kind.py) and the data format (data/formats/), each kept by its own registry. A row of
its own would repeat lm's and make a user say "image" twice (the model and the objective). `image_models`
says which objectives an image-text checkpoint may train under.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from llm_train.config.objective_sections import Objective

# What a run holds to score the policy against: nothing, log-probs computed once before training and cached
# beside the data, a frozen copy of the initial model scored every step, or the policy itself with its LoRA
# adapters switched off (runtime/engines/reference.py).
Reference = Literal["none", "cached", "live", "adapter-disabled"]
# The layouts an objective may run under (config/parallel.py refuses the others, naming the setting).
LayoutPart = Literal["zero", "offload", "lora", "pipeline", "tensor_parallel", "sequence_parallel"]
# The data an objective trains on: the formats whose `objectives` (config/source_schema.py) name it.
DataFamily = Literal["text", "pairs", "prompts"]

_ALL_LAYOUTS: frozenset[LayoutPart] = frozenset(get_args(LayoutPart))
# Preference, reward-model and RL losses score whole sequences on one rank: a pipeline hands back no logits,
# AutoTP may split the vocabulary, Ulysses splits the sequence (config/parallel.py's reasons).
_WHOLE_SEQUENCES: frozenset[LayoutPart] = frozenset({"zero", "offload", "lora"})


@dataclass(frozen=True)
class ObjectiveSpec:
    name: Objective
    section: (
        Literal["preference", "reward", "grpo"] | None
    )  # the recipe section it reads (objective_sections.py)
    data: DataFamily
    loss: str  # where its loss lives, under runtime/
    references: tuple[Reference, ...]  # the references it may hold; the recipe picks one (`reference_of`)
    metrics: tuple[str, ...]  # per step, besides loss, grad_norm, lr, ... (eval_ + name at evaluation)
    layouts: frozenset[LayoutPart]
    # Keys of its section that only this objective reads (dpo and simpo share `preference`).
    own_keys: tuple[str, ...] = ()
    head: Literal["lm", "score"] = "lm"  # a score head generates no text: final/ gets no sample
    generates: bool = False  # trains on its own completions (rollouts, runtime/rl/)
    sequences_per_sample: int = 1
    image_models: bool = True  # an image-text checkpoint may train under it
    reference_of: Callable[[Any], Reference] = lambda recipe: "none"  # which of `references` a recipe holds


_PAIR_METRICS = ("reward_accuracy", "reward_chosen", "reward_rejected", "reward_margin")

OBJECTIVES: dict[Objective, ObjectiveSpec] = {
    spec.name: spec
    for spec in (
        ObjectiveSpec("lm", None, "text", "loss/language_modeling.py", ("none",), (), _ALL_LAYOUTS),
        ObjectiveSpec(
            "dpo",
            "preference",
            "pairs",
            "loss/preference_tuning.py",
            ("cached", "live", "adapter-disabled"),
            (*_PAIR_METRICS, "logp_chosen", "logp_rejected"),
            _WHOLE_SEQUENCES,
            own_keys=("reference",),
            sequences_per_sample=2,
            reference_of=lambda recipe: recipe.preference.reference,
        ),
        ObjectiveSpec(
            "simpo",
            "preference",
            "pairs",
            "loss/preference_tuning.py",
            ("none",),
            (*_PAIR_METRICS, "logp_chosen", "logp_rejected"),
            _WHOLE_SEQUENCES,
            own_keys=("simpo_gamma",),
            sequences_per_sample=2,
        ),
        ObjectiveSpec(
            "reward",
            "reward",
            "pairs",
            "loss/reward.py",
            ("none",),
            _PAIR_METRICS,
            # LoRA on a reward model is not supported yet (recipe.py refuses it).
            frozenset({"zero", "offload"}),
            head="score",
            sequences_per_sample=2,
            # A reward model's score head is built on a causal LM (resolution.py refuses an image-text one).
            image_models=False,
        ),
        ObjectiveSpec(
            "grpo",
            "grpo",
            "prompts",
            "rl/grpo.py, loss/grpo.py",
            ("none", "live", "adapter-disabled"),
            # Besides these, rewards/<name>/mean and /std of each reward function (runtime/rl/rewards.py
            # `reward_metrics`), and kl with beta > 0 (runtime/loss/grpo.py).
            (
                "reward",
                "reward_std",
                "frac_reward_zero_std",
                "entropy",
                "completions/mean_length",
                "clip_ratio/region_mean",
            ),
            _WHOLE_SEQUENCES,
            generates=True,
            # beta > 0 scores every micro-batch under the initial model live (planning/search/candidate.py counts it;
            # under LoRA it is the policy with its adapters off, which the memory model counts as live too).
            reference_of=lambda recipe: "live" if recipe.grpo.beta > 0 else "none",
        ),
    )
}


def objective_spec(name: Objective) -> ObjectiveSpec:
    """The row of a recipe's `objective:` (the schema's Literal admits only names in the table)."""
    return OBJECTIVES[name]
