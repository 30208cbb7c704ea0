"""LoRA through PEFT: the recipe section, the wrap, the merged export (real runs: tests/e2e/test_lora.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llm_train.config.recipe import LoraSection, load_recipe
from llm_train.errors import UserError
from llm_train.planning.shapes import shape_from_config
from llm_train.runtime.lora import apply_lora, export_view, merged_state_dict, verify_adapter_export

pytest.importorskip("peft")

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


def test_unknown_target_module_is_one_line() -> None:
    with pytest.raises(
        UserError, match=r"lora.target_modules: query_key_value not in this model; its linear"
    ):
        apply_lora(tiny_model(), LoraSection(target_modules=["q_proj", "query_key_value"]))


def test_merged_export_equals_peft_merge() -> None:
    model = apply_lora(tiny_model(), LoraSection(rank=4, alpha=8, dropout=0.0))
    with torch.no_grad():  # B starts at zero; give the adapters something to merge
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    to_save, merged = export_view(model, state, LoraSection(rank=4, alpha=8))
    assert to_save is model.get_base_model()
    reference = model.merge_and_unload().state_dict()
    assert set(merged) == set(reference)
    for key, value in reference.items():
        torch.testing.assert_close(merged[key], value, rtol=0, atol=1e-6)
    assert not any("lora" in k or "base_layer" in k for k in merged)


def test_export_view_passes_through_without_lora_or_for_adapter_export() -> None:
    model = tiny_model()
    state = model.state_dict()
    assert export_view(model, state, None) == (model, state)
    peft_model = apply_lora(tiny_model(), LoraSection(rank=4))
    state = peft_model.state_dict()
    assert export_view(peft_model, state, LoraSection(rank=4, export="adapter")) == (peft_model, state)


def test_merge_refuses_a_state_dict_without_adapters() -> None:
    model = apply_lora(tiny_model(), LoraSection(rank=4))
    with pytest.raises(UserError, match="holds no adapter weights"):
        merged_state_dict(model, {"base_model.model.lm_head.weight": torch.zeros(2, 2)})


def test_verify_adapter_export(tmp_path: Path) -> None:
    model = apply_lora(tiny_model(), LoraSection(rank=4))
    model.save_pretrained(tmp_path)
    assert verify_adapter_export(tmp_path) == 2 * 7 * TINY["num_hidden_layers"]
    assert json.loads((tmp_path / "export_check.json").read_text())["adapter"] is True
