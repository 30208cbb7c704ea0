"""Checkpoints survive anything: kill -9 at arbitrary moments (also mid-save), SIGTERM, export.

Each interrupted run repeats a reference run (conftest.py) with checkpoints every 2 steps
and `--resume auto` on every launch; after it completes, its per-step losses and final
weights must equal the uninterrupted reference bit for bit.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.reference import STEPS, run_args
from tests.helpers import (
    assert_ok,
    assert_resumed,
    committed_step,
    launch,
    launch_popen,
    losses,
    run_cmd,
    wait_for_step,
)

pytestmark = pytest.mark.e2e

CHECKPOINTING = ["checkpoint.every_steps=2", "--resume", "auto"]


def _kill_after(run_dir: Path, args: list[str], step: int, delay: float) -> None:
    """kill -9 the whole launch `delay` s after `step` is logged; fails unless the run was still going.

    A launch that finds a committed checkpoint must say it resumed from it before training on.
    """
    before = committed_step(run_dir)
    proc = launch_popen(args)
    assert wait_for_step(run_dir, step, proc), proc.communicate()[0][-4000:]
    time.sleep(delay)  # land in the step, the eval or the save that follows
    assert proc.poll() is None, (
        f"the run ended before the kill at step {step} + {delay:.2f}s: nothing was tested"
    )
    os.killpg(proc.pid, signal.SIGKILL)
    output = proc.communicate()[0]
    # Killed (possibly mid-export), not finished on its own between the check above and the kill.
    assert proc.returncode == -signal.SIGKILL, proc.returncode
    if before is not None:
        assert_resumed(output, run_dir, before)


def _assert_identical(run_dir: Path, reference: Path) -> None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, STEPS + 1))  # none repeated or lost
    assert losses(run_dir) == losses(reference)  # exact float equality
    mine, theirs = (
        load_file(run_dir / "final" / "model.safetensors"),
        load_file(reference / "final" / "model.safetensors"),
    )
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


# ZeRO-1 saves and loads through the same stage_1_and_2 optimizer code as ZeRO-2 (and is resumed
# after kills in test_bf16 and on other layouts in test_resume_anywhere): two variants, for CI time.
@pytest.mark.parametrize("variant", ["zero2", "zero3"])
def test_kill_9_and_resume_is_exact(
    runs: dict[str, Path], pretrained: Path, tmp_path: Path, variant: str
) -> None:
    run_dir = tmp_path / variant
    args = run_args(variant, run_dir, pretrained) + CHECKPOINTING
    rng = random.Random(variant)
    kill_points = [(2, rng.uniform(0.0, 0.6)), (4, rng.uniform(0.0, 0.6))]
    for step, delay in kill_points:
        _kill_after(run_dir, args, step, delay)
    last = committed_step(run_dir)
    assert last is not None, "no checkpoint was committed before the kills"
    result = launch(args)
    assert_ok(result)
    assert_resumed(result.stdout, run_dir, last)
    _assert_identical(run_dir, runs[variant])
    print(f"{variant}: killed at {kill_points}, resumed exactly")


def _signal_during_save(run_dir: Path, proc) -> None:
    """SIGTERM while a checkpoint is being written (its temporary directory exists), not after a fixed time."""
    deadline = time.monotonic() + 120
    while not list((run_dir / "checkpoints").glob(".tmp-*")):
        assert proc.poll() is None, "the run ended without a checkpoint write to signal during"
        assert time.monotonic() < deadline, "no checkpoint write began within 120 s"
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)


@pytest.mark.parametrize("during", ["step", "save"])
def test_stop_signal_checkpoints_and_exits_resumable(
    runs: dict[str, Path], pretrained: Path, tmp_path: Path, during: str
) -> None:
    run_dir = tmp_path / during
    cadence = ["checkpoint.every_steps=1"] if during == "save" else []  # saves to land in
    args = run_args("zero2", run_dir, pretrained) + cadence + ["--resume", "auto"]
    proc = launch_popen(args)
    assert wait_for_step(run_dir, 1, proc)
    # SLURM signals the job's tasks; here: their launcher, which forwards the signal to every worker
    # as accelerate's and torchrun's do (through `accelerate launch`: test_train_command.py).
    sent = time.monotonic()
    if during == "save":
        _signal_during_save(run_dir, proc)
    else:
        wait_for_step(run_dir, 2, proc)
        proc.send_signal(signal.SIGUSR1)
    output, _ = proc.communicate(timeout=120)
    elapsed = time.monotonic() - sent
    assert elapsed < 25, elapsed  # the default grace budget
    assert proc.returncode == 75, output[-3000:]  # EXIT_PREEMPTED
    stopped_at = int((run_dir / "checkpoints" / "latest").read_text().split("-")[1])
    assert 1 <= stopped_at < STEPS
    assert not (run_dir / "final").exists()
    result = launch(args)
    assert_ok(result)
    assert_resumed(result.stdout, run_dir, stopped_at)
    _assert_identical(run_dir, runs["zero2"])


def test_grace_budget_cuts_the_stop_short_and_latest_stays_complete(pretrained: Path, tmp_path: Path) -> None:
    """checkpoint.grace_s smaller than a step: the run exits 75 at once, without committing the stop
    checkpoint, and `latest` still names the previous complete one."""
    from llm_train.runtime.checkpointing.commit import verify

    run_dir = tmp_path / "grace"
    long_run = ["--max-steps=40", "checkpoint.every_steps=2", "checkpoint.grace_s=0.001"]
    args = run_args("zero2", run_dir, pretrained) + long_run
    proc = launch_popen(args)
    assert wait_for_step(run_dir, 3, proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, output[-3000:]
    assert "checkpoint.grace_s=0.001 ran out" in output
    checkpoints = run_dir / "checkpoints"
    latest = checkpoints / (checkpoints / "latest").read_text().strip()
    assert verify(latest) is None  # never a partial one
    assert not (run_dir / "final").exists()
    saved = [int(p.name.split("-")[1]) for p in checkpoints.glob("step-*")]
    assert saved and all(step % 2 == 0 and step < 40 for step in saved)  # periodic saves only


@pytest.mark.parametrize("variant", ["zero0", "zero1", "zero2", "zero3", "zero3_offload"])
def test_export_round_trip(runs: dict[str, Path], tmp_path: Path, variant: str) -> None:
    from transformers import AutoModelForCausalLM

    from llm_train.cli import main

    out = tmp_path / "export"
    command = ["export", str(runs[variant]), str(out), "--dtype", "fp32"]
    if variant == "zero3":  # the installed `llm-train` script, once
        assert_ok(run_cmd([str(Path(sys.executable).with_name("llm-train")), *command]))
    else:  # the same command in this process: a new one would spend most of its time importing torch
        assert main(command) == 0
    exported = AutoModelForCausalLM.from_pretrained(out)
    trained = AutoModelForCausalLM.from_pretrained(runs[variant] / "final")  # gathered from the live engine
    batch = torch.arange(24).view(2, 12)
    with torch.no_grad():
        assert torch.allclose(exported(batch).logits, trained(batch).logits, atol=1e-5)
    assert {p.name for p in out.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "generation_config.json",
    }


def test_planted_pickle_in_unverified_checkpoint_is_never_loaded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # In this process (cli.main, as the installed `llm-train` runs it; that script itself is launched in
    # test_export_round_trip): a fresh interpreter per refusal cost two imports of torch, and a pickle that
    # did load would run os.system here just the same.
    from llm_train.cli import main

    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    fake = tmp_path / "run" / "checkpoints" / "step-00000009"
    (fake / "state" / "ds").mkdir(parents=True)
    with (fake / "state" / "ds" / "mp_rank_00_model_states.pt").open("wb") as handle:
        pickle.dump(Exploit(), handle)
    (fake.parent / "latest").write_text(fake.name)
    assert main(["export", str(fake), str(tmp_path / "out")]) == 2
    assert "no manifest" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    assert "skipping checkpoint" in capsys.readouterr().err
    assert not marker.exists()
