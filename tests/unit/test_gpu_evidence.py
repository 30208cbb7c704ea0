"""config/gpu_evidence.py: a CUDA run names the parts of it no GPU check has run; a CPU run names none."""

from __future__ import annotations

import json

from llm_train import train
from llm_train.config import gpu_evidence
from llm_train.config.resolution import resolve_run
from tests.helpers import REPO


def _unverified(recipe: str, overrides: list[str], world_size: int = 1) -> list[str]:
    run = resolve_run(recipe, overrides, world_size=world_size)
    return gpu_evidence.unverified_on_gpu(run.recipe, run.layout)


def test_what_the_first_gpu_check_ran_is_not_flagged_and_each_other_part_is() -> None:
    ran = ["memory.attention=sdpa", "memory.activation_checkpointing=false", "memory.tiled_loss=false"]
    assert _unverified("1b-zero2", ran) == []  # ZeRO-2, bf16, sdpa, full fine-tune: the H200 check's run
    assert _unverified("1b-zero2", [*ran, "memory.torch_compile=layers"]) == ["torch.compile (layers)"]
    # The H100 check of 2026-12-06 ran document-aware attention and Liger's kernels.
    assert _unverified("1b-zero2", [*ran, "memory.attention=sdpa_flex", "memory.liger_kernels=true"]) == []
    assert _unverified("1b-zero2", [*ran, "memory.activation_checkpointing=true"]) == [
        "activation checkpointing"
    ]
    assert _unverified("1b-zero2", ran, world_size=2) == ["more than one GPU (NCCL)"]
    lora = _unverified("8b-lora-rtx4090", ["memory.attention=sdpa"])
    assert "LoRA adapters" in lora and "ZeRO-2" not in lora
    assert "QLoRA nf4 base" in _unverified("8b-qlora-rtx4070", ["memory.attention=sdpa"])
    assert "optimizer offload to NVMe" in _unverified("8b-rtx4090-nvme", ["memory.attention=sdpa"])


def test_a_cpu_run_has_no_such_line_since_the_suite_runs_every_part_there() -> None:
    run = resolve_run("tiny-cpu", [], world_size=2)
    assert gpu_evidence.unverified_line(run.recipe, run.layout) is None


def _measured(evidence: str, measurement: str) -> dict:
    lines = [json.loads(line) for line in (REPO / evidence).read_text().splitlines() if line.strip()]
    (shown,) = [line for line in lines if line["measurement"] == measurement]
    return shown


def test_every_part_listed_as_ran_on_a_gpu_points_at_a_passed_line_of_a_committed_result() -> None:
    for part, (evidence, measurement) in gpu_evidence.RAN_ON_GPU.items():
        assert _measured(evidence, measurement)["passed"] is True, part


def test_every_failure_listed_points_at_a_failed_line_that_ran_exactly_those_parts() -> None:
    names = {
        "memory.liger_kernels=true": "Liger kernels",
        "memory.torch_compile=layers": "torch.compile (layers)",
    }
    for parts, evidence, measurement, saw in gpu_evidence.FAILED_ON_GPU:
        shown = _measured(evidence, measurement)
        # exit 3: llm_train's non-finite-loss stop, after the 2 steps it logged (the log's last line: step 3).
        assert shown["passed"] is False and shown["error"].startswith("exit 3 after 2 of"), shown
        assert "step 3" in saw
        assert {names[s] for s in shown["switches"] if s in names} == parts


def test_a_run_of_parts_that_failed_together_on_a_gpu_says_so_and_one_of_them_alone_does_not() -> None:
    both = resolve_run("1b-zero2", ["memory.liger_kernels=true", "memory.torch_compile=layers"], world_size=1)
    line = gpu_evidence.failed_line(both.recipe, both.layout)
    assert line is not None and "Liger kernels with torch.compile (layers)" in line and "step 3" in line
    alone = resolve_run("1b-zero2", ["memory.liger_kernels=true"], world_size=1)
    assert gpu_evidence.failed_line(alone.recipe, alone.layout) is None
    cpu = resolve_run("tiny-cpu", ["memory.torch_compile=layers"], world_size=1)
    assert gpu_evidence.failed_line(cpu.recipe, cpu.layout) is None  # the suite runs it on CPU


def test_the_dry_run_says_which_parts_are_unverified_in_one_line(capsys) -> None:  # type: ignore[no-untyped-def]
    train.print_dry_run(resolve_run("8b-lora-rtx4090", ["memory.attention=sdpa"], world_size=1))
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.lstrip().startswith("unverified")]
    assert "LoRA adapters" in line and "optim.max_steps=20" in line
