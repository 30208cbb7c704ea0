"""One real 2-process tiny-cpu run with every observability feature on, read by several tests.

W&B offline + TensorBoard + --profile + --peak-tflops, a fake WANDB_API_KEY in the
environment and a credential-like recipe field: the metrics are present and sane, the
trackers hold them, the profiler wrote a trace, and no secret reaches what tracking writes.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from llm_train.observability.run_report import make_report
from tests.helpers import assert_ok, launch, read_metrics

pytestmark = pytest.mark.e2e

STEPS = 6
FAKE_WANDB_KEY = "fa4e0123456789abcdef0123456789abcdef0123"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path_factory.mktemp("observability") / "run"
    result = launch(
        [
            "--recipe",
            "tiny-cpu",
            "--output-dir",
            str(run_dir),
            f"--max-steps={STEPS}",
            "--profile",
            "2-3",
            "--peak-tflops",
            "1.0",  # a nominal CPU peak, so that MFU is computed on CPU
            "optim.warmup_steps=0",
            "output.log_every=1",
            "eval.every=3",
            "eval.batches=1",
            "output.sample_prompt=null",
            "checkpoint.at_end=false",
            "tracking.mode=offline",
            "tracking.tensorboard=true",
            "tracking.tags=[e2e]",
        ],
        env={"WANDB_API_KEY": FAKE_WANDB_KEY, "WANDB_MODE": "offline"},
    )
    assert_ok(result)
    return run_dir, result


def test_every_logged_step_has_sane_metrics(run: tuple[Path, subprocess.CompletedProcess]) -> None:
    run_dir, _ = run
    rows = read_metrics(run_dir)
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for row in train:
        assert row["tokens_per_s"] > 0 and row["samples_per_s"] > 0 and row["step_time_s"] > 0
        assert row["tokens_per_s_per_gpu"] == pytest.approx(row["tokens_per_s"] / 2)
        # Slots: global batch 16 x seq 128. Real tokens leave out a packed row's unused tail: a few
        # tokens of each 128-token row at most (the corpus' documents are far shorter than a row).
        assert row["slot_tokens_per_s"] == pytest.approx(16 * 128 / row["step_time_s"])
        assert 0.9 * row["slot_tokens_per_s"] < row["tokens_per_s"] <= row["slot_tokens_per_s"]
        assert 0 < row["mfu"] < 1
        # Packed rows of the bundled corpus: documents far shorter than the row, so the attention they
        # span, and the document-aware MFU, are below the row-width figure.
        assert 0 < row["attention_span"] < 128 and row["mfu"] < row["mfu_seq_len"] < 1
        assert 0 < row["host_rss_gib"] < 16
        assert math.isfinite(row["grad_norm"]) and row["lr"] > 0
        assert not any(k.startswith("gpu_mem") for k in row)  # CPU run
    assert train[0]["startup_s"] > 0
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 6]
    assert all(r["eval_ppl"] == pytest.approx(math.exp(r["eval_loss"])) for r in evals)
    startup = json.loads((run_dir / "startup.json").read_text())
    assert {"imports", "data", "model build", "deepspeed init", "first step"} <= set(startup["phases_s"])


def test_console_shows_progress_and_no_library_chatter(run: tuple[Path, subprocess.CompletedProcess]) -> None:
    _, result = run
    assert "step 6/6 [####################] 100%" in result.stdout and "tok/s" in result.stdout
    assert "outputs " in result.stdout and "tensorboard/" in result.stdout
    assert "Setting accelerator to CPU" not in result.stdout + result.stderr


def test_profile_writes_a_trace(run: tuple[Path, subprocess.CompletedProcess]) -> None:
    run_dir, _ = run
    for rank in (0, 1):
        traces = list((run_dir / "profile").glob(f"rank{rank}.*.pt.trace.json"))
        assert len(traces) == 1
        assert "ProfilerStep#" in traces[0].read_text()  # the steps, as TensorBoard / Perfetto show them


def test_trackers_hold_the_metrics_and_config(run: tuple[Path, subprocess.CompletedProcess]) -> None:
    run_dir, _ = run
    (wandb_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data = wandb_file.read_bytes()
    for key in (
        b"tokens_per_s_per_gpu",
        b"mfu",
        b"eval_loss",
        b"host_rss_gib",
        b"zero_optimization",
        b"seq_len",
    ):
        assert key in data, key
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_no_secret_reaches_what_tracking_writes(run: tuple[Path, subprocess.CompletedProcess]) -> None:
    run_dir, result = run
    assert FAKE_WANDB_KEY not in result.stdout + result.stderr
    # The environment key must appear nowhere in the run directory.
    leaks = [p for p in run_dir.rglob("*") if p.is_file() and FAKE_WANDB_KEY.encode() in p.read_bytes()]
    assert leaks == []
    # A credential-like recipe key (model.config.hub_token=...) is refused when the recipe loads
    # (tests/unit/test_recipe.py), so no recipe field can carry one into the run directory.


def test_report_of_a_real_run(run: tuple[Path, subprocess.CompletedProcess]) -> None:
    run_dir, _ = run
    summary, images = make_report([run_dir])
    assert {"loss.png", "lr.png", "throughput.png", "memory.png", "mfu.png"} == {p.name for p in images}
    assert "| run | steps |" in summary.read_text()
