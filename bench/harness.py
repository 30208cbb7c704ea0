"""The one harness under every prepared GPU check: cases in time boxes, launches watched, verdicts, results.

A check is a list of `Case`s (bench/consumer.py, bench/full_ft.py, bench/mfu_matrix.py); `run_cases`
runs them in order inside one `Budget`, each in its own time box, and writes each case's JSON line the
moment it ends (`Results`). A case launches real `python llm_train/train.py` processes through
`launch`, which polls them (host memory as PSS, the device's memory through NVML, locked pages and
block I/O of the process tree) and stops them when told; its numbers are judged with `verdict` /
`judge` against the planner's estimate for the same configuration (+-15%) and against targets.
If this process is stopped (SIGTERM, SIGINT: the device tool's limit, a user), `Results.stop` kills
the running launch, writes the case in progress as a failed line with its log tail, then the summary.

Files (the device tool brings back at most 8): NAME.jsonl (one line per case), NAME.log (each launch's
command and output tail), NAME_summary.json; in --out DIR or $OUT with those names, else dated in
bench/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from llm_train.units import GiB

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "llm_train" / "train.py"
ASSETS = REPO / "llm_train" / "assets" / "tiny"
TOKENIZER = ASSETS / "tokenizer"
CORPUS = ASSETS / "corpus.txt"
OFFLINE_ENV = {  # nothing may wait on a network that is not there
    **dict.fromkeys(
        ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "PYTHONUNBUFFERED"), "1"
    ),
    "WANDB_MODE": "disabled",
}
TAIL_CHARS = 3000
ESTIMATE_TOLERANCE = 0.15  # the planner's stated precision (~15% on memory and speed)
NOT_JUDGED = "cpu-tiny: the planner's estimates and the targets are for GPUs"


def as_a_training_worker() -> None:
    """The library set-up every training worker makes first (runtime/session.py prepare_libraries).

    For a benchmark that runs DeepSpeed in its own process: with DeepSpeed's default build flags and
    another ninja it would JIT-build the ops again (pin_memory, cpu_adam: minutes on 2 cores), and the
    next training run would rebuild them back (seen in CI: bench.pinning_copy_time's 16 MiB case spent
    its time box building pin_memory). Also skips the unused shm op and quiets library logs.
    """
    from llm_train.runtime.session import prepare_libraries

    prepare_libraries(verbose=False)


def module_cmd(module: str, *args: str) -> list[str]:
    """`python -m bench.X ...`: run from the repository root, bench is a package there."""
    return [sys.executable, "-m", module, *args]


def capped_train(cap_gib: float, host_ram_gib: float | None = None) -> list[str]:
    """train.py under a GPU memory cap (and an emulated host RAM): bench/capped_train.py."""
    host = ["--host-ram-gib", f"{host_ram_gib:g}"] if host_ram_gib else []
    return module_cmd("bench.capped_train", "--gpu-cap-gib", f"{cap_gib:g}", *host)


def accelerate_launch(target: str, *args: str, deepspeed: bool = False) -> list[str]:
    """`accelerate launch` of a script (`llm_train/train.py`) or a module (`bench.overhead`) on 2 CPU
    processes, on its own port (run from the repository root)."""
    from llm_train.runtime.base.launch_env import free_port

    accelerate = Path(sys.executable).with_name("accelerate")
    flags = ["--use_deepspeed"] if deepspeed else []
    port = ["--main_process_port", str(free_port())]
    entry = [target] if target.endswith(".py") else ["-m", target]
    return [str(accelerate), "launch", "--num_processes", "2", *flags, *port, *entry, *args]


def run_or_exit(
    cmd: list[str], timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run offline from the repository root; a failure ends the benchmark with the command's output tail."""
    full_env = {**os.environ, **OFFLINE_ENV, **(env or {})}
    result = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def write_result(name: str, record: dict[str, Any]) -> Path:
    """bench/results/<name>-<date>.json, for the CPU benchmarks; prints where it went."""
    out = REPO / "bench" / "results" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out.relative_to(REPO)}")
    return out


# The libraries a result's numbers depend on, recorded beside them (bench/probe.py records more).
RESULT_LIBRARIES = (
    "torch", "deepspeed", "accelerate", "transformers", "peft", "bitsandbytes", "liger-kernel", "datasets",
    "huggingface-hub", "tokenizers", "safetensors",
)  # fmt: skip
LOCK = REPO / "requirements-lock.txt"


def versions(libraries: tuple[str, ...] = RESULT_LIBRARIES) -> dict[str, str]:
    """Installed versions, read without importing anything (no CUDA context in the harness process)."""
    out = {"python": sys.version.split()[0], "cpus": str(os.cpu_count())}
    for name in libraries:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def not_the_lock(ran: dict[str, str], lock: Path = LOCK) -> dict[str, str]:
    """Each library that ran at another release than requirements-lock.txt's: name -> "ran X, locked Y".

    torch is not in the lock (a GPU machine keeps its CUDA build); a library the lock does not pin is left
    out. On the GPU machine this names what its image imposed where no wheel of the lock's release
    travelled (tools/gpu_wheels/build.sh), so a result says which of its libraries were not the tested set.
    """
    if not lock.is_file():
        return {}
    locked = dict(re.findall(r"^([A-Za-z0-9_.\-]+)==([^\s;\\]+)", lock.read_text(), re.M))
    locked = {name.lower().replace("_", "-"): version for name, version in locked.items()}
    return {
        name: f"ran {version}, locked {locked[name]}"
        for name, version in ran.items()
        if name in locked and version != locked[name]
    }


# --- what a launch is watched for -------------------------------------------------------------------


def proc_kib_field(path: str, field: str) -> int | None:
    """Bytes of a 'Field:  N kB' line of a /proc file (status VmLck, smaps_rollup Pss); None if unreadable."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def proc_tree(pid: int) -> list[Any]:
    """psutil processes of `pid` and all its descendants ([] once it is gone)."""
    try:
        import psutil

        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except Exception:  # gone, or no psutil: nothing to sample
        return []


def used_bytes() -> int | None:
    """The machine's memory in use: MemTotal - MemAvailable (/proc/meminfo), as the OOM killer sees it."""
    fields = {}
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                key, value = line.split(":", 1)
                fields[key] = int(value.split()[0]) * 1024
        return fields["MemTotal"] - fields["MemAvailable"]
    except (OSError, KeyError, ValueError):
        return None


class GpuMemorySampler:
    """Device-wide used memory through NVML (no CUDA context in this process); None without NVML or GPU.

    The caps of bench/capped_train.py bound torch's allocator, not the CUDA context, kernel images or
    NCCL's buffers (0.5-1.5 GiB): only this device-wide number can be held against a real card's memory.
    """

    def __init__(self) -> None:
        self.handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._pynvml = pynvml
        except Exception:  # no NVML library or no GPU: device-wide numbers are simply not reported
            self.handle = None

    def name(self) -> str | None:
        """The device's name as the GPU table knows it ('NVIDIA H200')."""
        if self.handle is None:
            return None
        name = self._pynvml.nvmlDeviceGetName(self.handle)
        return name.decode() if isinstance(name, bytes) else str(name)

    def used_gib(self) -> float | None:
        if self.handle is None:
            return None
        try:
            return float(self._pynvml.nvmlDeviceGetMemoryInfo(self.handle).used) / GiB
        except Exception:
            return None


class HostMemorySampler:
    """Peak host memory of one process tree, measured two ways that do not over-count.

    The sum of RSS over a tree counts a page once per process that maps it: forked children share their
    parent's pages copy-on-write, and on the first H200 run the tree's RSS summed to 160.9 GiB on a
    125.9 GiB machine. Instead the tree's PSS (a page shared by n processes counts 1/n in each; pinned
    buffers are shared mappings and are in it), read at most every PSS_EVERY_S (the kernel walks every
    page table of a ~120 GiB process for it), and the machine's used memory above its value at the start.
    """

    PSS_EVERY_S = 1.0

    def __init__(self) -> None:
        self.baseline = used_bytes()
        self.pss_peak: int | None = None
        self.used_peak: int | None = None
        self._last_pss = 0.0

    def sample(self, pid: int) -> None:
        used = used_bytes()
        if used is not None:
            self.used_peak = max(self.used_peak or 0, used)
        now = time.monotonic()
        if now - self._last_pss < self.PSS_EVERY_S:
            return
        self._last_pss = now
        sizes = [proc_kib_field(f"/proc/{proc.pid}/smaps_rollup", "Pss") for proc in proc_tree(pid)]
        known = [size for size in sizes if size is not None]
        if known:
            self.pss_peak = max(self.pss_peak or 0, sum(known))

    @property
    def pss_peak_gib(self) -> float | None:
        return None if self.pss_peak is None else self.pss_peak / GiB

    @property
    def used_delta_peak_gib(self) -> float | None:
        if self.used_peak is None or self.baseline is None:
            return None
        return (self.used_peak - self.baseline) / GiB


class TreeSampler:
    """Per-process peak VmLck (native pinning, async-I/O buffers) and the tree's block I/O at each logged step."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.locked: dict[int, int] = {}
        self.io: dict[int, tuple[int, int]] = {}  # last counters of every process seen (exited ones too)
        self.at_step: list[tuple[float, int, int, int]] = []  # (time, rows, read, write) as rows appear
        self._rows = 0

    def sample(self, pid: int) -> None:
        for proc in proc_tree(pid):
            locked = proc_kib_field(f"/proc/{proc.pid}/status", "VmLck")
            if locked is not None:
                self.locked[proc.pid] = max(self.locked.get(proc.pid, 0), locked)
            self.io[proc.pid] = _io_bytes(proc.pid)
        rows = len(metrics_rows(self.run_dir))
        if rows > self._rows:
            self._rows = rows
            read = sum(r for r, _ in self.io.values())
            write = sum(w for _, w in self.io.values())
            self.at_step.append((time.time(), rows, read, write))

    @property
    def locked_peak(self) -> int:
        """The largest per-process peak (the training process; its launcher locks nothing)."""
        return max(self.locked.values(), default=0)

    def per_step(self) -> tuple[float, float, float] | None:
        """(bytes read, bytes written, seconds) per step from the first logged step on: the first step (no
        Adam moments on the drive yet, and the set-up's writes) is left out. Divided by the steps logged in
        between, not the samples: one sample can see two short steps at once."""
        if len(self.at_step) < 2:
            return None
        (t0, rows0, r0, w0), (t1, rows1, r1, w1) = self.at_step[0], self.at_step[-1]
        steps = rows1 - rows0
        return (r1 - r0) / steps, (w1 - w0) / steps, (t1 - t0) / steps


def _io_bytes(pid: int) -> tuple[int, int]:
    """(read_bytes, write_bytes) that reached the block layer (O_DIRECT included), /proc/PID/io."""
    try:
        fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
        return int(fields["read_bytes"]), int(fields["write_bytes"])
    except (OSError, KeyError, ValueError):
        return 0, 0


def metrics_rows(run_dir: Path) -> list[dict[str, Any]]:
    """Complete step rows of RUN_DIR/metrics.jsonl (a line still being written is skipped)."""
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        with contextlib.suppress(json.JSONDecodeError):
            row = json.loads(line)
            if "loss" in row and "step" in row:
                rows.append(row)
    return rows


def median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def peak(rows: list[dict[str, Any]], key: str) -> float | None:
    return max((r[key] for r in rows if r.get(key) is not None), default=None)


def round_floats(value: Any) -> Any:
    """Six significant digits (an injected estimate of 1e-6 stays 1e-6)."""
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {k: round_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [round_floats(v) for v in value]
    return value


# --- one launch ---------------------------------------------------------------------------------------


@dataclass
class Launch:
    """One process: how it ended, what the harness did to it, and what it held at most."""

    cmd: list[str]
    log: Path
    rc: int | None = None
    wall_s: float = 0.0
    output: str = ""
    timed_out: bool = False
    action: str | None = None  # what the harness did to it: "SIGTERM ..." / "SIGKILL ..."
    host_pss_peak_gib: float | None = None  # the process tree's PSS (HostMemorySampler)
    host_used_delta_peak_gib: float | None = None  # the machine's used memory above its value at launch
    gpu_used_peak_gib: float | None = None  # NVML, the whole device
    gpu_used_idle_gib: float | None = None  # NVML before the launch
    # With `second_phase_when`: the tree's PSS peak from the moment it first held (e.g. the export).
    second_phase_host_pss_peak_gib: float | None = None
    first_phase_host_pss_peak_gib: float | None = None  # ... and before it

    @property
    def tail(self) -> str:
        return self.output[-TAIL_CHARS:]

    @property
    def gpu_used_delta_gib(self) -> float | None:
        if self.gpu_used_peak_gib is None or self.gpu_used_idle_gib is None:
            return None
        return self.gpu_used_peak_gib - self.gpu_used_idle_gib

    @property
    def ended(self) -> str:
        """How the launch ended, for a case's error: 'timed out' or 'exit N'."""
        return "timed out" if self.timed_out else f"exit {self.rc}"

    def failure(self, done: int, wanted: int) -> str:
        """'timed out after 1 of 4 steps', 'exit 1 after 0 of 4 steps', naming an outside SIGKILL."""
        what = self.ended
        if self.rc == -signal.SIGKILL and not self.timed_out and self.action is None:
            # Not the harness's kill; with host memory near its end the kernel's OOM killer is the usual sender.
            what += " (SIGKILL not sent by the harness; see host_used_delta_peak_gib)"
        return f"{what} after {done} of {wanted} steps"


@dataclass
class _Running:
    proc: subprocess.Popen[bytes]
    log: Path


RUNNING: list[_Running] = []  # the launch in progress, for Results.stop


def launch(
    cmd: list[str],
    timeout: float,
    log: Path,
    *,
    sigterm_when: Callable[[], bool] | None = None,
    kill_when: Callable[[], bool] | None = None,
    second_phase_when: Callable[[], bool] | None = None,
    gpu: bool = False,
    on_poll: Callable[[int], None] | None = None,
    env: dict[str, str] | None = None,
) -> Launch:
    """Run `cmd` from the repository root in its own process group, polling it: SIGTERM once
    `sigterm_when()`, SIGKILL (the group) once `kill_when()` or at `timeout`. Host memory (and with `gpu`,
    the device's) is sampled at every poll; from the first poll at which `second_phase_when()` holds, the
    host peak is also kept apart for that phase. `on_poll(pid)` runs at every poll (more samplers)."""
    result = Launch(cmd, log)
    full_env = {**os.environ, **OFFLINE_ENV, **(env or {})}
    started = time.time()
    host = HostMemorySampler()
    second: HostMemorySampler | None = None
    sampler = GpuMemorySampler() if gpu else None
    result.gpu_used_idle_gib = sampler.used_gib() if sampler else None
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        # Its own process group (a kill takes its helpers too) but not its own session: the device tool
        # ends every process of the command's session when the command ends or times out.
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=full_env, stdout=out, stderr=subprocess.STDOUT, process_group=0
        )
        RUNNING.append(_Running(proc, log))
        try:
            while proc.poll() is None:
                host.sample(proc.pid)
                if second is None and second_phase_when is not None and second_phase_when():
                    result.first_phase_host_pss_peak_gib = host.pss_peak_gib
                    second = HostMemorySampler()
                if second is not None:
                    second.sample(proc.pid)
                if on_poll is not None:
                    on_poll(proc.pid)
                used = sampler.used_gib() if sampler else None
                if used is not None:
                    result.gpu_used_peak_gib = max(result.gpu_used_peak_gib or 0.0, used)
                if sigterm_when is not None and result.action is None and sigterm_when():
                    proc.send_signal(signal.SIGTERM)  # the trainer itself, as SLURM or a user would
                    result.action = f"SIGTERM at {time.time() - started:.1f}s"
                if kill_when is not None and kill_when():
                    result.action = f"SIGKILL after the steps were logged, at {time.time() - started:.1f}s"
                    kill_group(proc)
                    break
                if time.time() - started > timeout:
                    result.timed_out = True
                    kill_group(proc)
                    break
                time.sleep(0.05 if sigterm_when is not None else 0.25)
            result.rc = proc.wait()
        finally:
            RUNNING[:] = [r for r in RUNNING if r.proc is not proc]
    result.wall_s = time.time() - started
    result.host_pss_peak_gib, result.host_used_delta_peak_gib = host.pss_peak_gib, host.used_delta_peak_gib
    if second is not None:
        result.second_phase_host_pss_peak_gib = second.pss_peak_gib
    else:
        result.first_phase_host_pss_peak_gib = host.pss_peak_gib
    result.output = log.read_text(errors="replace")
    return result


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):  # it may have ended on its own just now
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def log_tail(path: Path, chars: int = TAIL_CHARS) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


# --- results ------------------------------------------------------------------------------------------

# The numbers a summary repeats per line, where a line has them.
SUMMARY_KEYS = (
    "skipped", "deferred", "error", "est_gpu_gib", "gpu_device_used_peak_gib", "gpu_mem_peak_gib", "est_host_gib",
    "host_pss_peak_gib", "est_step_time_s", "step_time_s", "tokens_per_s", "mfu", "ratio",
)  # fmt: skip


class Results:
    """NAME.jsonl (a line per case, written the moment it ends), NAME.log, NAME_summary.json."""

    def __init__(self, name: str, out: Path | None, dated_suffix: str = "") -> None:
        """In `out` (or $OUT: the device tool brings back its files, so fixed names), else dated in
        bench/results (which keeps every run)."""
        out = out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
        if out is not None:
            stem = out / name
        else:
            stem = REPO / "bench" / "results" / f"{name}{dated_suffix}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.name = name
        self.jsonl, self.log = Path(f"{stem}.jsonl"), Path(f"{stem}.log")
        self.summary = Path(f"{stem}_summary.json")
        self.records: list[dict[str, Any]] = []
        self.current: str | None = None  # the case in progress
        self.started = time.time()
        self.context: dict[str, Any] = {}  # what the summary says besides the lines (setup, budget)
        self.jsonl.parent.mkdir(parents=True, exist_ok=True)
        self.jsonl.write_text("")
        self.log.write_text("")

    def add(self, record: dict[str, Any]) -> dict[str, Any]:
        record = round_floats(record)
        self.records.append(record)
        with self.jsonl.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        print(json.dumps({k: v for k, v in record.items() if k != "tail"}), flush=True)
        return record

    def log_launch(self, title: str, run: Launch) -> None:
        self.log_text(f"{title}: rc {run.rc}, {run.wall_s:.1f}s, {run.action or 'ran to its end'}", run)

    def log_text(self, title: str, run: Launch | None = None, text: str | None = None) -> None:
        lines = (text if text is not None else run.output if run else "").splitlines()[-80:]
        with self.log.open("a") as handle:
            handle.write(f"===== {title}\n")
            if run is not None:
                handle.write(" ".join(run.cmd) + "\n")
            handle.write("\n".join(lines) + "\n\n")

    @property
    def failed(self) -> list[str]:
        return [r["measurement"] for r in self.records if r.get("passed") is False]

    def write_summary(self) -> dict[str, Any]:
        summary = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "check": self.name,
            **self.context,
            "passed": not self.failed,
            "failed": self.failed,
            "wall_s": round(time.time() - self.started, 1),
            "lines": {
                r["measurement"]: {
                    "passed": r.get("passed"),
                    **{k: r[k] for k in SUMMARY_KEYS if r.get(k) is not None},
                }
                for r in self.records
            },
            "versions": (ran := versions()),
            "not_the_lock": not_the_lock(ran),
        }
        self.summary.write_text(json.dumps(round_floats(summary), indent=2) + "\n")
        print(f"{self.name}: wrote {self.jsonl}, {self.summary.name}, {self.log.name}", flush=True)
        return summary

    def stop(self, signum: int, _frame: FrameType | None = None) -> None:
        """Stopped from outside: the running launch goes, its case becomes a failed line with the launch's
        log tail, the summary is written, and this process exits 128 + signum."""
        tails = []
        for running in list(RUNNING):
            kill_group(running.proc)
            tails.append(log_tail(running.log))
        name = signal.Signals(signum).name
        if self.current is not None:
            tail = "\n".join(tails)
            self.log_text(f"{self.current}: stopped by {name}", text=tail)
            self.add(
                {
                    "measurement": self.current,
                    "passed": False,
                    "error": f"stopped by {name} after {time.time() - self.started:.0f}s of the check",
                    "tail": tail,
                }
            )
        self.write_summary()
        sys.exit(128 + signum)

    def stop_on_signals(self) -> None:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)


# --- verdicts: a measured number against the planner's estimate and a target -------------------------


def verdict(
    quantity: str,
    measured: float | None,
    estimate: float | None = None,
    target: float | None = None,
    higher_is_better: bool = True,
    tolerance: float = ESTIMATE_TOLERANCE,
    judged: bool = True,
    why_not_judged: str | None = None,
) -> dict[str, Any]:
    """One measured quantity judged against an estimate (within +-tolerance) and/or a target.

    `passed` is False when the estimate or the target is missed, or when nothing was measured although
    something was expected. judged=False records the comparison without enforcing it (why_not_judged says
    why: e.g. a CPU check of a GPU script, whose numbers mean nothing).
    """
    out: dict[str, Any] = {"quantity": quantity, "measured": measured}
    misses: list[str] = []
    if estimate is None and target is None:
        misses.append(f"{quantity}: no estimate to judge it against")
    if estimate is not None:
        out.update(estimate=estimate, tolerance=tolerance)
        if measured is None:
            misses.append(f"{quantity}: not measured (estimate {estimate:.4g})")
        else:
            ratio = measured / estimate if estimate else math.inf
            out.update(ratio=ratio, within_estimate=abs(ratio - 1) <= tolerance)
            if not out["within_estimate"]:
                misses.append(
                    f"{quantity} {measured:.4g} is {ratio - 1:+.0%} off the planner's {estimate:.4g} "
                    f"(allowed +-{tolerance:.0%})"
                )
    if target is not None:
        out.update(target=target, higher_is_better=higher_is_better)
        if measured is None:
            misses.append(f"{quantity}: not measured (target {target:.4g})")
        else:
            out["target_met"] = measured >= target if higher_is_better else measured <= target
            if not out["target_met"]:
                sign = ">=" if higher_is_better else "<="
                misses.append(f"{quantity} {measured:.4g} misses its target {sign} {target:.4g}")
    out["judged"] = judged
    if not judged:
        out["why_not_judged"] = why_not_judged
    out["misses"] = misses
    out["passed"] = not (judged and misses)
    return out


def judge(record: dict[str, Any], verdicts: list[dict[str, Any]]) -> dict[str, Any]:
    """`record` with its verdicts; a judged miss fails the line (passed False, `error` names the misses)."""
    record["verdicts"] = [*record.get("verdicts", []), *verdicts]
    record.setdefault("passed", True)
    missed = [m for v in verdicts if v["judged"] for m in v["misses"]]
    if missed:
        record["passed"] = False
        record["error"] = "; ".join([*([record["error"]] if record.get("error") else []), *missed])
    return record


@dataclass(frozen=True)
class Judging:
    """How measured cases are judged: against the planner's estimates (enforced on a GPU), or against
    estimates injected with --expect NAME.QUANTITY=VALUE (enforced anywhere: the CI test's hook)."""

    enforce: bool
    injected: dict[str, float] = field(default_factory=dict)

    def against(
        self,
        name: str,
        quantity: str,
        measured: float | None,
        planner: float | None = None,
        target: float | None = None,
        higher_is_better: bool = True,
    ) -> dict[str, Any]:
        key = f"{name}.{quantity}"
        judged = self.enforce or key in self.injected
        return verdict(
            quantity,
            measured,
            estimate=self.injected.get(key, planner),
            target=target,
            higher_is_better=higher_is_better,
            judged=judged,
            why_not_judged=None if judged else NOT_JUDGED,
        )


# --- cases in time boxes ------------------------------------------------------------------------------


class Budget:
    """One deadline for a whole part; each case's time box is capped by what is left."""

    def __init__(self, seconds: float, started: float | None = None) -> None:
        self.seconds = seconds
        self.deadline = (started or time.time()) + seconds

    def left(self) -> float:
        return self.deadline - time.time()

    def timeout(self, box: float) -> float:
        return max(0.0, min(box, self.left()))


@dataclass
class Context:
    """What every case of one run reads: its sizes (GPU or --cpu-tiny), work folder, budget, results."""

    gpu: bool
    work: Path
    budget: Budget
    results: Results
    judging: Judging
    done: dict[str, dict[str, Any]] = field(default_factory=dict)  # the lines so far, by name
    state: dict[str, Any] = field(default_factory=dict)  # what a section's cases share (made once)
    box_s: float = 0.0  # the running case's time box (run_cases sets it)

    def timeout(self, share: float = 1.0) -> float:
        """What the running case may still spend on a launch: its box (times `share`), within the budget."""
        return self.budget.timeout(self.box_s * share)


@dataclass(frozen=True)
class Case:
    """One line of a check: what it is assumed to cost on the GPU, its time box, and how it runs.

    `cost_s` is the time the code assumes (bench/gpu_run.py's parts are sized from them, and a test holds
    every part's boxes within its limit); `box_s` is the most the case may take. A required case always
    runs; an optional one runs only while the budget holds its cost, and otherwise is a deferred line
    (passed None: left to the next part or visit, no failure). `cpu_box_s` is the box under --cpu-tiny
    (a 2-core CI machine, shared). `cleanup` names folders of the work directory removed after the
    case, whatever happened (checkpoints, exports, a base model on a 64 GiB disk).
    """

    name: str
    run: Callable[[Context], dict[str, Any]]
    cost_s: float
    box_s: float
    optional: bool = False
    cleanup: tuple[str, ...] = ()
    cpu_box_s: float = 600.0


def run_cases(cases: list[Case], ctx: Context) -> None:
    for case in cases:
        left = ctx.budget.left()
        record: dict[str, Any] = {"measurement": case.name}
        if case.optional and left < case.cost_s:
            record.update(passed=None, deferred=f"needs ~{case.cost_s:.0f}s, {max(0.0, left):.0f}s left")
        elif left <= 0:
            record.update(passed=False, error="not run: the budget is spent")
        else:
            ctx.box_s = case.box_s if ctx.gpu else case.cpu_box_s
            ctx.results.current = case.name
            try:
                record = {"measurement": case.name, **case.run(ctx)}
            except Exception as exc:  # a broken case must not take the others with it
                record.update(passed=False, error=f"{type(exc).__name__}: {exc}"[:1000])
            finally:
                ctx.results.current = None
        ctx.done[case.name] = ctx.results.add(record)
        for name in (case.name, *case.cleanup):
            shutil.rmtree(ctx.work / name, ignore_errors=True)


# --- the planner, asked as `llm-train plan` is ----------------------------------------------------------


def plan(
    recipe: str,
    overrides: list[str],
    gpu: str | None,
    gpu_mem_gib: float | None = None,
    host_ram_gib: float | None = None,
    nvme: bool = False,
) -> dict[str, Any]:
    """The planner's numbers for one configuration on one device (`gpu` None: this CPU).

    est_gpu_gib includes the CUDA context and allocator slack (compare NVML's device-wide peak);
    est_gpu_allocated_gib leaves them out (compare torch's max_memory_allocated); est_host_train_gib is
    the host peak of the load and training phases (the processes included), without the final export.
    """
    from llm_train.errors import UserError
    from llm_train.planning.host_memory import host_peak_bytes
    from llm_train.planning.verdict import plan_recipe

    try:
        report = plan_recipe(
            recipe,
            overrides,
            gpus=1,
            gpu=gpu,
            gpu_mem_gib=gpu_mem_gib,
            host_ram_gib=host_ram_gib,
            detect=False,
            nvme_gib=10_000 if nvme else None,  # the drive's space is checked by the run itself
        )
    except UserError as exc:
        return {"planner_error": str(exc)}
    ev = report.evaluation
    est = ev.estimate
    allocated = sum(v for k, v in est.gpu_terms.items() if k != "cuda_context_and_slack")
    # The export copy left out: what the host holds until the steps are logged (planning/memory_estimate.py).
    train = host_peak_bytes(ev.inputs, {**est.host_terms, "export_peak": 0}, 0.0)
    return {
        "config": report.config_line,
        "planner_verdict": report.word,
        "fits": ev.fits,
        "est_gpu_gib": ev.device_bytes / GiB,
        "est_gpu_allocated_gib": allocated / GiB if gpu else None,
        "est_host_gib": ev.host_bytes / GiB,
        "est_host_train_gib": (train + ev.host_bytes - est.host_bytes) / GiB,
        "est_locked_gib": est.locked_per_rank / GiB,
        "est_step_time_s": ev.time.total,
        "est_tokens_per_s": ev.time.tokens_per_s,
        "est_nvme_read_gb_per_step": ev.time.nvme_read_bytes / 1e9,
        "est_nvme_write_gb_per_step": ev.time.nvme_write_bytes / 1e9,
        # objective grpo: the generate call's seconds (a rough model until measured, planning/generation.py)
        "est_time_generate_s": ev.time.generation_call.total if ev.time.generation_call else None,
        # an image-text model's image rows: the planner's image tokens per image (planning/vision_shapes.py)
        "est_image_tokens_per_image": _image_tokens(ev.inputs),
    }


def _image_tokens(inp: Any) -> int | None:
    vision = inp.shape.vision
    if vision is None or not inp.vision.images_per_sample:
        return None
    return int(inp.vision.geometry(vision).max_tokens)


def check_arguments(description: str) -> argparse.ArgumentParser:
    """The options every check takes: --cpu-tiny, --out, --only NAME..., --budget-s, --expect."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--cpu-tiny", action="store_true", help="Tiny model on CPU: checks the script, not a GPU."
    )
    parser.add_argument("--out", type=Path, help="Output folder (default: $OUT, else bench/results/).")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="Run only these cases, in order.")
    parser.add_argument("--budget-s", type=float, help="Deadline for the whole run (default: the part's).")
    parser.add_argument(
        "--expect",
        nargs="+",
        default=[],
        metavar="NAME.QUANTITY=VALUE",
        help="Replace the planner's estimate of QUANTITY in case NAME and judge it, also under --cpu-tiny "
        "(a test hook: a wrong estimate must fail that line).",
    )
    return parser


def injected(parser: argparse.ArgumentParser, items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            out[key] = float(value)
        except ValueError:
            parser.error(f"--expect {item}: give NAME.QUANTITY=NUMBER")
    return out
