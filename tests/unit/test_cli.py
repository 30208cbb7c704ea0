"""`llm-train` (cli.py): a subcommand that needs an optional dependency this installation lacks says
so in one line naming the pyproject extra, and no subcommand disappears because an extra is missing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llm_train import cli
from llm_train.commands import report
from tests.helpers import OFFLINE_ENV, REPO

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11; the rule it checks does not depend on it

EXTRAS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
# Optional packages users meet: every extra except the developers' own tools.
OPTIONAL = {
    req.split(">")[0].split("=")[0].split("[")[0]: extra
    for extra, reqs in EXTRAS.items()
    if extra != "dev"
    for req in reqs
    if not req.startswith("llm_train[")  # an extra that includes another (qlora includes lora)
}

# The optional packages as on an installation without the extras: not found, neither by `import`
# nor by importlib.util.find_spec (which accelerate and transformers use to probe for them).
BLOCK_EXTRAS = f"""
import importlib.machinery, sys
class Hide(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in {sorted(OPTIONAL)!r}:
            return None
        return super().find_spec(name, path, target)
sys.meta_path = [Hide if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""


def test_the_extras_are_the_ones_the_cli_names() -> None:
    assert OPTIONAL == {
        "tensorboard": "tensorboard",
        "peft": "lora",
        "bitsandbytes": "qlora",
        "matplotlib": "report",
    }
    for package, extra in OPTIONAL.items():
        assert cli.missing_dependency_fix(package) == f"pip install 'llm_train[{extra}]'"
    assert cli.missing_dependency_fix("matplotlib.pyplot") == "pip install 'llm_train[report]'"
    assert "reinstall" in (cli.missing_dependency_fix("deepspeed") or "")
    assert cli.missing_dependency_fix("pytest") is None  # a developer tool, not the user's business
    assert cli.missing_dependency_fix("no_such_module") is None


def test_a_command_that_meets_a_missing_extra_says_which_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def needs_matplotlib(args: object) -> int:
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    monkeypatch.setattr(report, "cmd_report", needs_matplotlib)
    assert cli.main(["report", "runs/x"]) == 2
    assert capsys.readouterr().err == "llm-train report: needs matplotlib; pip install 'llm_train[report]'\n"


def test_a_missing_module_that_is_not_a_dependency_is_a_bug_and_keeps_its_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(args: object) -> int:
        raise ModuleNotFoundError("No module named 'llm_train.gone'", name="llm_train.gone")

    monkeypatch.setattr(report, "cmd_report", broken)
    with pytest.raises(ModuleNotFoundError):
        cli.main(["report", "runs/x"])


def test_every_subcommand_is_listed_without_the_optional_extras(tmp_path: Path) -> None:
    # Extras are imported only when their command runs: without them `llm-train` still starts
    # and lists every subcommand, and `report` ends in one line that names its extra.
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    script = (
        BLOCK_EXTRAS
        + "from llm_train import cli\n"
        + "print(sorted(cli.build_parser()._subparsers._group_actions[0].choices))\n"
        + f"sys.exit(cli.main(['report', {str(run)!r}]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env={**OFFLINE_ENV, "PATH": ""},
        capture_output=True,
        text=True,
    )
    listed = cli.build_parser()._subparsers._group_actions[0].choices
    assert result.stdout.strip() == str(sorted(listed)), result.stderr
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "llm_train[report]" in result.stderr, result.stderr
