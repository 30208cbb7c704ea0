"""The optimizer state of NVMe offload in checkpoints: DeepSpeed 0.19.8 does not save it.

With `offload_optimizer: nvme`, ZeRO-3 keeps each swapped sub-group's fp32 master, Adam m and v only
in swap files under NVME_PATH/zero_stage_3/optimizer/rankR (`{first}_{last}.tensor.swp`,
`exp_avg-...`, `exp_avg_sq-...`). Its engine checkpoint stores empty placeholders for them
(stage3.py `_rigid_state_dict`: `fp32_partitioned_groups_flat` holds 0-element tensors for swapped
sub-groups), and `_rigid_load_state_dict` swaps the state back in from whatever those files hold at
load time. After a kill at step k + 1 the files hold step k + 1's state, not the checkpoint's:
measured on CPU (tests/e2e/test_host_offload.py), the resumed losses left the uninterrupted run's
from the first resumed step (7.9238 against 7.9234).

So each rank copies its state files into the checkpoint as it is written (the swap-outs of the
step are complete when the engine saves), and copies them back over the swap directory before the
engine loads it. The gradient files are left out: the next backward rewrites them before any step
reads them. The copies are as large as the optimizer state they stand for (12 bytes per parameter,
what a CPU-offload checkpoint holds too).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from llm_train.errors import UserError

CHECKPOINT_SUBDIR = "nvme_optimizer"


def swap_dir(engine: Any) -> Path | None:
    """The folder DeepSpeed swaps this rank's optimizer state in (optimizer_utils.py `swap_folder`:
    NVME_PATH/zero_stage_3/optimizer/rankR), or None when the optimizer is not on NVMe."""
    swapper = getattr(getattr(engine, "optimizer", None), "optimizer_swapper", None)
    return Path(swapper.swap_folder) if swapper is not None else None


def _state_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*.tensor.swp") if "_gradient_" not in p.name)


def save_swap_state(engine: Any, checkpoint_tmp: Path, rank: int) -> None:
    """Copy this rank's swapped optimizer state into the checkpoint being written (a no-op without NVMe)."""
    source = swap_dir(engine)
    if source is None:
        return
    swapper = engine.optimizer.optimizer_swapper
    if getattr(swapper, "swap_ops", {}).get("async_swap_out") is not None:
        # pipeline_write leaves the last sub-group's write in flight after the step
        # (pipelined_optimizer_swapper.py `swap_out_optimizer_state`): finish it before copying.
        swapper._complete_swap_out("async_swap_out")
    target = checkpoint_tmp / CHECKPOINT_SUBDIR / f"rank{rank}"
    target.mkdir(parents=True, exist_ok=True)
    for path in _state_files(source):
        shutil.copyfile(path, target / path.name)


def restore_swap_state(engine: Any, checkpoint: Path, rank: int) -> None:
    """Put the checkpoint's swapped optimizer state back where DeepSpeed swaps it in, before it loads."""
    target = swap_dir(engine)
    if target is None:
        return
    saved = checkpoint / CHECKPOINT_SUBDIR / f"rank{rank}"
    if not saved.is_dir():
        raise UserError(
            f"checkpoint {checkpoint.name} has no NVMe optimizer state for rank {rank} ({saved}): it was "
            "written without the optimizer on NVMe, or by an llm_train that did not save it; resume it "
            "with the deepspeed.config that wrote it"
        )
    target.mkdir(parents=True, exist_ok=True)
    for path in _state_files(saved):
        shutil.copyfile(path, target / path.name)
