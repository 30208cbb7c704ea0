"""The measurements of bench/gpu_check.sh: real `python llm_train/train.py` runs on one device, in order of importance.

(a) correctness in a world of one (on a GPU: NCCL), bf16, a ~100M Llama (hidden 768, 12 layers,
    12 heads, intermediate 2048, the bundled tokenizer's 4096 words), for ZeRO-2, ZeRO-3 and
    ZeRO-3 + CPU offload: train with checkpoints, SIGTERM once the first one is committed
    (exit 75, EXIT_PREEMPTED), then `--resume auto` to the end, which exports final/ and
    verifies it (exit 0). Lines a_zero2, a_zero3, a_zero3_offload.
(b) MFU of a Llama-3.2-1B shape (random init), ZeRO-2, bf16, seq 4096, against the GPU
    table's dense bf16 peak (H200: 989 TFLOP/s); target 45%. Line b_mfu_zero2.
(c) ZeRO-3 / ZeRO-0 step-time ratio on the same shape. Lines c_zero3, c_zero0, c_zero3_over_zero0.
(d) the consumer card: recipe 7b-rtx4090 (random init) under a 24 GiB cap (bench/capped_train.py),
    or the largest known Llama shape the planner says fits 24 GiB and this host's RAM (at most
    128 GiB); a few steps; peak GPU memory and peak host memory (the process tree's PSS and the
    machine's used-memory growth, polled here: `HostMemorySampler`) against the planner's estimate
    for the same configuration. Line d_consumer_card.

Each result is one JSON line, appended to OUT_DIR/gpu_check.jsonl the moment it is known (a kill
leaves what was done); OUT_DIR/gpu_check_summary.json follows at the end, and
OUT_DIR/gpu_check.log holds each launch's command and output tail. Every line has `passed`;
a failed or timed-out measurement carries `error` and `tail` and the next one starts. The
exit code is 1 when any line did not pass.

Verdicts: every measured case of (b), (c) and (d) carries `verdicts` (bench/common.py `verdict`),
one per quantity, against the planner's estimate for the same configuration (+-15%, the planner's
stated precision) and against its target (b: MFU >= 45%). A miss fails the line (`passed` false,
`error` names what missed by how much) and the exit code, and every other line is still written.
Under --cpu-tiny the planner's GPU estimates mean nothing: the comparisons are recorded with
`judged: false`; `--expect NAME.QUANTITY=VALUE` replaces an estimate and judges it anywhere (the
CI test injects a wrong one and expects that line, and only it, to fail).

The speed runs ((b), (c), (d)) are stopped by this script (SIGKILL) once they have logged
their steps: their end-of-run export (a 13 GB gather for 7B) would cost minutes and, for 7B,
host RAM the consumer-card measurement does not have to spare.

Budget on one H200, 9 minutes in all, from start-up seen on CPU (~9 s per launch) and the H200's
speed; the first GPU run will tell. (a) 6 launches of ~15-20 s start-up, 25 steps of a 100M model,
~5 checkpoints of ~1.3 GB, one export each, plus ~40-60 s to JIT-build CPU Adam: ~3-3.5 min.
(b)+(c) 3 launches of ~20-25 s start-up and 15 steps of ~0.3-0.5 s: ~1.5 min. (d) 7B ZeRO-3
offload start-up (~100 GiB of pinned host buffers) and 3 steps of ~10 s (the planner's model
for accumulation 1): ~2-3 min. A global deadline (--budget-s, 510 s on a GPU, which leaves the
wheel install and a margin inside 9 minutes) caps every measurement's own timeout; what the
deadline leaves no time for is written as a failed "not run" line. (a)'s race (SIGTERM must
land before the run ends) has ~20 steps of margin against a 50 ms poll.

`--cpu-tiny` runs the same logic on CPU with the tiny-cpu model (bf16, short sequences,
a nominal --peak-tflops so that MFU is computed, (d) without a cap): it checks the script end
to end where no GPU is; its numbers say nothing about a GPU.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import (
    OFFLINE_ENV,
    REPO,
    GiB,
    check_arguments,
    judge,
    proc_kib_field,
    require_cuda,
    verdict,
    versions,
)  # bench/ is this script's folder

TRAIN = REPO / "llm_train" / "train.py"
CAPPED_TRAIN = REPO / "bench" / "capped_train.py"
TOKENIZER = REPO / "llm_train" / "assets" / "tiny" / "tokenizer"
CORPUS = REPO / "llm_train" / "assets" / "tiny" / "corpus.txt"
EXIT_PREEMPTED = 75  # llm_train/runtime/control.py; a copy, so that this file imports no llm_train at start
MFU_TARGET = 0.45
CONSUMER_GPU_GIB = 24.0
HOST_RAM_CAP_GIB = 128.0  # the H200 machine's RAM; the planner is asked with min(this, what psutil sees)
TAIL_CHARS = 3000
MIN_TIME_S = 20.0  # a measurement with less than this left of the budget is reported as not run

# Every run: no evaluation beyond one batch, no sample, no tracker, a metrics row per step.
COMMON = [
    "output.log_every=1",
    "eval.every=0",
    "eval.batches=1",
    "output.sample_prompt=null",
    "tracking.mode=disabled",
]
# (a) on a GPU: ~100M parameters (12 x 7.1M per layer + 2 x 3.1M embeddings = 91M).
GPU_100M = [
    "hardware.device=cuda",
    "precision=bf16",
    "data.seq_len=1024",
    "model.config.hidden_size=768",
    "model.config.intermediate_size=2048",
    "model.config.num_hidden_layers=12",
    "model.config.num_attention_heads=12",
    "model.config.num_key_value_heads=12",
    "model.config.max_position_embeddings=1024",
    "optim.micro_batch_size=8",
    "optim.grad_accum=1",
    "optim.lr=1e-3",
    "optim.warmup_steps=5",
]
GPU_1B = [
    "hardware.device=cuda",
    "precision=bf16",
    "model.init=random",
    "model.name_or_path=meta-llama/Llama-3.2-1B",  # shape known offline (llm_train/planning/shapes.py)
    "model.config={}",  # drop tiny-cpu's shape; its bundled tokenizer stays
    "data.seq_len=4096",
    "optim.micro_batch_size=4",
    "optim.grad_accum=1",
    "optim.warmup_steps=0",
    "checkpoint.at_end=false",
]
CPU_TINY_A = ["precision=bf16", "data.seq_len=64", "optim.micro_batch_size=2", "optim.grad_accum=1"]
CPU_TINY_BC = [
    "precision=bf16",
    "data.seq_len=128",
    "optim.micro_batch_size=2",
    "optim.grad_accum=1",
    "optim.warmup_steps=0",
    "checkpoint.at_end=false",
]
# (d): the recipe's micro-batch and sequence, one micro-batch per step (memory is per micro-batch;
# the recipe's 8-fold accumulation would only multiply the time).
D_GPU = [
    "model.init=random",
    f"model.tokenizer={TOKENIZER}",  # the hub tokenizer is not on that machine
    f"data.train=[{CORPUS}]",  # nor the recipe's hub dataset: the bundled corpus, as text
    "data.max_epochs=1000",  # a memory and speed probe of a few steps, not a fine-tune
    "optim.global_batch_size=4",
    "optim.warmup_steps=0",
    "checkpoint.at_end=false",
]
# Largest first: the planner picks the first that fits 24 GiB and this host.
D_GPU_CANDIDATES = ["meta-llama/Llama-2-7b-hf", "meta-llama/Llama-3.2-3B", "meta-llama/Llama-3.2-1B"]
D_CPU = [
    "deepspeed.config=zero3_offload",
    "memory.activation_checkpointing=true",
    "precision=bf16",
    "data.seq_len=128",
    "optim.micro_batch_size=4",
    "optim.grad_accum=1",
    "optim.warmup_steps=0",
    "checkpoint.at_end=false",
]


@dataclass(frozen=True)
class Sizes:
    """What differs between the H200 run and the --cpu-tiny check of the script."""

    gpu: bool
    a_overrides: list[str]
    a_every: int  # checkpoint every N steps; SIGTERM after the first
    a_steps: int
    bc_overrides: list[str]
    bc_steps: int
    warmup: int  # steps left out of the speed medians: allocator warm-up, kernel autotuning
    d_recipe: str
    d_overrides: list[str]
    d_candidates: list[str | None]  # model.name_or_path values, largest first; None: the recipe's own
    d_steps: int
    extra_args: list[str]  # train.py flags every run gets
    timeouts: dict[str, float]
    budget_s: float
    mfu_target: float
    judge: bool  # enforce the verdicts against the planner's estimates and the targets (GPU only)


GPU_SIZES = Sizes(
    gpu=True,
    a_overrides=GPU_100M,
    a_every=5,
    a_steps=25,
    bc_overrides=GPU_1B,
    bc_steps=15,
    warmup=5,
    d_recipe="7b-rtx4090",
    d_overrides=D_GPU,
    d_candidates=list(D_GPU_CANDIDATES),
    d_steps=3,
    extra_args=[],
    timeouts={"a": 120, "a_offload": 200, "bc": 100, "d": 260},
    budget_s=510,
    mfu_target=MFU_TARGET,
    judge=True,
)
CPU_SIZES = Sizes(
    gpu=False,
    a_overrides=CPU_TINY_A,
    a_every=3,
    a_steps=8,
    bc_overrides=CPU_TINY_BC,
    bc_steps=6,
    warmup=3,
    d_recipe="tiny-cpu",
    d_overrides=D_CPU,
    d_candidates=[None],
    d_steps=3,
    extra_args=["--peak-tflops", "1.0"],  # nominal: MFU is computed, and means nothing
    timeouts={"a": 150, "a_offload": 300, "bc": 100, "d": 150},
    budget_s=900,
    mfu_target=MFU_TARGET,
    judge=False,
)
NOT_JUDGED = "cpu-tiny: the planner's estimates and the MFU target are for GPUs"


# --- launching and watching one run ------------------------------------------------------------------


class GpuMemorySampler:
    """Device-wide used memory through NVML (no CUDA context in this process); None without NVML."""

    def __init__(self) -> None:
        self.handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._pynvml = pynvml
        except Exception:  # no NVML library or no GPU: device-wide numbers are simply not reported
            self.handle = None

    def used_gib(self) -> float | None:
        if self.handle is None:
            return None
        try:
            return self._pynvml.nvmlDeviceGetMemoryInfo(self.handle).used / GiB
        except Exception:
            return None


def _proc_tree(pid: int) -> list[Any]:
    """psutil processes of `pid` and all its descendants ([] once it is gone)."""
    try:
        import psutil

        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except Exception:
        return []


def _pss_bytes(proc: Any) -> int | None:
    """Proportional set size of one process: each page it maps counted once, divided among its sharers.

    /proc/PID/smaps_rollup (Linux >= 4.14) sums it in the kernel; psutil's memory_full_info reads the
    same numbers from smaps. None for a process that ended or cannot be read.
    """
    pss = proc_kib_field(f"/proc/{proc.pid}/smaps_rollup", "Pss")
    if pss is not None:
        return pss
    try:
        return int(proc.memory_full_info().pss)
    except Exception:
        return None


def _used_bytes() -> int | None:
    """The machine's memory in use: MemTotal - MemAvailable (/proc/meminfo), as the OOM killer sees it."""
    try:
        fields = {}
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                key, value = line.split(":", 1)
                fields[key] = int(value.split()[0]) * 1024
        return fields["MemTotal"] - fields["MemAvailable"]
    except (OSError, KeyError, ValueError):
        return None


class HostMemorySampler:
    """Peak host memory of one launch, measured two ways that do not over-count.

    The sum of RSS over a process tree counts a page once per process that maps it: forked children
    (DataLoader workers, compile workers) share their parent's pages copy-on-write, and on the first
    H200 run the tree's RSS summed to 160.9 GiB on a 125.9 GiB machine. Instead:
    - the tree's PSS (proportional set size: a page shared by n processes counts 1/n in each), so the
      sum over the tree counts every resident page once; pinned (page-locked) buffers are shared
      mappings and are in it. Read at most every PSS_EVERY_S: the kernel walks every page table of
      a ~120 GiB process for it.
    - the machine's used memory (MemTotal - MemAvailable) above what it was at launch: everything,
      kernel allocations and tmpfs files included; an upper bound when nothing else runs.
    """

    PSS_EVERY_S = 1.0

    def __init__(self) -> None:
        self.baseline = _used_bytes()
        self.pss_peak: int | None = None
        self.used_peak: int | None = None
        self._last_pss = 0.0

    def sample(self, pid: int) -> None:
        used = _used_bytes()
        if used is not None:
            self.used_peak = max(self.used_peak or 0, used)
        now = time.monotonic()
        if now - self._last_pss < self.PSS_EVERY_S:
            return
        self._last_pss = now
        sizes = [_pss_bytes(proc) for proc in _proc_tree(pid)]
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


def metrics_rows(run_dir: Path) -> list[dict[str, Any]]:
    """Complete step rows of RUN_DIR/metrics.jsonl (a line still being written is skipped)."""
    path = run_dir / "metrics.jsonl"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in row and "step" in row:
            rows.append(row)
    return rows


@dataclass
class Launch:
    """One process: how it ended, what the harness did to it, and what it held at most."""

    cmd: list[str]
    rc: int | None = None
    wall_s: float = 0.0
    output: str = ""
    timed_out: bool = False
    action: str | None = None  # what this script did to it: "SIGTERM ..." / "SIGKILL ..."
    host_pss_peak_gib: float | None = None  # the process tree's PSS (HostMemorySampler)
    host_used_delta_peak_gib: float | None = None  # the machine's used memory above its value at launch
    gpu_used_peak_gib: float | None = None
    # With `second_phase_when`: the tree's PSS peak from the moment it first held (e.g. the export).
    second_phase_host_pss_peak_gib: float | None = None

    @property
    def tail(self) -> str:
        return self.output[-TAIL_CHARS:]


def launch(
    cmd: list[str],
    timeout: float,
    log: Path,
    sigterm_when: Callable[[], bool] | None = None,
    kill_when: Callable[[], bool] | None = None,
    gpu: GpuMemorySampler | None = None,
    second_phase_when: Callable[[], bool] | None = None,
) -> Launch:
    """Run `cmd` in its own process group, polling it: SIGTERM once `sigterm_when()`, SIGKILL (the
    group) once `kill_when()` or at `timeout`. Peak host memory (HostMemorySampler) and device memory
    are sampled; from the first poll at which `second_phase_when()` holds, a second host sampler too."""
    result = Launch(cmd)
    env = {**os.environ, **OFFLINE_ENV, "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    started = time.time()
    host = HostMemorySampler()
    second: HostMemorySampler | None = None
    with open(log, "w") as out:
        # Its own process group (so that a kill takes its helpers too) but not its own session: the
        # device tool ends every process of the command's session when the command ends or times out.
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0)
        RUNNING.append(proc)
        while proc.poll() is None:
            host.sample(proc.pid)
            if second is None and second_phase_when is not None and second_phase_when():
                second = HostMemorySampler()
            if second is not None:
                second.sample(proc.pid)
            used = gpu.used_gib() if gpu else None
            if used is not None:
                result.gpu_used_peak_gib = max(result.gpu_used_peak_gib or 0.0, used)
            if sigterm_when is not None and result.action is None and sigterm_when():
                proc.send_signal(signal.SIGTERM)  # the trainer itself, as SLURM or a user would
                result.action = f"SIGTERM at {time.time() - started:.1f}s"
            if kill_when is not None and kill_when():
                result.action = f"SIGKILL after the steps were logged, at {time.time() - started:.1f}s"
                _kill_group(proc)
                break
            if time.time() - started > timeout:
                result.timed_out = True
                _kill_group(proc)
                break
            time.sleep(0.05 if sigterm_when is not None else 0.25)
        result.rc = proc.wait()
        RUNNING.remove(proc)
    result.wall_s = time.time() - started
    result.host_pss_peak_gib, result.host_used_delta_peak_gib = host.pss_peak_gib, host.used_delta_peak_gib
    result.second_phase_host_pss_peak_gib = second.pss_peak_gib if second is not None else None
    result.output = log.read_text(errors="replace")
    return result


RUNNING: list[subprocess.Popen] = []  # the launch in progress, for _on_stop_signal


def _on_stop_signal(signum: int, _frame: object) -> None:
    """This script stopped from outside: take the training run with it (the lines so far are written)."""
    for proc in RUNNING:
        _kill_group(proc)
    sys.exit(128 + signum)


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # it may have ended on its own just now
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def train_cmd(
    sizes: Sizes,
    recipe: str,
    run_dir: Path,
    max_steps: int,
    overrides: list[str],
    entry: list[str] | None = None,
) -> list[str]:
    """`python llm_train/train.py ...`, or the same arguments after another `entry` (the capped wrapper)."""
    return [
        *(entry or [sys.executable, str(TRAIN)]),
        "--recipe",
        recipe,
        "--output-dir",
        str(run_dir),
        f"--max-steps={max_steps}",
        *sizes.extra_args,
        *COMMON,
        *overrides,
    ]


def median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def peak(rows: list[dict[str, Any]], key: str) -> float | None:
    return max((r[key] for r in rows if r.get(key) is not None), default=None)


def round_floats(value: Any) -> Any:
    """Six significant digits (an injected estimate of 1e-6 stays 1e-6)."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: round_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [round_floats(v) for v in value]
    return value


# --- the results file -----------------------------------------------------------------------------------


@dataclass
class Results:
    """gpu_check.jsonl (one line per result, written at once), gpu_check.log, the summary at the end."""

    jsonl: Path
    log: Path
    summary: Path
    records: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def for_check(cls, name: str, out: Path | None, cpu_tiny: bool) -> Results:
        """NAME.jsonl, NAME.log and NAME_summary.json in --out or $OUT (the device tool brings back $OUT's
        files: fixed names), else dated in bench/results (which keeps every run)."""
        out = out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
        if out is not None:
            stem = out / name
        else:
            suffix = "_cpu_tiny" if cpu_tiny else ""
            stem = REPO / "bench" / "results" / f"{name}{suffix}-{time.strftime('%Y%m%d-%H%M%S')}"
        return cls(jsonl=Path(f"{stem}.jsonl"), log=Path(f"{stem}.log"), summary=Path(f"{stem}_summary.json"))

    def __post_init__(self) -> None:
        self.jsonl.parent.mkdir(parents=True, exist_ok=True)
        self.jsonl.write_text("")
        self.log.write_text("")

    def add(self, record: dict[str, Any]) -> None:
        record = round_floats(record)
        self.records.append(record)
        line = json.dumps(record)
        with self.jsonl.open("a") as handle:
            handle.write(line + "\n")
        shown = {k: v for k, v in record.items() if k != "tail"}
        print(json.dumps(shown), flush=True)

    def log_launch(self, title: str, run: Launch) -> None:
        lines = run.output.splitlines()[-80:]
        with self.log.open("a") as handle:
            handle.write(f"===== {title}: rc {run.rc}, {run.wall_s:.1f}s, {run.action or 'ran to its end'}\n")
            handle.write(" ".join(run.cmd) + "\n")
            handle.write("\n".join(lines) + "\n\n")


class Budget:
    """One deadline for the whole check; each measurement's timeout is capped by what is left."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.time() + seconds

    def left(self) -> float:
        return self.deadline - time.time()

    def timeout(self, wanted: float) -> float:
        return max(0.0, min(wanted, self.left()))


def not_run(name: str, group: str, budget: Budget) -> dict[str, Any] | None:
    if budget.left() >= MIN_TIME_S:
        return None
    return {
        "measurement": name,
        "group": group,
        "passed": False,
        "error": f"not run: {max(0.0, budget.left()):.0f}s of the budget left (under {MIN_TIME_S:.0f}s)",
    }


# --- (a) SIGTERM, exit 75, resume, export ----------------------------------------------------------------


def check_resume(
    name: str, ds_config: str, sizes: Sizes, work: Path, budget: Budget, results: Results
) -> dict[str, Any]:
    run_dir = work / name
    latest = run_dir / "checkpoints" / "latest"
    overrides = [*sizes.a_overrides, f"checkpoint.every_steps={sizes.a_every}"]
    cmd = [*train_cmd(sizes, "tiny-cpu", run_dir, sizes.a_steps, overrides), "--ds-config", ds_config]
    deadline = time.time() + budget.timeout(sizes.timeouts["a_offload" if "offload" in ds_config else "a"])
    record: dict[str, Any] = {
        "measurement": name,
        "group": "a",
        "ds_config": ds_config,
        "steps": sizes.a_steps,
    }
    started = time.time()

    first = launch(cmd, deadline - time.time(), work / f"{name}.1.log", sigterm_when=latest.is_file)
    results.log_launch(f"{name} (until SIGTERM)", first)
    rows = metrics_rows(run_dir)
    stop_step = _checkpoint_step(latest)
    record.update(
        exit_code_sigterm=first.rc,
        sigterm=first.action,
        steps_before=rows[-1]["step"] if rows else 0,
        checkpoint_step_at_stop=stop_step,
        wall_s_first=first.wall_s,
    )
    if first.timed_out or first.rc != EXIT_PREEMPTED:
        what = "timed out" if first.timed_out else f"exit {first.rc}, expected {EXIT_PREEMPTED}"
        return {**record, "passed": False, "error": f"first launch: {what}", "tail": first.tail}

    second = launch([*cmd, "--resume", "auto"], deadline - time.time(), work / f"{name}.2.log")
    results.log_launch(f"{name} (--resume auto)", second)
    rows = metrics_rows(run_dir)
    losses = [r["loss"] for r in rows]
    final = run_dir / "final"
    checks = {
        "exit_75_after_sigterm": first.rc == EXIT_PREEMPTED,
        "stopped_after_first_checkpoint": stop_step is not None
        and sizes.a_every <= stop_step < sizes.a_steps,
        "resume_exit_0": second.rc == 0,
        # metrics.jsonl is cut back to the checkpoint on resume: every step exactly once.
        "every_step_logged_once": [r["step"] for r in rows] == list(range(1, sizes.a_steps + 1)),
        "exported": (final / "config.json").is_file() and any(final.glob("*.safetensors")),
        "loss_finite_and_decreased": bool(losses)
        and all(math.isfinite(v) for v in losses)
        and losses[-1] < losses[0],
    }
    record.update(
        exit_code_resume=second.rc,
        steps_after=rows[-1]["step"] if rows else 0,
        first_loss=losses[0] if losses else None,
        final_loss=losses[-1] if losses else None,
        wall_s_resume=second.wall_s,
        wall_s=time.time() - started,
        checks=checks,
        passed=all(checks.values()),
    )
    if not record["passed"]:
        failed = [k for k, ok in checks.items() if not ok]
        timed = " (timed out)" if second.timed_out else ""
        record.update(error=f"failed checks: {', '.join(failed)}{timed}", tail=second.tail)
    return record


def _checkpoint_step(latest: Path) -> int | None:
    """checkpoints/latest names the newest committed checkpoint, 'step-00000006'."""
    try:
        return int(latest.read_text().strip().rsplit("-", 1)[-1])
    except (OSError, ValueError):
        return None


# --- verdicts against the planner -------------------------------------------------------------------------


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
        planner: float | None,
        target: float | None = None,
    ) -> dict[str, Any]:
        key = f"{name}.{quantity}"
        judged = self.enforce or key in self.injected
        return verdict(
            quantity,
            measured,
            estimate=self.injected.get(key, planner),
            target=target,
            judged=judged,
            why_not_judged=None if judged else NOT_JUDGED,
        )


def planner_estimate(sizes: Sizes, recipe: str, overrides: list[str]) -> dict[str, Any]:
    """The planner's step time for the configuration a launch runs (one GPU, or this CPU).

    A planner that refuses the configuration leaves the estimate None and says why: the verdict
    then misses ("not measured" is the measurement's side; this is the estimate's).
    """
    from llm_train.errors import UserError
    from llm_train.planning.report import plan_recipe

    host_gib = min(HOST_RAM_CAP_GIB, machine_host_gib()) if sizes.gpu else machine_host_gib()
    try:
        report = plan_recipe(
            recipe,
            [*COMMON, *overrides],
            gpus=1,
            gpu="H200" if sizes.gpu else None,
            host_ram_gib=host_gib,
            detect=False,
        )
    except UserError as exc:
        return {"step_time_s": None, "planner_error": str(exc)}
    return {"step_time_s": report.evaluation.time.total}


# --- (b), (c) speed -------------------------------------------------------------------------------------------


def measure_speed(
    name: str,
    group: str,
    ds_config: str,
    sizes: Sizes,
    work: Path,
    budget: Budget,
    results: Results,
    judging: Judging,
    extra: list[str] | None = None,
    mfu_target: float | None = None,
) -> dict[str, Any]:
    run_dir = work / name
    steps = sizes.bc_steps
    estimate = planner_estimate(
        sizes, "tiny-cpu", [*sizes.bc_overrides, *(extra or []), f"deepspeed.config={ds_config}"]
    )
    # Two steps more than are waited for: the run is stopped mid-step, never in its export.
    cmd = [
        *train_cmd(sizes, "tiny-cpu", run_dir, steps + 2, [*sizes.bc_overrides, *(extra or [])]),
        "--ds-config",
        ds_config,
    ]
    run = launch(
        cmd,
        budget.timeout(sizes.timeouts["bc"]),
        work / f"{name}.log",
        kill_when=lambda: len(metrics_rows(run_dir)) >= steps,
    )
    results.log_launch(name, run)
    rows = metrics_rows(run_dir)[:steps]
    steady = [r for r in rows if r["step"] > sizes.warmup]
    record: dict[str, Any] = {
        "measurement": name,
        "group": group,
        "ds_config": ds_config,
        "extra": extra or [],
        "steps": len(rows),
        "steady_steps": len(steady),
        "step_time_s": median(steady, "step_time_s"),
        "tokens_per_s": median(steady, "tokens_per_s"),
        "mfu": median(steady, "mfu"),  # attention over the documents the rows pack (planning/flops.py)
        "mfu_seq_len": median(steady, "mfu_seq_len"),  # attention over the whole row, as before
        "attention_span": median(steady, "attention_span"),
        "gpu_mem_peak_gib": peak(rows, "gpu_mem_peak_gib"),
        "final_loss": rows[-1]["loss"] if rows else None,
        "wall_s": run.wall_s,
        "stopped": run.action,
    }
    ok = len(rows) >= steps and bool(steady) and record["step_time_s"] and record["mfu"] is not None
    if not ok:
        what = "timed out" if run.timed_out else f"exit {run.rc}"
        record.update(passed=False, error=f"{what} after {len(rows)} of {steps} steps", tail=run.tail)
    else:
        record["passed"] = True
    record["est_step_time_s"] = estimate["step_time_s"]
    if "planner_error" in estimate:
        record["planner_error"] = estimate["planner_error"]
    verdicts = [judging.against(name, "step_time_s", record["step_time_s"], estimate["step_time_s"])]
    if mfu_target is not None:
        verdicts.append(judging.against(name, "mfu", record["mfu"], None, target=mfu_target))
    return judge(record, verdicts)


def speed_ratio(zero3: dict[str, Any], zero0: dict[str, Any], judging: Judging) -> dict[str, Any]:
    name = "c_zero3_over_zero0"
    t3, t0 = zero3.get("step_time_s"), zero0.get("step_time_s")
    e3, e0 = zero3.get("est_step_time_s"), zero0.get("est_step_time_s")
    record: dict[str, Any] = {
        "measurement": name,
        "group": "c",
        "zero3_step_time_s": t3,
        "zero0_step_time_s": t0,
        "ratio": t3 / t0 if t3 and t0 else None,
        "est_ratio": e3 / e0 if e3 and e0 else None,
    }
    record["passed"] = record["ratio"] is not None
    if not record["passed"]:
        record["error"] = "a step time is missing (see c_zero3 and c_zero0)"
    return judge(record, [judging.against(name, "ratio", record["ratio"], record["est_ratio"])])


# --- (d) the consumer card --------------------------------------------------------------------------------------


def machine_host_gib() -> float:
    import psutil

    return psutil.virtual_memory().total / GiB


def consumer_card(
    sizes: Sizes, work: Path, budget: Budget, results: Results, judging: Judging
) -> dict[str, Any]:
    name = "d_consumer_card"
    record: dict[str, Any] = {"measurement": name, "group": "d", "recipe": sizes.d_recipe}
    host_gib = min(HOST_RAM_CAP_GIB, machine_host_gib()) if sizes.gpu else machine_host_gib()
    cap = CONSUMER_GPU_GIB if sizes.gpu else None
    record.update(gpu_cap_gib=cap, planner_host_ram_gib=host_gib)

    from llm_train.errors import UserError
    from llm_train.planning.report import plan_recipe

    tried, chosen = [], None
    for candidate in sizes.d_candidates:
        overrides = [*sizes.d_overrides, *([f"model.name_or_path={candidate}"] if candidate else [])]
        try:
            report = plan_recipe(
                sizes.d_recipe,
                overrides,
                gpus=1,
                gpu="H200" if sizes.gpu else None,  # its peak for the speed model; memory is the cap
                gpu_mem_gib=cap,
                host_ram_gib=host_gib,
                detect=False,
            )
        except UserError as exc:
            return {**record, "passed": False, "error": f"planner: {exc}"}
        ev = report.evaluation
        tried.append(
            {
                "model": candidate or "recipe's own",
                "fits": ev.fits,
                "gpu_gib": ev.device_bytes / GiB,
                "host_gib": ev.host_bytes / GiB,
            }
        )
        if ev.fits:
            chosen = (candidate, overrides, report)
            break
    record["planner_tried"] = tried
    if chosen is None:
        return {**record, "passed": False, "error": "the planner says none of the candidate shapes fits"}
    candidate, overrides, report = chosen
    ev = report.evaluation
    record.update(
        model=candidate or "recipe's own",
        config=report.config_line,
        est_gpu_gib=ev.device_bytes / GiB,
        est_host_gib=ev.host_bytes / GiB,
        est_step_time_s=ev.time.total,
    )

    run_dir = work / name
    steps = sizes.d_steps
    # Through the wrapper on CPU too (where it caps nothing), so that --cpu-tiny checks it end to end.
    wrapper = [sys.executable, str(CAPPED_TRAIN), "--gpu-cap-gib", str(CONSUMER_GPU_GIB)]
    cmd = train_cmd(sizes, sizes.d_recipe, run_dir, steps + 2, overrides, entry=wrapper)
    gpu = GpuMemorySampler() if sizes.gpu else None
    baseline = gpu.used_gib() if gpu else None
    run = launch(
        cmd,
        budget.timeout(sizes.timeouts["d"]),
        work / f"{name}.log",
        kill_when=lambda: len(metrics_rows(run_dir)) >= steps,
        gpu=gpu,
    )
    results.log_launch(name, run)
    rows = metrics_rows(run_dir)[:steps]
    gpu_peak = peak(rows, "gpu_mem_peak_gib")
    device_used = (
        run.gpu_used_peak_gib - baseline
        if run.gpu_used_peak_gib is not None and baseline is not None
        else None
    )
    record.update(
        steps=len(rows),
        # The first step allocates the optimizer states and warms the kernels: leave it out.
        step_time_s=median(rows[1:] or rows, "step_time_s"),
        gpu_mem_peak_gib=gpu_peak,  # torch.cuda.max_memory_allocated, from metrics.jsonl
        gpu_mem_reserved_peak_gib=peak(rows, "gpu_mem_reserved_gib"),
        gpu_device_used_peak_gib=device_used,  # NVML, whole device, CUDA context included
        host_pss_peak_gib=run.host_pss_peak_gib,  # the process tree's PSS, polled here every 1 s
        host_used_delta_peak_gib=run.host_used_delta_peak_gib,  # the machine, every 0.25 s
        host_rss_metrics_peak_gib=peak(rows, "host_rss_gib"),  # the trainer's own RSS, per step
        wall_s=run.wall_s,
        stopped=run.action,
        cap_note=next((line for line in run.output.splitlines() if line.startswith("capped_train:")), None),
    )
    if gpu_peak is not None and ev.device_bytes:
        record["gpu_measured_over_estimate"] = gpu_peak / (ev.device_bytes / GiB)
    if run.host_pss_peak_gib is not None and ev.host_bytes:
        record["host_measured_over_estimate"] = run.host_pss_peak_gib / (ev.host_bytes / GiB)
    if len(rows) >= steps:
        record["passed"] = True
    else:
        what = "timed out" if run.timed_out else f"exit {run.rc}"
        if run.rc == -signal.SIGKILL and not run.timed_out and run.action is None:
            # Not this script's kill; with host memory near its end the kernel's OOM killer is the usual sender.
            what += " (SIGKILL not sent by gpu_check; see host_used_delta_peak_gib)"
        record.update(passed=False, error=f"{what} after {len(rows)} of {steps} steps", tail=run.tail)
    # Each against the planner's number for the configuration it chose (the tree's PSS for the host).
    verdicts = [
        judging.against(name, "gpu_mem_peak_gib", gpu_peak, record["est_gpu_gib"]),
        judging.against(name, "host_pss_peak_gib", run.host_pss_peak_gib, record["est_host_gib"]),
        judging.against(name, "step_time_s", record["step_time_s"], record["est_step_time_s"]),
    ]
    return judge(record, verdicts)


# --- main --------------------------------------------------------------------------------------------------------


def run_all(
    sizes: Sizes, only: set[str] | None, results: Results, budget: Budget, work: Path, judging: Judging
) -> None:
    def wanted(name: str) -> bool:
        return only is None or name in only

    def guarded(name: str, group: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        record = not_run(name, group, budget)
        if record is None:
            try:
                record = fn()
            except Exception as exc:  # a broken measurement must not take the others with it
                record = {"measurement": name, "group": group, "passed": False, "error": repr(exc)}
        results.add(record)
        # Checkpoints and exports (~4 GB per (a) run) go now: /tmp may be RAM, and (d) needs ~116 GiB of it.
        shutil.rmtree(work / name, ignore_errors=True)
        return record

    for name, ds in (("a_zero2", "zero2"), ("a_zero3", "zero3"), ("a_zero3_offload", "zero3_offload")):
        if wanted(name):
            guarded(name, "a", lambda n=name, d=ds: check_resume(n, d, sizes, work, budget, results))
    speed: dict[str, dict[str, Any]] = {}
    for name, group, ds in (
        ("b_mfu_zero2", "b", "zero2"),
        ("c_zero3", "c", "zero3"),
        ("c_zero0", "c", "zero0"),
    ):
        if wanted(name):
            target = sizes.mfu_target if group == "b" else None
            speed[name] = guarded(
                name,
                group,
                lambda n=name, g=group, d=ds, t=target: measure_speed(
                    n, g, d, sizes, work, budget, results, judging, mfu_target=t
                ),
            )
    if "c_zero3" in speed and "c_zero0" in speed:
        results.add(speed_ratio(speed["c_zero3"], speed["c_zero0"], judging))
    if wanted("d_consumer_card"):
        guarded("d_consumer_card", "d", lambda: consumer_card(sizes, work, budget, results, judging))
    if wanted("zero2_ac"):  # optional (--only zero2_ac): activation checkpointing's cost on the 1B shape
        guarded(
            "zero2_ac",
            "extra",
            lambda: measure_speed(
                "zero2_ac",
                "extra",
                "zero2",
                sizes,
                work,
                budget,
                results,
                judging,
                ["memory.activation_checkpointing=true"],
            ),
        )


NAMES = [
    "a_zero2",
    "a_zero3",
    "a_zero3_offload",
    "b_mfu_zero2",
    "c_zero3",
    "c_zero0",
    "d_consumer_card",
    "zero2_ac",
]


def main() -> None:
    parser = check_arguments(
        __doc__.splitlines()[0],
        NAMES,
        "Run only these (default: all but zero2_ac, in order).",
        "Deadline for the whole check (default 510 GPU, 900 CPU).",
    )
    parser.add_argument(
        "--expect",
        nargs="+",
        default=[],
        metavar="NAME.QUANTITY=VALUE",
        help="Replace the planner's estimate of QUANTITY in measurement NAME and judge it, also under "
        "--cpu-tiny (a test hook: a wrong estimate must fail that line), e.g. c_zero0.step_time_s=1e-6.",
    )
    args = parser.parse_args()
    injected = {}
    for item in args.expect:
        key, _, value = item.partition("=")
        try:
            injected[key] = float(value)
        except ValueError:
            parser.error(f"--expect {item}: give NAME.QUANTITY=NUMBER")
    sizes = CPU_SIZES if args.cpu_tiny else GPU_SIZES
    require_cuda("gpu_check", args.cpu_tiny)
    signal.signal(signal.SIGTERM, _on_stop_signal)
    signal.signal(signal.SIGINT, _on_stop_signal)
    started = time.time()
    budget = Budget(args.budget_s or sizes.budget_s)
    only = set(args.only) if args.only else set(NAMES) - {"zero2_ac"}

    suffix = "_cpu_tiny" if args.cpu_tiny else ""
    results = Results.for_check("gpu_check", args.out, args.cpu_tiny)
    with tempfile.TemporaryDirectory(prefix="llm_train_gpu_check_") as tmp:
        run_all(sizes, only, results, budget, Path(tmp), Judging(sizes.judge, injected))

    by_name = {r["measurement"]: r for r in results.records}
    failed = [r["measurement"] for r in results.records if not r.get("passed")]
    b = by_name.get("b_mfu_zero2", {})
    d = by_name.get("d_consumer_card", {})
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "benchmark": f"gpu_check{suffix}",
        "setup": (
            "CPU script check: tiny-cpu model, bf16, short sequences (numbers say nothing about a GPU)"
            if args.cpu_tiny
            else "one GPU, world of one: (a) ~100M Llama bf16 seq 1024; (b)/(c) Llama-3.2-1B shape, "
            "random init, bf16, seq 4096, micro 4; (d) 7b-rtx4090 under a 24 GiB cap"
        ),
        "passed": not failed,
        "failed": failed,
        "wall_s": round(time.time() - started, 1),
        "budget_s": args.budget_s or sizes.budget_s,
        "correctness": {
            k: by_name.get(k, {}).get("passed") for k in ("a_zero2", "a_zero3", "a_zero3_offload")
        },
        "mfu_zero2": b.get("mfu"),
        "mfu_target": sizes.mfu_target,
        "verdicts_missed": {
            r["measurement"]: [m for v in r.get("verdicts", []) if v["judged"] for m in v["misses"]]
            for r in results.records
            if any(v["judged"] and v["misses"] for v in r.get("verdicts", []))
        },
        "judged": sizes.judge or bool(injected),
        "zero3_over_zero0_step_time": by_name.get("c_zero3_over_zero0", {}).get("ratio"),
        "consumer_card": {
            k: d.get(k)
            for k in (
                "model",
                "gpu_cap_gib",
                "est_gpu_gib",
                "gpu_mem_peak_gib",
                "gpu_device_used_peak_gib",
                "est_host_gib",
                "host_pss_peak_gib",
                "host_used_delta_peak_gib",
                "est_step_time_s",
                "step_time_s",
            )
        },
        "lines": len(results.records),
        "versions": versions(),
    }
    results.summary.write_text(json.dumps(round_floats(summary), indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "versions"}), flush=True)
    print(f"gpu_check: wrote {results.jsonl}, {results.summary.name}, {results.log.name}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
