"""`llm_train/train.py` on a big machine that behaves like a smaller one: a GPU memory cap, a host RAM budget.

    python -m bench.capped_train --gpu-cap-gib 12 [--host-ram-gib 16] --recipe 8b-qlora-rtx4070 ...

The prepared GPU checks run the consumer-card recipes on an H200 this way. The GPU cap is the caching
allocator's `set_per_process_memory_fraction`, set in the training process itself before anything is
allocated, so every tensor of the run counts against it (bitsandbytes' too; the cap holds with
expandable segments) and an allocation past it fails with the same out-of-memory error as on the real
card. The CUDA context, kernel images and NCCL's buffers (0.5-1.5 GiB) are outside it: the checks hold
NVML's device-wide peak against the real card's memory for that.

`--host-ram-gib N` makes llm_train see the desktop the recipe is written for (its hardware.host_ram_gib):
psutil.virtual_memory() reports N GiB in total and N less this process's resident memory available, so
every decision the run takes from the host's RAM is the one it takes there: the planner's guards at
start, and the export's verification, which reloads final/ on the CPU only when the model fits half the
free RAM (runtime/export/verify.py). On a 128 GiB machine it reloaded the merged 15 GiB 8B, a path a 16 GiB
desktop never takes and the planner does not count. Nothing bounds the real use: the checks measure it.

Everything after the options goes to train.py unchanged, and its exit code (75 after a preemption, 2
for a user error) is this script's. Without a CUDA device the GPU cap is a no-op.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any

TRAIN = Path(__file__).resolve().parent.parent / "llm_train" / "train.py"
GiB = 1024**3
USAGE = "usage: python -m bench.capped_train --gpu-cap-gib GIB [--host-ram-gib GIB] [train.py arguments ...]"


def cap_gpu_memory(cap_gib: float) -> str:
    """Set the allocator's cap on device 0; returns what was done, for the run's log."""
    from llm_train.runtime.model.fast import set_cuda_alloc_conf

    # The allocator reads its configuration when CUDA is first initialised, which the cap below does:
    # set it first, as train.py would, so the capped run allocates the same way.
    set_cuda_alloc_conf()
    import torch

    if not torch.cuda.is_available():
        return "capped_train: no CUDA device; running without a GPU memory cap"
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, cap_gib * GiB / total)
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    return f"capped_train: GPU memory capped at {cap_gib:g} GiB ({fraction:.4f} of {total / GiB:.1f} GiB)"


def budget_host_ram(budget_gib: float) -> str:
    """psutil.virtual_memory() as a machine of `budget_gib` running only this process (module docstring)."""
    import psutil

    real = psutil.virtual_memory
    budget = int(budget_gib * GiB)

    def virtual_memory() -> Any:
        seen = real()
        total = min(budget, seen.total)  # never more than the machine has
        available = max(0, min(seen.available, total - psutil.Process().memory_info().rss))
        return seen._replace(total=total, available=available, free=min(seen.free, available))

    psutil.virtual_memory = virtual_memory
    return f"capped_train: host RAM seen as {budget_gib:g} GiB (of {real().total / GiB:.1f} GiB)"


def option(args: list[str], name: str) -> tuple[float | None, list[str]]:
    """(the value of `name GIB` at the front of args, the rest); exits 2 on a value that is no positive number."""
    if not args or args[0] != name:
        return None, args
    try:
        value = float(args[1]) if len(args) > 1 else 0.0
    except ValueError:
        value = 0.0
    if value <= 0:
        given = args[1] if len(args) > 1 else ""
        print(f"capped_train: {name} {given!r} is not a positive number of GiB", file=sys.stderr)
        sys.exit(2)
    return value, args[2:]


def main() -> None:
    cap, args = option(sys.argv[1:], "--gpu-cap-gib")
    if cap is None:
        print(f"capped_train: {USAGE}", file=sys.stderr)
        sys.exit(2)
    host, args = option(args, "--host-ram-gib")
    print(cap_gpu_memory(cap), flush=True)
    if host is not None:
        print(budget_host_ram(host), flush=True)
    sys.argv = [str(TRAIN), *args]
    # train.py's __main__ block ends the process with its exit code (os._exit).
    runpy.run_path(str(TRAIN), run_name="__main__")


if __name__ == "__main__":
    main()
