"""Recipe files as mappings: finding one, reading its YAML, `key.sub=value` overrides, anchoring its paths.

Everything before validation (recipe.py validates the mapping into a `Recipe`): a recipe name or path
-> a file; YAML as users write numbers; overrides with the recipe's own names; relative paths taken
from the file's folder (or, in overrides, the working directory) so a recipe works from anywhere; and
a pydantic error turned into one line that names the key and the fix.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from llm_train import RECIPES_DIR
from llm_train.errors import UserError


def available_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def find_recipe(name_or_path: str) -> Path:
    """A recipe name from recipes/ or a path to a YAML file."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise UserError(f"--recipe {name_or_path}: file not found")
        return path
    candidate = RECIPES_DIR / f"{name_or_path}.yaml"
    if candidate.is_file():
        return candidate
    names = available_recipes()
    close = difflib.get_close_matches(name_or_path, names, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise UserError(
        f"unknown recipe '{name_or_path}'{hint}; available: {', '.join(names)}; or pass a path to a YAML file"
    )


class _Loader(yaml.SafeLoader):
    """YAML as users write numbers: `1e-5` is a float (PyYAML follows YAML 1.1, where it is a string).

    Typed fields coerce strings anyway, but `model.config` passes values straight to
    transformers, whose configs refuse a string epsilon.
    """


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)


def parse_override(text: str) -> tuple[list[str], Any]:
    """'optim.lr=3e-4' -> (['optim', 'lr'], 3e-4). Values are parsed as YAML (numbers, lists, null)."""
    if "=" not in text:
        raise UserError(f"override '{text}' is not key.sub=value (e.g. optim.lr=3e-4)")
    key, _, raw = text.partition("=")
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise UserError(f"override '{text}' has an empty key")
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def _apply_override(data: dict[str, Any], parts: list[str], value: Any, text: str) -> None:
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise UserError(f"override '{text}': {'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


# Fields that hold paths; relative paths in a YAML file are taken relative to that file
# (so recipes work from any working directory), those from overrides relative to the cwd.
_PATH_FIELDS = (("model", "tokenizer"), ("model", "name_or_path"), ("deepspeed", "config"))
# Fields that can only be local paths, so a bare relative name ('nvme') is anchored too; workers may
# start in another directory, and DeepSpeed receives the absolute path.
_LOCAL_PATH_FIELDS = (("deepspeed", "nvme_path"),)
_PATH_LIST_FIELDS = (("data", "train"), ("data", "eval"), ("eval", "tasks_include_path"))


def _anchor_path(value: str, base: Path) -> str:
    looks_local = value.startswith((".", "/", "~")) or any(ch in value for ch in "*?")
    if not looks_local:
        return value  # a hub id ('meta-llama/Llama-2-7b-hf') or a ds_configs name ('zero3')
    return str((base / Path(value).expanduser()).resolve()) if not Path(value).is_absolute() else value


def _anchor_paths(data: dict[str, Any], base: Path) -> None:
    for section, key in _PATH_FIELDS:
        value = (data.get(section) or {}).get(key)
        if isinstance(value, str):
            data[section][key] = _anchor_path(value, base)
    for section, key in _LOCAL_PATH_FIELDS:
        value = (data.get(section) or {}).get(key)
        if isinstance(value, str) and value.strip() not in ("", "auto"):  # those two: the schema explains
            # abspath, not resolve(): keep the user's spelling of a symlinked mount in every message.
            data[section][key] = os.path.abspath(base / Path(value).expanduser())
    for section, key in _PATH_LIST_FIELDS:
        value = (data.get(section) or {}).get(key)
        if isinstance(value, str):
            value = [value]
        if isinstance(value, dict):  # data.train: {path: ..., format: ...} (one source, no list)
            value = [value]
        if isinstance(value, list):
            data[section][key] = [_anchor_source(v, base) for v in value]


def _anchor_source(value: Any, base: Path) -> Any:
    """A path string, or a data source mapping whose 'path' is anchored the same way."""
    if isinstance(value, str):
        return _anchor_path(value, base)
    if isinstance(value, dict) and isinstance(value.get("path"), str):
        return {**value, "path": _anchor_path(value["path"], base)}
    return value


def describe_validation_error(error: ValidationError, model: type[BaseModel], source: str) -> str:
    """The first validation problem as one line: the key, what is wrong, how to fix it."""
    err = error.errors()[0]
    loc = [str(p) for p in err["loc"] if not isinstance(p, int)]
    key = ".".join(loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        owner: Any = model
        for part in loc[:-1]:
            annotation = owner.model_fields[part].annotation if part in owner.model_fields else None
            # An optional section (`lora: LoraSection | None`): look inside the union.
            annotation = next((a for a in get_args(annotation) if a is not type(None)), annotation)
            owner = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
            if owner is None:
                break
        valid = sorted(owner.model_fields) if owner else []
        close = difflib.get_close_matches(loc[-1], valid, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return f"{source}: unknown key '{key}'; {hint}valid keys here: {', '.join(valid)}"
    if err["type"] == "missing":
        return f"{source}: missing required key '{key}'; add it to the recipe or pass {key}=VALUE"
    got = err.get("input")
    got_text = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "value_error":
        return f"{source}: {message}"
    return f"{source}: {key}: {message}{got_text}"


def read_recipe_file(path: Path) -> dict[str, Any]:
    """A recipe file's mapping: its name defaulted to the file's stem, its paths anchored at its folder."""
    try:
        data = yaml_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise UserError(f"recipe {path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(data, dict):
        raise UserError(f"recipe {path}: expected a mapping of sections at the top level")
    data.setdefault("name", path.stem)
    _anchor_paths(data, path.parent)
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """`data` (a recipe's mapping, paths anchored) with `key.sub=value` overrides applied in place; paths
    in overrides are taken relative to the working directory."""
    for text in overrides or []:
        parts, value = parse_override(text)
        single: dict[str, Any] = {parts[0]: {}} if len(parts) > 1 else {}
        _apply_override(single, parts, value, text)
        _anchor_paths(single, Path.cwd())
        _apply_override(data, parts, _dig(single, parts), text)
    return data


def _dig(data: dict[str, Any], parts: list[str]) -> Any:
    for part in parts:
        data = data[part]
    return data
