"""`llm-train convert`: what it refuses, in one line each, before any conversion starts.

The conversion itself (DeepSpeed's ds_to_universal on a real checkpoint) runs in
tests/e2e/test_resume_anywhere.py, through this command.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llm_train.cli import main as cli_main
from llm_train.runtime.checkpointing.commit import LATEST, MANIFEST, build_manifest, write_atomic


def _checkpoint(root: Path, **layout: object) -> Path:
    ckpt = root / "checkpoints" / "step-00000004"
    (ckpt / "state" / "ds").mkdir(parents=True)
    (ckpt / "state" / "ds" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x" * 100)
    meta = {
        "step": 4,
        "world_size": 2,
        "zero_stage": layout.get("zero_stage", 2),
        "layout": {"world_size": 2, **layout},
    }
    write_atomic(ckpt / MANIFEST, json.dumps(build_manifest(ckpt, meta)))
    (root / "checkpoints" / LATEST).write_text(ckpt.name)
    return ckpt


@pytest.mark.parametrize(
    ("layout", "says"),
    [
        ({"zero_stage": 1, "pp": 2}, "pipeline-parallel run"),
        ({"zero_stage": 0}, "ZeRO-0 checkpoint: it holds the whole optimizer state"),
    ],
)
def test_what_cannot_or_need_not_convert_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], layout: dict, says: str
) -> None:
    _checkpoint(tmp_path, **layout)
    assert cli_main(["convert", str(tmp_path)]) == 2  # a run directory: its newest checkpoint
    err = capsys.readouterr().err
    assert err.startswith("llm-train: error: convert: ") and says in err and err.count("\n") == 1


def test_a_checkpoint_that_does_not_verify_is_not_converted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _checkpoint(tmp_path, zero_stage=2)
    (ckpt / "state" / "ds" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"y" * 100)
    assert cli_main(["convert", str(ckpt)]) == 2
    assert "checksum differs from the manifest; not converting it" in capsys.readouterr().err


def test_a_path_that_is_no_checkpoint_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["convert", str(tmp_path / "nothing")]) == 2
    assert "is not a checkpoint directory" in capsys.readouterr().err
