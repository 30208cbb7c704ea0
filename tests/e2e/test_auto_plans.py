"""The single-card plans `--recipe auto` produces, run end to end on CPU: LoRA and QLoRA under ZeRO-0 in
bf16, with 1 and 2 processes, train, resume bit for bit after kill -9 and export; a resume onto another
base model is refused in one line.

The runs use the tiny pretrained Llama of tests/helpers.py (QLoRA quantises a checkpoint as it loads) and
the tiny-cpu-lora recipe with the knobs auto writes for one consumer card: deepspeed.config=zero0, bf16.
"""

from __future__ import annotations

import subprocess
import sys
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
    base: Path, tmp_path: Path, quantize: str, nproc: int
) -> None:
    if quantize == "nf4":
        require("bitsandbytes")
    from safetensors.torch import load_file

    reference, killed = tmp_path / "reference", tmp_path / "killed"
    first = launch(_args(reference, base, quantize), nproc)
    assert_ok(first)
    run_losses = list(losses(reference).values())
    assert len(run_losses) == STEPS and run_losses[-1] < run_losses[0], run_losses
    resume_after_kill_9(killed, _args(killed, base, quantize), step=3, nproc=nproc)
    assert losses(killed) == losses(reference)  # exact float equality, every step logged once
    mine, theirs = (load_file(d / "final" / "adapter_model.safetensors") for d in (killed, reference))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert all("lora_A" in k or "lora_B" in k for k in mine)


def test_resume_onto_another_base_is_refused_in_one_line(base: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert_ok(launch(_args(run, base, "none", "--max-steps=2"), 1))
    other = make_tiny_pretrained(tmp_path / "other", seed=4)  # the same shapes, other weights
    cmd = [sys.executable, str(REPO / "llm_train/train.py"), *_args(run, other, "none", "--max-steps=4")]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 2, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert "trained LoRA adapters on another base model" in line and "--allow-base-change" in line
    allowed = launch(_args(run, other, "none", "--max-steps=4", "--allow-base-change"), 1)
    assert_ok(allowed)
