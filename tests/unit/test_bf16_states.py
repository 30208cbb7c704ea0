"""optim.state_dtype=bf16: the DeepSpeed JSON it resolves to, the CPU Adam it builds, and every refusal.

DeepSpeed 0.19.8 keeps bf16 master weights and Adam states only on the ZeRO-Offload path with
its CPU Adam built with fp32_optimizer_states=False (runtime/base_optimizer.py
_configure_master_weights); anything else asserts deep inside engine init, so each such
combination must be one line naming optim.state_dtype before a worker starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llm_train import train
from llm_train.config.layout import state_dtype_problem
from llm_train.config.recipe_sections import OptimSection
from llm_train.errors import UserError
from llm_train.runtime.model.optim import build_optimizer
from tests.devices import resolve

BF16_STATES = ["precision=bf16", "optim.state_dtype=bf16"]


@pytest.mark.parametrize("ds", ["zero2_offload", "zero3_offload", "zero3_offload_optimizer"])
def test_bf16_states_turn_on_both_deepspeed_switches_and_keep_our_cpu_adam(ds: str) -> None:
    run = resolve("tiny-cpu", BF16_STATES, ds=ds)
    bf16 = run.ds_config["bf16"]
    assert bf16 == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    assert run.ds_config["zero_force_ds_cpu_optimizer"] is False  # our CPU Adam, built with bf16 moments


def test_fp32_states_leave_the_deepspeed_json_as_it_was() -> None:
    bf16 = resolve("tiny-cpu", ["precision=bf16"], ds="zero2_offload")
    assert bf16.recipe.optim.state_dtype == "fp32"  # the default
    assert bf16.ds_config["bf16"] == {"enabled": True}


def test_a_json_that_contradicts_state_dtype_names_the_recipe_key(tmp_path: Path) -> None:
    config = json.loads(
        (Path(train.__file__).parent.parent / "ds_configs" / "zero2_offload.json").read_text()
    )
    config["bf16"]["bf16_optimizer_states"] = True
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"bf16\.bf16_optimizer_states=true contradicts optim\.state_dtype"):
        resolve("tiny-cpu", ["precision=bf16"], ds=str(path))
    config["bf16"]["bf16_master_weights_and_grads"] = "auto"  # "auto" is filled from the recipe
    config["bf16"]["bf16_optimizer_states"] = "auto"
    path.write_text(json.dumps(config))
    assert (
        resolve("tiny-cpu", BF16_STATES, ds=str(path)).ds_config["bf16"]["bf16_master_weights_and_grads"]
        is True
    )


def _zero1_offload(tmp_path: Path) -> str:
    config = json.loads((Path(train.__file__).parent.parent / "ds_configs" / "zero1.json").read_text())
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    path = tmp_path / "zero1_offload.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(
    "overrides, ds, message",
    [
        (
            ["optim.state_dtype=bf16", "precision=fp32"],
            "zero2_offload",
            "needs precision=bf16, but the run trains in fp32",
        ),
        (BF16_STATES, "zero2", "needs the optimizer offloaded to CPU"),
        (BF16_STATES, "zero3", "needs the optimizer offloaded to CPU"),
        (
            BF16_STATES + ["deepspeed.nvme_path=/tmp"],
            "zero3_offload_nvme",
            "offload_optimizer.device=cpu only",
        ),
    ],
)
def test_combinations_deepspeed_would_assert_on_are_one_line_naming_state_dtype(
    overrides: list[str], ds: str, message: str
) -> None:
    with pytest.raises(UserError) as caught:
        resolve("tiny-cpu", overrides, ds=ds)
    text = str(caught.value)
    assert "\n" not in text and text.startswith("optim.state_dtype=bf16 ") and message in text, text
    assert "optim.state_dtype=fp32" in text  # the way out is always named


def test_pipeline_parallel_with_bf16_states_is_refused(tmp_path: Path) -> None:
    with pytest.raises(
        UserError, match=r"optim.state_dtype=bf16 is not supported with deepspeed.pipeline_stages=2"
    ):
        resolve("tiny-cpu-pp2", BF16_STATES, ds=_zero1_offload(tmp_path))


def test_the_rule_itself_lists_what_deepspeed_accepts() -> None:
    assert state_dtype_problem("fp32", "fp16", "none", pp=4) is None  # fp32 states: nothing to check
    assert state_dtype_problem("bf16", "bf16", "cpu", pp=1) is None
    assert state_dtype_problem("bf16", "fp16", "cpu", pp=1) == "state_precision"
    assert state_dtype_problem("bf16", "bf16", "none", pp=1) == "state_offload"
    assert state_dtype_problem("bf16", "bf16", "nvme", pp=1) == "state_nvme"
    assert state_dtype_problem("bf16", "bf16", "cpu", pp=2) == "state_pipeline"
    assert state_dtype_problem("bf16", "fp32", "none", pp=2) == "state_pipeline"  # the engine is named first


def test_a_refused_run_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    # tiny-cpu declares a CPU and ZeRO-3 without offload: the dry run already refuses.
    assert train.main(["--recipe", "tiny-cpu", "--dry-run", *BF16_STATES]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("llm-train: error: optim.state_dtype=bf16 needs the optimizer offloaded")
        and "\n" not in err
    )


@pytest.mark.parametrize("state_dtype, moment_dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_cpu_adam_keeps_its_moments_in_the_state_dtype(state_dtype: str, moment_dtype: torch.dtype) -> None:
    """DeepSpeed asserts fp32_optimizer_states=False for bf16 states; the moments then follow the bf16 weights."""
    layer = torch.nn.Linear(8, 8).to(torch.bfloat16)
    optim = OptimSection(lr=1e-3, max_steps=1, state_dtype=state_dtype)
    optimizer = build_optimizer(layer, optim, offload_optimizer="cpu")
    assert optimizer.fp32_optimizer_states is (state_dtype == "fp32")
    layer(torch.ones(2, 8, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    state = optimizer.state[layer.weight]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == moment_dtype
