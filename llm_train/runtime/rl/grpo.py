"""Online RL with GRPO on the ZeRO engine: generate -> score rewards -> advantages -> loss and backward.

The step loop (loop.py) and the engine's `train_step` are the same as for every objective. What GRPO adds
sits on the two sides of them:

- `Rollouts` is the iterator the engine draws its micro-batches from. When it runs dry it takes this rank's
  next prompts from the dealer (data/prompts.py), has the model write grpo.num_generations completions for
  each (`Generation`), scores every completion (runtime/rl/rewards.py), gathers the rewards of every rank,
  computes the group advantages (loss/grpo.py) and cuts this rank's completions into the step's
  micro-batches, handed out grpo.num_iterations times (one optimizer step each).
- `Grpo` is the objective: it scores a micro-batch by TRL's GRPO loss on the policy's log-probs.

Every rank draws the same prompts for the whole step and writes its slice of their groups (recipe check, as
TRL's: num_generations divides the step's completions over every rank), so a group may span ranks; gathering
the rewards in rank order puts every group's completions back together before the advantages.

Generation runs transformers' `generate` on the engine's module (the HF model, or the PEFT model with its
adapters active), sampling at grpo.temperature / top_p / top_k, in eval mode and without gradients. Under
ZeRO-3 each rank holds a shard of every weight: the whole model is gathered for the generation
with ZeRO-3's module hooks off (compat.gathered_for_generation; TRL's ds3_gather_for_generation), which needs
the model's full size in memory on every rank while it writes; with grpo.ds3_gather_for_generation false the
hooks stay on and gather one layer at a time, for every token (a model too large to gather whole still writes). A completion ends at its first EOS (kept, as
TRL does) or at grpo.max_completion_length; it is then "truncated" (it ends without EOS), and
grpo.mask_truncated_completions leaves it out of the loss. The generation engine is one small interface (`Generation`): a vLLM one would slot in there.

Metrics per step (metrics.jsonl): the reward mean/std of each function and of the weighted sum, the fraction
of groups whose rewards are all equal (they teach nothing), completion length mean/max and truncated fraction,
generation tokens/s, the seconds spent generating and scoring (the rest of step_time is training), and the
loss's clip ratios, the policy's entropy over the completion tokens (TRL's `entropy`) and, with beta > 0, the
KL to the reference.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from llm_train.config.objective_sections import GrpoSection
from llm_train.data.dealer import Batches
from llm_train.data.prompts import Prompt
from llm_train.errors import UserError
from llm_train.runtime.base.collectives import Collectives
from llm_train.runtime.base.compat import gathered_for_generation
from llm_train.runtime.loss.grpo import (
    Advantages,
    LossSettings,
    completion_logps_and_entropy,
    group_advantages,
    policy_loss,
)
from llm_train.runtime.loss.interface import Scored
from llm_train.runtime.rl.rewards import (
    RewardContext,
    RewardFunction,
    completions_as_trl,
    gather,
    reward_metrics,
    score,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from llm_train.data.prepare import PackedSplit

Batch = dict[str, Any]
# What a logging interval shows of a generation: a few completions with their rewards (session.py puts them in
# completions.jsonl and a W&B table on the steps it logs).
SampleLog = Callable[[list[dict[str, Any]]], None]
SAMPLES_PER_GENERATION = 4
# Per-token log-probs of a rollout micro-batch under the reference (beta > 0), no grad.
ReferenceLogps = Callable[[Batch], torch.Tensor]


def loss_settings(grpo: GrpoSection) -> LossSettings:
    return LossSettings(
        loss_type=grpo.loss_type,
        importance_sampling_level=grpo.importance_sampling_level,
        epsilon=grpo.epsilon,
        epsilon_high=grpo.epsilon_high,
        beta=grpo.beta,
        temperature=grpo.temperature,
        max_completion_length=grpo.max_completion_length,
        delta=grpo.delta,
        sapo_temperature_pos=grpo.sapo_temperature_pos,
        sapo_temperature_neg=grpo.sapo_temperature_neg,
        vespo_k_pos=grpo.vespo_k_pos,
        vespo_lambda_pos=grpo.vespo_lambda_pos,
        vespo_k_neg=grpo.vespo_k_neg,
        vespo_lambda_neg=grpo.vespo_lambda_neg,
    )


def rollout_logps(model: torch.nn.Module, batch: Batch, temperature: float) -> torch.Tensor:
    return rollout_logps_and_entropy(model, batch, temperature, entropy=False)[0]


def rollout_logps_and_entropy(
    model: torch.nn.Module, batch: Batch, temperature: float, entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A rollout micro-batch's completion log-probs (and their entropy): loss/grpo.py on its tensors."""
    return completion_logps_and_entropy(
        model,
        batch["prompt_ids"],
        batch["prompt_mask"],
        batch["completion_ids"],
        batch["completion_mask"],
        temperature,
        entropy,
    )


class Grpo:
    """The objective: TRL's GRPO loss of a rollout micro-batch (runtime/loss/grpo.py)."""

    name = "grpo"

    def __init__(self, grpo: GrpoSection, reference: ReferenceLogps | None = None) -> None:
        self.settings = loss_settings(grpo)
        self.reference = (
            reference  # beta > 0: the initial model's log-probs, taken when the batch is generated
        )

    def prepare(
        self, splits: list[PackedSplit | None], dp_rank: int, dp_size: int, say: Callable[[str], None]
    ) -> None:
        """Nothing to compute before training."""

    def score(self, model: torch.nn.Module, batch: Batch) -> Scored:
        logps, entropy = rollout_logps_and_entropy(model, batch, self.settings.temperature)
        assert entropy is not None
        loss, metrics = policy_loss(
            logps,
            batch["advantages"],
            batch["completion_mask"],
            self.settings,
            batch.get("old_logps"),
            batch.get("ref_logps"),
            batch["dapo_tokens"],
        )
        # The step's rollout metrics ride on each of its micro-batches: their mean over micro-batches is them.
        rollout = {k: torch.tensor(v, dtype=torch.float32) for k, v in batch["rollout_metrics"].items()}
        mask = batch["completion_mask"].to(entropy.dtype)
        metrics["entropy"] = (entropy * mask).sum() / mask.sum().clamp(min=1)  # mean over scored tokens
        return Scored(loss, {**metrics, **rollout})

    def eval_summary(self, means: dict[str, float]) -> dict[str, float]:
        return {"eval_loss": means["loss"]}


class Generation(Protocol):
    """What writes completions: token ids in, token ids out (transformers' generate here; vLLM would fit)."""

    def __call__(self, prompts: list[list[int]]) -> list[list[int]]:
        """One completion per prompt (prompts repeated by the caller), each cut after its first EOS."""
        ...


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids, mask


def right_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


def cut_at_eos(generated: torch.Tensor, eos_ids: list[int]) -> list[list[int]]:
    """Each row up to and including its first EOS (TRL keeps the EOS: the model learns to stop)."""
    out = []
    for row in generated.tolist():
        end = next((i for i, t in enumerate(row) if t in eos_ids), None)
        out.append(row if end is None else row[: end + 1])
    return out


class HfGeneration:
    """transformers' `generate` on the engine's module: sampling, eval mode, no grad; under ZeRO-3 every
    weight gathered while it writes (see the module docstring)."""

    def __init__(self, engine: Any, zero3: bool, grpo: GrpoSection, pad_id: int, eos_ids: list[int]) -> None:
        self.engine, self.module, self.zero3, self.grpo = engine, engine.module, zero3, grpo
        self.pad_id, self.eos_ids = pad_id, eos_ids

    def _whole_model(self) -> contextlib.AbstractContextManager[None]:
        # grpo.ds3_gather_for_generation false: ZeRO-3's module hooks gather each layer as generate reaches it
        # and release it after, at every decode step (the memory of a layer, the traffic of the model per token).
        whole = self.zero3 and self.grpo.ds3_gather_for_generation
        return gathered_for_generation(self.engine) if whole else contextlib.nullcontext()

    @torch.no_grad()
    def __call__(self, prompts: list[list[int]]) -> list[list[int]]:
        device = next(self.module.parameters()).device
        ids, mask = left_pad(prompts, self.pad_id)
        grpo = self.grpo
        was_training = self.module.training
        self.module.eval()
        try:
            with self._whole_model():
                out = self.module.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    **sampling_options(grpo, self.pad_id, self.eos_ids),
                )
        finally:
            if was_training:
                self.module.train()
        return cut_at_eos(out[:, ids.shape[1] :].cpu(), self.eos_ids)


def disable_dropout(model: torch.nn.Module) -> int:
    """grpo.disable_dropout: every `nn.Dropout` of the model set to p = 0, as TRL's `disable_dropout_in_model`
    does (so the log-probs of generation and training agree; TRL is a test-only dependency here, so its
    four lines are repeated); returns how many it found."""
    found = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
            found += 1
    return found


def sampling_options(grpo: GrpoSection, pad_id: int, eos_ids: list[int]) -> dict[str, Any]:
    """The generation options both engines use (TRL's GRPOTrainer builds the same GenerationConfig fields):
    grpo.generation_kwargs last, so they override the sampling options as TRL's do."""
    return {
        "do_sample": True,
        "temperature": grpo.temperature,
        "top_p": grpo.top_p,
        "top_k": grpo.top_k,  # 0: no top-k filter (None would mean the model's default, 50)
        "min_p": grpo.min_p,
        "repetition_penalty": grpo.repetition_penalty,
        "max_new_tokens": grpo.max_completion_length,
        "pad_token_id": pad_id,
        "eos_token_id": eos_ids,
        **(grpo.generation_kwargs or {}),
    }


@dataclass(frozen=True)
class RolloutShape:
    """How a step's completions are cut: micro-batch rows, micro-batches per step, data-parallel ranks."""

    micro_batch: int
    accumulation: int
    dp_size: int


class Rollouts(Iterator[Batch]):
    """The engine's micro-batches under GRPO: generated, scored and cut per step (see the module docstring)."""

    def __init__(
        self,
        prompts: Batches,
        generate: Generation,
        rewards: list[RewardFunction],
        grpo: GrpoSection,
        shape: RolloutShape,
        tokenizer: PreTrainedTokenizerBase,
        comm: Collectives,
        rank: int,
        policy_logps: Callable[[Batch], torch.Tensor],
        reference_logps: ReferenceLogps | None = None,
        samples: SampleLog | None = None,
        context: RewardContext | None = None,
        say: Callable[[str], None] | None = None,
    ) -> None:
        # This rank's place in the gathered rewards: the global rank (grpo runs data parallel only).
        self.rank = rank
        self.prompts, self.generate, self.rewards, self.grpo = prompts, generate, rewards, grpo
        self.shape, self.tokenizer, self.comm = shape, tokenizer, comm
        self.policy_logps, self.reference_logps = policy_logps, reference_logps
        # grpo.reward_weights (TRL's list) overrides each reward's own weight (the recipe checks its length).
        weights = grpo.reward_weights if grpo.reward_weights is not None else [r.weight for r in rewards]
        self.weights = torch.tensor(weights, dtype=torch.float32)
        self.samples = samples
        # TRL's reward keywords; trainer_state.global_step is the optimizer steps done when a generation starts.
        self.context = context or RewardContext()
        self.say = say or (lambda _line: None)
        # The ids generation stops at (stop_ids: EOS and generation_config's), which tell a finished completion.
        self.stop = list(getattr(generate, "eos_ids", None) or _eos_ids(tokenizer))
        self._queue: list[Batch] = []

    def __iter__(self) -> Rollouts:
        return self

    def __next__(self) -> Batch:
        if not self._queue:
            step = self._rollout()
            # num_iterations optimizer steps on one generation; later passes report no new generation time.
            later = [
                dict(b, rollout_metrics={**b["rollout_metrics"], "time_generate_s": 0.0, "time_score_s": 0.0})
                for b in step
            ]
            self._queue = step + later * (self.grpo.num_iterations - 1)
            self.context.trainer_state.global_step += self.grpo.num_iterations
        return self._queue.pop(0)

    def _rollout(self) -> list[Batch]:
        """One generation: this rank's prompts -> completions -> rewards (all ranks) -> the step's micro-batches."""
        # The step's prompts for every rank (each rank draws the same); this rank writes its slice of their
        # groups, so a group may span ranks (TRL's RepeatSampler + split by process).
        prompts = next(self.prompts)["prompts"]
        every = [p for p in prompts for _ in range(self.grpo.num_generations)]
        n = self.shape.micro_batch * self.shape.accumulation
        if len(every) != n * self.shape.dp_size:
            raise ValueError(f"{len(every)} completions per step for {self.shape.dp_size} ranks of {n}")
        repeated = every[self.rank * n : (self.rank + 1) * n]
        t0 = time.perf_counter()
        completions = self.generate([p.ids for p in repeated])
        t1 = time.perf_counter()
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        columns = {k: [p.columns[k] for p in repeated] for k in repeated[0].columns}
        prompt_values = [p.text for p in repeated]
        shaped = completions_as_trl(prompt_values, texts)
        try:
            local: torch.Tensor | UserError = score(
                self.rewards, prompt_values, shaped, completions, columns, self.context
            )
        except UserError as exc:  # every rank stops on this line (see rewards.gather)
            local = exc
        table = gather(local, self.comm)  # every rank's completions, in rank order
        advantages = group_advantages(table, self.weights, self.grpo.num_generations, self.grpo.scale_rewards)
        logged, extra = self.context.log.drain()
        t2 = time.perf_counter()
        n = len(repeated)
        if self.samples is not None:
            rows_shown = self._sample_rows(repeated, texts, table, advantages, self.rank * n)
            for column, values in extra.items():  # log_extra's columns, one value per completion
                for i, row in enumerate(rows_shown):
                    row[column] = values[i] if i < len(values) else None
            self.samples(rows_shown)
        rows = self._rows(repeated, completions, advantages.advantages[self.rank * n : (self.rank + 1) * n])
        stats, dapo_tokens = self._completion_stats(completions, rows["completion_mask"])
        metrics = {
            **reward_metrics(self.rewards, table, advantages.rewards, advantages.zero_std),
            **stats,
            **self._logged_metrics(logged),
            "generation_tokens_per_s": sum(map(len, completions)) / max(t1 - t0, 1e-9),
            "time_generate_s": t1 - t0,
            "time_score_s": t2 - t1,
        }
        if metrics["frac_reward_unscored"] == 1.0:
            # TRL warns; a run whose rewards are all None would otherwise train on nothing, silently.
            self.say(
                f"warning: step {self.context.trainer_state.global_step + 1}: every reward function returned None "
                f"for all {len(table)} completions: no learning signal (advantages 0); check grpo.rewards"
            )
        return [self._micro_batch(rows, k, dapo_tokens, metrics) for k in range(self.shape.accumulation)]

    def _logged_metrics(self, local: dict[str, float]) -> dict[str, float]:
        """What the reward functions logged with `log_metric`, each name's mean over the ranks that logged it."""
        gathered = self.comm.gather_objects(local)
        names = sorted({name for g in gathered for name in g})
        return {
            name: sum(g[name] for g in gathered if name in g) / sum(1 for g in gathered if name in g)
            for name in names
        }

    def _sample_rows(
        self,
        repeated: list[Prompt],
        texts: list[str],
        table: torch.Tensor,
        advantages: Advantages,
        offset: int,
    ) -> list[dict[str, Any]]:
        """The first completions of this rank's first group, with what each reward gave them (None: unscored)."""
        rows = []
        for i in range(min(SAMPLES_PER_GENERATION, self.grpo.num_generations)):
            rewards = {
                f"rewards/{r.name}": None if torch.isnan(v) else float(v)
                for r, v in zip(self.rewards, table[offset + i], strict=True)
            }
            total = advantages.rewards[offset + i]
            rows.append(
                {
                    "prompt": repeated[i].text,
                    "completion": texts[i],
                    "reward": None if torch.isnan(total) else float(total),
                    "advantage": float(advantages.advantages[offset + i]),
                    **rewards,
                }
            )
        return rows

    def _rows(self, repeated: list[Prompt], completions: list[list[int]], advantages: torch.Tensor) -> Batch:
        """This rank's completions as padded tensors, with their advantages (truncated ones masked if asked)."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        prompt_ids, prompt_mask = left_pad([p.ids for p in repeated], pad)
        completion_ids, completion_mask = right_pad(completions, pad)
        if self.grpo.mask_truncated_completions:
            kept = ~_truncated(completions, self.stop)
            completion_mask = completion_mask * kept.unsqueeze(1).long()
        return {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "advantages": advantages,
        }

    def _completion_stats(
        self, completions: list[list[int]], completion_mask: torch.Tensor
    ) -> tuple[dict[str, float], float]:
        """(the completions' length metrics over every rank, loss_type dapo's tokens per micro-batch)."""
        lengths = torch.tensor([len(c) for c in completions], dtype=torch.float32)
        truncated = _truncated(completions, self.stop).float()
        local = [
            completion_mask.sum().float(),
            lengths.sum(),
            truncated.sum(),
            torch.tensor(float(len(lengths))),
        ]
        scored, total_length, total_truncated, count = self.comm.sum(torch.stack(local)).tolist()
        longest = max(self.comm.gather_objects(int(lengths.max())))
        shortest = min(self.comm.gather_objects(int(lengths.min())))
        # TRL's names: completions/clipped_ratio is the fraction cut at max_completion_length (no EOS).
        stats = {
            "completions/mean_length": total_length / count,
            "completions/max_length": float(longest),
            "completions/min_length": float(shortest),
            "completions/clipped_ratio": total_truncated / count,
        }
        # dapo: the step's scored tokens over all ranks / (ranks x micro-batches), see loss/grpo.py.
        return stats, scored / (self.shape.dp_size * self.shape.accumulation)

    def _micro_batch(self, rows: Batch, k: int, dapo_tokens: float, metrics: dict[str, float]) -> Batch:
        """Micro-batch k of the step, with the log-probs it needs from the generating and the reference policy."""
        size = self.shape.micro_batch
        batch = _trim({name: value[k * size : (k + 1) * size] for name, value in rows.items()})
        if self.grpo.num_iterations > 1:  # the policy that generated them, for the ratio of later passes
            batch["old_logps"] = self.policy_logps(batch).detach()
        if self.reference_logps is not None:
            batch["ref_logps"] = self.reference_logps(batch).detach()
        # What tokens/s counts: the rows' real tokens (data/model_inputs.real_tokens reads this mask).
        batch["attention_mask"] = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        batch["dapo_tokens"] = dapo_tokens
        batch["rollout_metrics"] = metrics
        return batch


def _truncated(completions: list[list[int]], stop: list[int]) -> torch.Tensor:
    """Completions that end without a stop token: cut at grpo.max_completion_length."""
    eos = set(stop)
    return torch.tensor([not ids or ids[-1] not in eos for ids in completions])


def _trim(batch: Batch) -> Batch:
    """A micro-batch without the padding columns every one of its rows has (shorter forwards)."""
    keep_prompt = batch["prompt_mask"].any(dim=0)
    first = int(keep_prompt.float().argmax()) if keep_prompt.any() else 0
    used = batch["completion_mask"].any(dim=0)
    last = int(used.nonzero().max()) + 1 if used.any() else 1
    return {
        **batch,
        "prompt_ids": batch["prompt_ids"][:, first:],
        "prompt_mask": batch["prompt_mask"][:, first:],
        "completion_ids": batch["completion_ids"][:, :last],
        "completion_mask": batch["completion_mask"][:, :last],
    }


def _eos_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    eos = tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def stop_ids(tokenizer: PreTrainedTokenizerBase, generation_config: Any = None) -> list[int]:
    """What ends a completion: the tokenizer's EOS and every id of the model's `generation_config.eos_token_id`
    (an int or a list: chat models whose end-of-turn token is not the tokenizer's EOS list it there, and
    `generate` stops at any of them, as TRL's generation does)."""
    # TRL 1.16's order (GRPOTrainer.__init__): the model's ids, the tokenizer's EOS first when they lack it.
    configured = getattr(generation_config, "eos_token_id", None)
    ids = [int(i) for i in ([configured] if isinstance(configured, int) else list(configured or []))]
    for eos in reversed(_eos_ids(tokenizer)):
        if eos not in ids:
            ids.insert(0, eos)
    if not ids:
        raise UserError(
            "the tokenizer has no eos token and the model's generation_config none; GRPO needs one to stop"
        )
    return ids
