"""The recipe schema is strict: unknown keys, wrong types and impossible combinations are one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from llm_train import RECIPES_DIR
from llm_train.config.recipe import load_recipe
from llm_train.config.recipe_files import available_recipes, parse_override
from llm_train.errors import UserError


def test_every_shipped_recipe_loads() -> None:
    names = available_recipes()
    assert {"tiny-cpu", "1b-zero2", "7b-zero3", "7b-zero3-offload", "13b-zero3-offload", "70b-zero3"} <= set(
        names
    )
    for name in names:
        assert load_recipe(name).name == name


def test_every_shipped_recipe_has_a_header_with_hardware_and_launch() -> None:
    for path in Path(__file__).resolve().parents[2].joinpath("recipes").glob("*.yaml"):
        header = [line for line in path.read_text().splitlines() if line.startswith("#")]
        text = "\n".join(header).lower()
        assert "hardware" in text, path
        assert "launch" in text and "llm_train/train.py" in text, path


def test_overrides_use_the_recipes_own_names() -> None:
    recipe = load_recipe(
        "tiny-cpu", ["optim.lr=1e-4", "optim.betas=[0.8, 0.9]", "data.seq_len=64", "precision=bf16"]
    )
    assert recipe.optim.lr == pytest.approx(1e-4)
    assert recipe.optim.betas == (0.8, 0.9)
    assert recipe.data.seq_len == 64
    assert recipe.precision == "bf16"


def test_parse_override_types() -> None:
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a=null") == (["a"], None)
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["optim.lrr=1"], "unknown key 'optim.lrr'; did you mean 'lr'?"),
        (["optimizer.lr=1"], "unknown key 'optimizer'"),
        (["optim.lr=abc"], "optim.lr: Input should be a valid number"),
        (["optim.lr=-1"], "optim.lr: Input should be greater than 0"),
        (["precision=fp8"], "precision: Input should be 'bf16', 'fp16', 'fp32' or 'auto'"),
        (["optim.min_lr_ratio=2"], "optim.min_lr_ratio: Input should be less than or equal to 1"),
        (["memory.attention=flash_attention_2"], "flash_attention_2 needs a CUDA GPU"),
        (["optim.max_steps=null"], "set optim.max_steps or optim.epochs"),
        (["lr=3"], "unknown key 'lr'"),
        (["optim.lr"], "is not key.sub=value"),
        (["optim.lr.x=1"], "optim.lr is a value, not a section"),
        (["model.config.hub_token=hf_x"], "model.config.hub_token looks like a credential"),
    ],
)
def test_bad_overrides_are_one_line_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(UserError) as info:
        load_recipe("tiny-cpu", overrides)
    text = str(info.value)
    assert message in text
    assert "\n" not in text


def test_unknown_recipe_lists_the_available_ones() -> None:
    with pytest.raises(UserError) as info:
        load_recipe("tiny-cpuu")
    assert "unknown recipe 'tiny-cpuu' (did you mean 'tiny-cpu'?)" in str(info.value)
    assert "7b-zero3" in str(info.value)


def test_recipe_file_with_unknown_section(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text((RECIPES_DIR / "tiny-cpu.yaml").read_text() + "\nschedular: {}\n")
    with pytest.raises(UserError, match="unknown key 'schedular'"):
        load_recipe(str(path))


def test_recipe_file_not_yaml(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("model: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_recipe(str(path))


def test_relative_paths_in_a_recipe_are_relative_to_its_file() -> None:
    recipe = load_recipe("tiny-cpu")
    assert Path(recipe.data.train[0]).is_file()
    assert Path(recipe.model.tokenizer or "").is_dir()


def test_scientific_numbers_are_floats_in_recipes_and_overrides(tmp_path) -> None:
    """PyYAML reads `1e-5` as a string (YAML 1.1); model.config hands values to transformers unchanged."""
    from llm_train.config.recipe import load_recipe
    from llm_train.config.recipe_files import parse_override

    assert parse_override("model.config.rms_norm_eps=1e-5") == (["model", "config", "rms_norm_eps"], 1e-5)
    assert (
        parse_override("optim.lr=2E-4")[1] == 2e-4 and parse_override("tracking.run_name=1e5x")[1] == "1e5x"
    )
    recipe = load_recipe("tiny-cpu", ["model.config.rms_norm_eps=1e-6"])
    assert recipe.model.config["rms_norm_eps"] == 1e-6
