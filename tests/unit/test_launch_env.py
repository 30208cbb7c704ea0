"""runtime/base/launch_env.py: a worker's one-line error reaches torchrun's failure report."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from llm_train.runtime.base import launch_env

MESSAGE = "llm-train: error: recipe tiny-cpu.yaml: unknown key 'optim.lrr'; did you mean 'lr'?"


def test_the_error_file_is_read_by_torchrun_as_the_failures_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    launch_env.record_error(MESSAGE)
    # torchrun's own reader, the one that formats the "traceback :" field of its report.
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    assert failure.message == MESSAGE and failure.timestamp > 0


def test_without_torchrun_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    launch_env.record_error(MESSAGE)
    assert list(tmp_path.iterdir()) == []
