"""`llm-train doctor`'s real CPU Adam probe: DeepSpeed's extension JIT-builds and loads on this machine.

The unit tests (tests/unit/test_doctor.py) feed the probe a stand-in script; this one runs the
real build, which takes minutes the first time.
"""

from __future__ import annotations

import pytest

from llm_train.commands import doctor

pytestmark = pytest.mark.e2e


def test_cpu_adam_really_builds_here() -> None:
    """The real probe: JIT-builds DeepSpeed's CPU Adam (1-3 minutes the first time, then cached)."""
    report = doctor.Report()
    doctor.check_cpu_adam(report, timeout=600)
    value = report.sections["DeepSpeed ops"][0][1]
    assert value.startswith("builds and loads"), value
