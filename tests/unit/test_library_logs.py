"""observability/library_logs.py: the libraries' warnings stay out of a run's output unless --verbose."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from llm_train.observability import library_logs
from tests.helpers import REPO
from tests.optional import import_or_skip


def test_the_kernels_community_warning_is_dropped_and_other_bitsandbytes_warnings_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loggers = [logging.getLogger(name) for name in library_logs.KERNELS_COMMUNITY_LOGGERS]
    for logger in loggers:
        monkeypatch.setattr(logger, "filters", [])  # quiet() adds its filter to these loggers; restored after
    monkeypatch.setattr(logging.getLogger("DeepSpeed"), "filters", [])
    monkeypatch.setattr(library_logs.warnings, "filters", list(library_logs.warnings.filters))
    library_logs.quiet(verbose=False)
    fetch = logger.makeRecord(
        logger.name, logging.WARNING, __file__, 1, "from %s: x", ("kernels-community",), None
    )
    other = logger.makeRecord(logger.name, logging.WARNING, __file__, 1, "something else", (), None)
    assert not logger.filter(fetch) and logger.filter(other)


def test_a_lora_run_imports_peft_without_the_kernels_community_warning() -> None:
    import_or_skip("peft")
    import_or_skip("bitsandbytes")
    # A fresh interpreter: bitsandbytes logs it once, when PEFT first imports it (a worker's import order);
    # the tests' environment is offline, where the kernels package says it instead.
    code = "from llm_train.observability.library_logs import quiet; quiet(False); import peft, bitsandbytes"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "kernels-community" not in result.stdout + result.stderr
