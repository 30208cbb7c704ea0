"""Every recipe option that works under pipeline parallelism (pp=2), set together in two real runs.

The table (tests/unit/pipeline_options.py) classifies every recipe key; the unit tier checks it is
complete and that the refused options are refused in one line. Here the "works" options train in two
real 2-process runs (two, because some of them exclude each other).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import assert_ok, launch, read_metrics
from tests.unit.pipeline_options import OPTIONS, RUN_A, RUN_B

pytestmark = pytest.mark.e2e


def _overrides(run: str, values: dict[str, str]) -> list[str]:
    return [o[1].format(**values) for o in OPTIONS.values() if o[0] == run]


def test_every_other_option_works_in_a_real_two_stage_run(pretrained: Path, tmp_path: Path) -> None:
    from llm_train import ASSETS_DIR

    values = {
        "pretrained": str(pretrained),
        "tokenizer": str(ASSETS_DIR / "tiny" / "tokenizer"),
        "corpus": str(ASSETS_DIR / "tiny" / "corpus.txt"),
        "cache": str(tmp_path / "cache"),
        "run_dir": str(tmp_path / "a"),
    }
    common = ["--recipe", "tiny-cpu-pp2"]
    a = common + _overrides(RUN_A, values) + ["--profile", "2-3"]
    assert_ok(launch(a))
    run_a = tmp_path / "a"
    rows = read_metrics(run_a)
    trained = [r for r in rows if "loss" in r]
    assert [r["step"] for r in trained] == [1, 2, 3, 4]
    # The same metrics and eval lines as the ZeRO engine's (one loop writes both).
    assert {"lr", "grad_norm", "tokens_per_s", "skipped_microbatches", "overflow_skipped_steps"} <= set(
        trained[-1]
    )
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4]
    assert (run_a / "startup.json").is_file()
    assert any((run_a / "profile").iterdir())  # --profile traced steps 2-3
    assert (run_a / "tensorboard").is_dir() and (run_a / "wandb").is_dir()
    assert sorted(p.name for p in (run_a / "checkpoints").glob("step-*")) == [
        "step-00000002",
        "step-00000004",
    ]
    config = json.loads((run_a / "final" / "config.json").read_text())
    assert config["rms_norm_eps"] == 1e-5 and config["dtype"] == "bfloat16"

    values["run_dir"] = str(tmp_path / "b")
    b = common + _overrides(RUN_B, values) + ["--output-dir", str(tmp_path / "b"), "optim.max_steps=null"]
    assert_ok(launch(b))
    run_b = tmp_path / "b"
    steps = [r["step"] for r in read_metrics(run_b) if "loss" in r]
    assert steps and steps == list(range(1, len(steps) + 1))  # optim.epochs decided the length
    assert not (run_b / "checkpoints").exists() or not any(
        (run_b / "checkpoints").glob("step-*")
    )  # at_end=false
    assert (run_b / "final" / "config.json").is_file()
