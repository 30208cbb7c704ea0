"""LoRA end to end: tiny-cpu-lora trains in a real 2-process DeepSpeed run and exports merged or as an adapter.

The recipe section, the wrap and the merge are checked in one process by tests/unit/test_lora.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from llm_train.config.recipe import load_recipe
from tests.helpers import assert_ok, launch, read_metrics
from tests.optional import import_or_skip

import_or_skip("peft")

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    ("extra", "merged"),
    [
        ([], True),
        (["deepspeed.config=zero3", "memory.activation_checkpointing=true", "lora.export=adapter"], False),
    ],
    ids=["zero2-merged", "zero3-ckpt-adapter"],
)
def test_tiny_lora_trains_with_two_processes(tmp_path: Path, extra: list[str], merged: bool) -> None:
    out = tmp_path / "run"
    result = launch(["--recipe", "tiny-cpu-lora", "--output-dir", str(out), "--max-steps", "5", *extra])
    assert_ok(result)
    world = json.loads((out / "world.json").read_text())
    assert world["world_size"] == 2 and [r["rank"] for r in world["ranks"]] == [0, 1]
    losses = [m["loss"] for m in read_metrics(out) if "loss" in m]
    assert losses and all(loss == loss for loss in losses)
    final = out / "final"
    if merged:
        # A plain HF model: loads without PEFT, and the adapters moved its weights.
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(final)
        assert not any("lora" in n for n, _ in model.named_parameters())
        from llm_train.runtime.model.model import build_model

        recipe = load_recipe("tiny-cpu-lora")  # the run's base weights: same seed, same init
        start = build_model(recipe.model, recipe.memory, "fp32", recipe.optim.seed)
        moved = [
            name
            for name, p in model.named_parameters()
            if "q_proj" in name and not torch.allclose(p, dict(start.named_parameters())[name])
        ]
        assert moved, "merged export equals the initial weights: adapters were not folded in"
        # The frozen base: tensors no adapter targets (embeddings, norms, output layer) come out
        # bit for bit as they went in (fp32, no weight decay reaches them, merging leaves them).
        targets = tuple(recipe.lora.target_modules) if recipe.lora else ()
        untouched = {n: p for n, p in start.named_parameters() if not any(t in n for t in targets)}
        assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= set(untouched)
        exported = dict(model.named_parameters())
        changed = [n for n, p in untouched.items() if not torch.equal(exported[n], p)]
        assert not changed, f"frozen base weights changed in training: {changed[:5]}"
    else:
        assert (final / "adapter_config.json").is_file() and not (final / "config.json").exists()
        # Only adapter tensors: the base they apply to is the user's unchanged base model.
        from safetensors.torch import load_file

        saved = load_file(final / "adapter_model.safetensors")
        assert saved and all("lora_A" in n or "lora_B" in n for n in saved), sorted(saved)[:5]
        # It says the dtype it wrote: the adapter's own (tiny-cpu-lora trains in fp32).
        assert re.search(r"exported a LoRA adapter \(\d+ tensors, fp32\) to ", result.stdout), result.stdout[
            -2000:
        ]
