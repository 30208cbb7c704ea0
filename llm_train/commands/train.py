"""`llm-train train --recipe NAME [train.py's flags]`: validate in one process, then `accelerate launch`.

Why not just `accelerate launch llm_train/train.py`: that keeps working, but Accelerate turns any
non-zero exit of the workers into its own traceback (its simple launcher's `CalledProcessError`
on CPU, torchrun's per-rank `ChildFailedError` report on GPUs) printed under llm_train's one-line
message (seen with both launchers; validating in one process before the launcher starts is the only
way to keep a bad input to one line). So this command

1. resolves the recipe, overrides, DeepSpeed JSON and layout for the world size it will launch,
   and runs the start-up checks train.py runs (the same functions, `train.resolve` and
   `train.check_before_start`): a bad input is one line and exit 2, and no launcher starts;
2. runs `accelerate launch` as a child, with the number of processes and machines taken from
   `--num-processes` / `--num-machines`, else from the user's accelerate config (`--config-file`, or
   the default one `accelerate config` wrote), else from the recipe's `hardware:` section; the
   config's what-fields are read first, as the workers will read them
   (config/accelerate_launch.py): a kind llm_train cannot train under is one line here, and the
   rest reach the run's start-up notice;
3. streams the launcher's stderr through, and when the workers ended with one of llm_train's own
   exit codes (each of which has printed its one line) drops the launcher's traceback or failure
   report that follows, and exits with the workers' code instead of the launcher's 1;
4. hands a stop signal (SIGTERM, SIGUSR1) on to the workers once each, so that they checkpoint and
   exit 75 (preempted, resumable) and this command does too.

Anything it does not recognise (a worker crash, a signal, another Accelerate version's format) is
passed through untouched, with the launcher's exit code: hiding an unknown failure would be worse
than a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
from accelerate.commands.config import default_config_file

from llm_train import train
from llm_train.config import accelerate_launch
from llm_train.config.accelerate_launch import AccelerateLaunch
from llm_train.config.hardware import Device
from llm_train.config.recipe import load_recipe
from llm_train.errors import (
    EXIT_CHECKPOINT_IO,
    EXIT_NONFINITE,
    EXIT_PREEMPTED,
    EXIT_USER_ERROR,
    UserError,
    first_line,
)
from llm_train.runtime.base.launch_env import read_accelerate_launch

# Exit codes after which a worker has already said what happened in its own words.
SELF_EXPLAINED = frozenset({EXIT_USER_ERROR, EXIT_NONFINITE, EXIT_CHECKPOINT_IO, EXIT_PREEMPTED})

# The two ways a launcher reports failed workers (accelerate 1.x, torch.distributed.elastic 2.x).
_SIMPLE_LAUNCHER_EXIT = re.compile(r"CalledProcessError: Command .* returned non-zero exit status (-?\d+)\.")
_ELASTIC_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):(?:.|\n)*?exitcode\s*:\s*(-?\d+)")
# torchrun's own log lines about the failure, printed just before its report.
_ELASTIC_FAILURE_LOG = re.compile(
    r"^[EW]\d{4} [\d:.]+ \d+ \S*torch/distributed/elastic/\S*\] "
    r"(?:failed \(exitcode: -?\d+\)|Sending process \d+ closing signal)"
)
# What a worker wrote to torchrun's error file (runtime/launch_env.record_error), as the report shows it.
_ELASTIC_ROOT_MESSAGE = re.compile(r"Root Cause \(first observed failure\):(?:.|\n)*?traceback\s*:\s*(.*)")
_TRACEBACK = b"Traceback (most recent call last):\n"
# accelerate 1.16's simple launcher raises its CalledProcessError `from RuntimeError(tail)`, where
# tail is the last 64 chunks of 8 KiB of the workers' stderr (launch.py CHILD_STDERR_TAIL_CHUNKS and
# CHILD_STDERR_CHUNK_SIZE): up to 512 KiB that already went through, printed again as
# "RuntimeError: <tail>", a blank line, then Python's chaining sentence, before the traceback.
_ECHO_PREFIX = b"RuntimeError: "
_ECHO_END = (b"\n", b"\n", b"The above exception was the direct cause of the following exception:\n", b"\n")
_ECHO_SPAN = 64 * 8192 + 8192  # what the echo can repeat, and the line it may begin inside
_ERROR_PREFIX = "llm-train: error:"


@dataclass(frozen=True)
class LaunchOptions:
    """Where the processes run: the only things this command adds to train.py's flags."""

    num_processes: int  # over all machines, as `accelerate launch --num_processes` counts them
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str | None = None
    main_process_port: int | None = None
    max_restarts: int | None = None
    config_file: str | None = None  # the user's accelerate config, handed to accelerate as given

    @property
    def per_machine(self) -> int:
        return self.num_processes // self.num_machines


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llm-train train",
        description="Validate a run in one process, then start it with `accelerate launch`.",
        epilog="Every other argument is llm_train/train.py's (--recipe, --output-dir, --resume, "
        "key.sub=value overrides, ...): see `python llm_train/train.py --help`.",
        # train.py's --max-steps must never be taken for an abbreviation of --max-restarts.
        allow_abbrev=False,
    )
    parser.add_argument(
        "--num-processes",
        type=int,
        help="Processes over all machines (default: the recipe's hardware nodes x processes_per_node).",
    )
    parser.add_argument(
        "--num-machines",
        type=int,
        help="Machines (default: the recipe's hardware.nodes, or 1 with --num-processes).",
    )
    parser.add_argument("--machine-rank", type=int, help="This machine's rank (multi-node; default 0).")
    parser.add_argument("--main-process-ip", help="Address of machine 0 (multi-node).")
    parser.add_argument(
        "--main-process-port", type=int, help="Rendezvous port (default: accelerate's 29500)."
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        help="Passed to accelerate: restarts of failed workers (torchrun launchers).",
    )
    parser.add_argument(
        "--config-file",
        help="An accelerate config (what `accelerate config` writes; default: its default file, if any). "
        "Its processes and machines are used; its DeepSpeed fields and mixed_precision are reconciled "
        "with the recipe (one notice at start; its deepspeed_config_file stands for --ds-config).",
    )
    return parser


def split_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This command's own flags, and everything else (train.py's arguments, in their order)."""
    return _parser().parse_known_args(argv)


def launch_options(flags: argparse.Namespace, nodes: int, world_size: int) -> LaunchOptions:
    """The processes to start: flags first, then `nodes` x per node = `world_size` (config or recipe)."""
    explicit = flags.num_processes is not None
    num_processes = flags.num_processes if explicit else world_size
    # A process count on the command line is for this machine unless machines are named too.
    num_machines = flags.num_machines if flags.num_machines is not None else (1 if explicit else nodes)
    if num_processes < 1 or num_machines < 1:
        raise UserError(
            f"--num-processes {num_processes} / --num-machines {num_machines}: both must be at least 1"
        )
    if num_processes % num_machines:
        raise UserError(
            f"--num-processes {num_processes} is not a multiple of --num-machines {num_machines}: every "
            "machine runs the same number of processes (give the total over all machines)"
        )
    if num_machines > 1 and not flags.main_process_ip:
        raise UserError(
            f"{num_machines} machines need --main-process-ip (machine 0's address) and --machine-rank on "
            "each machine; on one machine pass --num-processes N (see launch/README.md)"
        )
    machine_rank = int(flags.machine_rank or 0)
    if not 0 <= machine_rank < num_machines:
        raise UserError(f"--machine-rank {machine_rank}: must be in 0..{num_machines - 1}")
    return LaunchOptions(
        num_processes=num_processes,
        num_machines=num_machines,
        machine_rank=machine_rank,
        main_process_ip=flags.main_process_ip,
        main_process_port=flags.main_process_port,
        max_restarts=flags.max_restarts,
        config_file=getattr(flags, "config_file", None),
    )


def accelerate_argv(
    options: LaunchOptions, train_argv: list[str], accelerate: Path, quiet_defaults: bool = True
) -> list[str]:
    """The `accelerate launch` command line that starts train.py with `train_argv`.

    Run through this Python and accelerate's own script, so that train.py recognises its parent as
    `accelerate launch` (runtime/base/launch_env.py reads the parent's command line on CPU). With
    `quiet_defaults` (no accelerate config file on this machine) it also names the values Accelerate
    would otherwise default with a five-line warning; they are its defaults, so nothing changes.
    """
    cmd = [sys.executable, str(accelerate), "launch", "--num_processes", str(options.num_processes)]
    if options.config_file is not None:
        cmd += ["--config_file", options.config_file]
    cmd += ["--num_machines", str(options.num_machines)]
    if options.num_machines > 1:
        cmd += [
            "--machine_rank",
            str(options.machine_rank),
            "--main_process_ip",
            str(options.main_process_ip),
        ]
    if options.main_process_port is not None:
        cmd += ["--main_process_port", str(options.main_process_port)]
    if options.max_restarts is not None:
        cmd += ["--max_restarts", str(options.max_restarts)]
    if quiet_defaults:
        cmd += ["--mixed_precision", "no", "--dynamo_backend", "no"]
    return [*cmd, str(Path(train.__file__).resolve()), *train_argv]


def find_accelerate() -> Path:
    """accelerate's command, next to this Python first (a virtual environment need not be on PATH)."""
    here = Path(sys.executable).with_name("accelerate")
    found = here if here.is_file() else (Path(p) if (p := shutil.which("accelerate")) else None)
    if found is None:
        raise UserError(
            f"llm-train train: accelerate's `accelerate` command is not installed next to {sys.executable} "
            "nor on PATH; pip install accelerate (or run `accelerate launch llm_train/train.py ...`)"
        )
    return found


def _has_accelerate_config(flags: argparse.Namespace) -> bool:
    """Whether accelerate will read a config (then its values stand, warning and all)."""
    return flags.config_file is not None or os.path.isfile(default_config_file)


def read_launch(args: list[str], config_file: str | None) -> tuple[argparse.Namespace, AccelerateLaunch]:
    """Accelerate's reading of an `accelerate launch` line (runtime/base/launch_env.py), its refusals as one line."""
    try:
        return read_accelerate_launch(args)
    except (ValueError, OSError, TypeError) as exc:
        # accelerate 1.15 raises these for a config it cannot load (unknown keys, a missing file) or
        # flags that contradict each other; it would print them as a traceback.
        where = f"accelerate config {config_file or default_config_file}"
        raise UserError(f"{where}: {first_line(exc)}") from None


def config_world(flags: argparse.Namespace, script: str) -> tuple[int, int] | None:
    """(machines, processes) the user's accelerate config sets, if accelerate will read one that does.

    The config's machine rank, address and port also become the defaults of `flags` (this command
    passes them on the accelerate line, which would otherwise override the config's with its own).
    """
    if not _has_accelerate_config(flags):
        return None
    args = ["--config_file", flags.config_file] if flags.config_file is not None else []
    parsed, _ = read_launch([*args, script], flags.config_file)
    for name in ("machine_rank", "main_process_ip", "main_process_port"):
        if getattr(flags, name) is None:
            setattr(flags, name, getattr(parsed, name, None))
    processes = int(parsed.num_processes or 0)
    if processes < 1:  # a config that leaves it to the command line (-1, as for SLURM)
        return None
    return int(parsed.num_machines or 1), processes


class LauncherOutput:
    """Streams the launcher's stderr; holds back its traceback / failure report until the end.

    Feed it every line; it returns what to print now. A traceback whose first frame is the
    accelerate command itself (and torchrun's failure log lines just before it) is held; at the
    end, `finish` drops it if the workers' exit code is one of llm_train's own, else returns it.
    Workers' tracebacks start in train.py, never in the accelerate command, and pass straight
    through. The echo accelerate >= 1.16 prints before its traceback (see _ECHO_PREFIX) is held
    while it repeats, line for line, the end of what went through; it is dropped with the
    launcher's traceback, and released the moment a line does not repeat.
    """

    def __init__(self, accelerate: Path) -> None:
        self._frame = f'  File "{accelerate}"'.encode()
        self._held: list[bytes] = []
        self._maybe_traceback = False  # the last line was "Traceback ...": is it the launcher's?
        self._launcher_traceback = False
        self._printed_errors: set[str] = set()  # the workers' one-line errors that went through
        self._seen: list[bytes] = []  # the last _ECHO_SPAN bytes fed (or more), what an echo repeats
        self._seen_bytes = 0
        self._echo: list[bytes] = []  # lines held as a possible echo
        self._echo_next: list[int] = []  # per place the echo may start: the index it expects next
        self._echo_whole = False  # the echo ran to the end of _ECHO_END

    def feed(self, line: bytes) -> list[bytes]:
        if self._launcher_traceback:
            self._held.append(line)
            return []
        if self._echo and not self._echo_whole:
            return self._follow_echo(line)
        if self._maybe_traceback:
            self._maybe_traceback = False
            if line.startswith(self._frame):
                self._launcher_traceback = True
                self._held += [_TRACEBACK, line]
                self._echo = []  # a repeat of what went through
                return []
            self._remember([line])
            return self._release([_TRACEBACK, line])
        if line.startswith(_ECHO_PREFIX) and not self._echo:
            body = line[len(_ECHO_PREFIX) :]
            starts = [i + 1 for i, seen in enumerate(self._seen) if seen.endswith(body)]
            if starts:
                self._echo, self._echo_next = [line], starts
                return []
        self._remember([line])
        if line == _TRACEBACK:
            self._maybe_traceback = True
            return []
        if _ELASTIC_FAILURE_LOG.match(line.decode(errors="replace")):
            self._held.append(line)
            return []
        return self._release([line])

    def finish(self, launcher_code: int) -> tuple[list[bytes], int]:
        """(lines still to print, the exit code to end with)."""
        if self._maybe_traceback:
            self._held.append(_TRACEBACK)
        text = b"".join(self._held).decode(errors="replace")
        found = _SIMPLE_LAUNCHER_EXIT.search(text) or _ELASTIC_ROOT_CAUSE.search(text)
        if not self._launcher_traceback or found is None:
            return [*self._echo, *self._held], launcher_code
        code = int(found.group(1))
        if code < 0:  # killed by a signal: the shell's convention
            code = 128 - code
        if code not in SELF_EXPLAINED:
            return self._held, code
        # Only rank 0 prints; when another rank fails first, torchrun stops rank 0 before it can, and
        # the report (from the worker's error file) is the one place the line is: keep that line.
        cause = _ELASTIC_ROOT_MESSAGE.search(text)
        message = cause.group(1).strip() if cause else ""
        if message.startswith(_ERROR_PREFIX) and message not in self._printed_errors:
            return [f"{message}\n".encode()], code
        return [], code

    def _follow_echo(self, line: bytes) -> list[bytes]:
        """One more line of a possible echo: still the repeat (held), or not (all of it released)."""
        seen, end = len(self._seen), len(self._seen) + len(_ECHO_END)

        def expected(i: int) -> bytes | None:
            return self._seen[i] if i < seen else _ECHO_END[i - seen] if i < end else None

        following = [i + 1 for i in self._echo_next if expected(i) == line]
        if following:
            self._echo.append(line)
            self._echo_next = following
            self._echo_whole = end in following
            return []
        echo, self._echo = self._echo, []
        self._remember(echo)
        return self._release(echo) + self.feed(line)

    def _remember(self, lines: list[bytes]) -> None:
        self._seen += lines
        self._seen_bytes += sum(map(len, lines))
        if self._seen_bytes > 2 * _ECHO_SPAN:  # trimmed in halves, so that remembering stays cheap
            drop = 0
            while self._seen_bytes - len(self._seen[drop]) >= _ECHO_SPAN:
                self._seen_bytes -= len(self._seen[drop])
                drop += 1
            del self._seen[:drop]

    def _release(self, lines: list[bytes]) -> list[bytes]:
        out, self._held = [*self._echo, *self._held, *lines], []
        self._echo, self._echo_whole = [], False
        for line in out:
            text = line.decode(errors="replace").strip()
            if text.startswith(_ERROR_PREFIX):
                self._printed_errors.add(text)
        return out


def run_launcher(cmd: list[str], accelerate: Path, write: Callable[[bytes], None]) -> int:
    """Run `cmd`, filtering its stderr through LauncherOutput; the workers' exit code."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE)

    def forward(signum: int, _frame: object) -> None:
        # A stop signal (SIGTERM, SLURM's SIGUSR1) must reach each worker once: they checkpoint and exit
        # 75. So it goes to the launcher's children: torchrun's workers, or under the simple launcher
        # train.py's own spawner, which relays it. The simple launcher itself would just die of it and
        # leave the workers running.
        try:
            children = psutil.Process(proc.pid).children()
        except psutil.Error:
            children = []
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.send_signal(signum)
        if not children and proc.poll() is None:
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    # Ctrl-C already reaches the launcher and the workers (one process group); do not die before them.
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        output = LauncherOutput(accelerate)
        assert proc.stderr is not None
        for line in iter(proc.stderr.readline, b""):
            for out in output.feed(line):
                write(out)
        rest, code = output.finish(proc.wait())
        for out in rest:
            write(out)
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stderr_bytes(data: bytes) -> None:
    stream = getattr(sys.stderr, "buffer", None)
    if stream is None:
        sys.stderr.write(data.decode(errors="replace"))
        sys.stderr.flush()
    else:
        stream.write(data)
        stream.flush()


def main(argv: list[str]) -> int:
    """`llm-train train`; raises UserError for a bad input (cli.py prints it as one line)."""
    flags, rest = split_args(argv)
    args = train.parse_args(rest)
    if args.dry_run:
        return train.main(rest)
    if args.world_size is not None:
        raise UserError("--world-size only applies to --dry-run; llm-train train takes --num-processes")
    recipe = load_recipe(args.recipe, args.overrides)
    script = str(Path(train.__file__).resolve())
    nodes, world_size = config_world(flags, script) or (recipe.hardware.nodes, recipe.hardware.world_size)
    options = launch_options(flags, nodes, world_size)
    accelerate = find_accelerate()
    cmd = accelerate_argv(options, rest, accelerate, quiet_defaults=not _has_accelerate_config(flags))
    # What accelerate will make of exactly this command line: refused here, before any launcher starts.
    _, settings = read_launch(cmd[3:], flags.config_file)
    accelerate_launch.refuse(settings)
    run = train.resolve(args, options.num_processes, Device.detect(), settings)
    train.check_before_start(run, args, options.per_machine)
    # The command itself, so that a user can see (and rerun) exactly what was started.
    print(f"llm-train: launching {run.layout.world_size} process(es): {' '.join(cmd[1:])}", flush=True)
    return run_launcher(cmd, accelerate, _stderr_bytes)
