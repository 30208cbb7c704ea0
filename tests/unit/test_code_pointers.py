"""Comments and docstrings that name a file of the repository or a test name one that exists.

docs/ are checked for dead links (tests/unit/test_docs.py); a comment that still names a module's old
path after it moved sends a reader nowhere just the same. So every comment and
docstring of llm_train/, tests/, bench/ and tools/ is read (tokenize for comments, ast for docstrings)
and each path it names must exist:

- a repository path: `llm_train/...`, `tests/...`, `bench/...`, `docs/...`, `tools/...` (a `*` in it
  must match at least one file);
- a path inside the package, as the code writes them (`runtime/loss/grpo.py`, `config/recipe.py`,
  `loss/grpo.py` from inside runtime/): it must exist under llm_train/, or under one of the folders that
  hold the file that names it;
- a test, `test_<words>` as a whole word: a test function or test module of that name exists under tests/.

A path inside a library the code cites (DeepSpeed's `runtime/zero/stage3.py`, accelerate's
`commands/config/cluster.py`) is accepted where that library, as installed, has it; a component in
capitals is a placeholder (`bench/TASK/METRIC`), and a run directory's own files (`config/recipe.yaml`)
are outputs, not pointers.
"""

from __future__ import annotations

import ast
import io
import re
import sysconfig
import tokenize
from pathlib import Path

from tests.helpers import REPO

SCANNED = ("llm_train", "tests", "bench", "tools")
ROOTS = ("llm_train", "tests", "bench", "docs", "tools")
# A path: folders, then a file with an extension or a folder with a trailing slash.
PATH = re.compile(
    r"(?<![\w./-])((?:[A-Za-z_][\w.*-]*/)+(?:[\w*-]+\.(?:py|md|yaml|json|sh|txt|jsonl|toml)\b|(?![\w*])))"
)
# Two characters at least after test_: `test_x` is a placeholder in a docstring's example.
TEST_NAME = re.compile(r"(?<![\w.])(test_[a-z0-9][a-z0-9_]+)\b")
# What runs write, not kept in the repository (a pointer to them names an output), and a run
# directory's own files (runtime/rundir.py writes config/recipe.yaml and config/ds_config.json).
OUTPUTS = (
    "runs/",
    "bench/results/",
    "checkpoints/",
    "final/",
    "state/",
    "config/recipe.yaml",
    "config/ds_config.json",
)
LIBRARIES = Path(sysconfig.get_paths()["purelib"])


def comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and every docstring (module, class, function) of a Python file."""
    source = path.read_text()
    found = [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                found.append((value.lineno, value.value))
    return found


def known_tests() -> set[str]:
    """Every test function and test module name under tests/."""
    names: set[str] = set()
    for path in (REPO / "tests").rglob("test_*.py"):
        names.add(path.stem)
        names |= set(re.findall(r"^\s*(?:async )?def (test_\w+)", path.read_text(), re.MULTILINE))
    return names


def path_exists(name: str, file: Path) -> bool:
    """Whether `name`, as written in `file`, points at something of the repository."""
    name = name.rstrip("/") or name
    bases = [REPO, REPO / "llm_train", *[p for p in file.parents if p.is_relative_to(REPO)]]
    for base in bases:
        if "*" in name:
            if any(base.glob(name)):
                return True
        elif (base / name).exists():
            return True
    return any((library / name).exists() for library in LIBRARIES.iterdir() if library.is_dir())


def is_pointer(name: str) -> bool:
    """A repository path (a root of ROOTS or a package folder), not a URL fragment or a run's output."""
    if name.startswith(OUTPUTS) or "//" in name or any(part.isupper() for part in name.split("/")):
        return False
    first = name.split("/", 1)[0]
    package_folders = {p.name for p in (REPO / "llm_train").iterdir() if p.is_dir()}
    return first in ROOTS or first in package_folders


def dead_in(file: Path, where: Path, tests: set[str]) -> list[tuple[int, str]]:
    """(line, name) of each dead pointer in `file`'s comments and docstrings, read as if it lay at `where`."""
    dead = []
    for line, text in comments_and_docstrings(file):
        dead += [
            (line, name) for name in PATH.findall(text) if is_pointer(name) and not path_exists(name, where)
        ]
        dead += [(line, test) for test in TEST_NAME.findall(text) if test not in tests]
    return dead


def dead_pointers(files: list[Path], tests: set[str]) -> list[str]:
    return [f"{f.relative_to(REPO)}:{line}: {name}" for f in files for line, name in dead_in(f, f, tests)]


def python_files() -> list[Path]:
    return sorted(p for top in SCANNED for p in (REPO / top).rglob("*.py"))


def test_every_path_and_test_a_comment_or_docstring_names_exists() -> None:
    files = python_files()
    assert len(files) > 300
    assert dead_pointers(files, known_tests()) == []


def test_the_pointer_check_catches_each_kind_of_dead_pointer(tmp_path: Path) -> None:
    module = REPO / "llm_train" / "runtime" / "rl" / "rewards.py"  # read as if it lay there
    text = (
        '"""See loss/grpo.py, llm_train/runtime/session.py and tests/unit/test_grpo.py."""\n'
        "# runtime/grpo.py moved; bench/no_such.py never was; test_no_such_thing; runs/x/metrics.jsonl\n"
        "# tests/e2e/test_*.py and test_every_path_and_test_a_comment_or_docstring_names_exists exist\n"
    )
    probe = tmp_path / "probe.py"
    probe.write_text(text)
    found = [name for _, name in dead_in(probe, module, known_tests())]
    assert found == ["runtime/grpo.py", "bench/no_such.py", "test_no_such_thing"]


CODE_SPAN = re.compile(r"`([^`\n]*)`")


def dead_in_markdown(path: Path) -> list[tuple[int, str]]:
    """(line, path) of each dead repository path a code span of a Markdown page names.

    test_docs.py follows the pages' links; a path in backticks (`config/recipe.py`) is a pointer too, read as
    the code's are (from the repository root or llm_train/). A span that is a git command names history on
    purpose (`git show REV:PATH`)."""
    where = REPO / "llm_train" / "__init__.py"
    dead = []
    for line, text in enumerate(path.read_text().splitlines(), 1):
        for span in CODE_SPAN.findall(text):
            if span.startswith("git "):
                continue
            dead += [
                (line, name)
                for name in PATH.findall(span)
                if is_pointer(name) and not path_exists(name, where)
            ]
    return dead


def test_every_path_a_docs_page_names_in_backticks_exists() -> None:
    pages = sorted([*(REPO / "docs").glob("*.md"), REPO / "README.md", REPO / "launch" / "README.md"])
    assert len(pages) > 10
    assert [
        f"{p.relative_to(REPO)}:{line}: {name}" for p in pages for line, name in dead_in_markdown(p)
    ] == []


def test_the_docs_path_check_catches_a_moved_module(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "`config/sources.py` moved; `config/source_schema.py` and `llm_train/runtime/session.py` exist;\n"
        "`git show 38dfde7:bench/bf16_states_quality.py` is history; `runs/x/metrics.jsonl` an output\n"
    )
    assert dead_in_markdown(page) == [(1, "config/sources.py")]
