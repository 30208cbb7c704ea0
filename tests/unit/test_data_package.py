"""llm_train.data: names imported lazily at run time, and the same names typed for mypy."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import llm_train.data as data


def _type_checking_imports() -> dict[str, str]:
    """name -> module of each `from M import X as X` under the package's `if TYPE_CHECKING:`."""
    tree = ast.parse(Path(data.__file__).read_text())
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom) and stmt.module is not None
                for alias in stmt.names:
                    assert alias.asname == alias.name, (
                        f"{alias.name}: re-export it as `{alias.name} as {alias.name}`"
                    )
                    found[alias.name] = stmt.module
    return found


def test_every_lazy_export_is_typed_for_the_checker() -> None:
    # A name only in _EXPORTS reaches mypy through __getattr__ as Any: its callers go unchecked.
    assert _type_checking_imports() == data._EXPORTS


def test_lazy_exports_resolve_to_their_modules_objects() -> None:
    for name, module in data._EXPORTS.items():
        assert getattr(data, name) is getattr(importlib.import_module(module), name)
