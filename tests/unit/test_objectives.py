"""The preference losses against TRL 1.16's own code: same batch, same weights, fp32.

DPO: llm_train's `Preference.score` against `trl.DPOTrainer._compute_loss` (its sigmoid loss with
precomputed reference log-probs, run on a copy of the model patched with TRL's fused LM head):
the loss, TRL's logged rewards, accuracy, margin and log-probs, and every parameter's gradient.
SimPO: against `trl.experimental.cpo.CPOTrainer.get_batch_logps` + `cpo_loss(loss_type="simpo")`.
Label smoothing: TRL 1.16's DPO "sigmoid" loss has none (its label_smoothing belongs to the robust
and EXO losses), so conservative DPO is checked against its formula (Mitchell 2023), written out
here in float64. Reward model: llm_train's `RewardModelling.score` against
`trl.RewardTrainer.compute_loss` (Bradley-Terry with a margin and reward centring) on a copy of one
Llama sequence classifier (num_labels=1). Tolerance 1e-5 (the issue's): both sides run the same fp32 model, and the
differences come from summation order alone (measured: printed by each test, ~1e-7).
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM, LlamaForSequenceClassification

# TRL is test-only (pyproject's dev extra, which `make install` installs): imported, not skipped.
from trl.experimental.cpo import CPOTrainer
from trl.trainer.dpo_trainer import DPOTrainer
from trl.trainer.reward_trainer import RewardTrainer
from trl.trainer.utils import add_fused_lm_head

from llm_train.config.objective_sections import PreferenceSection
from llm_train.runtime.loss.preference_tuning import Preference, dpo_loss, sequence_logps
from llm_train.runtime.loss.reward import RewardModelling
from tests.helpers import tiny_llama

TOLERANCE = 1e-5
PAIRS, WIDTH, VOCAB = 4, 24, 97


def _model() -> LlamaForCausalLM:
    return tiny_llama(VOCAB)


def _batch() -> dict[str, torch.Tensor]:
    """2 x PAIRS right-padded rows (chosen, then rejected), prompts of 3-6 tokens, responses after them."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2 * PAIRS, WIDTH), generator=g)
    attention = torch.zeros_like(ids)
    completion = torch.zeros_like(ids)
    for r in range(2 * PAIRS):
        prompt = 3 + r % PAIRS
        length = WIDTH - (r * 5) % 9
        attention[r, :length] = 1
        completion[r, prompt:length] = 1
    for r in range(PAIRS):  # a pair shares its prompt tokens
        prompt = 3 + r
        ids[r + PAIRS, :prompt] = ids[r, :prompt]
    return {"input_ids": ids * attention, "attention_mask": attention, "completion_mask": completion}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _largest(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _trl_dpo(model: LlamaForCausalLM, batch: dict[str, torch.Tensor], beta: float) -> tuple[Any, dict]:
    """TRL's DPOTrainer._compute_loss on `model`, with only what it reads of the trainer stood in."""
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    accelerator = SimpleNamespace(
        device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t
    )
    trainer = SimpleNamespace(
        model=model,
        accelerator=accelerator,
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=["sigmoid"],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=0.0,
        use_weighting=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0,
        _tp_size=1,
        args=SimpleNamespace(gradient_checkpointing_kwargs=None),
    )
    loss = DPOTrainer._compute_loss(trainer, model, batch, return_outputs=False)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _ours(
    model: LlamaForCausalLM, batch: dict[str, torch.Tensor], settings: PreferenceSection, name: str
) -> Any:
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": labels}
    if "ref_chosen_logps" in batch:
        inputs["reference_logps"] = torch.cat([batch["ref_chosen_logps"], batch["ref_rejected_logps"]])
    return Preference(name, settings).score(model, inputs)


def test_dpo_loss_rewards_and_gradients_equal_trls() -> None:
    ours_model = _model()
    trl_model = copy.deepcopy(ours_model)
    batch = _batch()
    with torch.no_grad():  # a reference a little off the policy, so rewards differ in sign across pairs
        logps, _ = sequence_logps(
            ours_model(**{k: batch[k] for k in ("input_ids", "attention_mask")}).logits,
            batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100),
        )
    shift = torch.tensor([3.0, -2.0, 1.5, -0.5, -1.0, 2.5, 0.5, 1.0])
    batch["ref_chosen_logps"], batch["ref_rejected_logps"] = (logps + shift).chunk(2)

    beta = 0.1
    scored = _ours(ours_model, batch, PreferenceSection(beta=beta), "dpo")
    scored.loss.backward()
    loss, metrics = _trl_dpo(trl_model, batch, beta)
    loss.backward()

    assert 0 < metrics["rewards/accuracies"] < 1  # a batch that tells right from wrong
    pairs = {
        "reward_accuracy": "rewards/accuracies",
        "reward_chosen": "rewards/chosen",
        "reward_rejected": "rewards/rejected",
        "reward_margin": "rewards/margins",
        "logp_chosen": "logps/chosen",
        "logp_rejected": "logps/rejected",
    }
    differences = {"loss": abs(float(scored.loss) - float(loss))}
    for ours_name, trl_name in pairs.items():
        differences[ours_name] = abs(float(scored.metrics[ours_name]) - metrics[trl_name])
    differences["gradients"] = _largest(_grads(ours_model), _grads(trl_model))
    print(f"DPO vs TRL 1.16 DPOTrainer: largest differences {differences}")
    assert max(differences.values()) <= TOLERANCE, differences


def test_sequence_logps_equal_trls_batch_logps() -> None:
    model, batch = _model(), _batch()
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    sums, counts = sequence_logps(logits, labels)
    theirs = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=False)
    assert torch.allclose(sums, theirs, atol=TOLERANCE, rtol=0)
    assert counts.tolist() == batch["completion_mask"][:, 1:].sum(-1).tolist()


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_simpo_equals_trls_cpo_trainer(label_smoothing: float) -> None:
    ours_model = _model()
    trl_model = copy.deepcopy(ours_model)
    batch = _batch()
    settings = PreferenceSection(beta=2.0, simpo_gamma=0.7, label_smoothing=label_smoothing)
    scored = _ours(ours_model, batch, settings, "simpo")
    scored.loss.backward()

    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    logits = trl_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    average = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    trainer = SimpleNamespace(
        alpha=0.0,
        loss_type="simpo",
        beta=2.0,
        simpo_gamma=0.7,
        label_smoothing=label_smoothing,
        accelerator=SimpleNamespace(device=torch.device("cpu")),
    )
    losses, chosen, rejected = CPOTrainer.cpo_loss(trainer, average[:PAIRS], average[PAIRS:])
    losses.mean().backward()

    differences = {
        "loss": abs(float(scored.loss) - float(losses.mean())),
        "reward_chosen": abs(float(scored.metrics["reward_chosen"]) - float(chosen.mean())),
        "reward_rejected": abs(float(scored.metrics["reward_rejected"]) - float(rejected.mean())),
        "reward_accuracy": abs(
            float(scored.metrics["reward_accuracy"]) - float((chosen > rejected).float().mean())
        ),
        "gradients": _largest(_grads(ours_model), _grads(trl_model)),
    }
    print(
        f"SimPO (label_smoothing {label_smoothing}) vs TRL 1.16 CPOTrainer: largest differences {differences}"
    )
    assert max(differences.values()) <= TOLERANCE, differences


def test_conservative_dpo_follows_its_formula() -> None:
    """Label smoothing e: -(1 - e) log s(b d) - e log s(-b d), d = (pi_c - pi_r) - (ref_c - ref_r)."""
    chosen = torch.tensor([-10.0, -12.5, -7.25], requires_grad=True)
    rejected = torch.tensor([-11.0, -9.0, -7.0], requires_grad=True)
    ref_chosen, ref_rejected = torch.tensor([-10.5, -12.0, -8.0]), torch.tensor([-10.0, -10.0, -6.5])
    beta, e = 0.5, 0.15
    losses, chosen_r, rejected_r = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta, e)
    losses.sum().backward()

    def log_sigmoid(x: float) -> float:
        return -math.log1p(math.exp(-x))

    for i in range(3):
        d = (float(chosen[i]) - float(rejected[i])) - (float(ref_chosen[i]) - float(ref_rejected[i]))
        expected = -(1 - e) * log_sigmoid(beta * d) - e * log_sigmoid(-beta * d)
        assert float(losses[i]) == pytest.approx(expected, abs=TOLERANCE)
        # d loss / d pi_c = -beta * ((1 - e) * s(-b d) - e * s(b d))
        sigmoid = 1 / (1 + math.exp(-beta * d))
        assert float(chosen.grad[i]) == pytest.approx(
            -beta * ((1 - e) * (1 - sigmoid) - e * sigmoid), abs=TOLERANCE
        )
        assert float(rejected.grad[i]) == pytest.approx(-float(chosen.grad[i]), abs=TOLERANCE)
        assert float(chosen_r[i]) == pytest.approx(
            beta * (float(chosen[i]) - float(ref_chosen[i])), abs=TOLERANCE
        )
        assert float(rejected_r[i]) == pytest.approx(
            beta * (float(rejected[i]) - float(ref_rejected[i])), abs=TOLERANCE
        )


def _reward_model() -> LlamaForSequenceClassification:
    """The losses' 2-layer Llama with a one-output score head; pad id 0, which `_batch` pads with and never
    draws as a token, so both sides score each row at its last attended token."""
    config = tiny_llama(VOCAB).config
    config.num_labels, config.pad_token_id = 1, 0
    torch.manual_seed(0)
    return LlamaForSequenceClassification(config).float()


@pytest.mark.parametrize(("margin", "center"), [(0.0, None), (0.3, 0.01)])
def test_reward_model_loss_metrics_and_gradients_equal_trls(margin: float, center: float | None) -> None:
    ours_model = _reward_model()
    trl_model = copy.deepcopy(ours_model)
    batch = {k: _batch()[k] for k in ("input_ids", "attention_mask")}
    # What the engine hands over: labels too, which the reward model must not pass to its head.
    scored = RewardModelling(margin, center).score(ours_model, {**batch, "labels": batch["input_ids"]})
    scored.loss.backward()

    # TRL reads a per-pair margin column; llm_train's margin is one recipe constant, so every pair gets it.
    inputs: dict[str, Any] = dict(batch)
    if margin:
        inputs["margin"] = torch.full((PAIRS,), margin)
    trainer = SimpleNamespace(
        model=trl_model,
        accelerator=SimpleNamespace(gather=lambda t: t, gather_for_metrics=lambda t: t),
        args=SimpleNamespace(center_rewards_coefficient=center),
        _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0,
        _tp_size=1,
    )
    loss = RewardTrainer.compute_loss(trainer, trl_model, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    assert 0 < metrics["accuracy"] < 1  # a batch that tells right from wrong
    differences = {
        "loss": abs(float(scored.loss) - float(loss)),
        "reward_accuracy": abs(float(scored.metrics["reward_accuracy"]) - metrics["accuracy"]),
        "reward_margin": abs(float(scored.metrics["reward_margin"]) - metrics["margin"]),
        "mean_reward": abs(
            float(scored.metrics["reward_chosen"] + scored.metrics["reward_rejected"]) / 2
            - metrics["mean_reward"]
        ),
        "gradients": _largest(_grads(ours_model), _grads(trl_model)),
    }
    print(f"reward model (margin {margin}, centring {center}) vs TRL 1.16 RewardTrainer: {differences}")
    assert max(differences.values()) <= TOLERANCE, differences
