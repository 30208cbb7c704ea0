"""`llm-train doctor`: runs on a CPU-only machine, prints every section, warnings carry their fix."""

from __future__ import annotations

import re

import pytest

from llm_train import cli
from llm_train.commands import doctor


def test_doctor_prints_its_sections(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor", "--skip-build"]) == 0
    out = capsys.readouterr().out
    for header in ("== system", "== GPUs", "== software", "== DeepSpeed ops", "== warnings"):
        assert header in out
    for key in ("CPU cores", "host RAM", "disk (here)", "torch", "deepspeed", "accelerate", "transformers"):
        assert f"  {key}" in out
    assert "flash-attn" in out
    # Keys are padded to the section's widest ("async I/O"), so match the gap loosely.
    assert re.search(r"  CPU Adam +not tried \(--skip-build\)", out)
    assert re.search(r"  async I/O +not tried \(--skip-build\)", out)


def test_every_warning_has_a_fix() -> None:
    report = doctor.collect(build=False)
    for problem, fix in report.warnings:
        assert problem and fix
    text = report.render()
    assert text.count("  ! ") == text.count("    fix: ") == len(report.warnings)


def test_no_gpu_is_a_warning_with_a_fix_not_a_crash() -> None:
    import torch

    if torch.cuda.is_available():  # what this test is about cannot happen here: not a missing part
        pytest.skip("this machine has a GPU")
    report = doctor.collect(build=False)
    gpus = dict(report.sections["GPUs"])
    assert gpus["CUDA GPUs"] == "none visible to torch"
    assert any("llm-train plan" in fix for _, fix in report.warnings)
    # The CPU recipes it names are the shipped ones written for a CPU, read from recipes/ (a list kept by hand
    # named two of the nine).
    from llm_train import RECIPES_DIR

    shipped = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml") if "\n  device: cpu" in p.read_text())
    assert len(shipped) >= 9 and doctor.cpu_recipes() == shipped
    (line,) = [problem for problem, _ in report.warnings if problem.startswith("no CUDA GPU")]
    assert line == f"no CUDA GPU: only CPU recipes ({', '.join(shipped)}) train here"


def test_cpu_adam_failure_is_one_line_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        doctor,
        "_CPU_ADAM_PROBE",
        "import sys\nprint('noise')\nsys.exit('RuntimeError: Error building extension cpu_adam')",
    )
    report = doctor.Report()
    doctor.check_cpu_adam(report, timeout=60)
    ((key, value),) = report.sections["DeepSpeed ops"]
    assert (
        key == "CPU Adam" and value == "FAILS to build/load: RuntimeError: Error building extension cpu_adam"
    )
    problem, fix = report.warnings[0]
    assert "CPU Adam does not build" in problem and "build-essential" in fix and "DS_BUILD_CPU_ADAM=1" in fix


def test_cpu_adam_probe_timeout_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "_CPU_ADAM_PROBE", "import time\ntime.sleep(30)")
    report = doctor.Report()
    doctor.check_cpu_adam(report, timeout=1)
    assert report.sections["DeepSpeed ops"][0][1].startswith("no answer after 1 s")
    assert "--build-timeout" in report.warnings[0][1]
