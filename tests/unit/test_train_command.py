"""`llm-train train` (commands/train.py): the accelerate command it builds, the checks it runs
before any launcher starts, and what it lets through of the launcher's output and exit code.

The launcher outputs below are shortened copies of what accelerate 1.15 / torch 2.13 print
(tests/e2e/test_train_command.py feeds the filter the real thing).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from llm_train import cli, train
from llm_train.commands import train as train_command
from llm_train.commands.train import LauncherOutput, accelerate_argv, launch_options, split_args

ACCELERATE = Path("/venv/bin/accelerate")
ERROR = (
    b"llm-train: error: recipe tiny-cpu.yaml (with overrides): unknown key 'optim.lrr'; did you mean 'lr'?\n"
)


def _flags(**kw: object) -> argparse.Namespace:
    return split_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])[0]


def simple_launcher_traceback(code: int, accelerate: Path = ACCELERATE) -> list[bytes]:
    return [
        b"Traceback (most recent call last):\n",
        f'  File "{accelerate}", line 8, in <module>\n'.encode(),
        b"    sys.exit(main())\n",
        b'  File "/venv/lib/python3.11/site-packages/accelerate/commands/launch.py", line 999, in simple_launcher\n',
        b"    raise subprocess.CalledProcessError(returncode=process.returncode, cmd=cmd)\n",
        b"subprocess.CalledProcessError: Command '['/venv/bin/python', 'llm_train/train.py', '--recipe', "
        + f"'tiny-cpu']' returned non-zero exit status {code}.\n".encode(),
    ]


def accelerate_echo(went_through: list[bytes], span: int = 64 * 8192) -> list[bytes]:
    """What accelerate 1.16's `raise CalledProcessError(...) from RuntimeError(tail)` prints first."""
    tail = b"".join(went_through)[-span:]
    chained = b"\nThe above exception was the direct cause of the following exception:\n\n"
    return (b"RuntimeError: " + tail + b"\n" + chained).splitlines(keepends=True)


def torchrun_failure(code: int, message: str) -> list[bytes]:
    return [
        b"W1130 15:54:04.937000 10210 torch/distributed/elastic/multiprocessing/api.py:1028] "
        b"Sending process 10321 closing signal SIGTERM\n",
        b"E1130 15:54:05.003000 10210 torch/distributed/elastic/multiprocessing/api.py:1002] "
        + f"failed (exitcode: {code}) local_rank: 1 (pid: 10322) of binary: /venv/bin/python\n".encode(),
        b"Traceback (most recent call last):\n",
        f'  File "{ACCELERATE}", line 8, in <module>\n'.encode(),
        b"    raise ChildFailedError(\n",
        b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n",
        b"============================================================\n",
        b"llm_train/train.py FAILED\n",
        b"------------------------------------------------------------\n",
        b"Failures:\n",
        b"[1]:\n",
        b"  rank      : 0 (local_rank: 0)\n",
        b"  exitcode  : -15 (pid: 10321)  (SIGTERM)\n",
        b"  traceback : Signal 15 (SIGTERM) received by PID 10321\n",
        b"------------------------------------------------------------\n",
        b"Root Cause (first observed failure):\n",
        b"[0]:\n",
        b"  rank      : 1 (local_rank: 1)\n",
        f"  exitcode  : {code} (pid: 10322) \n".encode(),
        b"  error_file: /tmp/torchelastic_x/attempt_0/1/error.json\n",
        f"  traceback : {message}\n".encode(),
        b"============================================================\n",
    ]


def filtered(lines: list[bytes], launcher_code: int = 1) -> tuple[list[bytes], int]:
    output = LauncherOutput(ACCELERATE)
    shown = [out for line in lines for out in output.feed(line)]
    rest, code = output.finish(launcher_code)
    return shown + rest, code


# --- the command line ---------------------------------------------------------------------------


def test_processes_and_machines_come_from_the_recipes_hardware() -> None:
    options = launch_options(_flags(), nodes=1, world_size=2)
    cmd = accelerate_argv(options, ["--recipe", "tiny-cpu", "optim.lr=1e-3"], ACCELERATE)
    assert cmd[:3] == [sys.executable, str(ACCELERATE), "launch"]
    assert cmd[cmd.index("--num_processes") + 1] == "2"
    assert cmd[cmd.index("--num_machines") + 1] == "1"
    # train.py's arguments follow the script unchanged and in order; nothing else is added.
    script = cmd.index(str(Path(train.__file__).resolve()))
    assert cmd[script + 1 :] == ["--recipe", "tiny-cpu", "optim.lr=1e-3"]
    assert "--machine_rank" not in cmd and "--use_deepspeed" not in cmd and "--config_file" not in cmd


def test_num_processes_overrides_the_recipe_and_means_one_machine() -> None:
    options = launch_options(_flags(num_processes=4), nodes=4, world_size=32)
    assert (options.num_processes, options.num_machines, options.per_machine) == (4, 1, 4)


def test_a_multi_node_recipe_launches_with_rank_address_port_and_restarts() -> None:
    flags = _flags(main_process_ip="10.0.0.1", machine_rank=3, main_process_port=29555, max_restarts=2)
    cmd = accelerate_argv(
        launch_options(flags, nodes=4, world_size=32), ["--recipe", "70b-zero3"], ACCELERATE
    )
    pairs = dict(zip(cmd[3:-3:2], cmd[4:-3:2], strict=False))
    assert pairs["--num_processes"] == "32" and pairs["--num_machines"] == "4"
    assert pairs["--machine_rank"] == "3" and pairs["--main_process_ip"] == "10.0.0.1"
    assert pairs["--main_process_port"] == "29555" and pairs["--max_restarts"] == "2"


@pytest.mark.parametrize(
    "flags, nodes, fragment",
    [
        ({}, 4, "need --main-process-ip"),
        ({"num_processes": 3, "num_machines": 2}, 1, "not a multiple of --num-machines 2"),
        ({"num_processes": 0}, 1, "must be at least 1"),
        ({"num_machines": 0}, 1, "must be at least 1"),
        (
            {"num_machines": 2, "main_process_ip": "h", "machine_rank": 2},
            1,
            "--machine-rank 2: must be in 0..1",
        ),
    ],
)
def test_impossible_process_counts_are_one_line_errors(flags: dict, nodes: int, fragment: str) -> None:
    with pytest.raises(train_command.UserError, match=fragment.replace("(", r"\(").replace(".", r"\.")):
        launch_options(_flags(**flags), nodes=nodes, world_size=8 * nodes)


def test_train_py_flags_are_never_taken_for_launch_flags() -> None:
    flags, rest = split_args(
        ["--recipe", "x", "--max-steps", "3", "--max-restarts", "2", "--max", "1", "a.b=1"]
    )
    assert flags.max_restarts == 2
    assert rest == ["--recipe", "x", "--max-steps", "3", "--max", "1", "a.b=1"]


def test_accelerates_default_warning_is_silenced_only_with_its_own_defaults() -> None:
    options = launch_options(_flags(), nodes=1, world_size=2)
    quiet = accelerate_argv(options, [], ACCELERATE, quiet_defaults=True)
    assert (
        quiet[quiet.index("--mixed_precision") + 1] == "no"
        and quiet[quiet.index("--dynamo_backend") + 1] == "no"
    )
    # A machine with an accelerate config keeps its values: nothing here may override them.
    loud = accelerate_argv(options, [], ACCELERATE, quiet_defaults=False)
    assert "--mixed_precision" not in loud and "--dynamo_backend" not in loud


# --- validation before any launcher -------------------------------------------------------------


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(train_command.subprocess, "Popen", refuse)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--recipe", "tiny-cpu", "optim.lrr=1"], "unknown key 'optim.lrr'"),
        (["--recipe", "no-such-recipe"], "no-such-recipe"),
        (["--recipe", "tiny-cpu", "--ds-config", "zero9"], "zero9"),
        (["--recipe", "tiny-cpu", "--world-size", "2"], "--world-size only applies to --dry-run"),
        # The layout is checked for the world this command will launch, not the recipe's.
        (
            ["--recipe", "tiny-cpu-tp2", "--num-processes", "3"],
            "world size 3 is not divisible by tensor parallel 2",
        ),
    ],
)
def test_a_bad_input_is_one_line_exit_2_and_starts_no_launcher(
    no_launch: None, capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str
) -> None:
    assert cli.main(["train", *argv]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("llm-train: error: ") and fragment in err, err
    assert "launching" not in out


def test_the_start_checks_run_before_the_launcher(
    no_launch: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "metrics.jsonl").write_text("{}\n")  # a directory that holds another run
    assert cli.main(["train", "--recipe", "tiny-cpu", "--output-dir", str(tmp_path)]) == 2
    assert "already holds a run; pass --overwrite" in capsys.readouterr().err


def test_a_valid_run_is_launched_with_the_recipes_processes_and_ends_with_the_workers_code(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[list[str]] = []

    def fake_run(cmd: list[str], accelerate: Path, write: object) -> int:
        seen.append(cmd)
        return 75  # preempted: the workers' code, not the launcher's

    monkeypatch.setattr(train_command, "run_launcher", fake_run)
    argv = ["train", "--recipe", "tiny-cpu", "--output-dir", str(tmp_path / "run"), "--max-steps", "3"]
    assert cli.main(argv) == 75
    (cmd,) = seen
    assert cmd[cmd.index("--num_processes") + 1] == "2"  # tiny-cpu: hardware.processes_per_node 2
    assert cmd[-4:] == ["--output-dir", str(tmp_path / "run"), "--max-steps", "3"]
    assert "llm-train: launching 2 process(es)" in capsys.readouterr().out


# --- the launcher's output ----------------------------------------------------------------------


def test_after_a_user_error_the_simple_launchers_traceback_is_dropped_and_its_code_kept() -> None:
    lines = [b"starting 2 local worker(s) of a world of 2\n", ERROR, *simple_launcher_traceback(2)]
    shown, code = filtered(lines)
    assert shown == lines[:2] and code == 2


@pytest.mark.parametrize("worker_code, exit_code", [(1, 1), (-9, 137), (250, 250)])
def test_a_failure_llm_train_did_not_explain_keeps_the_launchers_traceback(
    worker_code: int, exit_code: int
) -> None:
    lines = [b"step 1/3\n", *simple_launcher_traceback(worker_code)]
    shown, code = filtered(lines)
    assert shown == lines and code == exit_code


def test_a_workers_own_traceback_passes_straight_through() -> None:
    worker = [
        b"Traceback (most recent call last):\n",
        b'  File "/repo/llm_train/train.py", line 210, in <module>\n',
        b"RuntimeError: boom\n",
    ]
    output = LauncherOutput(ACCELERATE)
    assert output.feed(worker[0]) == []  # held one line: is it the launcher's?
    assert output.feed(worker[1]) == worker[:2]
    assert output.feed(worker[2]) == worker[2:]


def test_accelerate_1_16s_echo_of_the_workers_stderr_is_dropped_with_its_traceback() -> None:
    went_through = [b"starting 2 local worker(s) of a world of 2\n", ERROR]
    shown, code = filtered([*went_through, *accelerate_echo(went_through), *simple_launcher_traceback(2)])
    assert shown == went_through and code == 2
    # An unexplained failure keeps the launcher's traceback, but not the repeat of what went through.
    went_through = [b"step 1/3\n", b"Traceback (most recent call last):\n", b'  File "train.py"\n', b"boom\n"]
    traceback = simple_launcher_traceback(1)
    shown, code = filtered([*went_through, *accelerate_echo(went_through), *traceback])
    assert shown == went_through + traceback and code == 1


def test_an_echo_of_a_long_run_starts_inside_a_line_and_is_still_recognised() -> None:
    # 1.2 MB went through: the echo is its last 512 KiB, which begin in the middle of a line.
    went_through = [f"step {i:6d} {'x' * 88}\n".encode() for i in range(12_000)] + [ERROR]
    echo = accelerate_echo(went_through)
    assert not echo[0][len(b"RuntimeError: ") :].startswith(b"step")
    shown, code = filtered([*went_through, *echo, *simple_launcher_traceback(2)])
    assert shown == went_through and code == 2


def test_a_runtime_error_that_repeats_nothing_is_held_no_longer_than_it_matches() -> None:
    output = LauncherOutput(ACCELERATE)
    assert output.feed(b"boom\n") == [b"boom\n"]
    # Its text went through before, so it may be an echo: held, until the next line is not a repeat.
    assert output.feed(b"RuntimeError: boom\n") == []
    assert output.feed(b"step 2/3\n") == [b"RuntimeError: boom\n", b"step 2/3\n"]
    assert output.feed(b"RuntimeError: never seen\n") == [b"RuntimeError: never seen\n"]
    # Cut off in the middle of an echo, the launcher's code stands and nothing held is lost.
    assert output.feed(b"RuntimeError: step 2/3\n") == []
    assert output.finish(1) == ([b"RuntimeError: step 2/3\n"], 1)


def test_torchruns_report_is_dropped_but_its_root_cause_line_kept_when_no_rank_printed_it() -> None:
    message = ERROR.decode().strip()
    shown, code = filtered(torchrun_failure(2, message))
    assert shown == [ERROR] and code == 2
    # Printed by rank 0 already: not a second time.
    shown, code = filtered([ERROR, *torchrun_failure(2, message)])
    assert shown == [ERROR] and code == 2


def test_torchruns_report_of_an_unexplained_failure_is_kept_whole() -> None:
    lines = torchrun_failure(-11, "Signal 11 (SIGSEGV) received by PID 10322")
    shown, code = filtered(lines)
    assert shown == lines and code == 139


def test_a_successful_run_passes_every_line_in_order() -> None:
    lines = [b"W1130 torch/distributed/run.py:874] *****\n", b"step 1/3\n", b"exported\n"]
    assert filtered(lines, launcher_code=0) == (lines, 0)


def test_run_launcher_streams_a_real_process_and_returns_the_workers_code(tmp_path: Path) -> None:
    # A stand-in for accelerate: a worker line, the one-line error, then the real CalledProcessError
    # traceback Python prints when it escapes a script (its first frame names the script).
    fake = tmp_path / "accelerate"
    fake.write_text(
        "import subprocess, sys\n"
        "print('starting 2 local worker(s)', file=sys.stderr, flush=True)\n"
        f"print({ERROR.decode().strip()!r}, file=sys.stderr, flush=True)\n"
        "raise subprocess.CalledProcessError(returncode=2, cmd=['python', 'llm_train/train.py'])\n"
    )
    written: list[bytes] = []
    code = train_command.run_launcher([sys.executable, str(fake)], fake, written.append)
    assert code == 2
    assert written == [b"starting 2 local worker(s)\n", ERROR]
    assert subprocess.run([sys.executable, str(fake)], capture_output=True).returncode == 1  # what it hides
