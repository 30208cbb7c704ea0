"""The single-card plans `--recipe auto` produces, run end to end on CPU: LoRA and QLoRA under ZeRO-0 in
bf16, with 1 and 2 processes, train, resume bit for bit after kill -9 and export; a resume onto another
base model is refused in one line.

The runs use the tiny pretrained Llama of tests/helpers.py (QLoRA quantises a checkpoint as it loads) and
the tiny-cpu-lora recipe with the knobs auto writes for one consumer card: deepspeed.config=zero0, bf16.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    REPO,
    assert_ok,
    launch,
    losses,
    make_tiny_pretrained,
    resume_after_kill_9,
)
from tests.optional import import_or_skip, require

import_or_skip("peft")

pytestmark = pytest.mark.e2e

STEPS = 6


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_pretrained(tmp_path_factory.mktemp("auto") / "base", seed=3)


@pytest.fixture(scope="module")
def reference(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int], Path]:
    """The uninterrupted run of each (quantize, processes), launched once: the resume test compares against
    it and the base-change test resumes a copy of the 1-process LoRA one (one launch fewer)."""
    made: dict[tuple[str, int], Path] = {}

    def run(quantize: str, nproc: int) -> Path:
        if (quantize, nproc) not in made:
            run_dir = tmp_path_factory.mktemp("reference") / f"{quantize}-{nproc}"
            assert_ok(launch(_args(run_dir, base, quantize), nproc))
            made[quantize, nproc] = run_dir
        return made[quantize, nproc]

    return run


def _args(run_dir: Path, base: Path, quantize: str, *extra: str) -> list[str]:
    return [
        "--recipe",
        "tiny-cpu-lora",
        "--output-dir",
        str(run_dir),
        f"--max-steps={STEPS}",
        "model.init=pretrained",
        f"model.name_or_path={base}",
        f"lora.quantize={quantize}",
        "deepspeed.config=zero0",
        "precision=bf16",
        "optim.warmup_steps=0",
        "output.log_every=1",
        "output.sample_prompt=null",
        "checkpoint.every_steps=2",
        "lora.export=adapter",
        "--resume",
        "auto",
        *extra,
    ]


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("quantize", ["none", "nf4"], ids=["lora", "qlora"])
def test_zero0_bf16_adapters_train_resume_exactly_and_export(
    base: Path, reference: Callable[[str, int], Path], tmp_path: Path, quantize: str, nproc: int
) -> None:
    if quantize == "nf4":
        require("bitsandbytes")
    from safetensors.torch import load_file

    reference_dir, killed = reference(quantize, nproc), tmp_path / "killed"
    run_losses = list(losses(reference_dir).values())
    assert len(run_losses) == STEPS and run_losses[-1] < run_losses[0], run_losses
    resume_after_kill_9(killed, _args(killed, base, quantize), step=3, nproc=nproc)
    assert losses(killed) == losses(reference_dir)  # exact float equality, every step logged once
    mine, theirs = (load_file(d / "final" / "adapter_model.safetensors") for d in (killed, reference_dir))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert all("lora_A" in k or "lora_B" in k for k in mine)


def test_resume_onto_another_base_is_refused_in_one_line(
    reference: Callable[[str, int], Path], tmp_path: Path
) -> None:
    # A copy of the 1-process LoRA run (its checkpoints up to step STEPS), resumed onto other weights.
    run = tmp_path / "run"
    shutil.copytree(reference("none", 1), run)
    other = make_tiny_pretrained(tmp_path / "other", seed=4)  # the same shapes, other weights
    more = f"--max-steps={STEPS + 2}"
    cmd = [sys.executable, str(REPO / "llm_train/train.py"), *_args(run, other, "none", more)]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 2, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert "trained LoRA adapters on another base model" in line and "--allow-base-change" in line
    allowed = launch(_args(run, other, "none", more, "--allow-base-change"), 1)
    assert_ok(allowed)
    assert sorted(losses(run)) == list(range(1, STEPS + 3))  # it trained on, onto the other base
