"""`llm-train report`: PNGs and a markdown summary from metrics.jsonl, several runs on one plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from llm_train.cli import main as cli_main
from llm_train.errors import UserError
from llm_train.observability.run_report import load_run, make_report, summary_rows

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(path: Path, steps: int = 20, speed: float = 1000.0, cuda: bool = False) -> Path:
    path.mkdir(parents=True)
    rows = []
    for step in range(1, steps + 1):
        row = {
            "step": step,
            "loss": 5.0 / math.sqrt(step),
            "lr": 3e-4 * min(1.0, step / 5),
            "grad_norm": 1.0,
            "tokens_per_s": speed * (0.5 if step == 1 else 1.0),  # warm-up
            "tokens_per_s_per_gpu": speed / 2,
            "step_time_s": 2048 / speed,
            "mfu": 0.4,
            "host_rss_gib": 1.0 + step / 100,
            "elapsed_s": step * 2.0,
        }
        if cuda:
            row.update(gpu_mem_peak_gib=10.0 + step / 10, gpu_mem_reserved_gib=12.0)
        rows.append(row)
        if step % 10 == 0:
            rows.append(
                {
                    "step": step,
                    "eval_loss": 4.0 / math.sqrt(step),
                    "eval_ppl": math.exp(4.0 / math.sqrt(step)),
                }
            )
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "startup.json").write_text(
        json.dumps({"total_s": 12.5, "phases_s": {"imports": 5.0, "first step": 7.5}})
    )
    return path


def test_one_run_writes_pngs_and_summary(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run")
    summary, images = make_report([run])
    assert summary == run / "report" / "report.md"
    assert {p.name for p in images} == {"loss.png", "lr.png", "throughput.png", "mfu.png", "memory.png"}
    for image in images:
        assert image.read_bytes().startswith(PNG_MAGIC) and image.stat().st_size > 5000
    text = summary.read_text()
    assert "| run | steps | final loss |" in text and "![loss](loss.png)" in text
    assert "12.5s = imports 5.0s, first step 7.5s" in text


def test_summary_numbers_skip_the_warm_up_row(tmp_path: Path) -> None:
    row = summary_rows(load_run(_write_run(tmp_path / "a", cuda=True)))
    assert row["tokens/s"] == "1,000"  # the first logged row ran at half speed and is left out
    assert row["steps"] == "20" and row["MFU"] == "40.0%"
    assert row["best eval loss"].endswith("@ 20") and row["peak GPU mem (GiB)"] == "12.00"
    assert row["train time"] == "40s"  # 20 steps of 2 s in one launch


def test_a_resumed_runs_train_time_counts_every_launch(tmp_path: Path) -> None:
    # Launch 1 logged steps 1-12 (elapsed 2-24 s) and was killed; the resume truncated the rows after its
    # step-10 checkpoint and logged steps 11-20 with elapsed counted from its own start (3-30 s).
    run = _write_run(tmp_path / "run")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        if row["step"] > 10 and "elapsed_s" in row:
            row["elapsed_s"] = (row["step"] - 10) * 3.0
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert summary_rows(load_run(run))["train time"] == "50s"  # 20 s before the resume + 30 s after, not 30


def test_several_runs_compare_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _write_run(tmp_path / "zero2" / "run", speed=1000.0)
    b = _write_run(tmp_path / "zero3" / "run", speed=800.0, cuda=True)
    out = tmp_path / "cmp"
    assert cli_main(["report", str(a), str(b), "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "zero2/run" in text and "zero3/run" in text  # same-named run dirs get distinct labels
    assert "wrote" in capsys.readouterr().out
    assert (out / "memory.png").is_file()


def test_partial_last_line_is_tolerated_and_bad_input_is_one_line(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run", steps=3)
    with (run / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 4, "lo')  # killed mid-write
    assert len(load_run(run).train) == 3
    with pytest.raises(UserError, match="no metrics.jsonl"):
        make_report([tmp_path])
    assert cli_main(["report", str(tmp_path / "missing")]) == 2


def test_recipes_table_has_the_layout_columns(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:7] == ["recipe", "model", "ZeRO/TP/PP/SP", "GPUs", "VRAM", "host", "RAM"]
    tiny = next(line for line in lines if line.startswith("tiny-cpu "))
    assert "3/1/1/1" in tiny and "none (cpu x2)" in tiny and "2 GiB" in tiny
    sp = next(line for line in lines if line.startswith("8b-128k-sp8 "))
    assert "3/1/1/8" in sp


def test_a_grpo_run_plots_reward_per_function_length_kl_clip_and_entropy(tmp_path: Path) -> None:
    """GRPO's metrics under TRL's names (runtime/rl/): the report adds a plot for each group it finds."""
    run = _write_run(tmp_path / "grpo", steps=4)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        if "loss" in row:
            row.update(
                {
                    "reward": 0.2 * row["step"],
                    "rewards/format/mean": 0.1 * row["step"],
                    "rewards/correct/mean": 0.3,
                    "completions/mean_length": 12.0,
                    "completions/max_length": 16.0,
                    "kl": 0.01,
                    "clip_ratio/low_mean": 0.0,
                    "clip_ratio/high_mean": 0.02,
                    "clip_ratio/region_mean": 0.02,
                    "entropy": 2.5,
                }
            )
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, images = make_report([run])
    names = {p.name for p in images}
    assert {"reward.png", "completion_length.png", "kl.png", "clip_ratio.png", "entropy.png"} <= names
    plain = _write_run(tmp_path / "lm", steps=4)
    assert not {p.name for p in make_report([plain])[1]} & {"reward.png", "kl.png"}  # only GRPO runs get them
