"""The runtime half of the objective registry: the loss each objective builds (config/objectives.py is the
torch-free half, with the table of sections, data, references and layouts).

lm      language_modeling.py `LanguageModeling` (`SequenceParallelLM` under sequence parallelism,
        which the ZeRO engine picks itself: it holds the group)
dpo     preference_tuning.py `Preference`, with the reference the engine provides (cached, live, frozen)
simpo   preference_tuning.py `Preference`, reference-free
reward  reward.py `RewardModelling`
grpo    not here: an objective that `generates` is built by the ZeRO engine as runtime/rl/grpo.py `Grpo`
        (rollouts, then grpo.py's policy loss), whose room sits above this one
"""

from __future__ import annotations

from collections.abc import Callable

from llm_train.config.objective_sections import Objective as ObjectiveName
from llm_train.config.recipe import Recipe
from llm_train.runtime.loss.interface import Objective
from llm_train.runtime.loss.language_modeling import LanguageModeling
from llm_train.runtime.loss.preference_tuning import Forward, Preference, PrepareReference
from llm_train.runtime.loss.reward import RewardModelling

# (recipe, live reference, cached-reference preparation) -> the objective's loss.
Build = Callable[[Recipe, Forward | None, PrepareReference | None], Objective]


def _preference(recipe: Recipe, live: Forward | None, prepare: PrepareReference | None) -> Objective:
    return Preference(recipe.objective, recipe.preference, live, prepare, recipe.memory.tiled_loss)


LOSSES: dict[ObjectiveName, Build] = {
    "lm": lambda recipe, live, prepare: LanguageModeling(),
    "dpo": _preference,
    "simpo": _preference,
    "reward": lambda recipe, live, prepare: RewardModelling(
        recipe.reward.margin, recipe.reward.center_rewards_coefficient
    ),
}


def make_objective(
    recipe: Recipe, live_reference: Forward | None = None, prepare: PrepareReference | None = None
) -> Objective:
    return LOSSES[recipe.objective](recipe, live_reference, prepare)
