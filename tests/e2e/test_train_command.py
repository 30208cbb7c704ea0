"""`llm-train train` launches real workers through accelerate; what a user error looks like under each launcher.

Plain `accelerate launch` keeps its own traceback after llm_train's one line (nothing a worker can
do removes it: the launcher raises after the worker has exited); these tests pin down exactly how
much there is, and that `llm-train train` shows none of it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.version import Version

from llm_train.commands.train import LauncherOutput
from tests.helpers import (
    ACCELERATE,
    OFFLINE_ENV,
    REPO,
    TRAIN,
    assert_ok,
    free_port,
    losses,
    run_cmd,
    wait_for_step,
)

pytestmark = pytest.mark.e2e

LLM_TRAIN = Path(sys.executable).with_name("llm-train")
BAD = ["--recipe", "tiny-cpu", "optim.lrr=1"]
ERROR = "llm-train: error: recipe tiny-cpu.yaml (with overrides): unknown key 'optim.lrr'; did you mean 'lr'?"
# accelerate's "values were not passed ... had defaults used instead" warning is not under test.
QUIET = ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]


def _plain_launch(nproc: int, *extra: str) -> tuple[list[str], int]:
    cmd = [str(ACCELERATE), "launch", *extra, "--num_processes", str(nproc), *QUIET]
    result = run_cmd([*cmd, "--main_process_port", str(free_port()), str(TRAIN), *BAD], timeout=300)
    return result.stderr.splitlines(keepends=True), result.returncode


def _through_llm_train(lines: list[str]) -> tuple[list[str], int]:
    """What `llm-train train` would show of this launcher output, and the code it would end with."""
    output = LauncherOutput(ACCELERATE)
    shown = [out for line in lines for out in output.feed(line.encode())]
    rest, code = output.finish(1)
    return [line.decode() for line in shown + rest], code


def test_llm_train_train_runs_the_recipes_two_processes_and_finishes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["train", "--recipe", "tiny-cpu", "--output-dir", str(run_dir), "--max-steps", "3"]
    args += ["--main-process-port", str(free_port()), "optim.warmup_steps=0", "output.log_every=1"]
    result = run_cmd([str(LLM_TRAIN), *args, "eval.every=0", "eval.batches=1", "output.sample_prompt=null"])
    assert_ok(result)
    assert "llm-train: launching 2 process(es)" in result.stdout  # from tiny-cpu's hardware section
    world = json.loads((run_dir / "world.json").read_text())
    assert world["world_size"] == 2 and [r["rank"] for r in world["ranks"]] == [0, 1]
    assert sorted(losses(run_dir)) == [1, 2, 3]
    assert "Traceback" not in result.stderr


def test_a_stop_signal_to_llm_train_train_checkpoints_and_ends_with_75(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["train", "--recipe", "tiny-cpu", "--output-dir", str(run_dir), "--max-steps", "200"]
    args += ["--main-process-port", str(free_port()), "output.log_every=1", "eval.every=0"]
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen(
            [str(LLM_TRAIN), *args],
            cwd=REPO,
            env={**os.environ, **OFFLINE_ENV},
            stdout=out,
            stderr=err,
            start_new_session=True,  # only so that a failing test can clean up the whole group
        )
        try:
            assert wait_for_step(run_dir, 2, proc), (tmp_path / "err").read_text()[-3000:]
            proc.send_signal(signal.SIGTERM)  # to llm-train alone, as a scheduler's `kill` would
            code = proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    stderr = (tmp_path / "err").read_text()
    assert code == 75, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert (run_dir / "checkpoints" / "latest").is_file()
    assert max(losses(run_dir)) < 200  # stopped by the signal, not by the end of the run


def test_llm_train_train_with_a_bad_override_is_one_line_and_starts_no_launcher() -> None:
    result = run_cmd([str(LLM_TRAIN), "train", *BAD], timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(ERROR), result.stderr
    assert "launching" not in result.stdout


@pytest.mark.parametrize("nproc", [1, 2])
def test_plain_accelerate_launch_adds_only_its_own_traceback_to_the_one_line(nproc: int) -> None:
    lines, code = _plain_launch(nproc)
    assert code == 1  # the simple launcher's CalledProcessError, whatever the workers' code
    ours = [line for line in lines if line.startswith("llm-train: error:")]
    assert len(ours) == 1 and ours[0].startswith(ERROR)
    # Everything else is accelerate's traceback: 10 lines with accelerate 1.15, 13 with 1.16 (Python 3.11),
    # beginning at accelerate's own command and ending in the CalledProcessError that names exit status 2.
    rest = lines[lines.index(ours[0]) + 1 :]
    assert lines[: lines.index(ours[0])] == []
    if Version(version("accelerate")) >= Version("1.16"):
        # Which raises it `from RuntimeError(<the workers' stderr>)`: here, the one line again.
        chained = ["\n", "\n", "The above exception was the direct cause of the following exception:\n", "\n"]
        assert rest[:5] == [f"RuntimeError: {ours[0]}", *chained], "".join(rest)
        rest = rest[5:]
    assert rest[0] == "Traceback (most recent call last):\n" and str(ACCELERATE) in rest[1]
    assert rest[-1].startswith("subprocess.CalledProcessError") and "exit status 2." in rest[-1]
    assert len(rest) <= 14, "".join(rest)
    # Under `llm-train train` the same output is the one line and exit code 2.
    assert _through_llm_train(lines) == (ours, 2)


def test_plain_accelerate_launch_quiet_is_the_one_line_but_exit_1() -> None:
    lines, code = _plain_launch(2, "-q")
    assert code == 1 and len(lines) == 1 and lines[0].startswith(ERROR), lines


def test_torchruns_report_names_the_error_and_llm_train_train_shows_only_the_line() -> None:
    # --use_deepspeed takes accelerate's torchrun path on CPU: the report GPU users get.
    lines, code = _plain_launch(2, "--use_deepspeed")
    assert code == 1
    text = "".join(lines)
    assert "ChildFailedError" in text
    # The worker's error file puts the line into the report, even when torchrun stopped rank 0
    # before rank 0 (the only rank that prints) got to it.
    root_cause = text.split("Root Cause (first observed failure):")[1]
    assert f"traceback : {ERROR}" in root_cause, text
    shown, code = _through_llm_train(lines)
    assert code == 2
    assert [line for line in shown if line.startswith("llm-train: error:")] == [lines_with(ERROR, lines)]
    assert not any(word in "".join(shown) for word in ("Traceback", "ChildFailedError", "failed (exitcode"))


def lines_with(prefix: str, lines: list[str]) -> str:
    """The error line as the workers or the report carry it (the report indents it)."""
    for line in lines:
        if prefix in line:
            return line[line.index(prefix) :].rstrip() + "\n"
    raise AssertionError(f"{prefix!r} not in the output")
