"""The ALST memory switches under real 2-process ZeRO-3: the same per-step losses as without them.

tiny-cpu at 256 tokens (hidden 128: each MLP runs in 2 tiles, recomputed in backward while
ZeRO-3 gathers its partitioned weights per tile), with activation checkpointing, once plain
and once with tiled MLP, tiled loss and checkpoint offload. fp32: only the order of a few sums
changes (observed differences ~1e-6), so 1e-5 on the loss and DeepSpeed's gradient norm.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import accelerate_launch, assert_ok, read_metrics

pytestmark = pytest.mark.e2e

STEPS = 3
TOL = 1e-5
SWITCHES = ["memory.tiled_mlp=true", "memory.tiled_loss=true", "memory.offload_checkpoints=true"]


def _run(run_dir: Path, *extra: str) -> dict[int, dict]:
    args = [
        "--recipe",
        "tiny-cpu",
        f"--max-steps={STEPS}",
        "--output-dir",
        str(run_dir),
        "optim.warmup_steps=0",
        "optim.micro_batch_size=2",
        "data.seq_len=256",
        "memory.activation_checkpointing=true",
        "output.log_every=1",
        "eval.every=0",
        "output.sample_prompt=null",
        *extra,
    ]
    assert_ok(accelerate_launch(args, nproc=2))
    return {m["step"]: m for m in read_metrics(run_dir) if "loss" in m}


def test_tiled_mlp_tiled_loss_and_offload_train_as_the_plain_model_under_zero3(tmp_path: Path) -> None:
    plain = _run(tmp_path / "plain")
    alst = _run(tmp_path / "alst", *SWITCHES)
    assert sorted(plain) == sorted(alst) == list(range(1, STEPS + 1))
    for step in plain:
        assert alst[step]["loss"] == pytest.approx(plain[step]["loss"], abs=TOL), (step, plain, alst)
        assert alst[step]["grad_norm"] == pytest.approx(plain[step]["grad_norm"], abs=TOL), (
            step,
            plain,
            alst,
        )
