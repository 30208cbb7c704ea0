"""Every import of an llm_train name goes to the module that defines it: no facades inside the package.

A module that imports a name only to hand it on (`from a import x as x`, kept "for compatibility") makes
a second address for it; importers drift between the two, and a split of the defining module then breaks
code that never named it (2016d82 fixed a CI failure of that kind). The one exception is a package face:
an `__init__.py` whose docstring says it is the package's face (llm_train/data/__init__.py, which imports
lazily so `llm-train --help` pays for no numpy or torch).

Checked over llm_train/, tests/, bench/ and tools/: every `from llm_train.M import N` names an N that M
defines (a def, a class, an assignment, or a submodule of a package), or M is a face.
"""

from __future__ import annotations

import ast
from pathlib import Path

import llm_train

PACKAGE = Path(llm_train.__file__).resolve().parent
REPO = PACKAGE.parent
SCANNED = ("llm_train", "tests", "bench", "tools")


def module_path(module: str) -> Path | None:
    """The file of an llm_train module (a package: its __init__.py), None if there is none."""
    base = REPO.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def defined_names(path: Path) -> set[str]:
    """Names a module binds at its top level by itself: defs, classes, assignments (not imports)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.If, ast.Try)):  # a version switch or a guarded definition
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return names


def is_face(path: Path) -> bool:
    """A package `__init__.py` that says in its docstring that it is the package's face."""
    if path.name != "__init__.py":
        return False
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return "package's face" in doc


def facade_imports(files: list[Path]) -> list[str]:
    """`file:line: from M import N` for each import of an llm_train name M does not define."""
    found = []
    cache: dict[str, tuple[Path | None, set[str]]] = {}
    for file in files:
        tree = ast.parse(file.read_text(), filename=str(file))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0):
                continue
            if node.module != "llm_train" and not node.module.startswith("llm_train."):
                continue
            if node.module not in cache:
                path = module_path(node.module)
                cache[node.module] = (path, defined_names(path) if path else set())
            path, names = cache[node.module]
            if path is None or is_face(path):
                continue
            for alias in node.names:
                submodule = path.name == "__init__.py" and module_path(f"{node.module}.{alias.name}")
                if alias.name not in names and not submodule:
                    where = file.relative_to(REPO) if file.is_relative_to(REPO) else file
                    found.append(f"{where}:{node.lineno}: from {node.module} import {alias.name}")
    return found


def marked_reexports(files: list[Path]) -> list[str]:
    """`file:line: x as x`: the explicit re-export form (PEP 484), allowed only in a face."""
    found = []
    for file in files:
        if is_face(file):
            continue
        tree = ast.parse(file.read_text(), filename=str(file))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llm_train"):
                for alias in node.names:
                    if alias.asname == alias.name:
                        found.append(f"{file.relative_to(REPO)}:{node.lineno}: {alias.name} as {alias.name}")
    return found


def scanned_files() -> list[Path]:
    return sorted(p for top in SCANNED for p in (REPO / top).rglob("*.py") if ".venv" not in p.parts)


def test_every_import_of_an_llm_train_name_goes_to_its_defining_module() -> None:
    files = scanned_files()
    assert len(files) > 300  # the listing found the package and the tests
    assert facade_imports(files) == []
    assert marked_reexports([p for p in files if p.is_relative_to(PACKAGE)]) == []


def test_the_scan_catches_a_facade_and_lets_a_face_and_a_definition_pass(tmp_path: Path) -> None:
    importer = tmp_path / "importer.py"
    importer.write_text(
        "from llm_train.units import GiB\n"  # defined there
        "from llm_train.data import prepare_data\n"  # the data package's face
        "from llm_train.runtime import session\n"  # a submodule of a package
        "from llm_train.config.resolution import Device\n"  # imported by resolution.py, defined in hardware.py
    )
    assert is_face(PACKAGE / "data" / "__init__.py")
    assert facade_imports([importer]) == [f"{importer}:4: from llm_train.config.resolution import Device"]
