"""Real 2-process DeepSpeed on CPU: every ZeRO stage trains tiny-cpu, sees the true world, exports.

The session fixture `runs` (conftest.py) launches each variant once; the tests read its run directory.
The runs fine-tune one saved tiny model (from_pretrained on a local directory: the real
fine-tuning path; under ZeRO-3 it is loaded inside zero.Init, already partitioned).
Parity: fp32, same weights and data, so ZeRO-1/2/3 must reproduce ZeRO-0's per-step losses
(partitioning changes where numbers live, not what they are; 1e-4 leaves room for the
different reduction order of bucketed all-reduce vs reduce-scatter). The offload variants
step DeepSpeed's CPU Adam instead of torch's AdamW: the same update (decoupled weight
decay, the recipe's betas and eps), so the same losses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.reference import STEPS, TIMEOUT_MINUTES, VARIANTS
from tests.helpers import losses

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("variant", VARIANTS)
def test_loop_saw_the_true_world(runs: dict[str, Path], variant: str) -> None:
    world = json.loads((runs[variant] / "world.json").read_text())
    assert world["world_size"] == 2
    assert sorted(r["rank"] for r in world["ranks"]) == [0, 1]
    assert all(r["world_size"] == 2 for r in world["ranks"])
    assert sorted(r["dp_rank"] for r in world["ranks"]) == [0, 1]
    # deepspeed.timeout_minutes, as the gloo backend of each rank's process group holds it
    assert [r["pg_timeout_s"] for r in world["ranks"]] == [TIMEOUT_MINUTES * 60.0] * 2


@pytest.mark.parametrize("variant", VARIANTS)
def test_run_directory_contract(runs: dict[str, Path], variant: str) -> None:
    run_dir = runs[variant]
    ds = (run_dir / "config" / "ds_config.json").read_text()
    assert '"auto"' not in ds
    assert json.loads(ds)["zero_optimization"]["stage"] == int(variant[4])
    assert (run_dir / "config" / "recipe.yaml").is_file()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in (m for m in metrics if "loss" in m):
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(row)
        assert row["tokens_per_s"] > 0 and row["grad_norm"] == row["grad_norm"]  # not NaN
    steps = losses(run_dir)
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert steps[STEPS] < steps[1] - 0.3, steps


@pytest.mark.parametrize("variant", VARIANTS)
def test_final_is_a_plain_hf_model(runs: dict[str, Path], variant: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    final = runs[variant] / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    assert sum(p.numel() for p in model.parameters()) > 1_000_000  # not an empty ZeRO-3 save
    with torch.no_grad():
        logits = model(torch.arange(16).view(1, 16)).logits
    assert logits.shape == (1, 16, 4096) and torch.isfinite(logits).all()


@pytest.mark.parametrize("variant", ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"])
def test_parity_with_zero0(runs: dict[str, Path], variant: str) -> None:
    reference, candidate = losses(runs["zero0"]), losses(runs[variant])
    for step in range(1, STEPS + 1):
        assert candidate[step] == pytest.approx(reference[step], abs=1e-4), (step, reference, candidate)
