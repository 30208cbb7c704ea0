"""GRPO's run wiring: the micro-batches of a GRPO run, generated from the prompts the data stream deals.

The objective registry (config/objectives.py) marks grpo as the objective that `generates`; runtime/session.py
asks it and hands this module the engine's model and objective, so what GRPO needs at run time (generation
engine, rewards, policy and reference log-probs) is assembled here, in rl/, beside its loss and rollouts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from llm_train.config.resolution import Resolved
from llm_train.data.dealer import Batches
from llm_train.runtime.base import collectives
from llm_train.runtime.loss.interface import Objective
from llm_train.runtime.rl.continuous import ContinuousBatchingGeneration
from llm_train.runtime.rl.grpo import (
    Grpo,
    HfGeneration,
    Rollouts,
    RolloutShape,
    SampleLog,
    disable_dropout,
    rollout_logps,
    stop_ids,
)
from llm_train.runtime.rl.rewards import RewardContext, load_rewards

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Batch = dict[str, Any]


def grpo_rollouts(
    run: Resolved,
    ds: Any,
    objective: Objective,
    prompts: Batches,
    tokenizer: PreTrainedTokenizerBase,
    rank: int,
    place: Callable[[Batch], Batch],
    samples: SampleLog | None,
    context: RewardContext,
    say: Callable[[str], None],
) -> Rollouts:
    """The engine's micro-batches under GRPO: completions of the model itself, scored by the recipe's rewards.

    `ds` is the engine's DeepSpeed model, `objective` the one the ZeRO engine built for grpo (it holds the
    reference, the initial model with beta > 0), `place` moves a batch to the model's device."""
    if not isinstance(objective, Grpo):  # the ZeRO engine builds a Grpo for every objective that generates
        raise TypeError(
            f"objective {run.recipe.objective} generates, but its engine built {type(objective).__name__}"
        )
    recipe, layout = run.recipe, run.layout
    grpo = recipe.grpo
    eos = stop_ids(tokenizer, getattr(ds.module, "generation_config", None))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    engine_class = ContinuousBatchingGeneration if grpo.use_transformers_continuous_batching else HfGeneration
    generation = engine_class(ds, layout.zero_stage == 3, grpo, pad, eos)
    if grpo.disable_dropout:
        disable_dropout(ds.module)

    @torch.no_grad()
    def policy_logps(batch: Batch) -> torch.Tensor:
        return rollout_logps(ds, place(batch), grpo.temperature)

    return Rollouts(
        prompts,
        generation,
        load_rewards(grpo.rewards, grpo.max_completion_length),
        grpo,
        RolloutShape(layout.micro_batch_size, layout.grad_accum, layout.dp),
        tokenizer,
        collectives.WORLD,
        rank,
        policy_logps,
        objective.reference,
        samples,
        context,
        say,
    )
