"""The test suite's tiers are its folders: a test's marker and the folder it lives in must agree.

`make test-fast` selects by marker (-m "not e2e"), a reader by folder; both must mean the same
quick set. So every test under tests/unit runs without the e2e marker, every test under
tests/e2e carries it, and every test under tests/gpu carries `gpu` (which tests/conftest.py turns
into a skip where no CUDA device is present), the only folder where `gpu` is used. Read from the
source with ast (module-level `pytestmark`, class and function decorators), so a misplaced test
is caught without importing or running it.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
UNIT, E2E, GPU = TESTS / "unit", TESTS / "e2e", TESTS / "gpu"


def _mark_name(node: ast.AST) -> str | None:
    """`pytest.mark.NAME`, `mark.NAME` or either called (`pytest.mark.NAME(...)`): NAME, else None."""
    if isinstance(node, ast.Call):
        node = node.func
    if not isinstance(node, ast.Attribute):
        return None
    owner = node.value
    if (isinstance(owner, ast.Attribute) and owner.attr == "mark") or (
        isinstance(owner, ast.Name) and owner.id == "mark"
    ):
        return node.attr
    return None


def _marks(nodes: list[ast.expr]) -> set[str]:
    """Marks applied by these decorators / `pytestmark` values (a mark, or a list or tuple of marks)."""
    found: set[str] = set()
    for node in nodes:
        items = node.elts if isinstance(node, (ast.List, ast.Tuple)) else [node]
        found |= {name for item in items if (name := _mark_name(item))}
    return found


def _pytestmark(body: list[ast.stmt]) -> set[str]:
    values = [
        stmt.value
        for stmt in body
        if isinstance(stmt, (ast.Assign, ast.AnnAssign))
        and stmt.value is not None
        and any(
            isinstance(target, ast.Name) and target.id == "pytestmark"
            for target in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])
        )
    ]
    return _marks(values)


def marks_per_test(source: str) -> dict[str, set[str]]:
    """Each test of a module (`test_x`, `TestY.test_z`) and the marks it carries as a whole."""
    tree = ast.parse(source)
    module = _pytestmark(tree.body)
    found: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            found[node.name] = module | _marks(node.decorator_list)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            cls = module | _marks(node.decorator_list) | _pytestmark(node.body)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test"):
                    found[f"{node.name}.{item.name}"] = cls | _marks(item.decorator_list)
    return found


def mark_uses(source: str, mark: str) -> list[int]:
    """Lines that name the mark anywhere: decorators, `pytestmark`, `pytest.param(marks=...)`, applymarker."""
    return sorted(
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and _mark_name(node) == mark
    )


def _test_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("test_*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(TESTS.parent).as_posix()


def test_no_test_under_unit_is_e2e() -> None:
    files = _test_files(UNIT)
    assert files
    offences = [f"{_rel(f)}:{line}" for f in files for line in mark_uses(f.read_text(), "e2e")]
    assert offences == [], "e2e tests live under tests/e2e (named after what they test):\n" + "\n".join(
        offences
    )


def test_every_test_under_e2e_is_marked_e2e() -> None:
    found = {f: marks_per_test(f.read_text()) for f in _test_files(E2E)}
    assert sum(map(len, found.values())) > 0
    unmarked = [
        f"{_rel(f)}::{name}"
        for f, tests in found.items()
        for name, marks in tests.items()
        if "e2e" not in marks
    ]
    assert unmarked == [], (
        "mark these e2e (`pytestmark = pytest.mark.e2e`) or move them to tests/unit:\n" + "\n".join(unmarked)
    )


def test_every_test_under_gpu_is_marked_gpu() -> None:
    found = {f: marks_per_test(f.read_text()) for f in _test_files(GPU)}
    assert sum(map(len, found.values())) > 0
    unmarked = [
        f"{_rel(f)}::{name}"
        for f, tests in found.items()
        for name, marks in tests.items()
        if "gpu" not in marks
    ]
    assert unmarked == [], "mark these gpu (`pytestmark = pytest.mark.gpu`):\n" + "\n".join(unmarked)


def test_the_gpu_marker_is_used_only_under_gpu() -> None:
    files = [f for f in _test_files(TESTS) if GPU not in f.parents]
    offences = [f"{_rel(f)}:{line}" for f in files for line in mark_uses(f.read_text(), "gpu")]
    assert offences == [], "GPU tests live under tests/gpu:\n" + "\n".join(offences)


def test_the_reader_sees_each_way_of_marking_a_test() -> None:
    source = (
        "import pytest\n"
        "from pytest import mark\n"
        "pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings('ignore')]\n"
        "def test_module_mark(): ...\n"
        "@pytest.mark.e2e\n"
        "def test_decorated(): ...\n"
        "@mark.e2e\n"
        "@pytest.mark.parametrize('x', [1])\n"
        "def test_bare_mark(x): ...\n"
        "@pytest.mark.e2e()\n"
        "async def test_called_mark(): ...\n"
        "@pytest.mark.e2e\n"
        "class TestGroup:\n"
        "    def test_in_class(self): ...\n"
        "    def helper(self): ...\n"
        "class TestOther:\n"
        "    pytestmark = pytest.mark.slow\n"
        "    def test_class_mark(self): ...\n"
        "def helper(): ...\n"
    )
    assert marks_per_test(source) == {
        "test_module_mark": {"gpu", "filterwarnings"},
        "test_decorated": {"gpu", "filterwarnings", "e2e"},
        "test_bare_mark": {"gpu", "filterwarnings", "e2e", "parametrize"},
        "test_called_mark": {"gpu", "filterwarnings", "e2e"},
        "TestGroup.test_in_class": {"gpu", "filterwarnings", "e2e"},
        "TestOther.test_class_mark": {"gpu", "filterwarnings", "slow"},
    }
    # A unit file may not mark even one parameter e2e, nor apply the mark at run time.
    hidden = (
        "import pytest\n"
        "@pytest.mark.parametrize('x', [1, pytest.param(2, marks=pytest.mark.e2e)])\n"
        "def test_x(x, request): request.applymarker(pytest.mark.e2e)\n"
        "pytest_mark_e2e = 'pytest.mark.e2e'\n"
    )
    assert mark_uses(hidden, "e2e") == [2, 3]


def device_constants(source: str) -> list[str]:
    """Module-level `NAME = Device(...)` assignments: the devices tests/devices.py keeps in one place."""
    found = []
    for stmt in ast.parse(source).body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call):
            func = stmt.value.func
            if isinstance(func, ast.Name) and func.id == "Device":
                found += [t.id for t in stmt.targets if isinstance(t, ast.Name)]
    return found


def test_devices_are_defined_once_in_tests_devices() -> None:
    # 13 modules used to define their own, with bf16 arguments that disagreed for the same machine.
    own = {
        str(path.relative_to(TESTS)): names
        for path in sorted(TESTS.rglob("*.py"))
        if path.name != "devices.py" and (names := device_constants(path.read_text()))
    }
    assert own == {}, "import these from tests/devices.py (add a device there if it is missing)"
    assert device_constants("CPU = Device('cpu', 'cpu', True)\ncard = make(Device('cuda', 'x', True))\n") == [
        "CPU"
    ]
