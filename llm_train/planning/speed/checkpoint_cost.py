"""What one checkpoint of a run costs: its size, and the time to save, verify and convert it.

Sizes, as DeepSpeed 0.19.8 writes them (measured on tiny-cpu checkpoints, 2 ranks, fp32 and bf16,
ZeRO-2 and ZeRO-3, and a 91M-parameter fp32 ZeRO-2 one):
- the optimizer state: fp32 master weights, Adam m and v, 12 bytes per trained parameter in all,
  one file per data-parallel rank holding its partition (ZeRO-1/2/3; ZeRO-0: one file);
- the model file: ZeRO-0/1/2 also write the whole module once, from data-parallel rank 0, in the
  training precision (2 bytes per parameter in bf16/fp16, 4 in fp32; a LoRA run leaves its frozen
  base out, runtime/checkpointing/run_state.py); ZeRO-3's per-rank model files are a few kB (its weights
  are the fp32 partitions).

Times, at the rates below (each says whether it was measured or assumed):
- save: the slowest rank's write (its partition; under ZeRO-0/1/2 data-parallel rank 0 also writes
  the model file) at WRITE_GIB_S, then every rank hashes 1/world of the bytes
  (runtime/checkpointing/commit.py `share`) at SHA256_GIB_S;
- verify (each resume): the same split hashing;
- conversion to DeepSpeed's universal format, only for a resume on a new layout: ds_to_universal
  on one node, with min(4, cores) extract workers at CONVERT_GIB_S_PER_WORKER each.
None of these waits inside a collective (runtime/checkpointing/file_sync.py) except the write, which DeepSpeed's
save_checkpoint ends with a barrier: that wait is compared with the process-group timeout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llm_train.config.layout import Layout
from llm_train.errors import UserError
from llm_train.planning.model.shapes import LORA_TARGETS, ModelShape, shape_from_config
from llm_train.units import GiB

# sha256 of 2 GiB in memory on this machine (2 cores shared with other work): 1.32 GiB per CPU-second.
SHA256_GIB_S = 1.3
# Measured here: ds_to_universal of a 91M-parameter ZeRO-2 checkpoint (1.02 GiB of optimizer state)
# used 19.6 CPU-seconds (48.5 s of wall time on a loaded 2-core machine): ~0.05 GiB per worker-second.
CONVERT_GIB_S_PER_WORKER = 0.05
CONVERT_WORKERS = (
    4  # runtime/checkpointing/universal.py: min(4, cores) extract workers; a GPU node has the cores
)
# Assumed, not measured: what one rank writes to a local NVMe drive or its share of a parallel
# filesystem. The real figure is the storage's; the printed times scale with it.
WRITE_GIB_S = 1.0


@dataclass(frozen=True)
class CheckpointCost:
    total_bytes: float
    largest_write_bytes: float  # what the slowest rank writes inside DeepSpeed's save
    save_s: float
    verify_s: float
    convert_s: (
        float | None
    )  # None: a resume on another layout is refused (runtime/checkpointing/resume.py), nothing converts

    def line(self, timeout_minutes: float) -> str:
        """One line for `plan` and --dry-run."""
        convert = (
            f"conversion for a resume on a new layout ~{_duration(self.convert_s)} (`llm-train convert` does "
            "it ahead)"
            if self.convert_s is not None
            else "no conversion (this layout resumes only as it is, or ZeRO-0 on any data-parallel size)"
        )
        return (
            f"~{_size(self.total_bytes)} per save; save ~{_duration(self.save_s)} (slowest rank writes "
            f"{_size(self.largest_write_bytes)} at an assumed {WRITE_GIB_S:g} GiB/s, then every rank hashes "
            f"its share), verify on resume ~{_duration(self.verify_s)}, {convert}; process-group timeout "
            f"{timeout_minutes:g} min"
        )

    def timeout_problem(self, timeout_minutes: float) -> str | None:
        """The one wait inside a collective that scales with the checkpoint, against the timeout."""
        write_s = self.largest_write_bytes / GiB / WRITE_GIB_S
        if write_s <= 0.5 * timeout_minutes * 60:
            return None
        return (
            f"one rank writes {_size(self.largest_write_bytes)} of each checkpoint (~{_duration(write_s)} "
            f"at {WRITE_GIB_S:g} GiB/s) while the others wait in DeepSpeed's barrier, over half of "
            f"deepspeed.timeout_minutes={timeout_minutes:g}: raise it, or use ZeRO-3 (every rank writes its share)"
        )


def checkpoint_cost(
    shape: ModelShape,
    layout: Layout,
    lora_rank: int | None = None,
    lora_targets: tuple[str, ...] = LORA_TARGETS,
) -> CheckpointCost:
    params = shape.num_params
    trained = shape.lora_params(lora_rank, lora_targets) if lora_rank else params
    optimizer = 12.0 * trained
    weight_bytes = 4 if layout.precision == "fp32" else 2
    model_file = 0.0 if layout.zero_stage == 3 else float(weight_bytes * trained)
    # Each model-parallel slice (TP, PP) holds 1/(tp*pp) of the state; ZeRO splits it over dp (x sp).
    model_parallel = layout.tp * layout.pp
    zero_ranks = layout.world_size // model_parallel if layout.zero_stage >= 1 else 1
    largest = optimizer / (model_parallel * zero_ranks) + model_file / model_parallel
    total = optimizer + model_file
    hash_s = total / layout.world_size / GiB / SHA256_GIB_S
    # Pipelines never convert; ZeRO-0 loads its whole saved state on a new data-parallel size as it is.
    convertible = layout.pp == 1 and layout.zero_stage >= 1
    convert_s = optimizer / GiB / (CONVERT_GIB_S_PER_WORKER * CONVERT_WORKERS) if convertible else None
    return CheckpointCost(
        total_bytes=total,
        largest_write_bytes=largest,
        save_s=largest / GiB / WRITE_GIB_S + hash_s,
        verify_s=hash_s,
        convert_s=convert_s,
    )


def checkpoint_lines(run: Any) -> list[str]:
    """The dry run's and the plan's checkpoint lines for a resolved run ([] for an unknown model shape)."""
    try:
        shape = shape_from_config(run.model_fields)
    except UserError:
        return []
    recipe = run.recipe
    lora = recipe.lora
    if lora is None:
        cost = checkpoint_cost(shape, run.layout)
    else:
        cost = checkpoint_cost(shape, run.layout, lora.rank, tuple(lora.target_modules))
    timeout = recipe.deepspeed.timeout_minutes
    problem = cost.timeout_problem(timeout)
    return [cost.line(timeout), *([f"warning: {problem}"] if problem else [])]


def _size(n: float) -> str:
    return f"{n / GiB:,.1f} GiB" if n >= GiB / 10 else f"{n / 2**20:,.1f} MiB"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
