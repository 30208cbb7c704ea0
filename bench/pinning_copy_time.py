"""What each pinning choice (deepspeed.pinning: torch, native, off) costs in copy time, side by side.

    .venv/bin/python -m bench.pinning_copy_time [--mib 512] [--repeats 5] [--out DIR]

One host buffer per choice, allocated the way DeepSpeed allocates it: torch's pinned allocator
(`tensor.pin_memory()`, CUDA only: rounded up to a power of two), DeepSpeed's native pinning
(`DS_PIN_MEMORY_BACKEND=native`: posix_memalign + mlock of the exact size, deepspeed/utils/pin_memory.py)
and a plain pageable tensor (`pin_memory: false`). For each it times:
- the allocation, first touch included (native locks every page at once);
- host copies into it (what CPU Adam's side of the step does: the gradient copy-in, the update);
- on a GPU, device -> host and host -> device copies of it, non_blocking as DeepSpeed issues them
  (only pinned memory is a DMA target; a pageable copy is staged through a driver buffer and
  blocks the stream).
A CPU run reports the first two and says the rest needs a GPU (run it on one for them). One JSON object, written to OUT/pinning-copy-time.json (default bench/results/, dated).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.environment import REPO, as_a_training_worker, versions

MiB = 2**20


def _native_pins() -> Any:
    from deepspeed.utils.pin_memory import get_native_pinned_memory

    return get_native_pinned_memory()


def allocate(choice: str, numel: int) -> torch.Tensor:
    """A float32 host buffer of `numel` elements as DeepSpeed allocates it under `choice`, every page touched."""
    if choice == "torch":
        buffer = torch.empty(numel, dtype=torch.float32).pin_memory()
    elif choice == "native":
        buffer = _native_pins().pin_empty(torch.empty(0, dtype=torch.float32), (numel,))
    else:
        buffer = torch.empty(numel, dtype=torch.float32)
    buffer.zero_()
    return buffer


def _timed(fn: Any, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(choice: str, nbytes: int, repeats: int) -> dict[str, Any]:
    """Allocation, host copy and (on CUDA) device copy speeds of one pinning choice."""
    numel = nbytes // 4
    if choice == "native":
        _native_pins()  # load (or JIT-build) DeepSpeed's pin_memory op outside the timing
    started = time.perf_counter()
    buffer = allocate(choice, numel)
    alloc_s = time.perf_counter() - started
    source = torch.randn(numel)
    gbs = nbytes / 1e9
    row: dict[str, Any] = {
        "choice": choice,
        "alloc_and_touch_s": alloc_s,
        "host_copy_in_gbs": gbs / _timed(lambda: buffer.copy_(source), repeats),
        "host_add_gbs": gbs / _timed(lambda: buffer.add_(source, alpha=1e-3), repeats),
    }
    if torch.cuda.is_available():
        device = torch.empty(numel, dtype=torch.float32, device="cuda")

        def d2h() -> None:
            buffer.copy_(device, non_blocking=True)
            torch.cuda.synchronize()

        def h2d() -> None:
            device.copy_(buffer, non_blocking=True)
            torch.cuda.synchronize()

        row.update(d2h_gbs=gbs / _timed(d2h, repeats), h2d_gbs=gbs / _timed(h2d, repeats))
    return row


def run(nbytes: int, repeats: int) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    rows = []
    for choice in ("torch", "native", "off"):
        if choice == "torch" and not cuda:
            rows.append({"choice": "torch", "skipped": "torch's pinned allocator needs CUDA"})
            continue
        try:
            rows.append(measure(choice, nbytes, repeats))
        except Exception as exc:  # native pinning past the memlock limit, a missing pin_memory op build
            rows.append({"choice": choice, "error": f"{type(exc).__name__}: {exc}"})
    return {
        "benchmark": "pinning_copy_time",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "buffer_mib": nbytes // MiB,
        "repeats": repeats,
        "rows": rows,
        "versions": versions(),
    }


def main() -> None:
    as_a_training_worker()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="Buffer size in MiB (default 512).")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, help="Output folder (default bench/results/, dated name).")
    args = parser.parse_args()
    record = run(args.mib * MiB, args.repeats)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "pinning-copy-time.json"
    else:
        path = REPO / "bench" / "results" / f"pinning-copy-time-{time.strftime('%Y%m%d-%H%M')}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["rows"], indent=1))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
