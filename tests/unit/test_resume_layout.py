"""What a resume on another layout does: load as is, convert to universal, keep the batch, or refuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llm_train.config.layout import Layout
from llm_train.errors import UserError
from llm_train.runtime.checkpointing.resume import (
    Resume,
    ResumeLayout,
    bridge,
    check_same_plan,
    peek_manifest,
    saved_layout,
)


def _layout(**fields: object) -> Layout:
    base: dict[str, object] = {"world_size": 2, "zero_stage": 2, "micro_batch_size": 8, "precision": "fp32"}
    return Layout(**{**base, **fields})  # type: ignore[arg-type]


def _saved(**fields: object) -> dict[str, object]:
    return _layout(**fields).as_dict()


def test_the_same_layout_loads_the_checkpoint_as_it_is() -> None:
    plan = bridge(_saved(), _layout(), allow_batch_change=False)
    assert plan == ResumeLayout() and plan.same_layout and not plan.universal


def test_fewer_processes_convert_to_universal_and_keep_the_global_batch() -> None:
    plan = bridge(_saved(world_size=2), _layout(world_size=1), allow_batch_change=False)
    assert plan.universal and plan.grad_accum == 2  # 8 x 1 x dp 2 = 16 = 8 x 2 x dp 1
    assert "data-parallel size 2 -> 1" in plan.changes
    assert any("gradient accumulation 1 -> 2" in n for n in plan.notices)


@pytest.mark.parametrize(
    ("saved", "now"),
    [
        ({"zero_stage": 2}, {"zero_stage": 1}),
        ({"offload_optimizer": "none"}, {"offload_optimizer": "cpu"}),
        ({"zero_stage": 3}, {"zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}),
        (
            {"world_size": 2, "tp": 2, "zero_stage": 1},
            {"world_size": 2, "tp": 1, "zero_stage": 1, "grad_accum": 1},
        ),
    ],
)
def test_a_resharded_optimizer_state_goes_through_universal(saved: dict, now: dict) -> None:
    plan = bridge(_saved(**saved), _layout(**now), allow_batch_change=True)
    assert plan.universal


def test_zero0_on_another_data_parallel_size_loads_directly() -> None:
    # ZeRO-0 saves the whole optimizer state: nothing to re-partition.
    plan = bridge(_saved(zero_stage=0), _layout(zero_stage=0, world_size=1), allow_batch_change=False)
    assert not plan.universal and plan.grad_accum == 2


def test_a_precision_change_goes_through_universal() -> None:
    # The universal loader rebuilds the 16-bit weights from the saved fp32 master weights.
    plan = bridge(_saved(precision="fp32"), _layout(precision="bf16"), allow_batch_change=False)
    assert plan.changes == ("precision fp32 -> bf16",) and plan.universal


@pytest.mark.parametrize(
    ("saved", "now", "says"),
    [
        ({"world_size": 2, "pp": 2, "zero_stage": 1}, {"world_size": 2, "zero_stage": 1}, "pipeline"),
        (
            {"world_size": 4, "pp": 2, "zero_stage": 1},
            {"world_size": 2, "pp": 2, "zero_stage": 1},
            "pipeline",
        ),
        ({"zero_stage": 0}, {"zero_stage": 1}, "ZeRO-1/2/3 only"),
        ({"zero_stage": 3}, {"zero_stage": 0}, "ZeRO-1/2/3 only"),
        ({"zero_stage": 2}, {"zero_stage": 3}, "between ZeRO-3 and ZeRO-1/2"),
        ({"zero_stage": 3}, {"zero_stage": 1}, "between ZeRO-3 and ZeRO-1/2"),
        # The swapped optimizer state lives in per-rank swap files (runtime/base/compat.py), not in DeepSpeed's
        # checkpoint: no universal conversion can read it.
        (
            {"zero_stage": 3, "offload_optimizer": "nvme"},
            {"zero_stage": 3, "offload_optimizer": "nvme", "world_size": 1},
            "NVMe optimizer offload",
        ),
        (
            {"zero_stage": 3, "offload_optimizer": "nvme"},
            {"zero_stage": 3, "offload_optimizer": "cpu"},
            "NVMe",
        ),
        ({"zero_stage": 0, "precision": "fp32"}, {"zero_stage": 0, "precision": "bf16"}, "precision=fp32"),
        ({"zero_stage": 0, "precision": "bf16"}, {"zero_stage": 0, "precision": "fp32"}, "precision=bf16"),
        # the same world, split 2 x sp 1 before and 1 x sp 2 after (or more ranks with sp 2)
        ({"zero_stage": 3, "sp": 2}, {"zero_stage": 3}, "deepspeed.sequence_parallel=2"),
        ({"zero_stage": 3}, {"zero_stage": 3, "sp": 2}, "deepspeed.sequence_parallel=1"),
    ],
)
def test_changes_deepspeed_cannot_convert_are_refused_in_one_line(saved: dict, now: dict, says: str) -> None:
    with pytest.raises(UserError) as caught:
        bridge(_saved(**saved), _layout(**now), allow_batch_change=True)
    message = str(caught.value)
    assert says in message and "\n" not in message and "->" in message  # names what changed


def test_the_same_sequence_parallel_degree_on_more_ranks_is_a_data_parallel_change() -> None:
    plan = bridge(_saved(zero_stage=3, sp=2), _layout(zero_stage=3, sp=2, world_size=4), True)
    assert plan.universal and plan.changes == ("world size 2 -> 4", "data-parallel size 1 -> 2")


def test_a_global_batch_that_cannot_be_kept_is_refused_unless_allowed() -> None:
    saved, now = _saved(world_size=2), _layout(world_size=3)  # 16 is not a multiple of 8 x 3
    with pytest.raises(UserError, match="--allow-batch-change"):
        bridge(saved, now, allow_batch_change=False)
    plan = bridge(saved, now, allow_batch_change=True)
    assert plan.grad_accum is None and any("16 -> 24" in n for n in plan.notices)


def test_older_manifests_without_a_layout_compare_world_and_stage() -> None:
    saved = saved_layout({"world_size": 2, "zero_stage": 3})
    assert bridge(saved, _layout(world_size=2, zero_stage=3), False).same_layout
    assert bridge(saved, _layout(world_size=1, zero_stage=3), False).universal


def test_peek_reads_the_manifest_latest_names(tmp_path: Path) -> None:
    for step in (2, 4):
        (tmp_path / f"step-0000000{step}").mkdir()
        (tmp_path / f"step-0000000{step}" / "manifest.json").write_text(json.dumps({"step": step}))
    (tmp_path / "latest").write_text("step-00000002")
    assert peek_manifest("auto", tmp_path) == {"step": 2}
    (tmp_path / "latest").unlink()
    assert peek_manifest("auto", tmp_path) == {"step": 4}  # no pointer: the newest directory
    assert peek_manifest(str(tmp_path / "step-00000004"), tmp_path) == {"step": 4}
    assert peek_manifest("auto", tmp_path / "missing") is None


def test_a_fallback_checkpoint_needing_another_bridge_is_refused(tmp_path: Path) -> None:
    planned = ResumeLayout(("world size 2 -> 1",), universal=True, grad_accum=2)
    check_same_plan(tmp_path, planned, ResumeLayout(("world size 2 -> 1",), universal=True))
    with pytest.raises(UserError, match="--resume"):
        check_same_plan(tmp_path, planned, ResumeLayout())


def test_a_resume_that_cannot_work_fails_before_any_worker_starts(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not a directory"):
        Resume.plan(str(tmp_path / "nope"), tmp_path, _layout(), allow_batch_change=False)
    ckpt = tmp_path / "step-00000002"
    ckpt.mkdir()
    (ckpt / "manifest.json").write_text(json.dumps({"layout": _saved(world_size=4, pp=2, zero_stage=1)}))
    with pytest.raises(UserError, match="pipeline"):
        Resume.plan("auto", tmp_path, _layout(zero_stage=1), allow_batch_change=False)
    Resume.plan("auto", tmp_path / "no-checkpoints-yet", _layout(), allow_batch_change=False)  # first start
