"""GRPO's run wiring: its prompts, and the micro-batches of a GRPO run generated from them.

The objective registry (config/objectives.py) marks grpo as the objective that `generates`; runtime/session.py
asks it and hands this module the tokenizer (for the prompts) and then the engine's model, objective and
tracker, so what GRPO needs at run time (the prompt stream and its step count, generation engine, rewards,
policy and reference log-probs, the completions table) is assembled here, in rl/, beside its loss and
rollouts. session.py holds no GRPO code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from llm_train.config.resolution import Resolved, steps_for_epochs
from llm_train.data.dealer import Batches
from llm_train.data.prompts import prompt_stream
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
Say = Callable[[str], None]


class StepSchedule(Protocol):
    """The loop's schedule a GRPO run reads (runtime/loop.py LoopConfig is one)."""

    @property
    def start_step(self) -> int: ...
    @property
    def max_steps(self) -> int: ...
    @property
    def log_every(self) -> int: ...


class TableLog(Protocol):
    """Where the completions table goes (observability/tracking.py Trackers is one)."""

    def log_table(self, key: str, rows: list[dict[str, Any]], step: int) -> None: ...


def grpo_prompts(run: Resolved, tokenizer: PreTrainedTokenizerBase, say: Say) -> tuple[Batches, int]:
    """GRPO's prompts, one batch per step, the same on every rank: the step's completions / num_generations;
    and the run's number of steps.

    No data-volume guard: an RL run visits its prompts many times by design (each visit samples anew).
    """
    recipe, layout = run.recipe, run.layout
    grpo = recipe.grpo
    # Every rank draws the step's prompts for the whole world (the same ones, in the same order) and generates
    # its own slice of their groups (Rollouts): a group may span ranks, as in TRL.
    per_step = layout.micro_batch_size * layout.grad_accum * layout.dp // grpo.num_generations
    room = recipe.data.seq_len - grpo.max_completion_length
    stream = prompt_stream(
        recipe.data,
        tokenizer,
        room,
        per_step,
        0,
        1,
        recipe.optim.seed,
        say,
        grpo.chat_template_kwargs,
    )
    assert stream.per_epoch is not None  # prompts have a known number
    # Each generation trains grpo.num_iterations optimizer steps: an epoch of prompts is that many times longer.
    generations = stream.per_epoch * grpo.num_iterations
    return stream, recipe.optim.max_steps or steps_for_epochs(recipe.optim.epochs or 1.0, generations, 1)


def grpo_rollouts(
    run: Resolved,
    ds: Any,
    objective: Objective,
    prompts: Batches,
    tokenizer: PreTrainedTokenizerBase,
    rank: int,
    place: Callable[[Batch], Batch],
    tracker: TableLog,
    schedule: StepSchedule,
    say: Say,
) -> Rollouts:
    """The engine's micro-batches under GRPO: completions of the model itself, scored by the recipe's rewards.

    `ds` is the engine's DeepSpeed model, `objective` the one the ZeRO engine built for grpo (it holds the
    reference, the initial model with beta > 0), `place` moves a batch to the model's device; completions go
    to `tracker`'s table on the steps `schedule` logs (grpo.log_completions)."""
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
    samples = (
        sample_log(tracker, schedule, grpo.num_iterations, grpo.num_completions_to_print, say)
        if grpo.log_completions
        else None
    )

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
        RewardContext.at_step(schedule.start_step, schedule.max_steps),
        say,
    )


def sample_log(
    tracker: TableLog,
    schedule: StepSchedule,
    iterations: int,
    to_print: int | None = None,
    say: Say | None = None,
) -> SampleLog:
    """A few completions of each generation that trains a logged step (loop.py's rule), as table
    `completions` (completions.jsonl in the run, a W&B table) at that generation's first step; `to_print` of
    them (None: all) also on screen (grpo.log_completions, num_completions_to_print: TRL's options)."""
    generations = 0

    def log(rows: list[dict[str, Any]]) -> None:
        nonlocal generations
        first = schedule.start_step + generations * iterations + 1
        generations += 1
        steps = range(first, first + iterations)
        logged = any(s % schedule.log_every == 0 or s == schedule.max_steps for s in steps)
        if first == schedule.start_step + 1 or logged:
            tracker.log_table("completions", rows, first)
            if say is None:
                return
            for row in rows if to_print is None else rows[:to_print]:
                reward = "None" if row["reward"] is None else f"{row['reward']:.3f}"
                say(f"step {first} completion (reward {reward}): {row['prompt']!r} -> {row['completion']!r}")

    return log
