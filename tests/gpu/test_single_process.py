"""`python llm_train/train.py` on one GPU in bf16: trains, checkpoints, resumes, exports a model that verifies.

The CPU tiers run the same code under gloo; on a GPU Accelerate and DeepSpeed make an NCCL
world (of one, on one GPU) and the model, the optimizer states and every collective live on
cuda:0, which is where the bugs the CPU cannot show would surface (NCCL takes only CUDA tensors). The run
is tiny-cpu moved to the GPU in bf16, with the CPU e2e tiers' checkpoint cadence and
`--resume auto` on every launch: the first launch finds nothing to resume and trains 4 steps;
a copy of its run directory is relaunched for 6 and must continue from the step-4 checkpoint.
About a minute on a GPU, most of it process start-up.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from llm_train.runtime.checkpointing.commit import LATEST, step_name, verify
from llm_train.runtime.checkpointing.logit_reference import read_reference
from llm_train.runtime.export.verify import expected_shapes, verify_export
from tests.helpers import assert_ok, assert_resumed, losses, read_metrics, train_py

pytestmark = pytest.mark.gpu

GPU_BF16 = ["--recipe", "tiny-cpu", "hardware.device=cuda", "precision=bf16", "output.log_every=1"]
CHECKPOINTING = ["checkpoint.every_steps=2", "--resume", "auto"]
STEPS, MORE_STEPS = 4, 6
# Without offload the fp32 master weights and Adam's two fp32 moments (DeepSpeed's bf16 path) are on
# the GPU: at least 12 bytes per parameter. A run whose model stayed on the CPU allocates next to
# nothing there (a few bytes per collective).
MIN_GPU_BYTES_PER_PARAM = 12


def _launch(run_dir: Path, steps: int) -> subprocess.CompletedProcess:
    return train_py([*GPU_BF16, "--output-dir", str(run_dir), "--max-steps", str(steps), *CHECKPOINTING])


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """The first launch: a fresh run directory, `--resume auto` finds nothing, 4 steps."""
    run_dir = tmp_path_factory.mktemp("gpu") / "run"
    result = _launch(run_dir, STEPS)
    assert_ok(result)
    return run_dir, result


def _final_verifies(run_dir: Path, stdout: str) -> None:
    """final/ passed the run's own check, passes it again here, and loads on the GPU with finite logits."""
    from transformers import AutoModelForCausalLM

    final = run_dir / "final"
    assert json.loads((final / "export_check.json").read_text())["ok"] is True
    tensors = verify_export(final, read_reference(final)).tensors  # keys and logits again
    assert f"exported {tensors} tensors to" in stdout
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.bfloat16).to("cuda").eval()
    with torch.no_grad():
        logits = model(torch.arange(16, device="cuda").view(1, 16)).logits
    assert logits.shape == (1, 16, 4096) and torch.isfinite(logits).all()


def test_bf16_run_on_the_gpu_trains_checkpoints_and_exports(
    first: tuple[Path, subprocess.CompletedProcess],
) -> None:
    run_dir, result = first
    assert "no complete checkpoint to resume from; starting at step 0" in result.stdout
    ds = json.loads((run_dir / "config" / "ds_config.json").read_text())
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    assert json.loads((run_dir / "world.json").read_text())["world_size"] == 1

    steps = losses(run_dir)
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert all(math.isfinite(loss) for loss in steps.values()), steps
    params = sum(math.prod(shape) for shape in expected_shapes(run_dir / "final").values())
    last = [row for row in read_metrics(run_dir) if "loss" in row][-1]
    assert last["gpu_mem_peak_gib"] * 1024**3 >= MIN_GPU_BYTES_PER_PARAM * params, (last, params)

    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / LATEST).read_text().strip() == step_name(STEPS)
    for step in (2, STEPS):
        assert verify(checkpoints / step_name(step)) is None
    _final_verifies(run_dir, result.stdout)


def test_relaunch_with_resume_auto_continues_from_the_last_checkpoint(
    first: tuple[Path, subprocess.CompletedProcess], tmp_path: Path
) -> None:
    done, _ = first
    run_dir = tmp_path / "run"
    shutil.copytree(done, run_dir)
    result = _launch(run_dir, MORE_STEPS)
    assert_ok(result)
    assert_resumed(
        result.stdout, run_dir, STEPS
    )  # "resumed from RUN_DIR/checkpoints/step-00000004 at step 4"
    steps = losses(run_dir)
    assert sorted(steps) == list(range(1, MORE_STEPS + 1))  # none repeated or lost
    assert {s: steps[s] for s in range(1, STEPS + 1)} == losses(done)  # the first launch's rows, kept
    assert all(math.isfinite(loss) for loss in steps.values()), steps
    assert (run_dir / "checkpoints" / LATEST).read_text().strip() == step_name(MORE_STEPS)
    assert verify(run_dir / "checkpoints" / step_name(MORE_STEPS)) is None
    _final_verifies(run_dir, result.stdout)
