"""A reward model in a real 2-process DeepSpeed run on CPU (recipe tiny-cpu-reward: the bundled preference pairs).

One launch covers the feature: the tiny Llama with a one-output score head learns to rank the held-out
pairs, and final/ is a plain transformers sequence classifier whose scores are the run's. A second one
uses that final/ as the reward of tiny-cpu-grpo (grpo.rewards kind reward_model) for two steps. The loss and
its gradients are checked against TRL's RewardTrainer in tests/unit/test_objectives.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from llm_train.cli import main as cli_main
from llm_train.runtime.checkpointing.logit_reference import read_reference
from llm_train.runtime.loss.reward import REWARD_METRICS
from tests.helpers import assert_ok, launch, read_metrics

pytestmark = pytest.mark.e2e

# Held-out pairs: 18 of the 185 bundled ones (eval_fraction 0.1). An untrained score head ranks a pair either
# way with probability 1/2, so by chance P(accuracy >= 0.8) = P(at least 15 of 18 right) = 988 / 2^18 = 0.4%;
# the recipe reaches 1.0 by step 20 (rejected answers are the chosen ones with their words shuffled).
ABOVE_CHANCE = 0.8
PAIRS = Path(__file__).resolve().parents[2] / "llm_train" / "assets" / "tiny" / "preferences.jsonl"


def test_a_reward_model_learns_to_rank_held_out_pairs_and_exports_as_a_sequence_classifier(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    result = launch(
        ["--recipe", "tiny-cpu-reward", "--output-dir", str(run_dir), f"data.cache_dir={tmp_path}"]
    )
    assert_ok(result)

    evals = [m for m in read_metrics(run_dir) if "eval_loss" in m]
    assert evals and all(f"eval_{k}" in m for m in evals for k in REWARD_METRICS)
    trained = [m for m in read_metrics(run_dir) if "reward_accuracy" in m]
    assert trained and all("reward_margin" in m for m in trained)
    last = evals[-1]
    print(f"held-out reward accuracy by step: {[(m['step'], m['eval_reward_accuracy']) for m in evals]}")
    assert last["eval_reward_accuracy"] >= ABOVE_CHANCE, evals
    assert last["eval_reward_margin"] > 0, evals

    # final/ as a user loads it: one score per row, the pad id the run padded with, the run's scores.
    final = run_dir / "final"
    model = AutoModelForSequenceClassification.from_pretrained(final, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer.pad_token_id is not None
    reference = read_reference(final)
    assert reference is not None
    with torch.no_grad():
        scores = model(input_ids=reference.input_ids).logits
    assert scores.shape == (1, 1)
    # An fp32 run reloaded in fp32 in one process: the same weights through the same kernels, so fp32 noise.
    difference = float((scores - reference.logits).abs().max())
    assert difference <= 1e-5, difference
    check = json.loads((final / "export_check.json").read_text())
    assert check["ok"] and check["max_logit_diff"] <= check["tolerance"]

    # `llm-train export` of the last checkpoint: the same sequence classifier, verified the same way.
    out = tmp_path / "from-checkpoint"
    assert cli_main(["export", "--dtype", "fp32", str(run_dir), str(out)]) == 0
    again = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(again(input_ids=reference.input_ids).logits, scores)  # the same fp32 weights

    _ranks_its_training_pairs_as_a_reward(final)

    # The trained model as GRPO's reward: every completion gets a finite score, logged and shown with it.
    grpo_dir = tmp_path / "grpo"
    result = launch(
        [
            "--recipe",
            "tiny-cpu-grpo",
            "--output-dir",
            str(grpo_dir),
            "--max-steps=2",
            f"grpo.rewards=[{{kind: reward_model, name: rm, path: '{final}'}}]",
        ]
    )
    assert_ok(result)
    rows = [m for m in read_metrics(grpo_dir) if "rewards/rm/mean" in m]
    assert [m["step"] for m in rows] == [1, 2]
    assert all(math.isfinite(m["rewards/rm/mean"]) and m["rewards/rm/std"] > 0 for m in rows), rows
    shown = [json.loads(line) for line in (grpo_dir / "completions.jsonl").read_text().splitlines()]
    assert shown and all(math.isfinite(r["rewards/rm"]) for r in shown)


def _ranks_its_training_pairs_as_a_reward(final: Path) -> None:
    """The trained reward model as GRPO's reward ranks its own training pairs as the run scored them: the
    reward's scores of (prompt, chosen) and (prompt, rejected) equal the model's scores of the rows the run
    trained on (the same tokens), so chosen-above-rejected agrees pair by pair."""
    from llm_train.config.objective_sections import parse_reward
    from llm_train.runtime.rl.rewards import completions_as_trl, load_rewards, score
    from tests.unit.test_rewards import _scores, _trained_rows

    pairs = [json.loads(line) for line in PAIRS.read_text().splitlines()][:24]
    prompts = [p["prompt"] for p in pairs]  # text prompts; chosen/rejected are conversations
    (reward,) = load_rewards([parse_reward({"kind": "reward_model", "path": str(final)}, "r")], 64)
    ranked = []
    for side in ("chosen", "rejected"):
        answers = [p[side][-1]["content"] for p in pairs]
        as_reward = score([reward], prompts, answers, [[0]] * len(pairs), {})[:, 0]
        trained = _scores(
            final, _trained_rows(final, prompts, completions_as_trl([[{}]] * len(pairs), answers))
        )
        assert torch.allclose(as_reward, torch.tensor(trained), atol=1e-4), (as_reward, trained)
        ranked.append(as_reward)
    agree = (ranked[0] > ranked[1]).float().mean()
    print(f"reward model as a GRPO reward: chosen above rejected on {float(agree):.2f} of 24 training pairs")
    assert agree >= ABOVE_CHANCE
