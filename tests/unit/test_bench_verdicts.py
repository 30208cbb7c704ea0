"""bench/common.py's verdicts: a measured number against the planner's estimate (+-15%) and a target.

The GPU scripts (bench/gpu_check.py first) judge each measured case with these; a miss must fail
the line, a hit must not, and a comparison recorded without being judged must never fail one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def common() -> object:
    sys.path.insert(0, str(BENCH))
    try:
        import common
    finally:
        sys.path.remove(str(BENCH))
    return common


@pytest.mark.parametrize(
    ("measured", "passed"), [(1.0, True), (1.149, True), (0.851, True), (1.16, False), (0.8, False)]
)
def test_an_estimate_is_met_within_15_percent_either_way(common, measured: float, passed: bool) -> None:
    v = common.verdict("step_time_s", measured, estimate=1.0)
    assert v["passed"] is passed and v["within_estimate"] is passed
    assert v["ratio"] == pytest.approx(measured)
    assert bool(v["misses"]) is not passed
    if not passed:
        assert "off the planner's 1 (allowed +-15%)" in v["misses"][0]


def test_a_target_is_a_floor_or_a_ceiling(common) -> None:
    assert common.verdict("mfu", 0.45, target=0.45)["passed"]
    missed = common.verdict("mfu", 0.30, target=0.45)
    assert not missed["passed"] and missed["misses"] == ["mfu 0.3 misses its target >= 0.45"]
    assert common.verdict("step_time_s", 2.0, target=3.0, higher_is_better=False)["passed"]
    assert not common.verdict("step_time_s", 4.0, target=3.0, higher_is_better=False)["passed"]


def test_nothing_measured_or_nothing_to_compare_with_is_a_miss(common) -> None:
    assert common.verdict("gpu_mem_peak_gib", None, estimate=20.0)["misses"] == [
        "gpu_mem_peak_gib: not measured (estimate 20)"
    ]
    assert not common.verdict("step_time_s", 1.0)["passed"]  # a verdict with nothing to judge by


def test_an_unjudged_comparison_is_recorded_and_never_fails_a_line(common) -> None:
    v = common.verdict("step_time_s", 5.0, estimate=1.0, judged=False, why_not_judged="cpu-tiny")
    assert v["passed"] and v["misses"] and v["why_not_judged"] == "cpu-tiny"
    record = common.judge({"measurement": "x", "passed": True}, [v])
    assert record["passed"] is True and "error" not in record


def test_a_judged_miss_fails_the_line_and_names_every_miss(common) -> None:
    verdicts = [
        common.verdict("step_time_s", 2.0, estimate=1.0),
        common.verdict("mfu", 0.3, target=0.45),
        common.verdict("gpu_mem_peak_gib", 20.0, estimate=20.5),
    ]
    record = common.judge({"measurement": "b", "passed": True, "error": "exit 1"}, verdicts)
    assert record["passed"] is False and record["verdicts"] == verdicts
    assert (
        record["error"].startswith("exit 1; step_time_s 2 is +100% off")
        and "mfu 0.3 misses" in record["error"]
    )
