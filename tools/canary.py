"""`make test-latest`: does llm_train still pass on the newest releases the package index serves?

    python tools/canary.py                      # newest releases, inside the windows and past them
    python tools/canary.py --inside-windows     # newest releases inside pyproject.toml's windows only
    python tools/canary.py --resolve-only       # which library moved, without installing or testing

requirements-lock.txt is what the suite last passed on and what `make install` installs; the windows in
pyproject.toml (and llm_train/runtime/base/compat.py WINDOWS) are the releases it was tested with. A release
that appears after the last lock is what a user's `pip install` may get next (transformers 5.25 did: it
broke the export check of every large model the day it came out). This script finds such a release
before a user does:

1. resolve the newest set: every requirement of pyproject.toml (main and the extras `make install`
   takes) with its upper bound dropped (`--inside-windows`: kept), torch pinned as the Makefile pins it,
   through pip's own resolver (`pip install --dry-run --report`);
2. print each library whose resolved release differs from the lock, and whether it is past its window;
3. build a separate environment with that set (.venv-latest, rebuilt from nothing each time), llm_train
   installed from this checkout without its dependencies;
4. run the unit tier and a few e2e runs there (CANARY_E2E: training under ZeRO-3 with kill -9 and
   resume, the export check of every family, LoRA and QLoRA) and print which tests failed.

Exit status 0: every test passed on the newest set (a window may be widened: docs/development.md);
1: some failed (bound the library, or fix the code, in a change of its own); 2: the set could not be
resolved or installed. Run it before widening a window and at the start of each day's work.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "requirements-lock.txt"
VENV = REPO / ".venv-latest"
# The extras `make install` takes (Makefile EXTRAS).
EXTRAS = ("dev", "tensorboard", "lora", "qlora", "report", "eval")
TORCH = "torch==2.13.0"  # the Makefile's TORCH: the CPU build on this machine's disk
# A few e2e runs that lean on the libraries' internals most: the ZeRO-3 save/resume path and the checkpoint
# repairs (deepspeed, accelerate), the export check of every model family (transformers' loader), adapters
# and 4-bit bases (peft, bitsandbytes, transformers' quantizer).
CANARY_E2E = (
    "tests/e2e/test_resume.py",
    "tests/e2e/test_export_families.py",
    "tests/e2e/test_lora.py",
    "tests/e2e/test_qlora.py",
)
# Tests that assert the installed set is inside the windows: true of the lock, false here by design (the
# moved libraries are printed instead).
INSIDE_THE_WINDOWS = ("tests/unit/test_compat.py::test_the_installed_set_is_inside_every_window",)
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "WANDB_MODE": "offline",
}


def pyproject_requirements(text: str, extras: tuple[str, ...] = EXTRAS) -> list[Requirement]:
    """pyproject.toml's dependencies and the named extras' (llm_train's own extras folded in)."""
    import tomllib  # Python 3.11+, which this tool needs (the package itself supports 3.10)

    project = tomllib.loads(text)["project"]
    optional = project.get("optional-dependencies", {})
    out = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        for line in optional.get(extra, []):
            req = Requirement(line)
            if canonicalize_name(req.name) != canonicalize_name(project["name"]):  # llm_train[lora]
                out.append(req)
    return out


def without_upper_bounds(req: Requirement) -> str:
    """The requirement with its `<`, `<=`, `==`-prefix and `~=` caps dropped (its floor kept)."""
    floors = [str(s) for s in req.specifier if s.operator in (">=", ">", "!=")]
    pinned = [s.version for s in req.specifier if s.operator == "==" and "*" not in s.version]
    if pinned and not floors:  # an exact pin (trl, mypy): the newest release at or above it
        floors = [f">={pinned[0]}"]
    return req.name + ",".join(floors)


def locked_versions(text: str) -> dict[str, str]:
    """name -> version of every `name==version` line of a pip-compile lock."""
    return {
        canonicalize_name(name): version
        for name, version in re.findall(r"^([A-Za-z0-9_.\-]+)==([^\s;\\]+)", text, re.M)
    }


def window_of(library: str, requirements: list[Requirement]) -> SpecifierSet | None:
    for req in requirements:
        if canonicalize_name(req.name) == canonicalize_name(library):
            return req.specifier
    return None


def moved_lines(
    resolved: dict[str, str], locked: dict[str, str], requirements: list[Requirement]
) -> list[str]:
    """One line per library whose resolved release differs from the lock; direct requirements first."""
    direct = {canonicalize_name(r.name) for r in requirements}
    lines = []
    for name in sorted(resolved, key=lambda n: (n not in direct, n)):
        new, old = resolved[name], locked.get(name)
        if new == old or name in ("torch", "llm-train", "pip"):  # pip: the installer, not the set
            continue
        window = window_of(name, requirements) if name in direct else None
        where = ""
        if window is not None and str(window):
            where = " (inside the window" if new in window else " (PAST the window"
            where += f" {window})"
        elif name not in direct:
            where = " (indirect)"
        lines.append(f"  {name} {old or 'not locked'} -> {new}{where}")
    return lines


def _pip(python: str, *args: str, quiet: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [python, "-m", "pip", "--disable-pip-version-check", *(["-q"] if quiet else []), *args]
    return subprocess.run(cmd, text=True, capture_output=True, cwd=REPO)


def _quiet_pip_errors(stderr: str) -> str:
    """pip's stderr less this machine's notes about local index folders that lack a project."""
    return "\n".join(line for line in stderr.splitlines() if "is ignored: it is neither" not in line)


def resolve(requirements: list[Requirement], inside_windows: bool) -> dict[str, str]:
    """name -> version pip's resolver picks for the requirements (caps dropped unless inside_windows)."""
    specs = [str(r) if inside_windows else without_upper_bounds(r) for r in requirements]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        done = _pip(
            sys.executable,
            "install",
            "--dry-run",
            "--ignore-installed",
            "--report",
            str(report),
            TORCH,
            *specs,
        )
        if done.returncode != 0:
            raise SystemExit(
                f"canary: pip could not resolve the newest set:\n{_quiet_pip_errors(done.stderr)}"
            )
        items = json.loads(report.read_text())["install"]
    return {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in items}


def build_env(resolved: dict[str, str]) -> Path:
    """.venv-latest with exactly the resolved set and llm_train from this checkout; its python."""
    shutil.rmtree(VENV, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    python = str(VENV / "bin" / "python")
    pins = [f"{name}=={version}" for name, version in sorted(resolved.items()) if name != "torch"]
    for step in ([TORCH, *pins], ["--no-deps", "-e", str(REPO)]):
        done = _pip(python, "install", *step)
        if done.returncode != 0:
            raise SystemExit(
                f"canary: installing into {VENV} failed:\n{_quiet_pip_errors(done.stderr)[-3000:]}"
            )
    return Path(python)


def junit_results(junit: Path) -> tuple[list[str], str]:
    """(the failed or erroring tests' node ids, a "N passed, N failed, N skipped" line) from a JUnit report."""
    failed, passed, skipped = [], 0, 0
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
        elif case.find("skipped") is not None:
            skipped += 1
        else:
            passed += 1
    return failed, f"{passed} passed, {len(failed)} failed, {skipped} skipped"


def run_tests(python: Path, workers: int) -> tuple[int, list[str], str]:
    """(pytest's exit status, the failed tests, a count line) over the unit tier and CANARY_E2E.

    pytest's own output streams through (its progress dots), so a long run shows it is alive."""
    import os

    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
        cmd += ["-n", str(workers), "--dist", "loadscope", "tests/unit", *CANARY_E2E]
        cmd += [f"--deselect={test}" for test in INSIDE_THE_WINDOWS]
        env = {**os.environ, **OFFLINE, "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        env.pop(
            "CI", None
        )  # a part missing here (libaio) skips instead of failing: the canary is about releases
        done = subprocess.run(cmd, cwd=REPO, env=env)
        if not junit.is_file():
            return done.returncode, [], "(pytest wrote no report)"
        failed, counts = junit_results(junit)
        return done.returncode, failed, counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inside-windows", action="store_true", help="Keep pyproject.toml's upper bounds.")
    parser.add_argument(
        "--resolve-only", action="store_true", help="Print what moved; install and test nothing."
    )
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (default 2).")
    args = parser.parse_args(argv)

    requirements = pyproject_requirements((REPO / "pyproject.toml").read_text())
    resolved = resolve(requirements, args.inside_windows)
    moved = moved_lines(resolved, locked_versions(LOCK.read_text()), requirements)
    which = "inside the windows" if args.inside_windows else "newest on the index"
    print(f"canary: {which}: {len(moved)} libraries differ from requirements-lock.txt")
    print("\n".join(moved) if moved else "  (none: the lock is the newest set)")
    if args.resolve_only:
        return 0
    python = build_env(resolved)
    print(f"canary: {VENV.name} built; running tests/unit and {len(CANARY_E2E)} e2e modules")
    status, failed, summary = run_tests(python, args.workers)
    print(f"canary: {summary}")
    for test in failed:
        print(f"  FAILED {test}")
    if status not in (0, 1):
        print(f"canary: pytest exited {status}", file=sys.stderr)
        return 2
    return 0 if status == 0 and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
