"""Random weights are drawn on the device a non-ZeRO-3 run trains on (runtime/model/model.py build_model).

On the CPU a 1B shape took ~50 s per launch on the first H200 run; drawn on the GPU, about a second.
The same seed must still give every rank (and the HF Trainer peer of bench/mfu_matrix.py, which draws
its weights the same way) the same weights.
"""

from __future__ import annotations

import pytest
import torch

from llm_train.config.recipe import load_recipe
from llm_train.runtime.model.model import build_model

pytestmark = pytest.mark.gpu


def test_random_weights_are_drawn_on_the_gpu_and_repeat_with_the_seed() -> None:
    recipe = load_recipe("tiny-cpu", ["memory.attention=sdpa"])
    built = [build_model(recipe.model, recipe.memory, "bf16", 7, device="cuda:0") for _ in range(2)]
    for model in built:
        assert {p.device.type for p in model.parameters()} == {"cuda"}
    first, second = (dict(m.named_parameters()) for m in built)
    assert all(torch.equal(first[name], second[name]) for name in first)
