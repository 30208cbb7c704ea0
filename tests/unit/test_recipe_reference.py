"""docs/recipe.md is the schema's own reference: generated from the field descriptions, and current.

A field added to (or changed in) llm_train/config/recipe.py changes `llm-train show --schema`; this
test then fails until docs/recipe.md is regenerated with the command its header names.
"""

from __future__ import annotations

import pytest

from llm_train import cli
from llm_train.config.recipe import Recipe
from llm_train.config.recipe_reference import REGENERATE, recipe_reference
from llm_train.config.section import Section
from llm_train.config.source_schema import SOURCE_CLASSES
from tests.helpers import REPO

PAGE = REPO / "docs" / "recipe.md"


def schema_keys(model: type[Section] = Recipe, prefix: str = "") -> list[str]:
    """Every leaf key of the schema as the reference names it (`optim.lr`, `memory.tiled_loss`, ...)."""
    keys = []
    for name, field in model.model_fields.items():
        section = next(
            (t for t in (field.annotation, *getattr(field.annotation, "__args__", ())) if _is_section(t)),
            None,
        )
        keys += schema_keys(section, f"{prefix}{name}.") if section else [f"{prefix}{name}"]
    return keys


def _is_section(annotation: object) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, Section)


def test_docs_recipe_md_matches_the_schema() -> None:
    assert PAGE.read_text() == recipe_reference(), f"docs/recipe.md is stale; regenerate it: {REGENERATE}"


def test_every_key_of_the_schema_is_in_the_reference_with_its_description() -> None:
    page = recipe_reference()
    keys = schema_keys()
    assert {"optim.lr", "memory.tiled_loss", "deepspeed.nvme_path", "lora.rank", "checkpoint.grace_s"} <= set(
        keys
    )
    for key in keys:
        assert f"| `{key}` |" in page, key
    for fmt, source in SOURCE_CLASSES.items():
        assert f"### `format: {fmt}`" in page
        for name, field in source.model_fields.items():
            if name != "format":
                described = (field.description or "").replace("|", "\\|")
                assert f"| `{name}` |" in page and described in page, (fmt, name)


def test_show_schema_prints_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["show", "--schema"]) == 0
    assert capsys.readouterr().out == recipe_reference()
    assert cli.main(["show", "--schema", "tiny-cpu"]) == 2
    assert "takes no recipe" in capsys.readouterr().err
