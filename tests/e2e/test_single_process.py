"""`python llm_train/train.py --recipe tiny-cpu` runs as one process, no launcher needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import assert_ok, losses, train_py

pytestmark = pytest.mark.e2e


def test_plain_python_is_a_world_of_one(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = train_py(
        ["--recipe", "tiny-cpu", "--output-dir", str(run_dir), "--max-steps", "3", "output.log_every=1"]
    )
    assert_ok(result)
    world = json.loads((run_dir / "world.json").read_text())
    assert world["world_size"] == 1 and world["ranks"][0]["rank"] == 0
    assert sorted(losses(run_dir)) == [1, 2, 3]
    assert "exported" in result.stdout and "sample:" in result.stdout
