"""runtime/model/model.py: random weights are drawn where they train, and the seed still decides them.

Non-ZeRO-3 GPU runs draw them on the GPU (tests/gpu/test_model_init.py); on the CPU, with or without a
device, the seed gives the weights every parity test compares. A reward model (head="score") is the same
family with one score per row, and reloads as a plain transformers sequence classifier.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from llm_train.config.recipe import load_recipe
from llm_train.config.recipe_sections import MemorySection, ModelSection
from llm_train.runtime.model.model import build_model
from tests.helpers import make_tiny_pretrained


def test_random_weights_drawn_on_the_cpu_are_the_ones_built_without_a_device() -> None:
    recipe = load_recipe("tiny-cpu", ["memory.attention=sdpa"])
    plain = dict(build_model(recipe.model, recipe.memory, "fp32", 7).named_parameters())
    placed = dict(build_model(recipe.model, recipe.memory, "fp32", 7, device="cpu").named_parameters())
    assert plain.keys() == placed.keys() and all(torch.equal(plain[k], placed[k]) for k in plain)


def test_a_reward_model_is_the_family_with_one_score_that_a_plain_classifier_reloads(tmp_path: Path) -> None:
    """head="score": one output per row, read at the last non-pad token; save_pretrained + transformers'
    AutoModelForSequenceClassification gives the same scores, with num_labels=1 and the pad id kept."""
    recipe = load_recipe("tiny-cpu", ["memory.attention=sdpa"])
    model = build_model(recipe.model, recipe.memory, "fp32", 7, head="score", pad_token_id=0).eval()
    assert model.config.num_labels == 1 and model.config.pad_token_id == 0
    ids = torch.randint(1, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    ids[1, 8:] = 0  # right padding
    attention = (ids != 0).long()
    with torch.no_grad():
        scores = model(input_ids=ids, attention_mask=attention).logits
        alone = model(input_ids=ids[1:, :8]).logits
    assert scores.shape == (2, 1)
    # Padding changes only the shapes the kernels see: fp32 rounding, far below 1e-5.
    assert torch.allclose(scores[1], alone[0], atol=1e-5, rtol=0)

    model.save_pretrained(tmp_path / "rm")
    plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", dtype=torch.float32).eval()
    assert plain.config.num_labels == 1 and plain.config.pad_token_id == 0
    with torch.no_grad():
        assert torch.equal(
            plain(input_ids=ids, attention_mask=attention).logits, scores
        )  # same weights, same code


def test_a_reward_model_starts_from_a_pretrained_causal_lms_body(tmp_path: Path) -> None:
    base = make_tiny_pretrained(tmp_path / "base")
    lm = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    section = ModelSection(name_or_path=str(base))
    model = build_model(section, MemorySection(attention="sdpa"), "fp32", 7, head="score", pad_token_id=0)
    body, loaded = dict(lm.model.named_parameters()), dict(model.model.named_parameters())
    assert body.keys() == loaded.keys() and all(torch.equal(body[k], loaded[k]) for k in body)
    assert model.score.weight.shape == (1, lm.config.hidden_size)


def test_activation_checkpointing_is_switched_on_by_the_name_transformers_keeps() -> None:
    import warnings

    recipe = load_recipe("tiny-cpu", ["memory.activation_checkpointing=true"])
    with warnings.catch_warnings():
        # transformers 5.25: gradient_checkpointing_enable is a deprecated alias (a FutureWarning), gone in v6.
        warnings.filterwarnings("error", message=".*gradient_checkpointing_enable.*")
        model = build_model(recipe.model, recipe.memory, "fp32", 7)
    layers = model.model.layers  # type: ignore[union-attr]
    assert all(layer.gradient_checkpointing for layer in layers) and not model.config.use_cache
