"""The package's folders are its layers: imports only go down, never in a circle, and sit at module top.

    0  llm_train (paths), errors
    1  config         what the user asked for: recipe, DS JSON, hardware, layout, resolution
    2  planning       will it fit, how fast
    3  observability  metrics, trackers, console, profiler, reports
    3  data           sources -> tokenised -> packed -> per-rank batches
    4  runtime        one run inside a worker
    5  entry points   train.py, cli.py, commands/

Function-local imports count: a cycle hidden inside a function is still a cycle. They are
allowed only for heavy third-party packages (torch, deepspeed, transformers, ...), never for
llm_train's own modules. The one exception is the runtime's choice of engine
(session.make_engine), which imports only the engine a run uses.

Inside runtime and planning the same rule holds between their rooms (RUNTIME_ROOMS and PLANNING_ROOMS, the
orders runtime/__init__.py and planning/__init__.py state): a module imports from its own room or from a
room below it, never from one above.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import llm_train

PACKAGE = Path(llm_train.__file__).resolve().parent
LAYERS = {
    "llm_train": 0,
    "llm_train.errors": 0,
    "llm_train.config": 1,
    "llm_train.planning": 2,
    "llm_train.observability": 3,
    "llm_train.data": 3,
    "llm_train.runtime": 4,
    "llm_train.train": 5,
    "llm_train.cli": 5,
    "llm_train.commands": 5,
    "llm_train.assets": 5,  # the builder of the bundled assets: a script
}
# runtime's rooms, lowest first; the last, runtime itself, holds the run (session, loop, benchmark, rundir).
RUNTIME_ROOMS = [
    "llm_train.runtime.base",
    "llm_train.runtime.loss",
    "llm_train.runtime.model",
    "llm_train.runtime.checkpointing",
    "llm_train.runtime.export",
    "llm_train.runtime.rl",
    "llm_train.runtime.engines",
    "llm_train.runtime",
]
# planning's rooms, lowest first; the last, planning itself, holds only its docstring.
PLANNING_ROOMS = [
    "llm_train.planning.model",
    "llm_train.planning.memory",
    "llm_train.planning.speed",
    "llm_train.planning.search",
    "llm_train.planning.report",
    "llm_train.planning.auto",
    "llm_train.planning",
]
ROOMS = {"runtime": RUNTIME_ROOMS, "planning": PLANNING_ROOMS}
# (importer, imported) pairs allowed as function-local imports of the package's own modules.
LOCAL_OK = {
    ("llm_train.runtime.session", "llm_train.runtime.engines.pipeline_engine"),
    ("llm_train.runtime.session", "llm_train.runtime.engines.zero_engine"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer(module: str) -> int:
    best = max((k for k in LAYERS if module == k or module.startswith(k + ".")), key=len)
    return LAYERS[best]


def imports(module: str) -> list[tuple[str, bool, int]]:
    """(imported llm_train module, at module top?, line) for every import in `module`."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(node) for node in tree.body}
    top |= {id(n) for node in tree.body if isinstance(node, ast.If) for n in node.body}  # TYPE_CHECKING
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        targets = {n for n in names if n in MODULES and n != module}
        # `from llm_train.config import recipe` names the module, not the package.
        if any(t != n and t.startswith(n + ".") for t in targets for n in targets):
            targets = {t for t in targets if not any(o.startswith(t + ".") for o in targets)}
        found += [(t, id(node) in top, node.lineno) for t in targets]
    return found


def test_the_readme_states_the_layers_this_test_enforces() -> None:
    """The README's arrow (`config <- planning <- data, observability <- runtime <- ...`) is LAYERS in order."""
    import re

    readme = (PACKAGE.parent / "README.md").read_text()
    found = re.search(r"`(config <- [^`]+)`", readme)
    assert found, "README.md states the layers as `config <- planning <- ...`"
    stated = [
        {p.strip().removesuffix("/").removesuffix(".py") for p in g.split(",")} for g in found[1].split("<-")
    ]
    by_layer: dict[int, set[str]] = {}
    for name, n in LAYERS.items():
        by_layer.setdefault(n, set()).add(name.removeprefix("llm_train.").removeprefix("llm_train"))
    expected = [by_layer[n] for n in (1, 2, 3, 4)]
    assert stated[:4] == expected and stated[4] <= by_layer[5] and len(stated) == 5, stated


def test_the_layer_table_covers_every_module() -> None:
    for module in MODULES:
        layer(module)  # raises for a module no layer claims


def room(module: str, rooms: list[str] = RUNTIME_ROOMS) -> int:
    """The rank of the room of `rooms` (lowest first: RUNTIME_ROOMS, PLANNING_ROOMS) that holds `module`."""
    return max(
        (i for i, r in enumerate(rooms) if module == r or module.startswith(r + ".")),
        key=lambda i: len(rooms[i]),
    )


@pytest.mark.parametrize("package", sorted(ROOMS))
def test_a_package_in_rooms_states_them_in_this_order(package: str) -> None:
    """runtime/__init__.py's docstring lists its rooms (`base/`, `loss/`, ...) in RUNTIME_ROOMS' order;
    planning/__init__.py its rooms (`model/`, `memory/`, ...) in PLANNING_ROOMS' order."""
    import re

    doc = (PACKAGE / package / "__init__.py").read_text()
    stated = re.findall(r"^    (\w+)/ ", doc, re.M)
    assert stated == [r.rsplit(".", 1)[1] for r in ROOMS[package][:-1]], stated
    rooms = {p.parent.name for p in (PACKAGE / package).glob("*/__init__.py")}
    assert rooms == set(stated), f"every sub-package of {package} is a room in its list"


@pytest.mark.parametrize("package", sorted(ROOMS))
def test_imports_only_go_down_a_packages_rooms(package: str) -> None:
    rooms = ROOMS[package]
    inside = [m for m in sorted(MODULES) if m == rooms[-1] or m.startswith(rooms[-1] + ".")]
    assert len({room(m, rooms) for m in inside}) == len(rooms)  # every room holds modules
    upward = [
        f"{m} ({rooms[room(m, rooms)]}) imports {t} ({rooms[room(t, rooms)]}) at line {line}"
        for m in inside
        for t, _, line in imports(m)
        if t.startswith(rooms[-1] + ".") and room(t, rooms) > room(m, rooms) and (m, t) not in LOCAL_OK
    ]
    assert upward == [], "\n".join(upward)


def test_imports_only_go_down() -> None:
    upward = [
        f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)}) at line {line}"
        for m in sorted(MODULES)
        for t, _, line in imports(m)
        if layer(t) > layer(m) and t != "llm_train"
    ]
    assert upward == [], "\n".join(upward)


def test_the_package_imports_itself_at_module_top() -> None:
    local = [
        f"{m}:{line} imports {t} inside a function"
        for m in sorted(MODULES)
        for t, at_top, line in imports(m)
        if not at_top and (m, t) not in LOCAL_OK
    ]
    assert local == [], "\n".join(local)


def test_no_import_cycles() -> None:
    graph = {m: {t for t, _, _ in imports(m) if t in MODULES} for m in MODULES}
    # A package imports its own modules only for re-export; an edge to a package is an edge to its __init__.
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert cycles == [], "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize(
    "probe, source, target",
    [
        # A loss that imports an engine is upward by runtime's rooms, though both are layer 4.
        (
            "runtime.loss",
            "from llm_train.runtime.engines.engine import Engine\n",
            "llm_train.runtime.engines.engine",
        ),
        # The memory estimate that asks auto's search is upward by planning's rooms, though both are layer 2.
        (
            "planning.memory",
            "from llm_train.planning.auto.choose import choose_auto\n",
            "llm_train.planning.auto.choose",
        ),
    ],
)
def test_the_room_rule_catches_an_arrow_up_inside_a_package(probe: str, source: str, target: str) -> None:
    fake = PACKAGE.joinpath(*probe.split(".")) / "_room_rule_probe.py"
    name = f"llm_train.{probe}._room_rule_probe"
    rooms = ROOMS[probe.split(".")[0]]
    fake.write_text(source)
    try:
        MODULES[name] = fake
        ((found, _, _),) = imports(name)
        assert found == target
        assert room(target, rooms) > room(name, rooms)
        assert layer(target) == layer(name)
    finally:
        MODULES.pop(name, None)
        fake.unlink()


@pytest.mark.parametrize(
    "source, problem",
    [
        ("from llm_train.runtime import session\n", "upward"),
        ("def f():\n    from llm_train.config import recipe\n", "local"),
    ],
)
def test_the_rules_catch_what_they_forbid(tmp_path: Path, source: str, problem: str) -> None:
    fake = PACKAGE / "config" / "_layer_rule_probe.py"
    fake.write_text(source)
    try:
        MODULES["llm_train.config._layer_rule_probe"] = fake
        found = imports("llm_train.config._layer_rule_probe")
        assert len(found) == 1
        target, at_top, _ = found[0]
        if problem == "upward":
            assert layer(target) > layer("llm_train.config._layer_rule_probe")
        else:
            assert not at_top
    finally:
        MODULES.pop("llm_train.config._layer_rule_probe", None)
        fake.unlink()
