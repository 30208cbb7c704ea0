"""The run's layout (config/layout.py): world-size arithmetic and precision choices, each failure one line."""

from __future__ import annotations

import pytest

from llm_train.config.layout import choose_precision
from llm_train.config.resolution import resolve_run
from llm_train.errors import UserError
from tests.devices import CPU, H100, T4


def test_auto_precision() -> None:
    assert choose_precision("auto", None, H100) == ("bf16", None)
    assert choose_precision("auto", None, CPU) == ("fp32", None)
    precision, notice = choose_precision("auto", None, T4)
    assert precision == "fp16" and "Tesla T4 has no bf16" in (notice or "")
    assert choose_precision("auto", "fp16", H100) == ("fp16", None)  # the JSON said so explicitly


def test_bf16_on_a_card_without_it_is_an_error() -> None:
    with pytest.raises(
        UserError, match=r"precision=bf16 but Tesla T4 \(compute capability 7.5\) has no bf16"
    ):
        choose_precision("bf16", None, T4)


def test_batch_arithmetic() -> None:
    run = resolve_run(
        "tiny-cpu", ["optim.global_batch_size=64", "optim.grad_accum=null"], world_size=2, device=CPU
    )
    assert (run.layout.micro_batch_size, run.layout.grad_accum, run.layout.dp) == (8, 4, 2)
    assert run.ds_config["train_batch_size"] == 64 and run.ds_config["gradient_accumulation_steps"] == 4


def test_batch_that_does_not_divide() -> None:
    with pytest.raises(
        UserError,
        match=r"global_batch_size=60 is not divisible by optim.micro_batch_size=8 x data-parallel size 2 = 16",
    ):
        resolve_run(
            "tiny-cpu", ["optim.global_batch_size=60", "optim.grad_accum=null"], world_size=2, device=CPU
        )


def test_global_batch_and_accum_that_disagree() -> None:
    with pytest.raises(
        UserError,
        match=r"global_batch_size=64 != optim.micro_batch_size=8 x optim.grad_accum=1 x data-parallel size 2 = 16",
    ):
        resolve_run("tiny-cpu", ["optim.global_batch_size=64"], world_size=2, device=CPU)


def test_world_not_divisible_by_tp(tmp_path) -> None:
    import json

    path = tmp_path / "tp.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2}}))
    with pytest.raises(
        UserError, match="world size 3 is not divisible by tensor parallel 2 x pipeline parallel 1 = 2"
    ):
        resolve_run("tiny-cpu", [], world_size=3, device=CPU, ds_config_path=str(path))


def test_param_offload_needs_stage3(tmp_path) -> None:
    import json

    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}))
    with pytest.raises(UserError, match="parameter offload needs zero_optimization.stage=3"):
        resolve_run("tiny-cpu", [], world_size=2, device=CPU, ds_config_path=str(path))


@pytest.mark.parametrize(
    ("fields", "rule"),
    [
        ({"world_size": 6, "tp": 4}, "degrees"),
        ({"world_size": 0}, "positive"),
        ({"world_size": 2, "grad_accum": 0}, "positive"),
        ({"world_size": 2, "zero_stage": 4}, "zero_stage"),
        ({"world_size": 2, "offload_params": "disk"}, "offload_device"),
        ({"world_size": 2, "zero_stage": 2, "offload_params": "cpu"}, "params"),
        ({"world_size": 2, "offload_optimizer": "cpu"}, "optimizer"),
        ({"world_size": 2, "zero_stage": 2, "offload_optimizer": "nvme"}, "nvme_optimizer"),
        ({"world_size": 4, "pp": 2, "zero_stage": 2}, "pipeline_zero"),
        ({"world_size": 2, "precision": "fp8"}, "precision"),
    ],
)
def test_every_layout_rule_is_checked_when_a_layout_is_made(fields: dict, rule: str) -> None:
    from llm_train.config.layout import Layout, LayoutError

    with pytest.raises(LayoutError) as info:
        Layout(**fields)
    assert info.value.rule == rule and "\n" not in str(info.value)


def test_a_layout_knows_its_data_parallel_size_and_global_batch_and_varies_under_the_same_rules() -> None:
    from llm_train.config.layout import Layout, LayoutError

    layout = Layout(world_size=16, tp=2, pp=2, zero_stage=1, micro_batch_size=2, grad_accum=4)
    assert (layout.dp, layout.global_batch_size) == (4, 2 * 4 * 4)
    assert layout.vary(zero_stage=0).zero_stage == 0
    with pytest.raises(LayoutError, match="pipeline"):
        layout.vary(zero_stage=3)


def test_no_loader_workers_fork_next_to_an_offloaded_optimizer_unless_asked() -> None:
    from llm_train.config.layout import workers_for

    assert workers_for(None, optimizer_offloaded=True) == 0
    assert workers_for(None, optimizer_offloaded=False) is None  # the stream's default (2 on CUDA)
    assert workers_for(3, optimizer_offloaded=True) == 3
