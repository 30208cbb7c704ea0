"""GRPO's loss types are one list: config/objective_sections.py `LossType` (what `grpo.loss_type` admits) and
runtime/loss/grpo.py `LOSS_TYPES` (each one's per-token term and reduction) name the same loss types, in the same
order; each is compared with TRL by test_grpo_loss.py and has its row in docs/rl.md. These checks fail while a
half is missing (docs/development.md, "Adding a loss type").
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from typing import get_args

import pytest

import llm_train.runtime.loss.grpo as grpo_loss
from llm_train.config.objective_sections import GrpoSection, LossType
from llm_train.config.recipe import load_recipe
from llm_train.errors import UserError
from llm_train.runtime.loss.grpo import LOSS_TYPES

REPO = Path(__file__).resolve().parents[2]
NAMES = get_args(LossType)


def test_every_name_has_its_loss_functions_and_the_schema_admits_exactly_the_list() -> None:
    assert tuple(LOSS_TYPES) == NAMES
    assert get_args(GrpoSection.model_fields["loss_type"].annotation) == NAMES
    for name in NAMES:
        assert GrpoSection(loss_type=name).loss_type == name


def _signature(function: object) -> tuple[str, ...]:
    return tuple(inspect.signature(function).parameters)  # type: ignore[arg-type]


def test_every_loss_function_has_its_name() -> None:
    """A per-token term or a reduction written in runtime/loss/grpo.py but reachable from no loss type fails here
    (found by its parameters: the table's `Term` and `Reduce`)."""
    rows = list(LOSS_TYPES.values())
    term, reduce = _signature(rows[0].term), _signature(rows[0].reduce)
    written = {
        name
        for name, function in vars(grpo_loss).items()
        if inspect.isfunction(function)
        and function.__module__ == grpo_loss.__name__
        and _signature(function) in (term, reduce)
    }
    listed = {row.term.__name__ for row in rows} | {row.reduce.__name__ for row in rows}
    assert all(_signature(row.term) == term and _signature(row.reduce) == reduce for row in rows)
    assert written == listed, f"loss functions no loss type uses: {sorted(written - listed)}"


def test_an_unknown_loss_type_is_one_line_naming_the_key_and_every_allowed_value() -> None:
    with pytest.raises(UserError) as excinfo:
        load_recipe("tiny-cpu-grpo", ["grpo.loss_type=ppo"])
    quoted = [f"'{name}'" for name in NAMES]
    allowed = f"{', '.join(quoted[:-1])} or {quoted[-1]}"
    assert str(excinfo.value) == (
        f"recipe tiny-cpu-grpo.yaml (with overrides): grpo.loss_type: Input should be {allowed} (got 'ppo')"
    )


def _loss_types_in(assignment: str, tree: ast.Module) -> set[str]:
    values = next(
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == assignment for t in node.targets)
    )
    return {n.value for n in ast.walk(values) if isinstance(n, ast.Constant) and n.value in NAMES}


def test_every_loss_type_is_compared_with_trl() -> None:
    """test_grpo_loss.py's parameter lists (read, not imported: importing it imports TRL) name every loss type."""
    tree = ast.parse((REPO / "tests" / "unit" / "test_grpo_loss.py").read_text())
    assert _loss_types_in("CASES", tree) | _loss_types_in("NEW_CASES", tree) == set(NAMES)


def test_the_docs_and_the_schema_describe_every_loss_type() -> None:
    table = (REPO / "docs" / "rl.md").read_text().split("| loss_type | reduction |", 1)[1].split("\n\n", 1)[0]
    assert sorted(re.findall(r"^\| `(\w+)`", table, re.MULTILINE)) == sorted(NAMES)
    description = GrpoSection.model_fields["loss_type"].description or ""
    assert sorted(re.findall(r"(\w+) \(", description.split(": ", 1)[1])) == sorted(NAMES)
