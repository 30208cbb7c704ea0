"""bench/full_ft_check.py's verdicts: a measurement outside the planner's estimate fails its line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
GiB = 1024**3


@pytest.fixture(scope="module")
def check() -> object:
    sys.path.insert(0, str(BENCH))
    try:
        import full_ft_check
    finally:
        sys.path.remove(str(BENCH))
    return full_ft_check


def _record(**changes: object) -> dict:
    # The 7B case as planned (116.4 GiB host, 37.7 GiB locked, 20.9 GiB GPU) and measured within it.
    record = {
        "fits": True,
        "est_host_gib": 116.4,
        "host_pss_peak_gib": 110.0,
        "gpu_mem_peak_gib": 20.0,
        "est_locked_gib": 37.65,
        "locked_peak_gib": 37.7,
    }
    return {**record, **changes}


def test_the_7b_case_passes_inside_the_estimate_and_fails_outside_it(check: object) -> None:
    case = check.GPU_SIZES.cases[0]  # type: ignore[attr-defined]
    sizes = check.GPU_SIZES  # type: ignore[attr-defined]
    assert all(check.verdicts(_record(), case, sizes).values())  # type: ignore[attr-defined]
    over = check.verdicts(_record(host_pss_peak_gib=117.0), case, sizes)  # type: ignore[attr-defined]
    assert not over["host_pss_at_most_estimate"]
    # More than 15% under the estimate: the planner would be wrong the other way.
    under = check.verdicts(_record(host_pss_peak_gib=90.0), case, sizes)  # type: ignore[attr-defined]
    assert not under["host_pss_at_least_85pct_of_estimate"]
    capped = check.verdicts(_record(gpu_mem_peak_gib=24.5), case, sizes)  # type: ignore[attr-defined]
    assert not capped["gpu_peak_under_cap"]
    unlocked = check.verdicts(_record(locked_peak_gib=0.0), case, sizes)  # type: ignore[attr-defined]
    assert not unlocked["locked_at_least_planned_at_most_1gib_more"]  # native pinning did not happen
    assert not check.verdicts(_record(est_host_gib=125.0, host_pss_peak_gib=121.0), case, sizes)[
        "host_pss_under_120_gib"
    ]  # type: ignore[attr-defined]


def test_the_nvme_case_checks_drive_bytes_and_losses(check: object) -> None:
    case, sizes = check.GPU_SIZES.cases[2], check.GPU_SIZES  # type: ignore[attr-defined]
    record = _record(
        est_nvme_read_gb_per_step=24.7, est_nvme_write_gb_per_step=24.7,
        nvme_read_gb_per_step=24.7, nvme_write_gb_per_step=30.0,
    )  # fmt: skip
    checks = check.verdicts(record, case, sizes)  # type: ignore[attr-defined]
    assert checks["drive_read_per_step_within_15pct"] and not checks["drive_write_per_step_within_15pct"]
    nvme, cpu = {"losses": [8.0, 7.5], "passed": True, "checks": {}}, {"losses": [8.0, 7.5]}
    check.compare_losses(nvme, cpu)  # type: ignore[attr-defined]
    assert nvme["checks"]["losses_match_cpu_offload"] and nvme["passed"]
    check.compare_losses(nvme, {"losses": [8.0, 7.4]})  # type: ignore[attr-defined]
    assert not nvme["checks"]["losses_match_cpu_offload"] and nvme["passed"] is False
