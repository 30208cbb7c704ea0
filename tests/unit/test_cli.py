"""`llm-train` (cli.py): a subcommand that needs an optional dependency this installation lacks says
so in one line naming the pyproject extra, and no subcommand disappears because an extra is missing.
Every subcommand, and train.py itself, takes key.sub=value overrides anywhere among its options.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llm_train import cli, train
from llm_train.commands import report
from llm_train.commands.train import split_args
from tests.helpers import REPO
from tests.optional import import_or_skip
from tests.session_env import OFFLINE_ENV

tomllib = import_or_skip("tomllib")  # Python >= 3.11; the rule it checks does not depend on it

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
        "lm-eval": "eval",
    }
    for package, extra in OPTIONAL.items():
        assert cli.missing_dependency_fix(package) == f"pip install 'llm_train[{extra}]'"
    assert cli.missing_dependency_fix("matplotlib.pyplot") == "pip install 'llm_train[report]'"
    assert cli.missing_dependency_fix("lm_eval") == "pip install 'llm_train[eval]'"  # lm-eval's module
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


# --- overrides anywhere on the command line -------------------------------------------------------------

SUBCOMMANDS = cli.build_parser()._subparsers._group_actions[0].choices
A, B, C = "optim.lr=1e-4", "data.seq_len=64", "optim.max_steps=3"
# Each subcommand's arguments with overrides before, between and after its options, and the
# options' values argparse must still see. (A recipe given as a positional is the first positional:
# `show optim.lr=1 tiny-cpu` asks for a recipe named "optim.lr=1", and says there is none.) The
# subcommands that take none are listed too, and `train` has its own test below: a new subcommand
# cannot be added without saying which it is.
WITH_OVERRIDES = {
    "dry-run": (
        ["--world-size", "2", "tiny-cpu", A, B, "--max-steps", "3", C],
        {"world_size": 2, "max_steps": 3},
    ),
    "show": (["tiny-cpu", A, "--world-size", "2", B, C], {"recipe": "tiny-cpu", "world_size": 2}),
    "plan": (
        [A, "--recipe", "tiny-cpu", B, "--gpus", "1", C, "--gpu-mem", "24"],
        {"gpus": 1, "gpu_mem": 24.0},
    ),
    "doctor": (["--skip-build", A, "--recipe", "tiny-cpu", B, C], {"skip_build": True, "recipe": "tiny-cpu"}),
    "data prepare": ([A, "--recipe", "tiny-cpu", B, C], {"recipe": "tiny-cpu"}),
    "data inspect": (["--recipe", "tiny-cpu", A, "-n", "5", B, C], {"recipe": "tiny-cpu", "n": 5}),
}
WITHOUT_OVERRIDES = {"recipes", "export", "report", "convert", "generate", "chat", "eval"}


def test_every_subcommand_says_whether_it_takes_overrides() -> None:
    covered = {name.split()[0] for name in WITH_OVERRIDES} | WITHOUT_OVERRIDES | {"train"}
    assert covered == set(SUBCOMMANDS)


@pytest.mark.parametrize("command", sorted(WITH_OVERRIDES))
def test_overrides_may_stand_anywhere_among_a_subcommands_options(command: str) -> None:
    argv, options = WITH_OVERRIDES[command]
    args = cli.parse_command(cli.build_parser(), [*command.split(), *argv])
    assert args.overrides == [A, B, C]  # all of them, in the order given (the last one wins)
    assert {key: getattr(args, key) for key in options} == options


def test_overrides_may_stand_anywhere_for_train_py_and_llm_train_train() -> None:
    # `python llm_train/train.py` and `accelerate launch llm_train/train.py` parse with this.
    args = train.parse_args([A, "--recipe", "tiny-cpu", B, "--max-steps", "3", C, "--overwrite"])
    assert (args.overrides, args.max_steps, args.overwrite) == ([A, B, C], 3, True)
    # `llm-train train`: its own flags come out, train.py's arguments keep their order.
    flags, rest = split_args(["--recipe", "tiny-cpu", A, "--num-processes", "2", B, "--max-steps", "3", C])
    assert flags.num_processes == 2
    assert train.parse_args(rest).overrides == [A, B, C]


def test_the_plan_command_of_the_issue_runs_with_overrides_after_an_option(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "--recipe", "8b-1m-sp8-alst", "data.seq_len=524288", "--gpus", "1"]
    assert cli.main([*argv, "deepspeed.sequence_parallel=1"]) == 0
    out = capsys.readouterr().out
    assert "micro 1 x accum 2 x dp 1, seq 524288" in out  # both overrides reached the plan


def test_a_stray_argument_is_still_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["show", "tiny-cpu", "--no-such-flag"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
