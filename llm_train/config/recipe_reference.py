"""The recipe reference (docs/recipe.md), written from the schema's own field descriptions.

Every field of the recipe schema (recipe.py and the modules it names) carries a description; this
renders them, with each key's type and default, as Markdown: `llm-train show --schema` prints it, and
docs/recipe.md is that output, committed. tests/unit/test_recipe_reference.py fails when the two differ, so a field added to
the schema without regenerating the page (the command is in the page's header) is caught in CI.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from llm_train.config.recipe import Recipe
from llm_train.config.section import Section
from llm_train.config.source_schema import SOURCE_CLASSES

REGENERATE = "llm-train show --schema > docs/recipe.md"

HEADER = f"""# Recipe reference

Every key a recipe (`recipes/*.yaml`, or any YAML path) may set, with its type, its default and what
it does. Generated from the schema's field descriptions (`llm_train/config/recipe.py` and the modules it
names); regenerate with `{REGENERATE}` after changing the schema (a test fails until this page matches it).

Any key can be overridden on the command line with its dotted name, anywhere among the options:
`optim.lr=1e-4`, `data.seq_len=4096`, `deepspeed.config=zero3_offload`. An unknown key, a wrong type
or an impossible combination is refused when the recipe loads, in one line that names the key and
the fix (exit code 2). "required" means the recipe must set it; "-" means the key is optional and
unset by default.
"""


def recipe_reference() -> str:
    """docs/recipe.md: the header, the top-level keys, then one table per section and per data format."""
    parts = [HEADER, "## Top level\n", _table(Recipe, "")]
    for name, field in Recipe.model_fields.items():
        section = _section_class(field.annotation)
        if section is not None:
            parts.append(f"## `{name}`\n")
            parts.append(_about(section, field))
            parts.append(_table(section, f"{name}."))
    parts.append("## Data sources (`data.train`, `data.eval`)\n")
    parts.append(
        "Each entry is a path (a text source read with `data.text_field`) or a mapping with `path` and "
        "`format`; the keys of each format:\n"
    )
    for fmt, source in SOURCE_CLASSES.items():
        parts.append(f"### `format: {fmt}`\n")
        parts.append(_about(source, None))
        parts.append(_table(source, "", skip={"format"}))  # the heading says it
    return "\n".join(parts)


def _about(section: type[BaseModel], field: FieldInfo | None) -> str:
    text = field.description if field is not None and field.description else ""
    doc = " ".join((section.__doc__ or "").split())
    lines = [line for line in (text, doc) if line]
    return "\n".join(lines) + "\n" if lines else ""


def _table(model: type[BaseModel], prefix: str, skip: set[str] | frozenset[str] = frozenset()) -> str:
    rows = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        if name in skip or _section_class(field.annotation) is not None:
            continue  # a section has its own table below
        cells = (f"`{prefix}{name}`", _type(field.annotation), _default(field), field.description or "")
        rows.append("| " + " | ".join(cell.replace("|", "\\|").replace("\n", " ") for cell in cells) + " |")
    return "\n".join(rows) + "\n"


def _section_class(annotation: Any) -> type[Section] | None:
    """The section class of a field (`Section` or `Section | None`), None for any other field."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, Section):
            return candidate
    return None


def _type(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " or ".join(f"`{value}`" for value in args)
    if origin in (typing.Union, types.UnionType):
        # SerializeAsAny[Source] is Annotated[Source, ...]: the type is its first argument.
        kept = [
            typing.get_args(arg)[0] if typing.get_origin(arg) is typing.Annotated else arg for arg in args
        ]
        kept = [arg for arg in kept if arg is not type(None)]
        if kept and all(isinstance(arg, type) and arg.__name__.endswith("Reward") for arg in kept):
            return "reward mapping (docs/rl.md)"
        if any(isinstance(arg, type) and issubclass(arg, BaseModel) for arg in kept):
            return "path or source mapping"
        return " or ".join(_type(arg) for arg in kept)
    if origin is list:
        return f"list of {_type(args[0])}"
    if origin is tuple:
        return "[" + ", ".join(_type(arg) for arg in args) + "]"
    if origin is dict:
        return "mapping"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    # The schema's factories take no arguments (pydantic also allows one that takes the validated data).
    value = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
    if value is None or value is PydanticUndefined:
        return "-"
    return f"`{json.dumps(value)}`"
