"""Tensor / pipeline / data parallelism (config/parallel.py): the degrees; one line per refused layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llm_train.config.resolution import resolve_run
from llm_train.errors import UserError
from tests.devices import CPU, H100


def _ds(tmp_path: Path, stage: int, tp: int = 1) -> str:
    config: dict = {"zero_optimization": {"stage": stage}}
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    path = tmp_path / f"z{stage}_tp{tp}.json"
    path.write_text(json.dumps(config))
    return str(path)


def _one_line_error(*args, **kwargs) -> str:
    with pytest.raises(UserError) as caught:
        resolve_run(*args, **kwargs)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_pipeline_degree_comes_from_the_recipe() -> None:
    run = resolve_run("tiny-cpu-pp2", [], world_size=4, device=CPU)
    assert (run.layout.pp, run.layout.tp, run.layout.dp) == (2, 1, 2)
    # DeepSpeed's pipeline engine counts data-parallel ranks only: train_batch = micro x accum x dp.
    assert run.ds_config["train_batch_size"] == 8 * 2 * 2


def test_tensor_parallel_batch_counts_every_rank() -> None:
    run = resolve_run("tiny-cpu-tp2", ["optim.grad_accum=2"], world_size=4, device=CPU)
    assert (run.layout.tp, run.layout.dp, run.layout.global_batch_size) == (2, 2, 32)
    # Under AutoTP DeepSpeed asserts micro x accum x world (TP replicas included).
    assert run.ds_config["train_batch_size"] == 64
    assert run.ds_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


def test_world_not_divisible_shows_every_factor() -> None:
    message = _one_line_error("tiny-cpu-pp2", [], world_size=3, device=CPU)
    assert "world size 3 is not divisible by tensor parallel 1 x pipeline parallel 2 = 2" in message
    assert "data parallel x tensor parallel x pipeline parallel" in message


def test_tensor_times_pipeline_is_refused(tmp_path: Path) -> None:
    message = _one_line_error(
        "tiny-cpu-pp2", [], world_size=4, device=CPU, ds_config_path=_ds(tmp_path, 1, tp=2)
    )
    assert "world size 4 = dp 1 x tp 2 x pp 2" in message
    assert "cannot be combined with pipeline parallel" in message and "supported:" in message


@pytest.mark.parametrize("stage", [2, 3])
def test_pipeline_needs_zero_0_or_1(tmp_path: Path, stage: int) -> None:
    message = _one_line_error(
        "tiny-cpu-pp2", [], world_size=2, device=CPU, ds_config_path=_ds(tmp_path, stage)
    )
    assert (
        f"needs ZeRO stage 0 or 1, but {tmp_path}" in message
        and f"zero_optimization.stage={stage}" in message
    )


def test_pipeline_needs_a_layer_per_stage() -> None:
    message = _one_line_error("tiny-cpu-pp2", ["deepspeed.pipeline_stages=8"], world_size=8, device=CPU)
    assert "world size 8 = dp 1 x tp 1 x pp 8" in message
    assert "needs at least 8 decoder layers, the model has num_hidden_layers=4" in message


def test_pipeline_knows_only_llama_family() -> None:
    message = _one_line_error("tiny-cpu-pp2", ["model.config.model_type=gpt2"], world_size=2, device=CPU)
    assert "supports model types llama, mistral, qwen2" in message and "'gpt2'" in message


def test_pipeline_without_lora() -> None:
    message = _one_line_error("tiny-cpu-pp2", ["lora.rank=8"], world_size=2, device=CPU)
    assert "lora is not supported with deepspeed.pipeline_stages=2" in message


def test_tensor_parallel_must_divide_heads(tmp_path: Path) -> None:
    message = _one_line_error("tiny-cpu", [], world_size=3, device=CPU, ds_config_path=_ds(tmp_path, 1, tp=3))
    assert "tensor_parallel.autotp_size=3 must divide the attention heads" in message
    assert "num_attention_heads=4 and num_key_value_heads=4" in message


def test_tensor_parallel_must_divide_kv_heads(tmp_path: Path) -> None:
    message = _one_line_error(
        "tiny-cpu",
        ["model.config.num_key_value_heads=2"],
        world_size=4,
        device=CPU,
        ds_config_path=_ds(tmp_path, 1, tp=4),
    )
    assert "num_attention_heads=4 and num_key_value_heads=2" in message


def test_tensor_parallel_zero3_only_from_scratch(tmp_path: Path) -> None:
    ds = _ds(tmp_path, 3, tp=2)
    message = _one_line_error("7b-tp2-zero1", [], world_size=8, device=H100, ds_config_path=ds)
    assert "ZeRO-3 with tensor_parallel.autotp_size=2" in message and "zero1_tp" in message
    run = resolve_run("tiny-cpu", [], world_size=2, device=CPU, ds_config_path=ds)  # init: random trains
    assert (run.layout.tp, run.layout.zero_stage) == (2, 3)


def test_tensor_parallel_without_lora(tmp_path: Path) -> None:
    message = _one_line_error("tiny-cpu-tp2", ["lora.rank=8"], world_size=2, device=CPU)
    assert "lora is not supported with tensor_parallel.autotp_size=2" in message


@pytest.mark.parametrize(
    ("recipe", "world", "row"),
    [
        ("7b-tp2-zero1", 8, "8 = dp 4 x tp 2 x pp 1"),
        ("13b-pp2-zero1", 8, "8 = dp 4 x tp 1 x pp 2"),
        ("70b-pp8-zero1", 64, "64 = dp 8 x tp 1 x pp 8"),
        ("tiny-cpu-tp2", 2, "2 = dp 1 x tp 2 x pp 1"),
        ("tiny-cpu-pp2", 2, "2 = dp 1 x tp 1 x pp 2"),
    ],
)
def test_shipped_parallel_recipes_at_their_world_size(recipe: str, world: int, row: str) -> None:
    run = resolve_run(recipe, [], world_size=world)  # the hardware the recipe declares
    assert run.recipe.hardware.world_size == world
    assert dict(run.layout.rows())["world size"] == row


def test_entry_point_reports_one_line_and_exit_2() -> None:
    from tests.helpers import train_py

    result = train_py(["--recipe", "tiny-cpu-pp2", "--dry-run", "--ds-config", "zero3"], timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("llm-train: error:")]
    assert len(lines) == 1 and "deepspeed.pipeline_stages=2 needs ZeRO stage 0 or 1" in lines[0]


def test_tensor_parallel_checkpoints_are_told_by_their_model_shards(tmp_path: Path) -> None:
    from llm_train.config.parallel import tensor_parallel_shards

    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (tmp_path / name).touch()
    assert tensor_parallel_shards(tmp_path) == 1  # data parallel: one model file
    (tmp_path / "mp_rank_01_model_states.pt").touch()
    assert tensor_parallel_shards(tmp_path) == 2
    (tmp_path / "layer_00-model_states.pt").touch()  # a pipeline checkpoint: one model file per stage
    assert tensor_parallel_shards(tmp_path) == 1
