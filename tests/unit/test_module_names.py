"""Names say the job: no two modules of the package share a file name.

Two `sources.py` (the schema half of a data format in config/, finding and loading a source in data/) or two
`preference.py` (DPO's losses, the preference data format) sent a reader, a traceback or a grep to the wrong
one (issue 52). A module's name is what a reader meets first, so it names the module's job, once.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import llm_train

PACKAGE = Path(llm_train.__file__).resolve().parent

# File names shared on purpose, each with exactly these paths (relative to llm_train/). A new module under
# one of these names still fails; an entry whose pair is gone fails too, so the list only ever shrinks.
ALLOWED: dict[str, set[str]] = {
    "__init__.py": set(),  # every package has one; its folder is its name
    # GRPO's rollouts and Objective (rl/) and its loss arithmetic (loss/): the objective-registry work
    # (issue 52 point 1) moves GRPO's wiring and resolves this pair; remove the entry then.
    "grpo.py": {"runtime/rl/grpo.py", "runtime/loss/grpo.py"},
    # llm_train/train.py is the launch script's path users type (`accelerate launch llm_train/train.py`), and
    # commands/ names each module after its subcommand (`llm-train train`): both names are their interface.
    "train.py": {"train.py", "commands/train.py"},
}


def shared_names(package: Path) -> dict[str, set[str]]:
    """Each file name that more than one module under `package` has: name -> their paths (relative)."""
    paths: dict[str, set[str]] = defaultdict(set)
    for path in package.rglob("*.py"):
        paths[path.name].add(path.relative_to(package).as_posix())
    return {name: found for name, found in paths.items() if len(found) > 1}


def unexplained(shared: dict[str, set[str]], allowed: dict[str, set[str]]) -> list[str]:
    """One line per shared name the allowed list does not cover exactly, and per stale entry."""
    problems = []
    for name, found in sorted(shared.items()):
        if name not in allowed:
            problems.append(f"{name}: {sorted(found)} share a name; rename one for its job")
        elif allowed[name] and found != allowed[name]:
            problems.append(f"{name}: {sorted(found)}, allowed only as {sorted(allowed[name])}")
    for name, expected in sorted(allowed.items()):
        if expected and name not in shared:
            problems.append(f"{name}: no longer shared as {sorted(expected)}; remove its ALLOWED entry")
    return problems


def test_no_two_modules_of_the_package_share_a_name() -> None:
    shared = shared_names(PACKAGE)
    assert "__init__.py" in shared  # the walk found the package's subpackages
    assert unexplained(shared, ALLOWED) == []


def test_the_check_catches_a_shared_name_a_third_copy_and_a_stale_entry(tmp_path: Path) -> None:
    for path in ("config/sources.py", "data/sources.py", "a/x.py", "b/x.py", "c/x.py", "one.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    allowed = {"x.py": {"a/x.py", "b/x.py"}, "one.py": {"one.py", "d/one.py"}}
    assert unexplained(shared_names(tmp_path), allowed) == [
        "sources.py: ['config/sources.py', 'data/sources.py'] share a name; rename one for its job",
        "x.py: ['a/x.py', 'b/x.py', 'c/x.py'], allowed only as ['a/x.py', 'b/x.py']",
        "one.py: no longer shared as ['d/one.py', 'one.py']; remove its ALLOWED entry",
    ]
