"""`llm-train doctor`: what this machine has, and what will break before it breaks.

    llm-train doctor [--skip-build] [--build-timeout SECONDS] [--recipe NAME [--drive-gib GIB] [key.sub=value ...]]

Prints GPUs (name, memory, compute capability, bf16), host RAM, CPU cores, free disk,
the GPU interconnect (`nvidia-smi topo -m`) when present, which GPU pairs lack peer-to-peer access
(NCCL hangs on them; runs set NCCL_P2P_DISABLE=1 themselves), the versions that matter
(torch and its CUDA, DeepSpeed, Accelerate, Transformers, PEFT, flash-attn), and whether
DeepSpeed's CPU Adam actually builds and loads here: the ZeRO-Offload recipes need it and
its JIT build is a classic failure (missing compiler, headers, mismatched CUDA). It also
says whether DeepSpeed's async I/O op (NVMe offload, ZeRO-Infinity) can build: that needs
libaio, which most machines lack. That is a warning only when --recipe names a recipe that
offloads to nvme (then its deepspeed.nvme_path is checked too, and the drive's sequential read and
write speed measured there: commands/drive.py), else information. Every
warning comes with its fix. Runs on a machine without a GPU or without nvidia-smi.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llm_train.commands.drive import measure_drive
from llm_train.config import ds_json
from llm_train.config.attention_kernel import choose_attention
from llm_train.config.ds_json import nvme_paths
from llm_train.config.hardware import Device, describe_pairs, find_gpu, gpus_without_p2p
from llm_train.config.recipe import load_recipe
from llm_train.config.recipe_files import available_recipes
from llm_train.config.resolution import resolve_run
from llm_train.errors import UserError, first_line
from llm_train.planning.search.guards import nvme_problems
from llm_train.runtime.base.compat import installed_version, version_problems
from llm_train.units import GiB

DEFAULT_BUILD_TIMEOUT_S = 300.0
# A few GiB: past the drive's DRAM cache, short enough for a check (a PCIe 4.0 drive: ~1-2 s each way).
DEFAULT_DRIVE_BYTES = 4 * GiB
# Below these, the common recipes run into trouble (checkpoints, NCCL shared memory).
MIN_FREE_DISK_GIB = 50.0
MIN_SHM_GIB = 1.0
PACKAGES = (
    "torch",
    "deepspeed",
    "accelerate",
    "transformers",
    "peft",
    "bitsandbytes",
    "datasets",
    "lm-eval",
    "safetensors",
    "wandb",
)

# Run in a child process: the build can take minutes, can hang, and prints a lot.
_CPU_ADAM_PROBE = """
import time, logging
t = time.perf_counter()
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.op_builder import CPUAdamBuilder
from llm_train.runtime.base.compat import prepare_op_loads
logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
prepare_op_loads()  # as a training run does: the same ninja, so the build is the run's
CPUAdamBuilder().load()
print(f"LLM_TRAIN_PROBE_OK accelerator={get_accelerator().device_name()} seconds={time.perf_counter() - t:.1f}")
"""


@dataclass
class Report:
    sections: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    warnings: list[tuple[str, str]] = field(default_factory=list)  # (problem, fix)

    def add(self, section: str, key: str, value: str) -> None:
        self.sections.setdefault(section, []).append((key, value))

    def warn(self, problem: str, fix: str) -> None:
        self.warnings.append((problem, fix))

    def render(self) -> str:
        lines = []
        for name, rows in self.sections.items():
            lines.append(f"== {name}")
            width = max(len(k) for k, _ in rows)
            for key, value in rows:
                first, *rest = value.splitlines() or [""]
                lines.append(f"  {key:<{width}}  {first}")
                lines.extend(f"  {'':<{width}}  {line}" for line in rest)
        lines.append("== warnings")
        if not self.warnings:
            lines.append("  none")
        for problem, fix in self.warnings:
            lines.append(f"  ! {problem}")
            lines.append(f"    fix: {fix}")
        return "\n".join(lines)


def cpu_recipes() -> list[str]:
    """The shipped recipes written for a CPU (hardware.device: cpu), read from recipes/ rather than listed."""
    return [name for name in available_recipes() if load_recipe(name).hardware.device == "cpu"]


def _run(cmd: list[str], timeout: float = 10.0) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


# --- sections ----------------------------------------------------------------------------------


def check_system(report: Report, cwd: Path) -> None:
    import psutil

    section = "system"
    report.add(section, "OS", f"{platform.system()} {platform.release()} ({platform.machine()})")
    report.add(section, "Python", f"{platform.python_version()} ({sys.executable})")
    physical = psutil.cpu_count(logical=False) or "?"
    cpu_name = platform.processor() or _cpu_model() or "unknown CPU"
    report.add(section, "CPU cores", f"{physical} physical, {os.cpu_count()} logical ({cpu_name})")
    vm = psutil.virtual_memory()
    report.add(section, "host RAM", f"{vm.total / GiB:.1f} GiB total, {vm.available / GiB:.1f} GiB available")
    for label, path in (("disk (here)", cwd), ("disk (~/.cache)", Path.home() / ".cache")):
        probe = path if path.exists() else path.parent
        free = shutil.disk_usage(probe).free / GiB
        report.add(section, label, f"{free:.0f} GiB free at {probe}")
        if label == "disk (here)" and free < MIN_FREE_DISK_GIB:
            report.warn(
                f"only {free:.0f} GiB free at {probe}: a 7B run's checkpoints (with optimizer states) "
                "take ~100 GB",
                "free space, or point output.dir=/big/disk/{name} at a larger disk",
            )
    shm = Path("/dev/shm")
    if shm.exists():
        size = shutil.disk_usage(shm).total / GiB
        report.add(section, "/dev/shm", f"{size:.1f} GiB")
        if size < MIN_SHM_GIB:
            report.warn(
                f"/dev/shm is {size:.2f} GiB: NCCL and data-loader workers need shared memory",
                "in Docker run with --shm-size=16g (or --ipc=host)",
            )


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def check_gpus(report: Report) -> list[tuple[str, float, tuple[int, int], bool]]:
    """GPUs as torch sees them: (name, memory GiB, compute capability, bf16)."""
    section = "GPUs"
    try:
        import torch
    except ImportError:
        report.add(section, "torch", "not installed")
        report.warn("torch is not installed", "pip install torch (a CUDA build on GPU machines)")
        return []
    smi = shutil.which("nvidia-smi")
    gpus: list[tuple[str, float, tuple[int, int], bool]] = []
    if torch.cuda.is_available():
        arch_list = set(torch.cuda.get_arch_list())
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            cc = (props.major, props.minor)
            bf16 = cc >= (8, 0)  # Ampere and newer
            mem = props.total_memory / GiB
            spec = find_gpu(props.name)
            peak = f", {spec.peak_tflops:g} TFLOP/s dense 16-bit" if spec else ""
            report.add(
                section,
                f"GPU {i}",
                f"{props.name}, {mem:.1f} GiB, compute capability {cc[0]}.{cc[1]}, "
                f"bf16 {'yes' if bf16 else 'no'}{peak}",
            )
            gpus.append((props.name, mem, cc, bf16))
            sm = f"sm_{cc[0]}{cc[1]}"
            if arch_list and sm not in arch_list and not any(a.startswith("compute_") for a in arch_list):
                report.warn(
                    f"this torch build has no kernels for {props.name} ({sm}; built for {', '.join(sorted(arch_list))})",
                    "install a torch wheel built for your GPU (pytorch.org/get-started)",
                )
        check_p2p(report, len(gpus), gpus_without_p2p() if len(gpus) > 1 else [])
        if any(not g[3] for g in gpus):
            names = ", ".join(sorted({g[0] for g in gpus if not g[3]}))
            report.warn(
                f"{names}: no bf16 (compute capability < 8.0)",
                "keep precision=auto (trains in fp16 with dynamic loss scaling); do not set precision=bf16",
            )
    else:
        report.add(section, "CUDA GPUs", "none visible to torch")
        if smi and torch.version.cuda is None:
            report.warn(
                "nvidia-smi is present but this torch is a CPU-only build",
                "pip install torch --index-url https://download.pytorch.org/whl/cu124 (match your driver)",
            )
        elif smi:
            report.warn(
                "nvidia-smi is present but torch sees no GPU",
                "check CUDA_VISIBLE_DEVICES and that the driver supports torch's CUDA "
                f"{torch.version.cuda} (nvidia-smi shows the highest CUDA it supports)",
            )
        else:
            report.warn(
                f"no CUDA GPU: only CPU recipes ({', '.join(cpu_recipes())}) train here",
                "plan a GPU machine with `llm-train plan --recipe NAME --gpu RTX-4090 --host-ram 128`",
            )
    if smi:
        driver = _run([smi, "--query-gpu=driver_version", "--format=csv,noheader"])
        if driver:
            report.add(section, "driver", driver.strip().splitlines()[0])
        topo = _run([smi, "topo", "-m"])
        if topo:
            # The matrix says NV# (NVLink), PIX/PXB (PCIe switch), PHB/NODE/SYS (through the CPU).
            report.add(section, "interconnect", topo.rstrip())
            if len(gpus) > 1 and "NV" not in topo:
                report.warn(
                    "GPUs talk over PCIe, not NVLink: ZeRO-3 all-gathers every micro-batch are slow",
                    "prefer ZeRO-2 (or ZeRO-1) when the model fits; `llm-train plan` ranks the options",
                )
    else:
        report.add(section, "nvidia-smi", "not found (no NVIDIA driver tools)")
    return gpus


def check_p2p(report: Report, gpu_count: int, pairs_without_p2p: list[tuple[int, int]]) -> None:
    """One row on peer-to-peer access between this node's GPUs; a warning for pairs without it."""
    if gpu_count < 2:
        return
    if not pairs_without_p2p:
        report.add("GPUs", "peer-to-peer", f"every pair of the {gpu_count} GPUs")
        return
    pairs = describe_pairs(pairs_without_p2p)
    report.add("GPUs", "peer-to-peer", f"NONE between GPUs {pairs}")
    report.warn(
        f"GPUs {pairs} have no peer-to-peer access (usual on RTX 40xx): NCCL hangs on them unless "
        "NCCL_P2P_DISABLE=1",
        "nothing for llm_train runs (they set NCCL_P2P_DISABLE=1 themselves, with a notice); for other "
        "tools export NCCL_P2P_DISABLE=1",
    )


def check_software(report: Report, gpus: list[tuple[str, float, tuple[int, int], bool]]) -> None:
    section = "software"
    torch_cuda = None
    try:
        import torch

        torch_cuda = torch.version.cuda
        cudnn = torch.backends.cudnn.version() if torch.cuda.is_available() else None
        report.add(
            section,
            "torch",
            f"{torch.__version__} (CUDA {torch_cuda or 'none: CPU build'}"
            + (f", cuDNN {cudnn})" if cudnn else ")"),
        )
    except ImportError:
        pass
    for package in PACKAGES[1:]:
        report.add(section, package, installed_version(package) or "not installed")
    # One warning per library outside its tested window (runtime/base/compat.py WINDOWS).
    for outside in version_problems():
        report.warn(*outside)
    if not installed_version("peft"):
        report.warn("peft is not installed: LoRA recipes will not run", "pip install 'llm_train[lora]'")
    flash = installed_version("flash-attn") or installed_version("flash_attn")
    if flash:
        try:
            import flash_attn  # noqa: F401

            report.add(section, "flash-attn", f"{flash} (imports)")
        except Exception as exc:  # an ABI mismatch with torch is the common failure
            report.add(section, "flash-attn", f"{flash} (FAILS to import: {first_line(exc)})")
            report.warn(
                "flash-attn is installed but does not import (built against another torch/CUDA)",
                "pip install --force-reinstall --no-build-isolation flash-attn, or use memory.attention=sdpa",
            )
    else:
        report.add(section, "flash-attn", "not installed (memory.attention=auto works without it)")
    # What memory.attention=auto picks on this machine for one process per GPU (config/attention_kernel.py).
    report.add(section, "attention", choose_attention("auto", Device.detect() if gpus else "cpu").why)
    if not flash and any(g[2] >= (8, 0) for g in gpus):
        report.warn(
            "flash-attn is not installed (optional)",
            "pip install flash-attn --no-build-isolation to use memory.attention=flash_attention_2",
        )
    compilers = []
    for tool in ("gcc", "g++", "ninja", "nvcc"):
        path = shutil.which(tool)
        compilers.append(f"{tool} {'at ' + path if path else 'missing'}")
    report.add(section, "build tools", ", ".join(compilers))
    if not shutil.which("g++") and not shutil.which("c++"):
        report.warn(
            "no C++ compiler: DeepSpeed cannot JIT-build CPU Adam (needed by every offload recipe)",
            "apt-get install build-essential python3-dev (or the distribution's equivalent)",
        )
    if not shutil.which("ninja") and not installed_version("ninja"):
        report.warn("ninja is missing: DeepSpeed's JIT op builds need it", "pip install ninja")
    nvcc = shutil.which("nvcc")
    if nvcc and torch_cuda:
        out = _run([nvcc, "--version"]) or ""
        release = next(
            (w.rstrip(",") for line in out.splitlines() if "release" in line for w in line.split()[4:5]), ""
        )
        if release and release.split(".")[0] != torch_cuda.split(".")[0]:
            report.warn(
                f"nvcc is CUDA {release} but torch was built with CUDA {torch_cuda}: DeepSpeed CUDA op builds fail",
                "install the matching CUDA toolkit and set CUDA_HOME to it",
            )


def check_cpu_adam(report: Report, timeout: float) -> None:
    """Build and load DeepSpeed's CPU Adam in a child process; one line either way."""
    section = "DeepSpeed ops"
    if not installed_version("deepspeed"):
        report.add(section, "CPU Adam", "not tried: deepspeed is not installed")
        return
    started = time.perf_counter()
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    # Its own session, so a timeout kills the compiler processes too, not just Python.
    proc = subprocess.Popen(
        [sys.executable, "-c", _CPU_ADAM_PROBE],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        report.add(section, "CPU Adam", f"no answer after {timeout:.0f} s (build still running; stopped)")
        report.warn(
            f"DeepSpeed CPU Adam did not build within {timeout:.0f} s",
            "run `llm-train doctor --build-timeout 900` once (the build is cached in ~/.cache/torch_extensions)",
        )
        return
    elapsed = time.perf_counter() - started
    ok = next((line for line in out.splitlines() if line.startswith("LLM_TRAIN_PROBE_OK")), None)
    if proc.returncode == 0 and ok:
        accel = ok.split("accelerator=")[1].split()[0]
        report.add(section, "CPU Adam", f"builds and loads ({elapsed:.1f} s; DeepSpeed accelerator: {accel})")
        return
    lines = [line.strip() for line in out.splitlines() if line.strip() and "[WARNING]" not in line]
    error = next(
        (line for line in reversed(lines) if "Error" in line or "error" in line), lines[-1] if lines else ""
    )
    report.add(section, "CPU Adam", f"FAILS to build/load: {error[:200]}")
    report.warn(
        "DeepSpeed CPU Adam does not build here: every ZeRO-Offload recipe (7b-rtx4090, 13b-rtx4090-offload) "
        "needs it",
        "install build-essential and python3-dev (and ninja), remove ~/.cache/torch_extensions, rerun; "
        "or prebuild it: DS_BUILD_CPU_ADAM=1 pip install --no-build-isolation --force-reinstall deepspeed",
    )


# How DeepSpeed's own op builder explains a failed libaio check (op_builder/async_io.py), as one fix.
AIO_FIX = (
    "install libaio's headers: apt install libaio-dev (yum install libaio-devel, pacman -S libaio); "
    "if libaio is installed elsewhere, set CFLAGS=-I<prefix>/include and LDFLAGS=-L<prefix>/lib; "
    "`ds_report` shows DeepSpeed's own view"
)


def _async_io_builder() -> Any:
    """DeepSpeed's AsyncIOBuilder for this machine's accelerator (a seam the tests replace)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return AsyncIOBuilder()


def async_io_status() -> tuple[bool, str]:
    """(whether DeepSpeed's async_io op can build here, why not), decided the way ds_report does.

    `is_compatible` links a test program against libaio's io_submit (a second or two, no JIT
    build of the op itself) and adds the builder's generic checks.
    """
    try:
        builder = _async_io_builder()
        if builder.is_compatible(verbose=False):
            return True, ""
        if not builder.has_function("io_submit", ("aio",)):
            return False, "libaio headers or library not found (DeepSpeed's io_submit link test failed)"
        return False, "DeepSpeed's op builder refuses it on this machine although libaio was found"
    except Exception as exc:  # a broken deepspeed install must not take the whole report down
        return False, f"the check itself failed: {first_line(exc)}"


def check_async_io(report: Report, uses_nvme: bool) -> None:
    """One row on DeepSpeed's async I/O op; a warning only when the recipe at hand needs it."""
    section = "DeepSpeed ops"
    if not installed_version("deepspeed"):
        report.add(section, "async I/O", "not tried: deepspeed is not installed")
        return
    ok, why = async_io_status()
    if ok:
        report.add(section, "async I/O", "can build (libaio found): NVMe offload is possible")
        return
    if uses_nvme:
        report.add(section, "async I/O", f"CANNOT build: {why}")
        report.warn(f"DeepSpeed async I/O cannot build, and the recipe offloads to NVMe: {why}", AIO_FIX)
    else:
        # Most machines lack libaio and most recipes never touch it: information, not a warning.
        report.add(
            section, "async I/O", f"cannot build: {why}; only NVMe offload needs it. To enable: {AIO_FIX}"
        )


def recipe_uses_nvme(recipe_name: str, overrides: list[str]) -> bool:
    """Whether the recipe (with overrides) offloads anything to nvme or names deepspeed.nvme_path."""

    recipe = load_recipe(recipe_name, overrides)
    _, raw = ds_json.load_ds_config(recipe.deepspeed.config)
    devices = {ds_json.offload_device(raw, what) for what in ("optimizer", "param")}
    return "nvme" in devices or recipe.deepspeed.nvme_path is not None


def check_nvme_recipe(
    report: Report, recipe_name: str, overrides: list[str], drive_bytes: int = DEFAULT_DRIVE_BYTES
) -> None:
    """The recipe's NVMe directory, with the checks a real run makes before it starts, and its drive's
    sequential speeds (commands/drive.py) when the directory passes them (drive_bytes 0: not measured)."""

    section = "NVMe offload"
    try:
        world = load_recipe(recipe_name, overrides).hardware.world_size
        run = resolve_run(recipe_name, overrides, world_size=world)
        problems = nvme_problems(run)
    except UserError as exc:  # no path given, or a contradiction: same line a run would print
        problems = [str(exc)]
        run = None
    paths = ", ".join(sorted(set(nvme_paths(run.ds_config).values()))) if run else "(no usable path)"
    report.add(section, "recipe", f"{recipe_name} offloads to nvme at {paths}")
    report.add(section, "path check", "ok (exists, writable, enough free space)" if not problems else "FAILS")
    for line in problems:
        problem, _, fix = line.partition("; ")
        report.warn(problem, fix or "see the message")
    if run is None or problems or not drive_bytes:
        return
    for path in sorted(set(nvme_paths(run.ds_config).values())):
        try:
            speed = measure_drive(Path(path), drive_bytes)
        except OSError as exc:
            report.add(section, "drive speed", f"not measured at {path}: {exc.strerror or exc}")
            continue
        report.add(section, "drive speed", f"{path}: {speed.describe()}")
        report.add(
            section,
            "plan with it",
            f"llm-train plan --recipe {recipe_name} --nvme-read-gbs {speed.read_bytes_per_s / 1e9:.2f} "
            f"--nvme-write-gbs {speed.write_bytes_per_s / 1e9:.2f} --nvme-gib FREE",
        )


def collect(
    build: bool = True,
    timeout: float = DEFAULT_BUILD_TIMEOUT_S,
    cwd: Path | None = None,
    recipe: str | None = None,
    overrides: list[str] | None = None,
    drive_bytes: int = 0,
) -> Report:
    report = Report()
    # The recipe first: a misspelled name is a one-line error before minutes of probing.
    uses_nvme = recipe_uses_nvme(recipe, overrides or []) if recipe else False
    check_system(report, cwd or Path.cwd())
    gpus = check_gpus(report)
    check_software(report, gpus)
    if build:
        check_cpu_adam(report, timeout)
        check_async_io(report, uses_nvme)
    else:
        report.add("DeepSpeed ops", "CPU Adam", "not tried (--skip-build)")
        report.add("DeepSpeed ops", "async I/O", "not tried (--skip-build)")
    if recipe and uses_nvme:
        check_nvme_recipe(report, recipe, overrides or [], drive_bytes)
    if gpus:
        import psutil

        host = psutil.virtual_memory().total / GiB
        if host < 64:
            report.warn(
                f"{host:.0f} GiB host RAM: full fine-tunes with CPU offload will not fit "
                "(7b-rtx4090 needs ~116 GiB)",
                "use LoRA (8b-lora-rtx4090) or NVMe offload; `llm-train plan --recipe NAME` shows the options",
            )
    return report


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="Check this machine: GPUs, RAM, disk, versions, DeepSpeed CPU Adam and async I/O builds.",
        description="Report the hardware and software llm_train depends on; every warning comes with its fix.",
    )
    p.add_argument(
        "--skip-build",
        action="store_true",
        help="Do not build/load DeepSpeed's CPU Adam nor probe its async I/O op.",
    )
    p.add_argument(
        "--build-timeout",
        type=float,
        default=DEFAULT_BUILD_TIMEOUT_S,
        metavar="SECONDS",
        help="Give up on the CPU Adam build after this long (the first build takes 1-3 minutes).",
    )
    p.add_argument(
        "--recipe",
        help="Also check what this recipe needs: with NVMe offload, async I/O and deepspeed.nvme_path.",
    )
    p.add_argument(
        "--drive-gib",
        type=float,
        default=DEFAULT_DRIVE_BYTES / GiB,
        metavar="GIB",
        help="With an NVMe recipe: write and read this much at its nvme_path to measure the drive "
        "(O_DIRECT where the filesystem allows; 0 skips it).",
    )
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="Recipe overrides (with --recipe).")
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:

    if args.overrides and not args.recipe:
        raise UserError("doctor: key.sub=value overrides need --recipe NAME")
    if args.drive_gib < 0:
        raise UserError(
            f"--drive-gib {args.drive_gib:g}: give GiB to write and read (0 skips the drive test)"
        )
    report = collect(
        build=not args.skip_build,
        timeout=args.build_timeout,
        recipe=args.recipe,
        overrides=args.overrides,
        drive_bytes=int(args.drive_gib * GiB),
    )
    print(report.render())
    return 0
