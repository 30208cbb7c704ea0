"""Which objective a recipe's `objective:` asks for: the loss the engines score every micro-batch by.

lm      language_modeling.py `LanguageModeling` (`SequenceParallelLM` under sequence parallelism,
        which the ZeRO engine picks itself: it holds the group)
dpo     preference_tuning.py `Preference`, with the reference the engine provides (cached, live, frozen)
simpo   preference_tuning.py `Preference`, reference-free
reward  reward.py `RewardModelling`
grpo    runtime/rl/grpo.py `Grpo` (rollouts, then grpo.py's policy loss), built by the ZeRO engine
"""

from __future__ import annotations

from llm_train.config.recipe import Recipe
from llm_train.runtime.loss.interface import Objective
from llm_train.runtime.loss.language_modeling import LanguageModeling
from llm_train.runtime.loss.preference_tuning import Forward, Preference, PrepareReference
from llm_train.runtime.loss.reward import RewardModelling


def make_objective(
    recipe: Recipe, live_reference: Forward | None = None, prepare: PrepareReference | None = None
) -> Objective:
    if recipe.objective == "lm":
        return LanguageModeling()
    if recipe.objective == "reward":
        return RewardModelling(recipe.reward.margin, recipe.reward.center_rewards_coefficient)
    return Preference(recipe.objective, recipe.preference, live_reference, prepare, recipe.memory.tiled_loss)
