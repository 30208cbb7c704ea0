"""bench/mfu_matrix.sh, the GPU speed matrix, works end to end before device time is spent on it.

`--cpu-tiny` runs every variant the H200 runs (llm_train with each switch, the Hugging Face Trainer on
the same job) with the tiny model on CPU: the data generation, one launch per variant, the medians,
the checks against the baseline, the choice of the best combination and the target lines. It is also
the suite's one real training run with `memory.torch_compile=layers` (and the HF Trainer's first losses
equal llm_train's: the two runs really are the same job).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
VARIANTS = [
    "baseline",
    "document_aware",
    "hf_trainer",
    "liger",
    "liger_compile",
    "best_micro8",
    "full_baseline",
    "full_best",
    "compile_model",
]
TARGETS = ["target_mfu", "target_vs_hf_trainer"]


def matrix(out: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "bench/mfu_matrix.sh", "--cpu-tiny", "--out", str(out), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_lines(out: Path) -> dict[str, dict]:
    lines = [json.loads(line) for line in (out / "mfu_matrix.jsonl").read_text().splitlines()]
    return {line["measurement"]: line for line in lines}


def test_cpu_tiny_matrix_runs_every_variant_and_judges_it(tmp_path: Path) -> None:
    result = matrix(tmp_path, timeout=1800)
    output = (result.stdout + result.stderr)[-4000:]
    by_name = read_lines(tmp_path)
    assert list(by_name) == ["predictions", *VARIANTS, *TARGETS], output
    # The predictions come first, before any launch; a CPU has none to make.
    assert set(by_name["predictions"]["predicted_step_time_s"]) == set(VARIANTS)

    # Every variant passed its checks, or is skipped for a stated reason: Liger needs CUDA, and without
    # it `liger` is document_aware again; compile_model is left to GPUs.
    skipped = {n: r["skipped"] for n, r in by_name.items() if r.get("passed") is None and n in VARIANTS}
    assert set(skipped) == {"liger", "compile_model"}, skipped
    assert [n for n in VARIANTS if n not in skipped and by_name[n]["passed"] is not True] == [], output
    base = by_name["baseline"]
    for name in ("document_aware", "hf_trainer", "liger_compile"):
        assert by_name[name]["checks"]["exact"] is True, by_name[name]
        assert len(by_name[name]["first_losses"]) == 3
    # The HF Trainer on the same rows, weights and optimizer: its first loss is llm_train's (fp32 on CPU).
    assert by_name["hf_trainer"]["first_losses"][0] == pytest.approx(base["first_losses"][0], rel=1e-5)
    compiled = by_name["liger_compile"]
    assert compiled["switches"] == ["memory.attention=auto", "memory.torch_compile=layers"], compiled
    assert compiled["dropped"] == ["memory.liger_kernels=true (needs CUDA)"]
    assert any(n.startswith("torch.compile on (each decoder layer") for n in compiled["notices"]), compiled
    # Its first step compiled the layer: longer than an uncompiled run's first-step warm-up.
    assert compiled["compile_s"] > by_name["document_aware"]["compile_s"], compiled
    assert by_name["document_aware"]["kernel"].startswith("sdpa (auto -> sdpa: on CPU"), by_name[
        "document_aware"
    ]
    # MFU both ways: packed rows span less than the row, full-length rows the whole row.
    assert base["attention_span"] < 128 and base["mfu"] < base["mfu_seq_len"], base
    full = by_name["full_baseline"]
    assert full["attention_span"] == 128 and full["mfu"] == pytest.approx(full["mfu_seq_len"]), full
    # The best combination: the fastest exact one of the three candidates, then at the larger micro-batch.
    candidates = [by_name[n] for n in ("document_aware", "liger_compile")]
    fastest = max(candidates, key=lambda r: r["tokens_per_s"])
    assert by_name["best_micro8"]["switches"] == fastest["switches"] == by_name["full_best"]["switches"]
    assert by_name["best_micro8"]["micro_batch"] == 2 * base["micro_batch"]

    # The targets: no CPU reaches 45% of a nominal 1 TFLOP/s, so the matrix fails on that line (exit 1).
    assert by_name["target_mfu"]["passed"] is False and by_name["target_mfu"]["best"] in VARIANTS
    ratio = by_name["target_vs_hf_trainer"]
    assert ratio["ratio"] == pytest.approx(ratio["tokens_per_s"] / ratio["hf_trainer_tokens_per_s"], rel=1e-3)
    assert result.returncode == 1, output
    summary = json.loads((tmp_path / "mfu_matrix_summary.json").read_text())
    assert "target_mfu" in summary["failed"] and set(summary["failed"]) <= set(TARGETS), summary
    # The device tool brings back at most 8 files from $OUT: the matrix writes three.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "mfu_matrix.jsonl",
        "mfu_matrix.log",
        "mfu_matrix_summary.json",
    ]


def test_a_variant_the_budget_leaves_no_time_for_is_a_failed_line_and_exit_1(tmp_path: Path) -> None:
    result = matrix(tmp_path, "--only", "baseline", "full_baseline", "--budget-s", "1", timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    by_name = read_lines(tmp_path)
    assert list(by_name) == ["predictions", "baseline", "full_baseline", *TARGETS]
    assert all(by_name[n]["passed"] is False and by_name[n]["error"].startswith("not run:") for n in by_name
               if n in ("baseline", "full_baseline")), by_name  # fmt: skip
