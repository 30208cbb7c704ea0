"""`--profile A-B`: a torch.profiler trace of optimizer steps A..B; `--flops-profiler`: DeepSpeed's.

The trace is written per rank to RUN_DIR/profile/rank{N}.<time>.pt.trace.json, the
format both TensorBoard's profiler plugin (`tensorboard --logdir RUN_DIR/profile`) and
Perfetto (https://ui.perfetto.dev, drag the file in) read. Step A-1, when it exists, is
profiled as warm-up and discarded, so the profiler's own start-up cost is not in the
trace. A summary table of the most expensive operators goes next to it.

DeepSpeed's flops profiler is configured through the DS config (it lives inside the
engine): it prints per-module FLOPs, latency and parameters for one step, on rank 0. Its
section (`flops_profiler_config`) reaches the DS config through `Resolved.refine`.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from llm_train.errors import UserError

PROFILE_DIR = "profile"
FLOPS_PROFILE_FILE = "flops_profiler.txt"


def parse_range(spec: str) -> tuple[int, int]:
    """'5-8' -> (5, 8); '7' -> (7, 7). Steps are 1-based optimizer steps, both ends included."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", spec or "")
    if not match:
        raise UserError(f"--profile {spec}: expected optimizer steps A-B, e.g. --profile 5-8")
    first, last = int(match.group(1)), int(match.group(2) or match.group(1))
    if first < 1 or last < first:
        raise UserError(f"--profile {spec}: need 1 <= A <= B, e.g. --profile 5-8")
    return first, last


class NullProfiler:
    """Stands in when --profile is not given, so the loop calls `step()` unconditionally."""

    def __enter__(self) -> NullProfiler:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def step(self) -> None:
        pass


class StepProfiler:
    """torch.profiler over optimizer steps first..last; `step()` is called after every step."""

    def __init__(
        self, first: int, last: int, out_dir: Path, rank: int, start_step: int = 0, cuda: bool = False
    ) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        self.first, self.last, self.out_dir, self.rank = first, last, out_dir, rank
        offset = first - start_step - 1  # profiler step index of step `first`
        warmup = 1 if offset >= 1 else 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "won't be using warmup" when A is the very first step
            layout = schedule(
                skip_first=offset - warmup, wait=0, warmup=warmup, active=last - first + 1, repeat=1
            )
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        trace = tensorboard_trace_handler(str(out_dir), worker_name=f"rank{rank}")

        def on_ready(prof: profile) -> None:
            trace(prof)
            sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
            table = prof.key_averages().table(sort_by=sort, row_limit=25)
            (out_dir / f"summary_rank{rank}.txt").write_text(
                f"optimizer steps {first}-{last}, rank {rank}\n{table}\n"
            )

        self.profiler = profile(
            activities=activities,
            schedule=layout,
            on_trace_ready=on_ready,
            record_shapes=True,
            profile_memory=True,
            with_flops=True,
        )

    def __enter__(self) -> StepProfiler:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.profiler.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.profiler.__exit__(exc_type, exc, tb)

    def step(self) -> None:
        self.profiler.step()


def make_profiler(
    spec: str | None,
    flops_profiler: bool,
    run_dir: Path,
    rank: int,
    start_step: int,
    max_steps: int,
    say: Callable[[str], None],
) -> StepProfiler | NullProfiler:
    """The profiler `--profile A-B` asks for (a no-op without it, or when the range was already trained).

    Called once the run directory exists (rank 0 may have just replaced it), so this is also
    where the flops profiler's output folder is made.
    """
    if flops_profiler:
        (run_dir / PROFILE_DIR).mkdir(parents=True, exist_ok=True)
        if rank == 0:
            say(f"DeepSpeed flops profiler -> {run_dir / PROFILE_DIR / FLOPS_PROFILE_FILE}")
    if not spec:
        return NullProfiler()
    first, last = parse_range(spec)
    last = min(last, max_steps)
    if first > max_steps or last <= start_step:
        say(
            f"--profile {spec}: outside the steps this run trains ({start_step + 1}-{max_steps}); not profiling"
        )
        return NullProfiler()
    first = max(first, start_step + 1)
    import torch

    out = run_dir / PROFILE_DIR
    say(f"profiling steps {first}-{last} -> {out}/ (tensorboard --logdir {out}, or ui.perfetto.dev)")
    return StepProfiler(first, last, out, rank, start_step, cuda=torch.cuda.is_available())


def flops_profiler_config(spec: str | None, run_dir: Path) -> dict[str, Any]:
    """The DS config section that runs DeepSpeed's flops profiler on one step (first of --profile, else 2).

    DeepSpeed compares `profile_step` with its count of finished optimizer steps, so step k is k-1.
    The session gives it to the run before the engine is built (`Resolved.refine(flops_profiler=...)`).
    """
    step = parse_range(spec)[0] if spec else 2
    return {
        "enabled": True,
        "profile_step": step - 1,
        "module_depth": -1,
        "top_modules": 3,
        "detailed": True,
        "output_file": str(run_dir / PROFILE_DIR / FLOPS_PROFILE_FILE),
    }
