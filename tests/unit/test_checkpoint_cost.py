"""The checkpoint's size and times that --dry-run and `plan` print (planning/speed/checkpoint_cost.py).

Sizes against checkpoints DeepSpeed 0.19.8 wrote here (tiny-cpu, 1,901,696 parameters, 2 ranks,
fp32, step 2, 2026-12-01): ZeRO-2 wrote mp_rank_00_model_states.pt of 7,619,749 bytes and two
optimizer files of 11,417,023; ZeRO-3 two optimizer files of 11,414,419 and two model files of
21,409. The pickles add headers and per-tensor records, well under 1%.
"""

from __future__ import annotations

import pytest

from llm_train.config.layout import Layout
from llm_train.config.recipe import load_recipe
from llm_train.planning.model.shapes import shape_from_config
from llm_train.planning.speed.checkpoint_cost import checkpoint_cost
from llm_train.train import main as train_main

TINY_PARAMS = 1_901_696


def _tiny_shape():
    recipe = load_recipe("tiny-cpu")
    shape = shape_from_config(dict(recipe.model.config))
    assert shape.num_params == TINY_PARAMS
    return shape


@pytest.mark.parametrize(
    ("stage", "measured_total", "measured_largest"),
    [
        (2, 7_619_749 + 2 * 11_417_023, 7_619_749 + 11_417_023),
        (3, 2 * (11_414_419 + 21_409), 11_414_419 + 21_409),
    ],
)
def test_sizes_match_what_deepspeed_wrote(stage: int, measured_total: int, measured_largest: int) -> None:
    cost = checkpoint_cost(_tiny_shape(), Layout(world_size=2, zero_stage=stage, precision="fp32"))
    assert cost.total_bytes == pytest.approx(measured_total, rel=0.01)
    assert cost.largest_write_bytes == pytest.approx(measured_largest, rel=0.01)


def test_70b_on_32_ranks_splits_the_work_and_converts_only_where_it_can() -> None:
    shape = shape_from_config({"model_type": "llama", **_llama_70b()})
    cost = checkpoint_cost(shape, Layout(world_size=32, zero_stage=3, precision="bf16"))
    assert cost.total_bytes == pytest.approx(12 * shape.num_params)  # no 16-bit copy under ZeRO-3
    assert cost.largest_write_bytes == pytest.approx(cost.total_bytes / 32)
    assert cost.verify_s < 60 < cost.convert_s  # hashing split 32 ways; one node converts it all
    pipeline = checkpoint_cost(shape, Layout(world_size=32, zero_stage=1, pp=8, precision="bf16"))
    zero0 = checkpoint_cost(shape, Layout(world_size=32, zero_stage=0, precision="bf16"))
    assert pipeline.convert_s is None and zero0.convert_s is None  # resumes refused / loaded as they are
    assert "no conversion" in pipeline.line(30)


def test_a_single_rank_write_near_the_timeout_is_a_warning_naming_the_key() -> None:
    shape = shape_from_config({"model_type": "llama", **_llama_70b()})
    cost = checkpoint_cost(
        shape, Layout(world_size=8, zero_stage=2, precision="bf16")
    )  # rank 0: the 16-bit model
    assert cost.timeout_problem(30) is None
    problem = cost.timeout_problem(1)
    assert problem is not None and "deepspeed.timeout_minutes=1" in problem and "ZeRO-3" in problem


def test_the_dry_run_prints_the_checkpoint_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert train_main(["--recipe", "70b-zero3", "--dry-run", "deepspeed.timeout_minutes=45"]) == 0
    out = capsys.readouterr().out
    section = out.split("# checkpoints")[1].splitlines()[1]
    assert (
        "GiB per save" in section
        and "verify on resume" in section
        and "process-group timeout 45 min" in section
    )


def _llama_70b() -> dict[str, int]:
    from llm_train.config.known_models import KNOWN_CONFIGS

    fields = dict(KNOWN_CONFIGS["meta-llama/Llama-3.1-70B"])
    fields.pop("model_type", None)
    return fields
