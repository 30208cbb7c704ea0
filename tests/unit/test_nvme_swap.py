"""NVMe offload's optimizer state, which DeepSpeed's checkpoint leaves out, travels with llm_train's checkpoint."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from llm_train.errors import UserError
from llm_train.runtime.nvme_swap import CHECKPOINT_SUBDIR, restore_swap_state, save_swap_state

# DeepSpeed's file names (optimizer_utils.py): a sub-group's master, its Adam states, its gradient pieces.
STATE = ["0_38.tensor.swp", "exp_avg-0_38.tensor.swp", "exp_avg_sq-0_38.tensor.swp"]
GRADIENT = "0_38_gradient_0_524288.tensor.swp"


def _engine(folder: Path | None) -> SimpleNamespace:
    swapper = None if folder is None else SimpleNamespace(swap_folder=str(folder), swap_ops={})
    return SimpleNamespace(optimizer=SimpleNamespace(optimizer_swapper=swapper))


def test_the_state_files_go_into_the_checkpoint_and_come_back_over_newer_ones(tmp_path: Path) -> None:
    swap = tmp_path / "nvme" / "zero_stage_3" / "optimizer" / "rank1"
    swap.mkdir(parents=True)
    for name in [*STATE, GRADIENT]:
        (swap / name).write_bytes(b"step 2 " + name.encode())
    ckpt = tmp_path / "step-2"
    save_swap_state(_engine(swap), ckpt, rank=1)
    saved = ckpt / CHECKPOINT_SUBDIR / "rank1"
    assert sorted(p.name for p in saved.iterdir()) == sorted(STATE)  # gradients are rewritten before use
    for name in STATE:
        (swap / name).write_bytes(b"step 3, then killed")  # what a run killed after the checkpoint leaves
    restore_swap_state(_engine(swap), ckpt, rank=1)
    assert all((swap / name).read_bytes() == b"step 2 " + name.encode() for name in STATE)


def test_without_nvme_offload_nothing_is_written_or_read(tmp_path: Path) -> None:
    save_swap_state(_engine(None), tmp_path / "ckpt", rank=0)
    restore_swap_state(_engine(None), tmp_path / "ckpt", rank=0)
    assert not (tmp_path / "ckpt").exists()


def test_a_checkpoint_without_the_state_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"checkpoint step-2 has no NVMe optimizer state for rank 0"):
        restore_swap_state(_engine(tmp_path / "swap"), tmp_path / "step-2", rank=0)
