"""LoRA through PEFT: the recipe section, the wrap, the merged export (real runs: tests/e2e/test_lora.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llm_train.config.recipe import load_recipe
from llm_train.config.recipe_sections import LoraSection
from llm_train.errors import UserError
from llm_train.planning.memory.offload_buffers import trainable_tensors
from llm_train.planning.model.shapes import shape_from_config
from llm_train.runtime.model.lora import apply_lora, verify_adapter_export
from tests.optional import import_or_skip

import_or_skip("peft")

TINY = dict(load_recipe("tiny-cpu").model.config)


def tiny_model() -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    fields = dict(TINY)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    return AutoModelForCausalLM.from_config(config)


def test_recipe_section_defaults_and_overrides() -> None:
    assert load_recipe("tiny-cpu").lora is None
    recipe = load_recipe("tiny-cpu", ["lora.rank=4"])
    assert recipe.lora == LoraSection(rank=4)
    assert recipe.lora.target_modules[-1] == "down_proj" and recipe.lora.export == "merged"
    assert load_recipe("tiny-cpu-lora", ["lora=null"]).lora is None
    with pytest.raises(UserError, match=r"unknown key 'lora.rnak'; did you mean 'rank'\?"):
        load_recipe("tiny-cpu-lora", ["lora.rnak=4"])
    with pytest.raises(UserError, match=r"lora.export: Input should be 'merged' or 'adapter'"):
        load_recipe("tiny-cpu-lora", ["lora.export=both"])


def test_apply_lora_trains_only_the_adapters_the_estimator_counts() -> None:
    model = apply_lora(tiny_model(), LoraSection(rank=8, alpha=16, dropout=0.0))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # The estimator's count of adapter parameters (all seven projections) is exact.
    assert trainable == shape_from_config(TINY).lora_params(8)
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize(
    "targets", [("q_proj", "v_proj"), ("down_proj", "o_proj", "k_proj"), ("gate_proj", "lm_head")]
)
def test_the_planners_adapter_tensors_are_the_wrapped_models_for_any_target_modules(
    targets: tuple[str, ...],
) -> None:
    # The tensors the host-offload buffers and the speed and checkpoint lines count, in the order
    # the model registers them, against PEFT's own wrap of the recipe's model.
    model = apply_lora(tiny_model(), LoraSection(rank=8, target_modules=list(targets)))
    numels = [p.numel() for p in model.parameters() if p.requires_grad]
    shape = shape_from_config(TINY)
    assert trainable_tensors(shape, 8, targets) == (numels, [])
    assert sum(numels) == shape.lora_params(8, targets) < shape.lora_params(8)


def test_unknown_target_module_is_one_line() -> None:
    with pytest.raises(
        UserError, match=r"lora.target_modules: query_key_value not in this model; its linear"
    ):
        apply_lora(tiny_model(), LoraSection(target_modules=["q_proj", "query_key_value"]))


def test_verify_adapter_export(tmp_path: Path) -> None:
    model = apply_lora(tiny_model(), LoraSection(rank=4))
    model.save_pretrained(tmp_path)
    # The dtype read back from the file: what the adapter was written in (fp32 here; a bf16 run's is bf16).
    assert verify_adapter_export(tmp_path) == (2 * 7 * TINY["num_hidden_layers"], "fp32")
    check = json.loads((tmp_path / "export_check.json").read_text())
    assert check["adapter"] is True and check["dtype"] == "fp32"
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert verify_adapter_export(tmp_path / "bf16")[1] == "bf16"
