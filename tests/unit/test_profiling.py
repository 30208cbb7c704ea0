"""--profile A-B: range parsing and a trace of exactly the asked steps; the flops profiler's DS section."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llm_train.errors import UserError
from llm_train.observability.profiling import (
    NullProfiler,
    StepProfiler,
    flops_profiler_config,
    make_profiler,
    parse_range,
)


def test_parse_range() -> None:
    assert parse_range("5-8") == (5, 8)
    assert parse_range("7") == (7, 7)
    for bad in ("", "8-5", "0-2", "a-b", "3-"):
        with pytest.raises(UserError, match="--profile"):
            parse_range(bad)


def _train(profiler: StepProfiler | NullProfiler, steps: int, start: int = 0) -> None:
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with profiler:
        for step in range(start + 1, steps + 1):
            with torch.profiler.record_function(f"train_step_{step}"):
                loss = model(torch.randn(8, 32)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
            profiler.step()


def test_trace_holds_exactly_the_asked_steps(tmp_path: Path) -> None:
    _train(StepProfiler(3, 4, tmp_path, rank=0), steps=6)
    traces = list(tmp_path.glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1
    names = {e.get("name") for e in json.loads(traces[0].read_text())["traceEvents"]}
    assert {"train_step_3", "train_step_4"} <= names
    assert not names & {"train_step_1", "train_step_2", "train_step_5", "train_step_6"}
    assert "aten::" in (tmp_path / "summary_rank0.txt").read_text()


def test_first_step_and_resumed_runs(tmp_path: Path) -> None:
    _train(StepProfiler(1, 1, tmp_path / "a", rank=0), steps=2)  # no warm-up step exists before step 1
    assert list((tmp_path / "a").glob("*.pt.trace.json"))
    _train(StepProfiler(12, 12, tmp_path / "b", rank=1, start_step=10), steps=13, start=10)
    names = {
        e.get("name") for e in json.loads(next((tmp_path / "b").glob("rank1.*")).read_text())["traceEvents"]
    }
    assert "train_step_12" in names and "train_step_11" not in names


def test_make_profiler_skips_ranges_outside_the_run(tmp_path: Path) -> None:
    said: list[str] = []
    assert isinstance(
        make_profiler("5-8", False, tmp_path, 0, start_step=10, max_steps=20, say=said.append), NullProfiler
    )
    assert "not profiling" in said[0]
    assert isinstance(make_profiler(None, False, tmp_path, 0, 0, 20, said.append), NullProfiler)


def test_flops_profiler_section_counts_steps_like_deepspeed(tmp_path: Path) -> None:
    section = flops_profiler_config("5-8", tmp_path)
    assert section["enabled"] and section["profile_step"] == 4  # DeepSpeed counts finished steps
    assert section["output_file"].endswith("profile/flops_profiler.txt")
    assert flops_profiler_config(None, tmp_path)["profile_step"] == 1
