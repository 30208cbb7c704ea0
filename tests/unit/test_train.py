"""llm_train/train.py, the entry point: every shipped recipe and DeepSpeed config dry-runs, and bad
input is one line on stderr, exit code 2, no traceback, nothing written.

The refusals run train.main in this process: a fresh interpreter per case (`python llm_train/train.py`)
cost its imports each (1.3 s on a quiet 2-core machine, 11-23 s on a loaded one) for what main() decides. That the
script itself turns main()'s 2 into its exit code with one line and no traceback is shown once, by a
fresh process: tests/unit/test_parallel.py's test_entry_point_reports_one_line_and_exit_2.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from llm_train import train

Refused = Callable[[list[str], str], str]


@pytest.fixture
def refused(capsys: pytest.CaptureFixture[str]) -> Refused:
    """train.main(ARGS) refuses in one line naming MESSAGE, exit 2; the environment as it was before."""

    def check(args: list[str], message: str) -> str:
        environ = dict(os.environ)  # a refusal may come after the single-process set-up wrote to it
        try:
            code = train.main(args)
        finally:
            os.environ.clear()
            os.environ.update(environ)
        err = capsys.readouterr().err
        assert code == 2, (code, err)
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("llm-train: error:") and message in lines[0], err
        return lines[0]

    return check


def test_unknown_recipe(refused: Refused) -> None:
    line = refused(["--recipe", "nope", "--dry-run"], "unknown recipe 'nope'")
    assert "tiny-cpu" in line and "7b-zero3" in line


def test_mistyped_key(refused: Refused) -> None:
    refused(
        ["--recipe", "tiny-cpu", "--dry-run", "optim.lrr=1e-3"], "unknown key 'optim.lrr'; did you mean 'lr'?"
    )


def test_wrong_type(refused: Refused) -> None:
    refused(["--recipe", "tiny-cpu", "--dry-run", "optim.micro_batch_size=two"], "optim.micro_batch_size")


def test_missing_ds_config(tmp_path: Path, refused: Refused) -> None:
    refused(["--recipe", "tiny-cpu", "--dry-run", "--ds-config", str(tmp_path / "x.json")], "file not found")


def test_unparsable_ds_config(tmp_path: Path, refused: Refused) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    refused(["--recipe", "tiny-cpu", "--dry-run", "--ds-config", str(bad)], "not valid JSON at line 1")


def test_batch_that_does_not_divide(refused: Refused) -> None:
    refused(
        ["--recipe", "tiny-cpu", "--dry-run", "optim.global_batch_size=20", "optim.grad_accum=null"],
        "optim.global_batch_size=20 is not divisible by optim.micro_batch_size=8 x data-parallel size 2 = 16",
    )


def test_output_dir_holding_another_run(tmp_path: Path, refused: Refused) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    before = sorted(p.name for p in run_dir.rglob("*"))
    refused(
        ["--recipe", "tiny-cpu", "--output-dir", str(run_dir), "--max-steps", "1"],
        "already holds a run; pass --overwrite",
    )
    assert sorted(p.name for p in run_dir.rglob("*")) == before


def test_data_file_missing(tmp_path: Path, refused: Refused) -> None:
    run_dir = tmp_path / "run"
    refused(
        [
            "--recipe",
            "tiny-cpu",
            "--output-dir",
            str(run_dir),
            "--max-steps",
            "1",
            f"data.train=[{tmp_path / 'none.txt'}]",
        ],
        "data.train: file not found",
    )
    assert not run_dir.exists()  # nothing half-written


def test_world_size_without_dry_run(refused: Refused) -> None:
    refused(["--recipe", "tiny-cpu", "--world-size", "4"], "--world-size only applies to --dry-run")


@pytest.mark.parametrize(
    "recipe", sorted(p.stem for p in Path(__file__).resolve().parents[2].joinpath("recipes").glob("*.yaml"))
)
def test_every_recipe_dry_runs_as_declared(recipe: str, capsys: pytest.CaptureFixture[str]) -> None:
    from llm_train.train import main

    assert main(["--recipe", recipe, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "# parallel plan" in out and "world size" in out
    effective = out.split("(effective)\n", 1)[1].split("\n\n# parallel plan", 1)[0]
    assert '"auto"' not in effective
    json.loads(effective)


def test_7b_zero3_at_world_size_8(capsys: pytest.CaptureFixture[str]) -> None:
    from llm_train.train import main

    assert main(["--recipe", "7b-zero3", "--dry-run", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "world size   8 = dp 8 x tp 1 x pp 1" in out
    assert "ZeRO stage   3" in out
    assert "GPU total" in out


@pytest.mark.parametrize(
    "ds", sorted(p.stem for p in Path(__file__).resolve().parents[2].joinpath("ds_configs").glob("*.json"))
)
def test_every_ds_config_dry_runs(ds: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from llm_train.train import main

    nvme = [f"deepspeed.nvme_path={tmp_path}"] if "nvme" in ds else []  # the drive is the user's to name
    assert main(["--recipe", "tiny-cpu", "--ds-config", ds, "--dry-run", *nvme]) == 0
    assert "# parallel plan" in capsys.readouterr().out


@pytest.mark.parametrize("size", ["0", "-2"])
def test_a_dry_run_for_fewer_than_one_process_is_refused(
    size: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from llm_train import train

    assert train.main(["--recipe", "tiny-cpu", "--dry-run", "--world-size", size]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"llm-train: error: --world-size {size}: plan for at least 1 process (or leave it out)"
