"""`llm_train/train.py` under a GPU memory cap: a big card behaves like a smaller one.

    python bench/capped_train.py --gpu-cap-gib 24 --recipe 7b-rtx4090 model.init=random ...

bench/gpu_check.py runs the consumer-card recipe (7b-rtx4090, written for a 24 GiB RTX 4090)
on an H200 this way, to check the planner's memory estimate for that card. The cap is the
caching allocator's `set_per_process_memory_fraction`, set in the training process itself
before anything is allocated, so every tensor of the run counts against it; an allocation
past it fails with the same out-of-memory error as on a real 24 GiB card. The CUDA context
(~0.5 GiB) is not counted by the allocator, which makes the cap slightly generous.

Everything after `--gpu-cap-gib N` goes to train.py unchanged, and its exit code (75 after a
preemption, 2 for a user error) is this script's. Without a CUDA device it runs uncapped.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "llm_train" / "train.py"
GiB = 1024**3  # not llm_train.units: this wrapper runs before the repo is importable
USAGE = "usage: python bench/capped_train.py --gpu-cap-gib GIB [train.py arguments ...]"


def cap_gpu_memory(cap_gib: float) -> str:
    """Set the allocator's cap on device 0; returns what was done, for the run's log."""
    sys.path.insert(0, str(REPO))
    from llm_train.runtime.fast import set_cuda_alloc_conf

    # The allocator reads its configuration when CUDA is first initialised, which the cap
    # below does: set it first, as train.py would, so the capped run allocates the same way.
    set_cuda_alloc_conf()
    import torch

    if not torch.cuda.is_available():
        return "capped_train: no CUDA device; running without a GPU memory cap"
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, cap_gib * GiB / total)
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    return f"capped_train: GPU memory capped at {cap_gib:g} GiB ({fraction:.4f} of {total / GiB:.1f} GiB)"


def main() -> None:
    args = sys.argv[1:]
    if len(args) < 2 or args[0] != "--gpu-cap-gib":
        print(f"capped_train: {USAGE}", file=sys.stderr)
        sys.exit(2)
    try:
        cap_gib = float(args[1])
    except ValueError:
        cap_gib = 0.0
    if cap_gib <= 0:
        print(f"capped_train: --gpu-cap-gib {args[1]!r} is not a positive number of GiB", file=sys.stderr)
        sys.exit(2)
    print(cap_gpu_memory(cap_gib), flush=True)
    sys.argv = [str(TRAIN), *args[2:]]
    # train.py's __main__ block ends the process with its exit code (os._exit).
    runpy.run_path(str(TRAIN), run_name="__main__")


if __name__ == "__main__":
    main()
