"""DeepSpeed JSONs: every "auto" is resolved from the recipe; typos and contradictions are errors."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from llm_train import DS_CONFIGS_DIR
from llm_train.config.ds_json import RecipeValues, fill_autos, load_ds_config, offload_device
from llm_train.config.resolution import resolve_run
from llm_train.errors import UserError
from tests.devices import CPU

VALUES = RecipeValues(
    micro_batch_size=4,
    grad_accum=2,
    global_batch_size=64,
    grad_clip=0.5,
    precision="bf16",
    hidden_size=1024,
    lr=2e-4,
    betas=(0.9, 0.95),
    eps=1e-8,
    weight_decay=0.1,
    warmup_steps=10,
    max_steps=100,
)


def _autos(node: object) -> int:
    if isinstance(node, dict):
        return sum(_autos(v) for v in node.values())
    if isinstance(node, list):
        return sum(_autos(v) for v in node)
    return int(node == "auto")


@pytest.mark.parametrize("name", sorted(p.stem for p in DS_CONFIGS_DIR.glob("*.json")))
def test_shipped_configs_resolve_without_auto(name: str) -> None:
    _, raw = load_ds_config(name)
    # The NVMe directory is the user's (deepspeed.nvme_path); configs without nvme refuse one.
    on_nvme = "nvme" in (offload_device(raw, "optimizer"), offload_device(raw, "param"))
    resolved = fill_autos(raw, replace(VALUES, nvme_path="/mnt/nvme") if on_nvme else VALUES, name)
    assert _autos(resolved) == 0
    assert resolved["train_micro_batch_size_per_gpu"] == 4
    assert resolved["gradient_accumulation_steps"] == 2
    assert resolved["train_batch_size"] == 64
    assert resolved["gradient_clipping"] == 0.5  # always explicit: DeepSpeed defaults to 1.0
    assert resolved["bf16"]["enabled"] is True and resolved["fp16"]["enabled"] is False
    if resolved["zero_optimization"]["stage"] == 3:
        zero = resolved["zero_optimization"]
        assert zero["reduce_bucket_size"] == 1024 * 1024
        assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 1024 * 1024)
        assert zero["stage3_param_persistence_threshold"] == 10 * 1024
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True


def test_config_written_for_the_hf_trainer_resolves() -> None:
    foreign = {
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
        "zero_optimization": {"stage": 2},
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
    }
    resolved = fill_autos(foreign, VALUES, "hf.json")
    assert resolved["optimizer"]["params"] == {
        "lr": 2e-4,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.1,
    }
    assert resolved["scheduler"]["params"]["total_num_steps"] == 100
    assert resolved["scheduler"]["params"]["warmup_num_steps"] == 10
    assert resolved["gradient_clipping"] == 0.5


def test_explicit_value_that_contradicts_the_recipe_is_an_error() -> None:
    with pytest.raises(
        UserError, match=r"train_micro_batch_size_per_gpu=8 contradicts optim.micro_batch_size"
    ):
        fill_autos({"train_micro_batch_size_per_gpu": 8}, VALUES, "x.json")


def test_unresolvable_auto_is_an_error() -> None:
    with pytest.raises(UserError, match=r"\"auto\" at zero_optimization.sub_group_size"):
        fill_autos({"zero_optimization": {"stage": 3, "sub_group_size": "auto"}}, VALUES, "x.json")


def test_misspelled_top_level_key(tmp_path: Path) -> None:
    path = tmp_path / "typo.json"
    path.write_text(json.dumps({"zero_optimisation": {"stage": 3}}))
    with pytest.raises(
        UserError, match="unknown top-level key 'zero_optimisation'.*did you mean 'zero_optimization'"
    ):
        load_ds_config(str(path))


def test_missing_and_unparsable_files(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="file not found"):
        load_ds_config(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 3,}}')
    with pytest.raises(UserError, match="not valid JSON at line 1 column"):
        load_ds_config(str(bad))
    with pytest.raises(UserError, match="unknown DeepSpeed config 'zero9'"):
        load_ds_config("zero9")


def test_recipe_precision_and_json_precision_agree() -> None:
    run = resolve_run("tiny-cpu", ["precision=auto"], world_size=2, device=CPU)
    assert run.layout.precision == "fp32" and run.ds_config["bf16"]["enabled"] is False
    run = resolve_run("tiny-cpu", ["precision=bf16"], world_size=2, device=CPU)
    assert run.layout.precision == "bf16" and run.ds_config["bf16"]["enabled"] is True


@pytest.mark.parametrize("ds", ["zero2_offload", "zero3_offload", "zero3_offload_optimizer"])
def test_our_cpu_adam_is_not_swapped_for_accelerates_copy(ds: str) -> None:
    """Accelerate's copy keeps only lr and weight_decay (Adam+L2, betas 0.9/0.999) and orphans the LR schedule."""
    run = resolve_run("tiny-cpu", [], world_size=2, device=CPU, ds_config_path=ds)
    assert run.ds_config["zero_force_ds_cpu_optimizer"] is False
    plain = resolve_run("tiny-cpu", [], world_size=2, device=CPU, ds_config_path="zero2")
    assert "zero_force_ds_cpu_optimizer" not in plain.ds_config
