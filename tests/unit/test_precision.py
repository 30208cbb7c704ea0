"""Precision on cards without bf16: fp16 with dynamic loss scaling, in a JSON DeepSpeed itself accepts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config

from llm_train import DS_CONFIGS_DIR
from llm_train.config.resolution import resolve_run
from tests.devices import H100, T4

# DeepSpeed 0.19's own defaults for dynamic loss scaling (precision_config.DeepSpeedFP16Config).
DYNAMIC = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2}


@pytest.mark.parametrize("ds_config", ["zero1", "zero2", "zero3", "zero3_offload"])
def test_auto_precision_on_a_card_without_bf16_is_fp16_with_dynamic_loss_scaling(ds_config: str) -> None:
    run = resolve_run("7b-zero3", ["precision=auto"], world_size=8, device=T4, ds_config_path=ds_config)
    assert run.layout.precision == "fp16"
    assert run.notice and "fp16 with dynamic loss scaling" in run.notice
    fp16, bf16 = get_float16_config(run.ds_config), get_bfloat16_config(run.ds_config)
    assert fp16.enabled and not bf16.enabled
    # 0 = dynamic: the scale starts at 2^16, halves on overflow (that step is skipped) and grows back
    assert {k: getattr(fp16, k) for k in DYNAMIC} == DYNAMIC
    assert fp16.min_loss_scale >= 1


def test_a_json_without_an_fp16_section_still_gets_dynamic_scaling(tmp_path: Path) -> None:
    raw = json.loads((DS_CONFIGS_DIR / "zero2.json").read_text())
    del raw["fp16"]
    path = tmp_path / "no_fp16.json"
    path.write_text(json.dumps(raw))
    run = resolve_run("7b-zero3", ["precision=auto"], world_size=8, device=T4, ds_config_path=str(path))
    assert run.ds_config["fp16"] == {"enabled": True}  # written explicitly: Accelerate must agree
    assert get_float16_config(run.ds_config).loss_scale == 0


def test_bf16_cards_train_bf16_and_leave_fp16_off() -> None:
    run = resolve_run("7b-zero3", ["precision=auto"], world_size=8, device=H100)
    assert run.layout.precision == "bf16" and run.notice is None
    assert get_bfloat16_config(run.ds_config).enabled and not get_float16_config(run.ds_config).enabled


@pytest.mark.parametrize(
    ("capability", "bf16"), [((7, 0), False), ((7, 5), False), ((8, 0), True), ((8, 9), True), ((9, 0), True)]
)
def test_bf16_is_detected_from_the_compute_capability_not_emulation(capability: tuple, bf16: bool) -> None:
    # V100 (7.0), T4 / RTX 20xx (7.5) only emulate bf16: precision=auto must choose fp16 there.
    from llm_train.config.hardware import native_bf16

    assert native_bf16(capability) is bf16
