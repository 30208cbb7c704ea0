"""eval.tasks: lm-eval benchmarks on the live model during training, on schedule, through a kill -9.

Real 2-process runs on CPU with the bundled task. Under ZeRO-3 the weights are gathered into a copy
on rank 0 (as the export gathers), under ZeRO-2 rank 0 evaluates the model in place; either way the
result at the last step must be what `llm-train eval` gives on the run's exported final/ (the same
weights), the metric lands at the scheduled steps in metrics.jsonl and TensorBoard, and a run killed
with -9 and resumed evaluates each scheduled step exactly once.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from llm_train import cli
from tests.helpers import (
    assert_ok,
    assert_resumed,
    committed_step,
    launch,
    launch_popen,
    read_metrics,
    wait_for_step,
)
from tests.optional import require

pytestmark = pytest.mark.e2e

BENCH = ["eval.tasks=[llm_train_tiny]", "eval.tasks_limit=8", "eval.tasks_batch_size=16"]
SHORT = [
    "optim.warmup_steps=0",
    "output.log_every=1",
    "eval.every=0",
    "eval.batches=1",
    "output.sample_prompt=null",
]
ACC = "bench/llm_train_tiny/acc"


@pytest.fixture(autouse=True)
def _lm_eval() -> None:
    require("lm_eval")


def _bench_rows(run_dir: Path) -> list[dict]:
    return [m for m in read_metrics(run_dir) if ACC in m]


def _posthoc(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    """`llm-train eval` of the run's final/ with the recipe's task settings: its per-task JSON."""
    args = ["eval", str(run_dir), "--tasks", "llm_train_tiny", "--limit", "8", "--batch-size", "16"]
    assert cli.main([*args, "--no-trackers"]) == 0
    capsys.readouterr()
    step = max(m["step"] for m in read_metrics(run_dir))
    return json.loads((run_dir / "eval" / f"step-{step:08d}.json").read_text())["tasks"]["llm_train_tiny"]


def _live(row: dict) -> dict:
    return {k.split("/")[-1]: v for k, v in row.items() if k.startswith("bench/llm_train_tiny/")}


def test_zero3_runs_the_schedule_through_a_kill_9_and_matches_the_export(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    args = ["--recipe", "tiny-cpu", "--output-dir", str(run_dir), "--max-steps", "12", *SHORT, *BENCH]
    args += [
        "eval.tasks_every=4",
        "checkpoint.every_steps=4",
        "tracking.tensorboard=true",
        "--resume",
        "auto",
    ]
    proc = launch_popen(args)
    try:
        assert wait_for_step(run_dir, 6, proc), proc.communicate()[0][-4000:]
        assert proc.poll() is None, "the run ended before the kill: nothing was tested"
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert [r["step"] for r in _bench_rows(run_dir)] == [4]  # evaluated before the kill
    last = committed_step(run_dir)
    assert last is not None, "killed before the first checkpoint: nothing to resume"
    result = launch(args)
    assert_ok(result)
    assert_resumed(result.stdout, run_dir, last)  # the newest checkpoint before the kill
    rows = _bench_rows(run_dir)
    assert [r["step"] for r in rows] == [4, 8, 12]  # each scheduled step once: none repeated, none lost
    assert all(r["bench/time_s"] > 0 for r in rows)  # its time is reported (and not in tokens/s)
    assert "step 12: bench llm_train_tiny acc" in result.stdout
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert sorted({e.step for e in events.Scalars(ACC)}) == [4, 8, 12]
    # The gathered copy at step 12 is the trained model: lm-eval on final/ says the same.
    assert _live(rows[-1]) == pytest.approx(_posthoc(run_dir, capsys), abs=0)


def test_zero2_evaluates_the_model_in_place_at_the_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    args = ["--recipe", "tiny-cpu", "--output-dir", str(run_dir), "--max-steps", "3", *SHORT, *BENCH]
    result = launch([*args, "deepspeed.config=zero2", "checkpoint.at_end=false"])
    assert_ok(result)
    rows = _bench_rows(run_dir)
    assert [r["step"] for r in rows] == [3]  # eval.tasks_every 0 and eval.every 0: at the end only
    assert _live(rows[0]) == pytest.approx(_posthoc(run_dir, capsys), abs=0)
