"""GPUs the planner knows by name: memory, bf16 support and peak dense tensor throughput.

Used by `llm-train plan --gpu NAME` (memory and bf16), by the planner's speed model and
by MFU reporting (peak TFLOP/s). Pure data, no torch import.

Memory is what `nvidia-smi` reports as total (MiB / 1024), not the marketing number:
an "A10 24 GB" has 22.5 GiB, and that is what has to hold the training run.

`peak_tflops` is the dense (no 2:4 sparsity) 16-bit tensor-core throughput with fp32
accumulation, from NVIDIA's data sheets / architecture whitepapers: bf16 where the card
has it, else fp16 (the precision such a card trains in). GeForce cards run fp32
accumulation at half the fp16-accumulate rate; training uses fp32 accumulation, so
their number is the lower one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llm_train.errors import UserError


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_gib: float
    bf16: bool
    peak_tflops: float
    """Dense 16-bit tensor TFLOP/s (bf16, or fp16 where bf16 is missing), fp32 accumulate."""
    compute_capability: tuple[int, int]
    nvlink: bool = False
    """GPUs of one node talk over NVLink (SXM boards); else PCIe."""
    aliases: tuple[str, ...] = ()


GPUS: tuple[GPUSpec, ...] = (
    GPUSpec("RTX 2080 Ti", 11264 / 1024, False, 53.8, (7, 5), aliases=("2080ti", "rtx2080ti")),
    GPUSpec("RTX 3090", 24576 / 1024, True, 71.0, (8, 6), aliases=("3090", "rtx3090")),
    GPUSpec("RTX 4090", 24564 / 1024, True, 165.2, (8, 9), aliases=("4090", "rtx4090")),
    GPUSpec("RTX 5090", 32607 / 1024, True, 209.5, (12, 0), aliases=("5090", "rtx5090")),
    GPUSpec("T4", 15360 / 1024, False, 65.0, (7, 5), aliases=("teslat4",)),
    GPUSpec("V100", 32768 / 1024, False, 125.0, (7, 0), nvlink=True, aliases=("v10032gb", "teslav100")),
    GPUSpec("A10", 23028 / 1024, True, 125.0, (8, 6), aliases=("a10g",)),
    GPUSpec("L4", 23034 / 1024, True, 121.0, (8, 9)),
    GPUSpec("L40S", 46068 / 1024, True, 362.0, (8, 9)),
    GPUSpec("A100-40GB", 40960 / 1024, True, 312.0, (8, 0), nvlink=True, aliases=("a10040", "a10040gb")),
    GPUSpec(
        "A100-80GB", 81920 / 1024, True, 312.0, (8, 0), nvlink=True, aliases=("a100", "a10080", "a10080gb")
    ),
    GPUSpec("H100", 81559 / 1024, True, 989.0, (9, 0), nvlink=True, aliases=("h10080gb", "h100sxm")),
    GPUSpec("H200", 143771 / 1024, True, 989.0, (9, 0), nvlink=True, aliases=("h200sxm",)),
)


def _key(text: str) -> str:
    # "NVIDIA GeForce RTX 4090" / "rtx-4090" / "RTX4090" all compare equal.
    text = text.lower()
    for noise in ("nvidia", "geforce", "tesla", "pcie", "sxm5", "sxm4", "sxm2", "hbm3", "hbm2e"):
        text = text.replace(noise, "")
    return re.sub(r"[^a-z0-9]", "", text)


def find_gpu(name: str) -> GPUSpec | None:
    """The table entry for a user-typed or driver-reported name, or None."""
    key = _key(name)
    for spec in GPUS:
        if key == _key(spec.name) or key in spec.aliases:
            return spec
    # Driver names carry extra words ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3").
    for spec in sorted(GPUS, key=lambda s: -len(_key(s.name))):
        if _key(spec.name) in key:
            return spec
    if "a100" in key:
        return find_gpu("A100-80GB" if "80" in key else "A100-40GB")
    return None


def gpu_spec(name: str) -> GPUSpec:
    """Like find_gpu, but an unknown name is a one-line UserError listing the known ones."""
    spec = find_gpu(name)
    if spec is None:
        known = ", ".join(s.name.replace(" ", "-") for s in GPUS)
        raise UserError(f"--gpu {name}: unknown GPU; known: {known}; or give its memory with --gpu-mem GIB")
    return spec


def peak_tflops(name: str) -> float | None:
    """Dense 16-bit peak TFLOP/s of a GPU by (driver) name; None when unknown. For MFU."""
    spec = find_gpu(name)
    return spec.peak_tflops if spec else None
