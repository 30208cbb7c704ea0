"""GRPO's loss, gradients and advantages against TRL 1.16's GRPOTrainer: same batch, same weights, fp32.

The loss: llm_train's `completion_logps` + `policy_loss` against `GRPOTrainer.compute_loss(model, inputs)` on
a hand-made batch (left-padded prompts, right-padded completions of different lengths), for every loss_type,
both importance-sampling levels, beta 0 and 0.04 (with the reference's log-probs), num_iterations 1 (no old
log-probs: the ratio is exp(0)) and 2 (old log-probs off the policy by up to +-0.4, so that both clip
bounds bite, asserted), at a sampling temperature of 0.7. The advantages: `group_advantages` against the
advantages TRL's `_generate_and_score_completions` hands its loss, on the same rewards (two functions,
weights, None values, a group of equal rewards), for scale_rewards group, batch and none.

Tolerance 1e-5 (the issue's): both sides run the same fp32 model and the same formulas; TRL takes
log-probs through its fused, tiled LM head, we through the model's logits, so differences come from
summation order alone (measured: printed by each test, ~1e-7).

Scaling: TRL divides its loss by the accumulation steps, DeepSpeed's `backward` divides ours (see
runtime/loss/grpo.py); `test_accumulation_divides_once` checks ours / accumulation == TRL's at accumulation 2.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

# TRL is test-only (pyproject's dev extra, which `make install` installs): imported, not skipped.
from trl import GRPOConfig, GRPOTrainer

from llm_train.runtime.loss.grpo import (
    LossSettings,
    completion_logps,
    completion_logps_and_entropy,
    group_advantages,
    policy_loss,
)
from tests.helpers import REPO, tiny_llama

TOLERANCE = 1e-5
ROWS, PROMPT, COMPLETION, VOCAB = 8, 6, 7, 97
TEMPERATURE = 0.7
TOKENIZER = REPO / "llm_train" / "assets" / "tiny" / "tokenizer"


def _model() -> LlamaForCausalLM:
    return tiny_llama(VOCAB).train()


def _batch() -> dict[str, torch.Tensor]:
    """Prompts of 2-6 tokens left-padded, completions of 1-7 tokens right-padded (pad id 0), advantages of both signs."""
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, VOCAB, (ROWS, PROMPT), generator=g)
    completion_ids = torch.randint(3, VOCAB, (ROWS, COMPLETION), generator=g)
    prompt_mask = torch.zeros_like(prompt_ids)
    completion_mask = torch.zeros_like(completion_ids)
    for r in range(ROWS):
        prompt_mask[r, PROMPT - (2 + r % 5) :] = 1
        completion_mask[r, : 1 + (r * 3) % COMPLETION] = 1
    return {
        "prompt_ids": prompt_ids * prompt_mask,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids * completion_mask,
        "completion_mask": completion_mask,
        "advantages": torch.randn(ROWS, generator=g),
    }


def _off_policy(logps: torch.Tensor, seed: int) -> torch.Tensor:
    """Log-probs of another policy: `logps` moved by up to +-0.4 per token."""
    g = torch.Generator().manual_seed(seed)
    return logps.detach() + (torch.rand(logps.shape, generator=g) - 0.5) * 0.8


def _trainer(
    model: LlamaForCausalLM, accumulation: int = 1, rewards: list[Any] | None = None, **options: Any
) -> GRPOTrainer:
    """TRL's trainer on CPU: no vLLM, use_cpu, fp32, no trackers, beta 0 at construction (a non-zero beta
    would load a reference model; `_run_both` sets `trainer.beta` afterwards, which is all the loss reads)."""
    from datasets import Dataset

    args = GRPOConfig(
        output_dir="/tmp/llm_train-test-grpo",  # never written: no step is taken
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        report_to=[],
        beta=0,
        temperature=TEMPERATURE,
        per_device_train_batch_size=ROWS,
        num_generations=4,
        max_completion_length=COMPLETION,
        gradient_accumulation_steps=accumulation,
        **options,
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=rewards or [lambda completions, **_: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "x"}] * ROWS),
        processing_class=AutoTokenizer.from_pretrained(TOKENIZER),
    )


@pytest.fixture(scope="module")
def models() -> tuple[LlamaForCausalLM, LlamaForCausalLM, GRPOTrainer]:
    ours = _model()
    theirs = copy.deepcopy(ours)
    return ours, theirs, _trainer(theirs)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _largest(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _run_both(
    ours: LlamaForCausalLM,
    theirs: LlamaForCausalLM,
    trainer: GRPOTrainer,
    settings: LossSettings,
    iterations: int,
    accumulation: int = 1,
) -> tuple[
    torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]
]:
    """(our loss, TRL's loss, our gradients, TRL's gradients, our metrics) on the same batch."""
    batch = _batch()
    with torch.no_grad():
        current = completion_logps(
            ours,
            *(batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")),
            TEMPERATURE,
        )
    old = _off_policy(current, seed=2) if iterations > 1 else None
    ref = _off_policy(current, seed=3) if settings.beta else None
    tokens = batch["completion_mask"].sum()

    ours.zero_grad(set_to_none=True)
    logps = completion_logps(
        ours,
        *(batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")),
        TEMPERATURE,
    )
    # One rank; the step's completions are this micro-batch `accumulation` times over (dapo_tokens' definition).
    loss, metrics = policy_loss(
        logps, batch["advantages"], batch["completion_mask"], settings, old, ref, dapo_tokens=tokens.float()
    )
    (loss / accumulation).backward()  # what DeepSpeed's backward does at that accumulation

    trainer.loss_type = settings.loss_type
    trainer.importance_sampling_level = settings.importance_sampling_level
    trainer.epsilon_low, trainer.epsilon_high = settings.epsilon, settings.upper
    trainer.beta = settings.beta
    # The options TRL's loss reads from its config, not from the trainer.
    trainer.args.delta = settings.delta
    for option in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos"):
        setattr(trainer.args, option, getattr(settings, option))
    trainer.args.vespo_k_neg, trainer.args.vespo_lambda_neg = settings.vespo_k_neg, settings.vespo_lambda_neg
    trainer.current_gradient_accumulation_steps = accumulation
    inputs = dict(batch, num_items_in_batch=tokens * accumulation)
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    theirs.zero_grad(set_to_none=True)
    trl_loss = trainer.compute_loss(theirs, inputs)
    trl_loss.backward()
    return loss.detach() / accumulation, trl_loss.detach(), _grads(ours), _grads(theirs), metrics


CASES = list(
    itertools.product(("grpo", "bnpo", "dr_grpo", "dapo"), ("token", "sequence"), (0.0, 0.04), (1, 2))
)


@pytest.mark.parametrize(("loss_type", "level", "beta", "iterations"), CASES)
def test_loss_and_gradients_equal_trls(
    models: tuple[LlamaForCausalLM, LlamaForCausalLM, GRPOTrainer],
    loss_type: str,
    level: str,
    beta: float,
    iterations: int,
) -> None:
    ours, theirs, trainer = models
    settings = LossSettings(
        loss_type=loss_type,  # type: ignore[arg-type]
        importance_sampling_level=level,  # type: ignore[arg-type]
        epsilon=0.2,
        epsilon_high=0.28,  # DAPO's clip-higher: the two bounds are told apart
        beta=beta,
        temperature=TEMPERATURE,
        max_completion_length=COMPLETION,
    )
    loss, trl_loss, grads, trl_grads, metrics = _run_both(ours, theirs, trainer, settings, iterations)
    differences = {"loss": abs(float(loss - trl_loss)), "gradients": _largest(grads, trl_grads)}
    print(
        f"{loss_type}/{level}/beta={beta}/iterations={iterations} vs TRL 1.16: largest differences {differences}"
    )
    assert max(differences.values()) <= TOLERANCE, differences
    assert float(loss) != 0.0 and differences["gradients"] < _largest(
        grads, {k: 0 * v for k, v in grads.items()}
    )
    if iterations == 1:  # on-policy: the ratio is exp(0), nothing is clipped
        assert float(metrics["clip_ratio/region_mean"]) == 0.0
    elif level == "token":  # 0.4 off the policy: both bounds bite somewhere
        assert float(metrics["clip_ratio/low_mean"]) > 0 and float(metrics["clip_ratio/high_mean"]) > 0
    trl_metrics = trainer._metrics["train"]
    assert (
        abs(float(metrics["clip_ratio/region_mean"]) - trl_metrics["clip_ratio/region_mean"][-1]) <= TOLERANCE
    )
    if beta:
        assert abs(float(metrics["kl"]) - trl_metrics["kl"][-1]) <= TOLERANCE and float(metrics["kl"]) > 0


# TRL 1.16's other loss types, and two-sided clipping (`delta`) on the clipped surrogate: off the policy
# (iterations 2), where the ratio differs from 1 and each one's gate, cap or weight acts.
NEW_CASES = [
    *itertools.product(("cispo", "sapo", "luspo", "vespo"), ("token", "sequence"), (0.0, 0.04), (None,)),
    *itertools.product(("dapo", "grpo"), ("token", "sequence"), (0.0,), (1.1,)),
]


@pytest.mark.parametrize(("loss_type", "level", "beta", "delta"), NEW_CASES)
def test_new_loss_types_and_delta_equal_trls(
    models: tuple[LlamaForCausalLM, LlamaForCausalLM, GRPOTrainer],
    loss_type: str,
    level: str,
    beta: float,
    delta: float | None,
) -> None:
    ours, theirs, trainer = models
    settings = LossSettings(
        loss_type=loss_type,  # type: ignore[arg-type]
        importance_sampling_level=level,  # type: ignore[arg-type]
        epsilon=0.2,
        epsilon_high=0.28,
        beta=beta,
        temperature=TEMPERATURE,
        max_completion_length=COMPLETION,
        delta=delta,
    )
    loss, trl_loss, grads, trl_grads, _ = _run_both(ours, theirs, trainer, settings, iterations=2)
    differences = {"loss": abs(float(loss - trl_loss)), "gradients": _largest(grads, trl_grads)}
    print(f"{loss_type}/{level}/beta={beta}/delta={delta} vs TRL 1.16: largest differences {differences}")
    assert max(differences.values()) <= TOLERANCE, differences
    assert float(loss) != 0.0 and differences["gradients"] < _largest(
        grads, {k: 0 * v for k, v in grads.items()}
    )
    if delta is not None:  # the cap bites: without it the loss differs
        uncapped, *_ = _run_both(
            ours, theirs, trainer, dataclasses.replace(settings, delta=None), iterations=2
        )
        assert abs(float(uncapped - loss)) > TOLERANCE


def test_entropy_equals_trls(models: tuple[LlamaForCausalLM, LlamaForCausalLM, GRPOTrainer]) -> None:
    """The logged entropy (Grpo.score: the mean over the scored completion tokens) is TRL's `entropy` metric."""
    ours, theirs, trainer = models
    settings = LossSettings(temperature=TEMPERATURE, max_completion_length=COMPLETION)
    _run_both(ours, theirs, trainer, settings, iterations=1)
    batch = _batch()
    with torch.no_grad():
        _, entropy = completion_logps_and_entropy(
            ours,
            *(batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")),
            TEMPERATURE,
        )
    assert entropy is not None
    mask = batch["completion_mask"].float()
    mean = float((entropy * mask).sum() / mask.sum())
    assert 0 < mean < math.log(ours.config.vocab_size)  # a distribution's entropy, below the uniform one's
    assert abs(mean - trainer._metrics["train"]["entropy"][-1]) <= TOLERANCE


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_accumulation_divides_once(loss_type: str) -> None:
    """At accumulation 2 TRL halves its loss itself; ours is halved by DeepSpeed's backward: equal gradients."""
    ours = _model()
    theirs = copy.deepcopy(ours)
    trainer = _trainer(theirs, accumulation=2)
    settings = LossSettings(loss_type=loss_type, temperature=TEMPERATURE, max_completion_length=COMPLETION)  # type: ignore[arg-type]
    loss, trl_loss, grads, trl_grads, _ = _run_both(
        ours, theirs, trainer, settings, iterations=2, accumulation=2
    )
    differences = {"loss": abs(float(loss - trl_loss)), "gradients": _largest(grads, trl_grads)}
    print(f"{loss_type} at accumulation 2 vs TRL 1.16: largest differences {differences}")
    assert max(differences.values()) <= TOLERANCE, differences


# Rewards of 8 completions (2 prompts x 4) by two functions; None = the function does not score it.
# Group 1 mixes values and a None; group 2's weighted sums are all 1 (std 0: advantages 0), one with a None.
REWARDS = [
    [1.0, 0.5],
    [0.0, None],
    [1.0, 0.0],
    [0.0, 1.0],
    [1.0, 0.0],
    [1.0, 0.0],
    [1.0, None],
    [1.0, 0.0],
]
WEIGHTS = [1.0, 0.5]


def _column(i: int) -> Any:
    """A reward function that returns column `i` of REWARDS."""

    def reward(completions: list[str], **_: Any) -> list[float | None]:
        return [REWARDS[k][i] for k in range(len(completions))]

    return reward


def _trl_advantages(scale: str) -> tuple[torch.Tensor, dict[str, list[float]]]:
    """The advantages TRL's `_generate_and_score_completions` computes for REWARDS (its generation stubbed)."""
    functions = [_column(i) for i in range(len(WEIGHTS))]
    trainer = _trainer(_model(), rewards=functions, scale_rewards=scale, reward_weights=WEIGHTS)
    trainer._generate_single_turn = lambda prompt_ids, *_, **__: ([[5, 6, 2]] * len(prompt_ids), None)
    out = trainer._generate_and_score_completions([{"prompt": f"p{k // 4}"} for k in range(ROWS)])
    return out["advantages"], trainer._metrics["train"]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trls(scale: str) -> None:
    rewards = torch.tensor([[float("nan") if v is None else v for v in row] for row in REWARDS])
    ours = group_advantages(rewards, torch.tensor(WEIGHTS), group=4, scale=scale)  # type: ignore[arg-type]
    theirs, metrics = _trl_advantages(scale)
    difference = float((ours.advantages - theirs).abs().max())
    print(f"advantages (scale_rewards={scale}) vs TRL 1.16: largest difference {difference:.2e}")
    assert difference <= TOLERANCE
    assert float(ours.zero_std.float().mean()) == metrics["frac_reward_zero_std"][-1]
    assert ours.advantages[:4].abs().sum() > 0
    if scale != "batch":
        assert ours.advantages[4:].abs().max() < 1e-3  # equal rewards in the group: nothing to learn


def test_a_completion_no_function_scores_gets_advantage_zero() -> None:
    rewards = torch.tensor([[1.0], [float("nan")], [0.0], [0.5]])
    out = group_advantages(rewards, torch.tensor([1.0]), group=4)
    assert out.advantages[1] == 0 and torch.isnan(out.rewards[1])
    # The group's mean and std are over the three scored completions: 0.5 and 0.5.
    assert torch.allclose(out.advantages[[0, 2, 3]], torch.tensor([0.5, -0.5, 0.0]) / (0.5 + 1e-4))
