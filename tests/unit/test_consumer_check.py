"""bench/consumer_check.py's verdicts can fail: a GPU or host peak off the planner by more than 15%, a run
that did not finish its steps, an export that did not verify, each fails its line (on a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import consumer_check  # noqa: E402 - bench/ is a folder of scripts, on the path above


def record(**changes: object) -> dict:
    base = {
        "steps": consumer_check.STEPS,
        "finish": True,
        "est_gpu_gib": 10.0,
        "gpu_device_used_peak_gib": 10.5,
        "est_host_gib": 8.0,
        "host_pss_peak_gib": 7.5,
        "export_host_pss_peak_gib": 6.0,
        "export_verified": True,
    }
    return {**base, **changes}


def test_a_case_within_the_planners_15_percent_passes() -> None:
    checked = consumer_check.verdicts(record(), enforce=True)
    assert checked["passed"] and checked["failed_checks"] == []
    assert checked["checks"]["gpu_vs_planner"]["ratio"] == pytest.approx(1.05)


@pytest.mark.parametrize(
    ("changes", "failed"),
    [
        ({"gpu_device_used_peak_gib": 11.6}, "gpu_vs_planner"),  # 16% over the estimate
        ({"gpu_device_used_peak_gib": 8.4}, "gpu_vs_planner"),  # 16% under: the planner wastes a card
        ({"host_pss_peak_gib": 9.3}, "host_vs_planner"),
        ({"export_host_pss_peak_gib": 9.3}, "export_host_within_planner"),
        ({"export_verified": False}, "export_verified"),
        ({"steps": 2, "error": "exit -9 after 2 steps"}, "steps_ran"),
        ({"gpu_device_used_peak_gib": None}, "gpu_vs_planner"),  # not measured is not a pass
    ],
)
def test_each_miss_fails_the_line(changes: dict, failed: str) -> None:
    checked = consumer_check.verdicts(record(**changes), enforce=True)
    assert not checked["passed"] and failed in checked["failed_checks"]


def test_on_cpu_the_verdicts_are_reported_but_only_the_steps_decide() -> None:
    checked = consumer_check.verdicts(record(gpu_device_used_peak_gib=None), enforce=False)
    assert checked["passed"] and checked["failed_checks"] == ["gpu_vs_planner"]
    assert not consumer_check.verdicts(record(steps=1), enforce=False)["passed"]
