"""The first minute of every GPU visit: what the machine is, before any case relies on it.

    python -m bench.probe [--cpu-tiny]     # prints one JSON object as its last line

The GPU (name, memory, compute capability, driver), the host (MemTotal, MemAvailable, the memlock
limit native pinning needs), the disk (free space of the work folder and the checkout, and whether /tmp
is RAM), libaio (DeepSpeed's async-I/O op compiles against it: the NVMe case needs it), the library
versions that the cases' results depend on, and two checks of what the cases assume:
- the memory cap works: with `set_per_process_memory_fraction` at 1 GiB (as bench/capped_train.py sets
  it, expandable segments on), 0.5 GiB allocates and 1.5 GiB more raises torch's out-of-memory error;
- a bitsandbytes round trip: NF4 quantise and dequantise a Gaussian matrix on the device: its relative
  RMS error is NF4's (0.05-0.15 on Gaussian weights; 0 would mean nothing was quantised), and on a GPU
  the result equals the CPU backend's (the QLoRA cases trust the GPU kernels; CI runs the CPU ones).
Run in its own process, so the check's own process never holds a CUDA context (NVML's device-wide
numbers are the trainer's alone).
"""

from __future__ import annotations

import argparse
import ctypes.util
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.environment import versions

GiB = 2**30
LIBRARIES = (
    "torch", "triton", "transformers", "accelerate", "deepspeed", "peft", "bitsandbytes", "liger-kernel",
    "flash-attn", "datasets", "pydantic", "safetensors", "tokenizers", "nvidia-ml-py", "psutil",
)  # fmt: skip
NF4_ERROR = (0.05, 0.15)  # relative RMS error of NF4 (blocksize 64) on Gaussian weights: measured ~0.1


def meminfo() -> dict[str, float]:
    fields = {}
    with open("/proc/meminfo") as lines:
        for line in lines:
            key, value = line.split(":", 1)
            fields[key] = int(value.split()[0]) * 1024 / GiB
    return {"mem_total_gib": fields["MemTotal"], "mem_available_gib": fields["MemAvailable"]}


def filesystem(path: Path) -> str | None:
    """The type of the filesystem `path` is on (/proc/mounts: the longest mount point above it)."""
    best, kind = "", None
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            point, fstype = line.split()[1], line.split()[2]
            if str(path.resolve()).startswith(point) and len(point) > len(best):
                best, kind = point, fstype
    except OSError:
        return None
    return kind


def disk(repo: Path) -> dict[str, Any]:
    tmp = Path(tempfile.gettempdir())
    return {
        "tmp_free_gib": shutil.disk_usage(tmp).free / GiB,
        "tmp_filesystem": filesystem(tmp),  # tmpfs: files there take host RAM
        "checkout_free_gib": shutil.disk_usage(repo).free / GiB,
        "checkout_filesystem": filesystem(repo),
    }


def libaio() -> dict[str, Any]:
    """Whether DeepSpeed's async-I/O op can build here (its own check: libaio's library and header)."""
    out: dict[str, Any] = {"libaio_library": ctypes.util.find_library("aio")}
    try:
        from llm_train.runtime.base.compat import prepare_op_loads

        prepare_op_loads()
        from deepspeed.ops.op_builder import AsyncIOBuilder

        out["libaio"] = bool(AsyncIOBuilder().is_compatible(verbose=False))
    except Exception as exc:  # no DeepSpeed: the NVMe case cannot run either
        out.update(libaio=False, libaio_error=f"{type(exc).__name__}: {exc}"[:300])
    return out


def gpu() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"cuda": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    if not out["cuda"]:
        return out
    props = torch.cuda.get_device_properties(0)
    out.update(
        device=props.name,
        device_memory_gib=props.total_memory / GiB,
        capability=f"{props.major}.{props.minor}",
        multiprocessors=props.multi_processor_count,
    )
    smi = shutil.which("nvidia-smi")
    if smi:
        query = [smi, "--query-gpu=driver_version,memory.used", "--format=csv,noheader"]
        try:
            done = subprocess.run(query, capture_output=True, text=True, timeout=20)
            out["nvidia_smi"] = done.stdout.strip() or done.stderr.strip()[:200]
        except (OSError, subprocess.TimeoutExpired) as exc:
            out["nvidia_smi"] = f"{type(exc).__name__}: {exc}"[:200]
    return out


def cap_works() -> dict[str, Any]:
    """0.5 GiB fits a 1 GiB cap and 1.5 GiB more does not (the allocator's cap, as capped_train sets it)."""
    from llm_train.runtime.model.fast import set_cuda_alloc_conf

    set_cuda_alloc_conf()  # before CUDA starts, as capped_train and train.py do
    import torch

    if not torch.cuda.is_available():
        return {"cap_works": None, "cap_note": "no CUDA device"}
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(GiB / total, 0)
    small = torch.empty(GiB // 2, dtype=torch.uint8, device="cuda")
    try:
        big = torch.empty(3 * GiB // 2, dtype=torch.uint8, device="cuda")
        refused = False
        del big
    except torch.OutOfMemoryError:
        refused = True
    del small
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    torch.cuda.empty_cache()
    return {"cap_works": refused}


def nf4_round_trip() -> dict[str, Any]:
    """NF4 quantise + dequantise of a 4096 x 4096 Gaussian on the device, against NF4's error and the CPU."""
    import torch

    try:
        import bitsandbytes.functional as bnbf
    except Exception as exc:  # no bitsandbytes: the QLoRA cases will say it too
        return {"nf4_ok": False, "nf4_error": f"{type(exc).__name__}: {exc}"[:300]}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    weights = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)

    def round_trip(where: str) -> torch.Tensor:
        packed, state = bnbf.quantize_4bit(weights.to(where), quant_type="nf4", blocksize=64)
        return bnbf.dequantize_4bit(packed, state, quant_type="nf4").float().cpu()

    started = time.perf_counter()
    back = round_trip(device)
    out: dict[str, Any] = {"nf4_device": device, "nf4_s": time.perf_counter() - started}
    error = float((back - weights.float()).pow(2).mean().sqrt() / weights.float().pow(2).mean().sqrt())
    out["nf4_relative_rms_error"] = error
    ok = NF4_ERROR[0] <= error <= NF4_ERROR[1]
    if device == "cuda":
        # The same 16 NF4 levels and block maxima: elements may differ only where a value sits on a
        # rounding boundary between two levels (ties), a vanishing fraction of a Gaussian matrix.
        differ = float((round_trip("cpu") != back).float().mean())
        out["nf4_fraction_differing_from_cpu"] = differ
        ok = ok and differ < 1e-4
    out["nf4_ok"] = ok
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-tiny", action="store_true", help="No GPU expected (CI).")
    args = parser.parse_args()
    repo = Path(__file__).resolve().parent.parent
    started = time.perf_counter()
    record: dict[str, Any] = {**meminfo(), **disk(repo), **libaio()}
    record["memlock_limit"] = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    record["nvml"] = importlib.util.find_spec("pynvml") is not None
    record["versions"] = versions(LIBRARIES)
    record.update(gpu())
    record.update(cap_works())
    record.update(nf4_round_trip())
    checks = {"nf4_round_trip": record["nf4_ok"]}
    if not args.cpu_tiny:
        checks.update(cuda=record["cuda"], cap_works=bool(record["cap_works"]), nvml=record["nvml"])
    record.update(checks=checks, passed=all(checks.values()), probe_s=time.perf_counter() - started)
    print(json.dumps(record), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
