"""bench/consumer_check.sh, the consumer-card GPU check, works end to end before device time is spent.

`--cpu-tiny` runs the same script as on the H200 (a base written with save_pretrained, the QLoRA and
LoRA recipes through the capped wrapper, the finished runs' merged export and its verification, the
stopped run, one JSON line per case with its planner estimate and verdicts) with the tiny model on CPU.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.optional import import_or_skip

pytestmark = pytest.mark.e2e
import_or_skip("bitsandbytes")

REPO = Path(__file__).resolve().parents[2]


def test_cpu_tiny_consumer_check_runs_every_case(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", "bench/consumer_check.sh", "--cpu-tiny", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    output = (result.stdout + result.stderr)[-4000:]
    assert result.returncode == 0, output
    records = [json.loads(line) for line in (tmp_path / "consumer_check.jsonl").read_text().splitlines()]
    assert [r["measurement"] for r in records] == ["qlora_12", "lora_24", "qlora_16"], output
    for record in records:
        assert record["passed"] and record["steps"] == 4, record
        assert record["config"].startswith("QLoRA (nf4 base)" if "qlora" in record["recipe"] else "LoRA r=16")
        # The verdicts are computed on CPU too, only not enforced there (a tiny model's memory means nothing).
        assert record["verdicts_enforced"] is False and {"gpu_vs_planner", "host_vs_planner"} <= set(
            record["checks"]
        )
        assert record["host_pss_peak_gib"] > 0 and record["tokens_per_s"] > 0
    finished = [r for r in records if r["finish"]]
    assert [r["measurement"] for r in finished] == ["qlora_12", "lora_24"]
    # The finished runs exported a merged model written shard by shard and verified it.
    assert all(r["export_verified"] and r["export_reported_host_peak_gib"] is not None for r in finished)
    summary = json.loads((tmp_path / "consumer_check_summary.json").read_text())
    assert summary["passed"] and set(summary["cases"]) == {"qlora_12", "lora_24", "qlora_16"}
