"""bench/overhead.py vs-hf compares the two steps only over the seconds both were training, past warm-up."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench import overhead as bench

WARMUP = 5


def contender(name: str, start: float, step_s: float, cpu_per_step: float, steps: int) -> Any:
    """A launch whose row k appeared at start + k * step_s, having used k * cpu_per_step CPU seconds."""
    c = bench.Contender(name, Path("unused"), SimpleNamespace(returncode=None))  # type: ignore[arg-type]
    for k in range(1, steps + 1):
        # llm_train's rows carry elapsed_s (its meter's clock); the peer's carry the interval itself.
        row = {"step": k, "loss": 8.0, "elapsed_s": k * step_s, "step_time_s": step_s}
        c.rows.append(row)
        c.seen_at.append((start + k * step_s, k * cpu_per_step))
    return c


def test_only_the_steps_both_trained_in_count() -> None:
    # llm_train logs from t=10.1 to 20 (0.1 s steps); the Trainer from t=14.23 to 34.03 (0.2 s steps).
    ours = contender("llm_train", 10.0, 0.1, 0.05, 100)
    theirs = contender("hf_trainer", 14.03, 0.2, 0.08, 100)
    got = bench.measure([ours, theirs], WARMUP)
    # The window: from the Trainer's warm-up end (t = 14.03 + 5 * 0.2 = 15.03) to llm_train's last row
    # (t = 20): llm_train's rows 51..100 (49 intervals), the Trainer's rows 5..29 (24 intervals).
    assert got["llm_train"]["steps"] == 49
    assert got["hf_trainer"]["steps"] == 24
    assert got["llm_train"]["wall_s"] == pytest.approx(0.1)
    assert got["hf_trainer"]["wall_s"] == pytest.approx(0.2)
    assert got["llm_train"]["cpu_s"] == pytest.approx(0.05)
    assert got["hf_trainer"]["cpu_s"] == pytest.approx(0.08)


def test_launches_that_barely_overlap_are_refused() -> None:
    ours = contender("llm_train", 10.0, 0.1, 0.05, 40)  # ends at t = 14
    theirs = contender("hf_trainer", 13.0, 0.1, 0.05, 40)  # warm-up ends at t = 13.5
    with pytest.raises(RuntimeError, match="raise --steps"):
        bench.measure([ours, theirs], WARMUP)
