"""runtime/model.py: random weights are drawn where they train, and the seed still decides them.

Non-ZeRO-3 GPU runs draw them on the GPU (tests/gpu/test_model_init.py); on the CPU, with or without a
device, the seed gives the weights every parity test compares.
"""

from __future__ import annotations

import torch

from llm_train.config.recipe import load_recipe
from llm_train.runtime.model import build_model


def test_random_weights_drawn_on_the_cpu_are_the_ones_built_without_a_device() -> None:
    recipe = load_recipe("tiny-cpu", ["memory.attention=sdpa"])
    plain = dict(build_model(recipe.model, recipe.memory, "fp32", 7).named_parameters())
    placed = dict(build_model(recipe.model, recipe.memory, "fp32", 7, device="cpu").named_parameters())
    assert plain.keys() == placed.keys() and all(torch.equal(plain[k], placed[k]) for k in plain)
