"""The objective registry: one row per objective in each half, and no string test of `objective` elsewhere.

config/objectives.py (torch-free: section, data family, references, metrics, layouts) and
runtime/loss/objective_losses.py (the loss each objective builds; GRPO's is built in runtime/rl/) must name the
same objectives as the schema's `Objective`; code outside the registry asks it instead of comparing strings.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

import llm_train
from llm_train.config.objective_sections import Objective
from llm_train.config.objectives import OBJECTIVES, objective_spec
from llm_train.config.recipe import load_recipe
from llm_train.config.source_schema import SOURCE_CLASSES
from llm_train.errors import UserError
from llm_train.runtime.loss.objective_losses import LOSSES
from llm_train.runtime.loss.preference_tuning import PREFERENCE_METRICS
from llm_train.runtime.loss.reward import REWARD_METRICS

PACKAGE = Path(llm_train.__file__).resolve().parent
REGISTRY = PACKAGE / "config" / "objectives.py"


def test_every_objective_has_a_row() -> None:
    """A name in the schema's Literal without a row (or a row the schema cannot spell) fails here."""
    assert set(OBJECTIVES) == set(get_args(Objective))
    for name, spec in OBJECTIVES.items():
        assert spec.name == name
        assert spec.references and set(spec.references) <= {"none", "cached", "live", "adapter-disabled"}
        assert "zero" in spec.layouts  # every objective trains under ZeRO data parallelism


def test_every_objective_has_a_loss() -> None:
    """The runtime half: a loss in LOSSES, or built in runtime/rl/ for an objective that generates."""
    assert set(LOSSES) <= set(OBJECTIVES)
    missing = [name for name, spec in OBJECTIVES.items() if not spec.generates and name not in LOSSES]
    assert not missing, f"objectives without a loss in runtime/loss/objective_losses.py LOSSES: {missing}"
    assert not [name for name in LOSSES if OBJECTIVES[name].generates]  # built once, in rl/


def test_data_families_match_the_formats() -> None:
    """Objectives of one data family are trained by the same formats (config/source_schema.py `objectives`), each
    objective by at least one, and two families share no format."""
    formats_of = {
        name: {fmt for fmt, cls in SOURCE_CLASSES.items() if name in cls.objectives} for name in OBJECTIVES
    }
    assert all(formats_of.values()), formats_of
    family_formats: dict[str, set[str]] = {}
    for name, spec in OBJECTIVES.items():
        assert family_formats.setdefault(spec.data, formats_of[name]) == formats_of[name], name
    families = list(family_formats.values())
    assert sum(len(f) for f in families) == len(set().union(*families))
    # The image-text SFT is lm on image rows (the registry's docstring says why), not an objective of its own.
    assert "image_chat" in formats_of["lm"]
    vlm = load_recipe("tiny-cpu-vlm")
    assert vlm.objective == "lm" and {s.format for s in vlm.data.sources("train")} == {"image_chat"}


def test_metrics_are_the_losses_names() -> None:
    """The table's metric names are the ones the preference and reward losses log."""
    assert objective_spec("dpo").metrics == PREFERENCE_METRICS
    assert objective_spec("simpo").metrics == PREFERENCE_METRICS
    assert objective_spec("reward").metrics == REWARD_METRICS


@pytest.mark.parametrize(
    ("recipe", "overrides", "reference"),
    [
        ("tiny-cpu", [], "none"),
        ("tiny-cpu-dpo", [], "cached"),
        ("tiny-cpu-dpo", ["preference.reference=live"], "live"),
        ("tiny-cpu-grpo", [], "none"),
        ("tiny-cpu-grpo", ["grpo.beta=0.04"], "live"),
    ],
)
def test_reference_of_a_recipe(recipe: str, overrides: list[str], reference: str) -> None:
    loaded = load_recipe(recipe, overrides)
    spec = objective_spec(loaded.objective)
    assert spec.reference_of(loaded) == reference
    assert reference in spec.references


def _string_tests_of_objective(tree: ast.AST) -> list[int]:
    """Lines comparing something named `objective` (a name or an attribute) with string constants."""

    def named_objective(node: ast.expr) -> bool:
        return (isinstance(node, ast.Name) and node.id == "objective") or (
            isinstance(node, ast.Attribute) and node.attr == "objective"
        )

    def strings(node: ast.expr) -> bool:
        if isinstance(node, ast.Constant):
            return isinstance(node.value, str)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return bool(node.elts) and all(strings(e) for e in node.elts)
        return False

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for left, right in zip(operands, operands[1:], strict=False):
                if (named_objective(left) and strings(right)) or (named_objective(right) and strings(left)):
                    lines.append(node.lineno)
    return lines


def test_the_scan_finds_a_string_test() -> None:
    """The scan below is not vacuous: each spelling the issue counted is found."""
    for source in (
        'recipe.objective == "grpo"',
        'objective != "reward"',
        'run.recipe.objective in ("dpo", "simpo")',
        '"lm" == self.objective',
    ):
        assert _string_tests_of_objective(ast.parse(source)) == [1], source
    assert not _string_tests_of_objective(ast.parse("objective_spec(recipe.objective).generates"))


def test_no_string_test_of_objective_outside_the_registry() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != REGISTRY
        for line in _string_tests_of_objective(ast.parse(path.read_text(), str(path)))
    ]
    assert not found, f"ask config/objectives.py objective_spec(...) instead of comparing strings: {found}"


def test_the_table_imports_no_torch() -> None:
    """config/ and planning/ ask the table without torch (a fresh interpreter: this one has torch already)."""
    code = "import sys, llm_train.config.objectives; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# A shipped tiny recipe of each objective (simpo: the DPO one with its objective switched).
TINY = {
    "lm": ("tiny-cpu", []),
    "dpo": ("tiny-cpu-dpo", []),
    "simpo": ("tiny-cpu-dpo", ["objective=simpo"]),
    "reward": ("tiny-cpu-reward", []),
    "grpo": ("tiny-cpu-grpo", []),
}


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_the_recipe_refuses_lora_where_the_table_does(name: str) -> None:
    """The row's `lora` layout and recipe.py's check agree (a row whose layouts lie fails here)."""
    assert set(TINY) == set(OBJECTIVES)  # a new objective needs its tiny recipe here
    recipe, overrides = TINY[name]
    assert load_recipe(recipe, overrides).objective == name
    if "lora" in objective_spec(name).layouts:
        assert load_recipe(recipe, [*overrides, "lora.rank=8"]).lora is not None
    else:
        with pytest.raises(UserError, match=f"lora: objective {name}"):
            load_recipe(recipe, [*overrides, "lora.rank=8"])
