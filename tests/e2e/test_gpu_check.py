"""bench/gpu_check.sh, the one command a GPU session runs once, works end to end before device time is spent.

`--cpu-tiny` runs the same logic as on the H200 (SIGTERM -> exit 75 -> resume -> export, here for
ZeRO-3+offload only, the speed runs, the planner-vs-measured memory check, each measured case's
verdicts against the planner and its target) with the tiny model on CPU. Device time is about 15 minutes for all tries together, so a broken script there costs the
whole measurement: this test is what makes the single GPU run likely to succeed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
# a_zero2 and a_zero3 run the same SIGTERM -> resume -> export code as a_zero3_offload with another DS
# JSON (bench/gpu_check.py check_resume), and that path itself is tests/e2e/test_resume.py's: four
# launches fewer in CI, the script's every line-writing path still covered.
ONLY = ["a_zero3_offload", "b_mfu_zero2", "c_zero3", "c_zero0", "d_consumer_card"]
EXPECTED = [
    "a_zero3_offload",
    "b_mfu_zero2",
    "c_zero3",
    "c_zero0",
    "c_zero3_over_zero0",
    "d_consumer_card",
]


def gpu_check(out: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "bench/gpu_check.sh", "--cpu-tiny", "--out", str(out), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]


# The verdict hook: an estimate no run can meet, for one measurement only. Its line must fail on that
# verdict alone, the exit code must say so, and every other line must still be written and pass.
INJECTED_MISS = "c_zero0.step_time_s=1e-6"


def test_cpu_tiny_check_writes_every_line_and_a_missed_estimate_fails_only_its_own(tmp_path: Path) -> None:
    result = gpu_check(tmp_path, "--only", *ONLY, "--expect", INJECTED_MISS, timeout=900)
    output = (result.stdout + result.stderr)[-4000:]
    assert result.returncode == 1, output
    records = read_lines(tmp_path)
    assert [r["measurement"] for r in records] == EXPECTED, output
    assert [r["measurement"] for r in records if r["passed"] is not True] == ["c_zero0"], output
    by_name = {r["measurement"]: r for r in records}

    missed = by_name["c_zero0"]
    assert missed["steps"] == missed["steady_steps"] + 3 and missed["step_time_s"] > 0, missed  # it ran fine
    (judged,) = [v for v in missed["verdicts"] if v["judged"]]
    assert judged["quantity"] == "step_time_s" and judged["estimate"] == 1e-6, judged
    assert judged["within_estimate"] is False and not judged["passed"], judged
    assert (
        missed["error"] == judged["misses"][0]
        and "off the planner's 1e-06 (allowed +-15%)" in missed["error"]
    )
    # Without the hook nothing is judged on CPU, but every comparison is recorded for the GPU run.
    for name in ("b_mfu_zero2", "c_zero3", "c_zero3_over_zero0", "d_consumer_card"):
        verdicts = by_name[name]["verdicts"]
        assert verdicts and not any(v["judged"] for v in verdicts), (name, verdicts)
        assert all(v.get("estimate") is not None or v.get("target") is not None for v in verdicts), verdicts

    for name in ("a_zero3_offload",):
        a = by_name[name]
        # Stopped by SIGTERM after the first checkpoint, resumed, and finished with the export.
        assert (a["exit_code_sigterm"], a["exit_code_resume"]) == (75, 0), a
        assert a["checkpoint_step_at_stop"] <= a["steps_before"] < a["steps_after"] == a["steps"], a
        assert all(a["checks"].values()), a
    b = by_name["b_mfu_zero2"]
    (mfu,) = [v for v in b["verdicts"] if v["quantity"] == "mfu"]
    assert b["mfu"] > 0 and mfu["target"] == 0.45 and mfu["target_met"] is False, b  # CPU: far below
    assert b["est_step_time_s"] > 0, b  # the planner was asked about the same configuration
    ratio = by_name["c_zero3_over_zero0"]
    assert ratio["ratio"] == pytest.approx(ratio["zero3_step_time_s"] / ratio["zero0_step_time_s"], rel=1e-3)
    d = by_name["d_consumer_card"]
    # Measured and estimated host memory, both present and of the same order: the tiny run's PSS
    # (~0.5 GiB: torch, DeepSpeed, transformers) against the planner's ~1 GiB per CPU process. The
    # machine-wide used-memory growth is recorded too, but other work on a shared machine moves it.
    assert 0.1 < d["host_pss_peak_gib"] < 4 and 0.1 < d["est_host_gib"] < 4, d
    assert d["host_used_delta_peak_gib"] is not None, d
    assert d["planner_tried"][-1]["fits"] is True and d["steps"] == 3, d
    assert d["cap_note"] == "capped_train: no CUDA device; running without a GPU memory cap", (
        d
    )  # the wrapper ran

    summary = json.loads((tmp_path / "gpu_check_summary.json").read_text())
    assert summary["passed"] is False and summary["failed"] == ["c_zero0"], summary
    assert summary["lines"] == len(EXPECTED) and list(summary["verdicts_missed"]) == ["c_zero0"], summary
    # The device tool brings back at most 8 files from $OUT: the check writes three.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "gpu_check.jsonl",
        "gpu_check.log",
        "gpu_check_summary.json",
    ]


def test_a_measurement_the_budget_leaves_no_time_for_is_a_failed_line_and_exit_1(tmp_path: Path) -> None:
    result = gpu_check(tmp_path, "--only", "a_zero2", "d_consumer_card", "--budget-s", "1", timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    records = read_lines(tmp_path)
    assert [r["measurement"] for r in records] == ["a_zero2", "d_consumer_card"]
    assert all(r["passed"] is False and r["error"].startswith("not run:") for r in records), records
    summary = json.loads((tmp_path / "gpu_check_summary.json").read_text())
    assert summary["failed"] == ["a_zero2", "d_consumer_card"]


def test_capped_train_without_a_cap_is_a_one_line_usage_error() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "capped_train.py"), "--recipe", "tiny-cpu"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "capped_train: usage: python bench/capped_train.py --gpu-cap-gib GIB [train.py arguments ...]"
    ]
