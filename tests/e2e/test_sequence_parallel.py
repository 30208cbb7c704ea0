"""Ulysses sequence parallelism (deepspeed.sequence_parallel) against the same run without it.

Splitting each sequence over sp ranks must not change the math: the per-step losses and the
gradient norms DeepSpeed measures equal those of sp=1 on the same samples, within 1e-5 in
fp32 (the all-to-all regroups the same products, summed in another order: the largest
differences seen were 9.5e-7 on a loss of ~8 and 3.1e-6 on a gradient norm, sp2 x dp2 under
ZeRO-2; a gradient averaged over the sequence ranks, DeepSpeed's reduce-scatter bug under
ZeRO-3, is off by a factor of sp). ZeRO-3 runs in the first test, ZeRO-2 in the second: the two
gradient-reduction paths sequence parallelism goes through (ZeRO-0/1 are not run here). The rows are padded, one sample each: the second half of most rows is padding,
so the two ranks of a group hold very different numbers of loss tokens, and only a
token-weighted reduction over the group matches sp=1.

A checkpoint taken under sp=2 resumes bit for bit, like every other layout.

The sp=2 x dp=1 run also turns on the ALST memory switches (tiled MLP, tiled loss, activation
checkpoints offloaded), which must not change the math either: at 512 tokens each rank's 256
run through its MLPs in 2 tiles, recomputed in backward while ZeRO-3 gathers the weights per
tile (tests/unit/test_tiling.py compares each switch on and off within 1e-5).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import assert_ok, assert_resumed, launch, read_metrics

pytestmark = pytest.mark.e2e

STEPS, RESUME_FROM = 5, 3
ALST = [
    "memory.activation_checkpointing=true",
    "memory.tiled_mlp=true",
    "memory.tiled_loss=true",
    "memory.offload_checkpoints=true",
]
TOL = 1e-5
RUN = [
    "--recipe",
    "tiny-cpu-sp2",
    f"--max-steps={STEPS}",
    "optim.warmup_steps=0",
    "optim.micro_batch_size=4",
    "data.seq_len=512",
    "output.log_every=1",
    f"eval.every={STEPS}",  # sharded like training (sequence_parallel.evaluating)
    "eval.batches=2",
    "output.sample_prompt=null",
]


def _run(
    run_dir: Path, pretrained: Path, sp: int, nproc: int, *extra: str, resumes: Path | None = None
) -> dict[int, dict]:
    """The per-step metrics of a run; `resumes`: the checkpoint the launch must say it resumed from."""
    args = [
        *RUN,
        "--output-dir",
        str(run_dir),
        "model.init=pretrained",
        f"model.name_or_path={pretrained}",
        f"deepspeed.sequence_parallel={sp}",
        *extra,
    ]
    result = launch(args, nproc=nproc)
    assert_ok(result)
    if resumes is not None:
        assert_resumed(result.stdout, resumes, int(resumes.name.split("-")[1]))
    if sp > 1:
        assert f"x sp {sp}" in result.stdout  # the start-up summary names the degree
    metrics = read_metrics(run_dir)
    steps = {m["step"]: m for m in metrics if "loss" in m}
    for m in metrics:
        if "eval_loss" in m:
            steps[m["step"]]["eval_loss"] = m["eval_loss"]
    return steps


def _assert_same_math(split: dict[int, dict], whole: dict[int, dict]) -> None:
    assert sorted(split) == sorted(whole) == list(range(1, STEPS + 1))
    loss_diff = max(abs(split[s]["loss"] - whole[s]["loss"]) for s in whole)
    norm_diff = max(abs(split[s]["grad_norm"] - whole[s]["grad_norm"]) for s in whole)
    eval_diff = abs(split[STEPS]["eval_loss"] - whole[STEPS]["eval_loss"])
    print(
        f"max loss difference {loss_diff:.2e}, max grad-norm difference {norm_diff:.2e}, eval {eval_diff:.2e}"
    )
    assert eval_diff <= TOL, (split[STEPS]["eval_loss"], whole[STEPS]["eval_loss"])
    assert loss_diff <= TOL, json.dumps({s: (split[s]["loss"], whole[s]["loss"]) for s in whole})
    assert norm_diff <= TOL, json.dumps({s: (split[s]["grad_norm"], whole[s]["grad_norm"]) for s in whole})


@pytest.fixture(scope="module")
def whole(pretrained: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """sp=1 on one process: the reference for sp=2 on two (the same dp of 1)."""
    return _run(tmp_path_factory.mktemp("sp") / "sp1", pretrained, sp=1, nproc=1)


def test_sp2_with_alst_switches_matches_sp1_and_resumes_bit_exact(
    whole: dict[int, dict], pretrained: Path, tmp_path: Path
) -> None:
    checkpoints = ["checkpoint.every_steps=3", *ALST]
    split = _run(tmp_path / "sp2", pretrained, 2, 2, *checkpoints)
    _assert_same_math(split, whole)

    from llm_train.runtime.checkpointing.commit import step_name

    resumed_dir = tmp_path / "resumed"
    checkpoint = tmp_path / "sp2" / "checkpoints" / step_name(RESUME_FROM)
    resumed = _run(
        resumed_dir, pretrained, 2, 2, *checkpoints, "--resume", str(checkpoint), resumes=checkpoint
    )
    assert sorted(resumed) == list(range(RESUME_FROM + 1, STEPS + 1))
    assert all(resumed[s]["loss"] == split[s]["loss"] for s in resumed)  # exact
    mine = load_file(resumed_dir / "final" / "model.safetensors")
    theirs = load_file(tmp_path / "sp2" / "final" / "model.safetensors")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_sp2_by_dp2_under_zero2_matches_sp1_by_dp2(pretrained: Path, tmp_path: Path) -> None:
    """Four processes: two sequence-parallel groups of two, each its own data-parallel rank, under ZeRO-2.

    ZeRO-2 reduces gradients on its own path (stage_1_and_2.py, reduce-scatter on), not ZeRO-3's:
    this is the run that shows it sums the sequence ranks' shares and averages only over dp.
    """
    zero2 = ["--ds-config", "zero2"]
    whole_dp2 = _run(tmp_path / "sp1dp2", pretrained, 1, 2, *zero2)
    split_dp2 = _run(tmp_path / "sp2dp2", pretrained, 2, 4, *zero2)
    _assert_same_math(split_dp2, whole_dp2)
