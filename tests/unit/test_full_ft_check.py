"""bench/full_ft_check.py's verdicts: a measurement outside the planner's estimate fails its line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def check() -> object:
    sys.path.insert(0, str(BENCH))
    try:
        import full_ft_check
    finally:
        sys.path.remove(str(BENCH))
    return full_ft_check


def _record(**changes: object) -> dict:
    # The 7B case as planned (116.4 GiB host, 37.65 GiB locked) and measured within it.
    record = {
        "fits": True,
        "est_host_gib": 116.4,
        "host_pss_peak_gib": 110.0,
        "gpu_mem_peak_gib": 20.0,
        "est_locked_gib": 37.65,
        "locked_peak_gib": 37.7,
    }
    return {**record, **changes}


def _misses(check: object, record: dict, case_index: int = 0, gpu: bool = True) -> set[str]:
    sizes = check.GPU_SIZES if gpu else check.CPU_SIZES  # type: ignore[attr-defined]
    verdicts = check.verdicts(record, sizes.cases[case_index], sizes)  # type: ignore[attr-defined]
    return {v["quantity"] for v in verdicts if not v["passed"]}


def test_the_7b_case_passes_inside_the_estimate_and_fails_outside_it(check: object) -> None:
    assert _misses(check, _record()) == set()
    assert _misses(check, _record(host_pss_peak_gib=117.0)) == {"host_pss_peak_gib"}  # above the estimate
    # More than 15% under the estimate: the planner would be wrong the other way.
    assert _misses(check, _record(host_pss_peak_gib=90.0)) == {"host_pss_peak_gib"}
    assert _misses(check, _record(gpu_mem_peak_gib=24.5)) == {"gpu_mem_peak_gib"}
    assert _misses(check, _record(locked_peak_gib=0.0)) == {
        "locked_peak_gib"
    }  # native pinning did not happen
    assert _misses(check, _record(locked_peak_gib=40.0)) == {"locked_peak_gib_at_most"}
    over = _record(est_host_gib=125.0, host_pss_peak_gib=121.0)
    assert _misses(check, over) == {"host_pss_peak_gib_ceiling"}
    assert _misses(check, _record(fits=False)) == {"planner_fits"}


def test_on_cpu_the_locked_bytes_are_exact_and_the_pss_only_recorded(check: object) -> None:
    cpu = _record(est_host_gib=1.09, host_pss_peak_gib=4.3, est_locked_gib=0.01418, locked_peak_gib=0.01418)
    assert _misses(check, cpu, gpu=False) == set()
    assert _misses(check, {**cpu, "locked_peak_gib": 0.0142}, gpu=False) == {"locked_peak_gib"}


def test_the_nvme_case_checks_drive_bytes_and_losses(check: object) -> None:
    record = _record(
        est_nvme_read_gb_per_step=24.7, est_nvme_write_gb_per_step=24.7,
        nvme_read_gb_per_step=24.7, nvme_write_gb_per_step=30.0,
    )  # fmt: skip
    assert _misses(check, record, case_index=2) == {"nvme_write_gb_per_step"}
    nvme = {"losses": [8.0, 7.5], "passed": True, "verdicts": []}
    check.compare_losses(nvme, {"losses": [8.0, 7.5]})  # type: ignore[attr-defined]
    assert nvme["passed"] and nvme["loss_max_rel_diff_vs_cpu_offload"] == 0.0
    check.compare_losses(nvme, {"losses": [8.0, 7.4]})  # type: ignore[attr-defined]
    assert nvme["passed"] is False and "loss_max_rel_diff_vs_cpu_offload" in nvme["error"]
