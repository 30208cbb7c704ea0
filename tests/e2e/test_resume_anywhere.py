"""Resume anywhere: a checkpoint continues on another world size or parallel layout, on the same trajectory.

Each case takes the step-3 checkpoint of an uninterrupted 6-step run (the shared reference
runs of reference.py commit one; they are killed nowhere, which is what a kill right after
that checkpoint leaves behind: test_resume shows a kill -9 loses nothing committed) and
resumes it into a new run directory on another layout, keeping the global batch of 16
sequences. Steps 4-6 must then repeat the uninterrupted run's losses, and the final weights
its weights.

Tolerances, fp32: changing the data-parallel size or the tensor-parallel split changes only
the order in which the same gradients are summed (all-reduce vs accumulation, one matrix vs
two halves), a rounding difference of a few fp32 ulps per step. 1e-4 on the loss and 1e-5
on each weight leave room for those to compound over three steps while catching any real
loss of state: an optimizer restarted from zero moments, a step of the LR schedule lost or
a batch of other samples all move the step-5 loss by more than 1e-2 here.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.reference import RESUME_FROM, STEPS, run_args
from tests.e2e.test_multinode import _sbatch, _tools
from tests.e2e.test_parallel import make_tiny_qwen2
from tests.helpers import (
    OFFLINE_ENV,
    REPO,
    RESUMED,
    accelerate_popen,
    assert_ok,
    assert_resumed,
    launch,
    losses,
    wait_for_step,
)

pytestmark = pytest.mark.e2e

LOSS_TOL = 1e-4
WEIGHT_TOL = 1e-5
# Largest differences seen, printed at the end of the session (`pytest -s`) for the closing note.
MEASURED: dict[str, tuple[float, float]] = {}


def _checkpoint(run_dir: Path, step: int = RESUME_FROM) -> Path:
    from llm_train.runtime.checkpointing.commit import step_name

    return run_dir / "checkpoints" / step_name(step)


def _resumed(args: list[str], run_dir: Path, checkpoint: Path) -> list[str]:
    """The same arguments, writing to run_dir and resuming `checkpoint`."""
    out = list(args)
    out[out.index("--output-dir") + 1] = str(run_dir)
    return [*out, "--resume", str(checkpoint)]


def _bf16_ulps(mine: torch.Tensor, theirs: torch.Tensor) -> float:
    """The largest difference of two bf16 weight tensors, in bf16 spacings at the tensor's own magnitude.

    The spacing is that of the tensor's largest |weight|: the coarsest rounding step any of its weights
    takes, so "rounded to the neighbouring value" is at most 1 wherever in the tensor it happens. The
    spacing at each weight's own value would not do: a weight near zero whose fp32 master moved by the
    reduction order's rounding (an absolute amount set by the gradients, not by the weight) counts
    hundreds of those tiny spacings (seen: 367 on a clean machine, 2026-12-02) while the tensor is the
    same to within its rounding. A lost update (~lr = 3e-3 on every weight) is still 3 or more spacings in
    every weight matrix: their largest weights start at 0.07-0.1 (std 0.02) and 6 steps move them by at
    most 6 x lr, below 0.125 (spacing 2^-10). (The norms' weights sit at 1.0, spacing 2^-7: there a lost
    update is under one spacing, but it moves the matrices too.)
    """
    a, b = mine.float(), theirs.float()
    largest = max(float(a.abs().max()), float(b.abs().max()), torch.finfo(torch.bfloat16).tiny)
    spacing = 2.0 ** (math.floor(math.log2(largest)) - 7)  # bf16 keeps 7 explicit mantissa bits
    return float((a - b).abs().max()) / spacing


def _compare(
    case: str,
    resumed: Path,
    uninterrupted: Path,
    loss_tol: float = LOSS_TOL,
    bf16_weight_ulps: float | None = None,
) -> None:
    after, before = losses(resumed), losses(uninterrupted)
    assert sorted(after) == list(range(RESUME_FROM + 1, STEPS + 1)), after  # continued at step 4, none lost
    loss_diff = max(abs(after[s] - before[s]) for s in after)
    assert loss_diff <= loss_tol, (case, before, after)
    mine, theirs = (
        load_file(resumed / "final" / "model.safetensors"),
        load_file(uninterrupted / "final" / "model.safetensors"),
    )
    assert mine.keys() == theirs.keys()
    weight_diff = max(float((mine[k].float() - theirs[k].float()).abs().max()) for k in mine)
    MEASURED[case] = (loss_diff, weight_diff)
    print(f"{case}: max loss difference {loss_diff:.2e}, max weight difference {weight_diff:.2e}")
    if bf16_weight_ulps is None:
        assert weight_diff <= WEIGHT_TOL, (case, weight_diff)
        return
    ulps = max(_bf16_ulps(mine[k], theirs[k]) for k in mine)
    print(f"{case}: max weight difference {ulps:.0f} bf16 ulp(s)")
    assert ulps <= bf16_weight_ulps, (case, ulps)


def _launch(args: list[str], nproc: int) -> str:
    result = launch(args, nproc=nproc)
    assert_ok(result)
    return result.stdout


@pytest.mark.parametrize("variant", ["zero1", "zero2", "zero3", "zero3_offload"])
def test_two_processes_resume_on_one_with_the_same_trajectory(
    runs: dict[str, Path], pretrained: Path, tmp_path: Path, variant: str
) -> None:
    args = run_args(variant, runs[variant], pretrained)
    out = _launch(_resumed(args, tmp_path / "one", _checkpoint(runs[variant])), nproc=1)
    assert_resumed(out, _checkpoint(runs[variant]), RESUME_FROM)
    assert "world size 2 -> 1" in out and "universal" in out
    assert "gradient accumulation 1 -> 2" in out  # the global batch of 16 is kept, and said so
    _compare(f"{variant} 2->1", tmp_path / "one", runs[variant])


# ZeRO-1's universal round trip is covered 2 -> 1 above; 1 -> 2 runs the stages with their own loaders,
# and each resume also changes the ZeRO stage or the offload (one launch for both changes): stage_1_and_2's
# loader takes ZeRO-2's checkpoint as ZeRO-1, stage3's takes ZeRO-3's with the optimizer moved to the host.
@pytest.mark.parametrize(("saved", "resumed"), [("zero2", "zero1"), ("zero3", "zero3_offload")])
def test_one_process_resumes_on_two_with_a_new_zero_stage_or_offload(
    runs: dict[str, Path], pretrained: Path, tmp_path: Path, saved: str, resumed: str
) -> None:
    one = tmp_path / "one"
    args = [*run_args(saved, one, pretrained), "optim.grad_accum=2"]  # 8 x 2 x dp 1: the same 16
    _launch(args, nproc=1)
    # The same command line on two processes (the accumulation of 2 the checkpoint kept becomes 1).
    two = [
        *run_args(resumed, tmp_path / "two", pretrained),
        "optim.grad_accum=2",
        "--resume",
        str(_checkpoint(one)),
    ]
    out = _launch(two, nproc=2)
    assert_resumed(out, _checkpoint(one), RESUME_FROM)
    assert "world size 1 -> 2" in out and "gradient accumulation 2 -> 1" in out
    assert "resuming on a new layout" in out and "universal" in out
    changed = "ZeRO stage 2 -> 1" if resumed == "zero1" else "optimizer offload none -> cpu"
    assert changed in out, out[-3000:]
    _compare(f"{saved} 1 -> {resumed} 2", tmp_path / "two", one)
    # And the 1-process run itself followed the 2-process reference: the world size is not in the math.
    reference, single = losses(runs[saved]), losses(one)
    assert max(abs(reference[s] - single[s]) for s in reference) <= LOSS_TOL


def test_bf16_resume_on_another_world_size_stays_within_bf16_rounding(
    pretrained: Path, tmp_path: Path
) -> None:
    # bf16 keeps 8 significant bits: one rounding of a loss near 8 is up to 2^-8 x 8 / 2 = 0.016, and the
    # forward and backward of the resumed run round its activations in other groupings (one rank
    # accumulating two micro-batches instead of two ranks averaging one each). 0.02 is about one such
    # rounding; a lost optimizer state or LR step moves these losses by > 0.05.
    # The weights: the fp32 master weights carry over and differ only by the reduction order's fp32
    # rounding, far below a bf16 ulp, so their bf16 copies round to the same value or, where a master
    # sits next to a rounding boundary, to the neighbouring one: at most 1 bf16 ulp. (Measured: losses
    # identical, 2 of 1.9M weights 1 ulp apart.) A lost update moves a weight by ~lr = 3e-3, tens of ulps.
    two = tmp_path / "two"
    args = [*run_args("zero2", two, pretrained), "precision=bf16"]
    _launch(args, nproc=2)
    out = _launch(_resumed(args, tmp_path / "one", _checkpoint(two)), nproc=1)
    assert_resumed(out, _checkpoint(two), RESUME_FROM)
    _compare("zero2 bf16 2->1", tmp_path / "one", two, loss_tol=0.02, bf16_weight_ulps=1)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen2(tmp_path_factory.mktemp("qwen2") / "pretrained")


@pytest.mark.parametrize(
    ("case", "before", "after"),
    [
        # (recipe, ds config, grad_accum): 8 x 2 x dp 1 under TP 2, 8 x 1 x dp 2 without.
        ("tp2 -> tp1 x dp2", ("tiny-cpu-tp2", None, 2), ("tiny-cpu", "zero1", 1)),
        ("dp2 -> tp2", ("tiny-cpu", "zero1", 1), ("tiny-cpu-tp2", None, 2)),
    ],
)
def test_tensor_parallel_layout_changes_keep_the_trajectory(
    qwen2: Path, tmp_path: Path, case: str, before: tuple, after: tuple
) -> None:
    def args(spec: tuple, run_dir: Path) -> list[str]:
        recipe, ds, accum = spec
        base = [
            "--recipe",
            recipe,
            *run_args("zero1", run_dir, qwen2)[4:],
            f"optim.grad_accum={accum}",
            "model.config={}",  # the recipes' own tiny-Llama fields do not apply to the Qwen2
        ]
        return [*base, "--ds-config", ds] if ds else base

    first = tmp_path / "first"
    _launch(args(before, first), nproc=2)
    out = _launch([*args(after, tmp_path / "second"), "--resume", str(_checkpoint(first))], nproc=2)
    assert_resumed(out, _checkpoint(first), RESUME_FROM)
    assert "tensor-parallel degree" in out and "universal" in out
    _compare(case, tmp_path / "second", first)

    # Export from any checkpoint: the step-3 one (now with its universal copy) and the last one
    # (for tp2: AutoTP slices, merged through the universal format), verified like final/.
    from llm_train.runtime.export.from_checkpoint import export_checkpoint

    for step in (RESUME_FROM, STEPS):
        result = export_checkpoint(_checkpoint(first, step), tmp_path / f"export-{step}", "fp32")
        assert "logits on a fixed batch" in result["verified"], result
    exported, trained = (
        load_file(tmp_path / f"export-{STEPS}" / "model.safetensors"),
        load_file(first / "final" / "model.safetensors"),
    )
    assert exported.keys() ^ trained.keys() <= {"lm_head.weight"}  # the tied head: saved once or twice
    assert (
        max(float((exported[k] - trained[k].float()).abs().max()) for k in exported.keys() & trained.keys())
        <= WEIGHT_TOL
    )


def test_a_conversion_killed_half_way_is_redone_never_used(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    from llm_train.cli import main
    from llm_train.runtime.checkpointing.commit import verify
    from llm_train.runtime.checkpointing.universal import ensure_universal, universal_dir

    ckpt = tmp_path / "ckpt"
    # Without the universal copy an earlier resume test may have made beside the shared checkpoint.
    shutil.copytree(_checkpoint(runs["zero3"]), ckpt, ignore=shutil.ignore_patterns("universal", ".tmp-*"))
    assert not universal_dir(ckpt).exists()
    code = f"from pathlib import Path; from llm_train.runtime.checkpointing.universal import ensure_universal as e; e(Path({str(ckpt)!r}), print)"
    convert = [sys.executable, "-c", code]
    proc = subprocess.Popen(convert, cwd=REPO, env={**os.environ, **OFFLINE_ENV}, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if any(p.is_file() for tmp in ckpt.glob(".tmp-universal*") for p in tmp.rglob("*.pt")):
            break  # the converter has started writing
        time.sleep(0.01)
    with contextlib.suppress(ProcessLookupError):  # already gone: the assert below says why
        os.killpg(proc.pid, signal.SIGKILL)  # the rank and its converter, as kill -9 of the job does
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the conversion finished before the kill: nothing was tested"
    assert not universal_dir(ckpt).exists()  # the half-written conversion is not in place
    assert list(ckpt.glob(".tmp-universal*"))  # it was left behind, half written

    # Redone through `llm-train convert`, the way a user converts ahead of a resume on a new layout (in this
    # process: a fresh interpreter would spend its time importing torch; the script is tested by export's).
    capsys.readouterr()
    assert main(["convert", str(ckpt)]) == 0
    stdout = capsys.readouterr().out
    target = universal_dir(ckpt)
    assert "converting" in stdout and f"{target}: verified universal copy" in stdout, stdout
    assert verify(target) is None and not list(ckpt.glob(".tmp-universal*"))

    # A copy whose files no longer match its manifest is converted again, never loaded.
    messages: list[str] = []
    victim = next(target.rglob("*.pt"))
    victim.write_bytes(victim.read_bytes()[:-1])
    assert verify(ensure_universal(ckpt, messages.append)) is None
    assert any("does not verify" in m for m in messages)


def test_slurm_requeue_on_fewer_nodes_finishes_the_run(
    runs: dict[str, Path], pretrained: Path, tmp_path: Path
) -> None:
    """2 loopback "nodes" are stopped by SLURM's time-limit signal; the requeued job gets 1 node."""
    bin_dir, run_dir, requeue_log = tmp_path / "bin", tmp_path / "elastic", tmp_path / "requeue.log"
    _tools(bin_dir)
    args = ["tiny-cpu", *run_args("zero3", run_dir, pretrained)[2:], "checkpoint.every_steps=1"]
    first = _sbatch(bin_dir, args, 0, requeue_log, nodes=2)
    assert wait_for_step(run_dir, 2, first), first.communicate()[0][-6000:]
    first.send_signal(signal.SIGUSR1)
    output = first.communicate(timeout=600)[0]
    assert first.returncode == 0, output[-6000:]
    stopped_at = max(losses(run_dir))
    assert stopped_at < STEPS, "the signal arrived after the last step; nothing was interrupted"

    second = _sbatch(bin_dir, args, 1, requeue_log, nodes=1)
    output = second.communicate(timeout=600)[0]
    assert second.returncode == 0, output[-6000:]
    assert "world size 2 -> 1" in output, output[-6000:]
    assert_resumed(output, run_dir, stopped_at)
    assert json.loads((run_dir / "world.json").read_text())["world_size"] == 1
    elastic, reference = losses(run_dir), losses(runs["zero3"])
    assert sorted(elastic) == list(range(1, STEPS + 1))
    loss_diff = max(abs(elastic[s] - reference[s]) for s in reference)
    print(
        f"slurm requeue 2 nodes -> 1: max loss difference {loss_diff:.2e} (stopped after step {stopped_at})"
    )
    assert loss_diff <= LOSS_TOL


def _workers(launcher_pid: int) -> list[int]:
    """PIDs of the train.py worker processes started under one launcher."""
    import psutil

    found = []
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            cmdline = child.cmdline()
        except psutil.Error:
            continue
        if any(c.endswith("llm_train/train.py") for c in cmdline) and "launch" not in cmdline:
            found.append(child.pid)
    return found


def test_max_restarts_brings_crashed_workers_back_from_the_newest_checkpoint(
    runs: dict[str, Path], pretrained: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "restarted"
    args = [*run_args("zero2", run_dir, pretrained), "checkpoint.every_steps=2", "--resume", "auto"]
    # On CPU accelerate's simple launcher has no restarts; --use_deepspeed takes its torchrun path,
    # the one every multi-GPU launch takes.
    restarts = ("--use_deepspeed", "--max_restarts", "1", "--monitor_interval", "0.5")
    proc = accelerate_popen(args, 2, launcher_flags=restarts)
    assert wait_for_step(run_dir, 3, proc), proc.communicate()[0][-6000:]
    victims = _workers(proc.pid)
    assert victims, "no worker found to crash"
    os.kill(victims[-1], signal.SIGKILL)  # one rank dies; torchrun restarts the whole group
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, output[-6000:]
    resumed = RESUMED.findall(output)
    assert resumed, output[-6000:]
    # A restart, from a committed checkpoint of this run (every 2 steps), at its step.
    assert_resumed(output, run_dir, int(resumed[-1][1]))
    assert int(resumed[-1][1]) % 2 == 0, resumed
    assert losses(run_dir) == losses(runs["zero2"])  # same layout: bit for bit
    theirs = load_file(runs["zero2"] / "final" / "model.safetensors")
    mine = load_file(run_dir / "final" / "model.safetensors")
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
