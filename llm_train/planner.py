"""`llm-train plan`: will this recipe fit my GPUs and host RAM, and if not, what is the cheapest fix?

    llm-train plan --recipe 7b-rtx4090 --gpu-mem 24 --host-ram 128
    llm-train plan --recipe 7b-zero3 --gpus 8 --gpu H100
    llm-train plan --recipe auto --model meta-llama/Llama-3.1-8B --gpu RTX-4090 [--train]

The numbers come from `memory.estimate_memory` (per-GPU bytes, host RAM and NVMe per
node) and `speed.step_time` (a first-order step-time model used only to rank choices).
Nothing here loads weights or imports deepspeed; torch is imported only to detect GPUs
when none were named.

Fixes are searched, not listed from a script: every combination of activation
checkpointing, a smaller micro-batch (more accumulation, same global batch), ZeRO-3,
optimizer offload, parameter offload, NVMe offload and LoRA is estimated; those that fit
are ranked by estimated step time, and a combination is dropped when a subset of its
changes already fits at least as fast. Changes that alter what is trained (LoRA) are
ranked after those that train the same model.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llm_train.errors import UserError
from llm_train.gpus import GPUSpec, find_gpu, gpu_spec
from llm_train.memory import (
    ALLOCATOR_SLACK_FRACTION,
    DS_ALLGATHER_BUCKET_SIZE,
    DS_SUB_GROUP_SIZE,
    PROCESS_HOST_BYTES,
    GiB,
    MemoryEstimate,
    MemoryInputError,
    MemoryInputs,
    estimate_memory,
)
from llm_train.shapes import ModelShape, shape_from_config
from llm_train.speed import StepTime, step_time

# Keep 5% of GPU memory free beyond the estimate (which already counts allocator slack):
# the estimate claims +-15%, and an OOM at step 900 costs more than a slower step.
GPU_HEADROOM = 0.05
# The OS, page cache and everything else on the machine: never plan to use the last
# max(4 GiB, 5%) of host RAM.
HOST_RESERVE_BYTES = 4 * GiB
HOST_RESERVE_FRACTION = 0.05
# Host RSS of one CPU-only training process before model state (torch, DeepSpeed,
# transformers, tokenizer): ~0.7 GiB measured for tiny-cpu; no CUDA libraries.
CPU_PROCESS_HOST_BYTES = 1 * GiB
# Speed model stand-ins when the hardware's peak is unknown (only ratios matter there).
UNKNOWN_GPU_PEAK_TFLOPS = 100.0
CPU_PEAK_TFLOPS = 0.2
# The adapter rank the planner proposes when it suggests LoRA.
SUGGESTED_LORA_RANK = 16
# Candidate micro-batch sizes for `--recipe auto`.
AUTO_MICRO_BATCHES = (1, 2, 4, 8, 16, 32)

# (ZeRO stage, optimizer offload, parameter offload) -> the shipped ds_configs/ file.
SHIPPED_DS_CONFIGS: dict[tuple[int, str, str], str] = {
    (0, "none", "none"): "zero0",
    (1, "none", "none"): "zero1",
    (2, "none", "none"): "zero2",
    (3, "none", "none"): "zero3",
    (2, "cpu", "none"): "zero2_offload",
    (3, "cpu", "none"): "zero3_offload_optimizer",
    (3, "cpu", "cpu"): "zero3_offload",
    (3, "nvme", "nvme"): "zero3_offload_nvme",
}

# Rule-of-thumb speed cost of each change, printed beside the model's own estimate.
TYPICAL_COST = {
    "checkpointing": "recomputes the forward: ~+33% compute",
    "micro_batch": "smaller matmuls: ~0-15% slower",
    "zero3": "all-gathers weights every micro-batch: ~+10-30% on PCIe, little on NVLink",
    "offload_optimizer": "CPU Adam + PCIe traffic each step: ~1.2-2x slower step",
    "offload_params": "weights cross PCIe every pass: ~2-4x slower step",
    "nvme": "weights and optimizer stream from the drive: ~5-10x+ slower",
    "lora": "trains adapters, not all weights (a different fine-tune); faster step",
    # Changes that spend spare memory on speed (offered when the recipe already fits).
    "no_checkpointing": "no recompute in backward",
    "bigger_micro_batch": "fewer, larger micro-batches (and fewer weight fetches under offload)",
    "less_offload": "less partitioning / offload traffic",
}


# --- hardware -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    """What the run will have: devices (per GPU) and the host (per node)."""

    kind: str  # "cuda" | "cpu"
    name: str
    gpus: int  # processes in the world (GPUs, or CPU processes)
    gpus_per_node: int
    gpu_mem_bytes: int  # per GPU; 0 on CPU
    host_ram_bytes: int  # per node
    bf16: bool
    peak_tflops: float
    nvlink: bool = False
    compute_capability: tuple[int, int] | None = None
    sources: tuple[str, ...] = ()  # where the numbers came from, for the printout

    @property
    def host_limit_bytes(self) -> int:
        return int(self.host_ram_bytes - max(HOST_RESERVE_BYTES, HOST_RESERVE_FRACTION * self.host_ram_bytes))

    @property
    def gpu_limit_bytes(self) -> int:
        return int(self.gpu_mem_bytes * (1 - GPU_HEADROOM))

    def device(self) -> Any:
        from llm_train.plan import Device

        if self.kind == "cpu":
            return Device(kind="cpu", name="cpu", bf16=True)
        return Device(kind="cuda", name=self.name, bf16=self.bf16, compute_capability=self.compute_capability)

    def describe(self) -> str:
        if self.kind == "cpu":
            where = f"{self.gpus} CPU process(es)"
        else:
            bf16 = "bf16" if self.bf16 else "no bf16: fp16"
            where = f"{self.gpus} x {self.name} ({self.gpu_mem_bytes / GiB:.2f} GiB, {bf16})"
            if self.gpus > self.gpus_per_node:
                where += f" on {-(-self.gpus // self.gpus_per_node)} nodes"
        text = f"{where}; host RAM {self.host_ram_bytes / GiB:.2f} GiB per node"
        return text + (f"  [{'; '.join(self.sources)}]" if self.sources else "")


def _detected_gpus() -> tuple[int, str, int, bool, tuple[int, int]] | None:
    """(count, name, memory bytes, bf16, compute capability) of this machine's GPUs, or None."""
    import shutil

    if shutil.which("nvidia-smi") is None and not os.environ.get("CUDA_VISIBLE_DEVICES"):
        return None  # no NVIDIA driver tools: skip the 2 s torch import
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return (
        torch.cuda.device_count(),
        props.name,
        int(props.total_memory),
        bool(torch.cuda.is_bf16_supported()),
        (props.major, props.minor),
    )


def host_ram_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


def resolve_hardware(
    gpus: int | None = None,
    gpu: str | None = None,
    gpu_mem_gib: float | None = None,
    host_ram_gib: float | None = None,
    recipe: Any = None,
    detect: bool = True,
) -> Hardware:
    """Hardware from flags, else this machine's GPUs, else what the recipe declares, else this CPU."""
    sources: list[str] = []
    spec: GPUSpec | None = gpu_spec(gpu) if gpu else None
    declared = recipe.hardware if recipe is not None else None
    kind = "cuda"
    name, mem, bf16, cc = "GPU", 0, True, None
    count_default = declared.world_size if declared else 1
    found = None
    from_recipe = False
    if spec or gpu_mem_gib:
        sources.append("--gpu" if spec else "--gpu-mem (bf16 assumed; --gpu NAME for a card without it)")
    elif declared is not None and declared.device == "cpu":
        kind = "cpu"
    elif detect and (found := _detected_gpus()) is not None:
        count, det_name, det_mem, bf16, cc = found
        spec = find_gpu(det_name)
        name, mem = det_name, det_mem
        count_default = count if declared is None else count_default
        sources.append("detected")
    elif declared is not None and (declared.gpu_name or declared.gpu_mem_gib):
        spec = find_gpu(declared.gpu_name) if declared.gpu_name else None
        if declared.gpu_mem_gib:
            gpu_mem_gib = declared.gpu_mem_gib
        from_recipe = True
        sources.append("GPU as the recipe declares")
    else:
        kind = "cpu"
        sources.append("no GPU found or named: CPU processes; --gpu/--gpu-mem to plan for a GPU")

    if spec is not None:
        name, bf16, cc = spec.name, spec.bf16, spec.compute_capability
        mem = mem or int(spec.memory_gib * GiB)
    if gpu_mem_gib:
        mem = int(gpu_mem_gib * GiB)
        if spec is None and found is None:
            name = f"{gpu_mem_gib:g} GiB GPU"
    world = gpus or count_default
    if world < 1:
        raise UserError(f"--gpus {world}: need at least 1")
    if declared is not None and world == declared.world_size:
        per_node = declared.processes_per_node
    elif found is not None:
        per_node = min(world, found[0])
    else:
        per_node = min(world, 8)  # the usual node: up to 8 GPUs

    if host_ram_gib:
        host = int(host_ram_gib * GiB)
        sources.append("--host-ram")
    elif from_recipe and declared.host_ram_gib:
        # Planning for the machine the recipe is written for, not this one.
        host = int(declared.host_ram_gib * GiB)
        sources[-1] = "GPU and host RAM as the recipe declares; --gpu/--gpu-mem/--host-ram for yours"
    else:
        host = host_ram_bytes()
        sources.append("host RAM of this machine; --host-ram for another")
    if kind == "cpu":
        return Hardware("cpu", "cpu", world, per_node, 0, host, True, CPU_PEAK_TFLOPS, sources=tuple(sources))
    peak = spec.peak_tflops if spec else UNKNOWN_GPU_PEAK_TFLOPS
    return Hardware(
        kind="cuda",
        name=name,
        gpus=world,
        gpus_per_node=per_node,
        gpu_mem_bytes=mem,
        host_ram_bytes=host,
        bf16=bf16,
        peak_tflops=peak,
        nvlink=bool(spec and spec.nvlink),
        compute_capability=cc,
        sources=tuple(sources),
    )


# --- one configuration: memory, speed, fit ----------------------------------------------------------


def memory_inputs(run: Any, shape: ModelShape, gpus_per_node: int | None = None) -> MemoryInputs:
    """MemoryInputs for a resolved run, bucket sizes and overlap read from its final DS config."""
    zero = run.ds_config.get("zero_optimization", {}) or {}
    plan, recipe = run.plan, run.recipe

    def number(key: str, default: int | None) -> int | None:
        value = zero.get(key)
        return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else default

    return MemoryInputs(
        shape=shape,
        world_size=plan.world_size,
        tp=plan.tp,
        pp=plan.pp,
        gpus_per_node=gpus_per_node or min(recipe.hardware.processes_per_node, plan.world_size),
        zero_stage=plan.zero_stage,
        offload_optimizer=plan.offload_optimizer,
        offload_params=plan.offload_params,
        precision=plan.precision,
        micro_batch=plan.micro_batch_size,
        seq_len=recipe.data.seq_len,
        activation_checkpointing=recipe.memory.activation_checkpointing,
        attn_impl=recipe.memory.attention,
        lora_rank=recipe.lora.rank if recipe.lora else None,
        reduce_bucket_size=number("reduce_bucket_size", None),
        prefetch_bucket_size=number("stage3_prefetch_bucket_size", None),
        # DeepSpeed turns overlap_comm on by default for stage 3 only.
        overlap_comm=bool(zero.get("overlap_comm", plan.zero_stage == 3)),
        allgather_bucket_size=number("allgather_bucket_size", DS_ALLGATHER_BUCKET_SIZE)
        or DS_ALLGATHER_BUCKET_SIZE,
        param_persistence_threshold=number("stage3_param_persistence_threshold", None),
        sub_group_size=number("sub_group_size", DS_SUB_GROUP_SIZE) or DS_SUB_GROUP_SIZE,
    )


def needs(est: MemoryEstimate, inp: MemoryInputs, kind: str) -> tuple[int, int]:
    """(bytes per device, host bytes per node). On CPU the "GPU" terms live in host RAM too."""
    if kind != "cpu":
        return est.gpu_bytes, est.host_bytes
    device = sum(v for k, v in est.gpu_terms.items() if k != "cuda_context_and_slack")
    device = int(device * (1 + ALLOCATOR_SLACK_FRACTION))
    ranks = inp.ranks_per_node
    host = est.host_bytes - ranks * PROCESS_HOST_BYTES + ranks * (CPU_PROCESS_HOST_BYTES + device)
    return device, host


@dataclass(frozen=True)
class Choice:
    """The knobs the planner turns."""

    zero_stage: int
    offload_optimizer: str
    offload_params: str
    micro_batch: int
    grad_accum: int
    activation_checkpointing: bool
    lora_rank: int | None

    @property
    def ds_key(self) -> tuple[int, str, str]:
        return (self.zero_stage, self.offload_optimizer, self.offload_params)

    @staticmethod
    def of(inp: MemoryInputs, grad_accum: int) -> Choice:
        return Choice(
            inp.zero_stage,
            inp.offload_optimizer,
            inp.offload_params,
            inp.micro_batch,
            grad_accum,
            inp.activation_checkpointing,
            inp.lora_rank,
        )


@dataclass(frozen=True)
class Evaluation:
    choice: Choice
    inputs: MemoryInputs
    estimate: MemoryEstimate
    device_bytes: int
    host_bytes: int
    time: StepTime
    fits_device: bool
    fits_host: bool

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host


def evaluate(base: MemoryInputs, choice: Choice, hw: Hardware) -> Evaluation:
    """Estimate `choice` applied to `base` on `hw`. Raises MemoryInputError for impossible combinations."""
    inp = dataclasses.replace(
        base,
        zero_stage=choice.zero_stage,
        offload_optimizer=choice.offload_optimizer,
        offload_params=choice.offload_params,
        micro_batch=choice.micro_batch,
        activation_checkpointing=choice.activation_checkpointing,
        lora_rank=choice.lora_rank,
        zero_init=None,  # re-derived from the stage
    )
    est = estimate_memory(inp)
    device_bytes, host_bytes = needs(est, inp, hw.kind)
    fits_device = hw.kind == "cpu" or device_bytes <= hw.gpu_limit_bytes
    fits_host = host_bytes <= hw.host_limit_bytes
    speed = step_time(inp, choice.grad_accum, hw.peak_tflops, hw.nvlink)
    return Evaluation(choice, inp, est, device_bytes, host_bytes, speed, fits_device, fits_host)


# --- changes and the search -------------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    kind: str  # a TYPICAL_COST key
    text: str


@dataclass
class Fix:
    """A set of changes to the recipe, with its evaluation and speed relative to the recipe."""

    evaluation: Evaluation
    changes: list[Change]
    overrides: list[str]
    slowdown: float  # step time / the recipe's step time

    @property
    def kinds(self) -> frozenset[str]:
        return frozenset(c.kind for c in self.changes)

    @property
    def changes_training(self) -> bool:
        return "lora" in self.kinds


def describe_changes(
    base: Choice, new: Choice, recipe: Any, ds_name: str | None
) -> tuple[list[Change], list[str]]:
    """The human-readable changes from `base` to `new`, and the recipe overrides that make them."""
    changes: list[Change] = []
    overrides: list[str] = []
    if new.activation_checkpointing != base.activation_checkpointing:
        on = new.activation_checkpointing
        changes.append(
            Change(
                "checkpointing" if on else "no_checkpointing",
                f"activation checkpointing {'on' if on else 'off'}",
            )
        )
        overrides.append(f"memory.activation_checkpointing={'true' if on else 'false'}")
    if new.micro_batch != base.micro_batch:
        changes.append(
            Change(
                "micro_batch" if new.micro_batch < base.micro_batch else "bigger_micro_batch",
                f"micro-batch {base.micro_batch} -> {new.micro_batch} with accumulation "
                f"{base.grad_accum} -> {new.grad_accum} (same global batch)",
            )
        )
        overrides.append(f"optim.micro_batch_size={new.micro_batch}")
        if recipe is not None and recipe.optim.global_batch_size is None:
            overrides.append(f"optim.grad_accum={new.grad_accum}")
    if new.ds_key != base.ds_key:
        adds = []
        if new.zero_stage == 3 and base.zero_stage != 3:
            adds.append(Change("zero3", "ZeRO-3 (partition the weights too)"))
        if "nvme" in (new.offload_optimizer, new.offload_params):
            if "nvme" not in (base.offload_optimizer, base.offload_params):
                adds.append(Change("nvme", "NVMe offload of optimizer states and weights (ZeRO-Infinity)"))
        else:
            if new.offload_optimizer == "cpu" and base.offload_optimizer == "none":
                adds.append(Change("offload_optimizer", "optimizer offload to CPU (DeepSpeed CPU Adam)"))
            if new.offload_params == "cpu" and base.offload_params == "none":
                adds.append(Change("offload_params", "parameter offload to CPU"))
        removes = (
            new.zero_stage < base.zero_stage
            or _offload_rank(new.offload_optimizer) < _offload_rank(base.offload_optimizer)
            or _offload_rank(new.offload_params) < _offload_rank(base.offload_params)
        )
        if removes or not adds:
            adds = [
                Change(
                    "less_offload",
                    f"ZeRO-{new.zero_stage} with offload optimizer={new.offload_optimizer}, "
                    f"params={new.offload_params}",
                )
            ]
        changes.extend(adds)
        overrides.append(f"deepspeed.config={ds_name}" if ds_name else "deepspeed.config=<a JSON with these>")
    if new.lora_rank and not base.lora_rank:
        changes.append(Change("lora", f"LoRA rank {new.lora_rank} instead of a full fine-tune"))
        overrides.append(f"lora.rank={new.lora_rank}")
    return changes, overrides


def _offload_rank(device: str) -> int:
    return {"none": 0, "cpu": 1, "nvme": 2}[device]


def _memory_modes(base: Choice, kind: str, saving_only: bool) -> list[tuple[int, str, str]]:
    """ZeRO stage / offload combinations to try (shipped configs only), the recipe's first."""
    if kind == "cpu":
        # Offloading to the CPU from the CPU saves nothing; only partitioning can help.
        candidates = [k for k in SHIPPED_DS_CONFIGS if k[1] == "none" and k[2] == "none"]
    else:
        candidates = list(SHIPPED_DS_CONFIGS)
    if saving_only:
        # To make a run fit, stages only go up and offload is only ever added.
        candidates = [
            k
            for k in candidates
            if k[0] >= max(base.zero_stage, 2)
            and _offload_rank(k[1]) >= _offload_rank(base.offload_optimizer)
            and _offload_rank(k[2]) >= _offload_rank(base.offload_params)
        ]
    return [base.ds_key] + [k for k in candidates if k != base.ds_key]


def search(
    base: MemoryInputs,
    grad_accum: int,
    hw: Hardware,
    recipe: Any,
    faster: bool = False,
    limit: int = 6,
) -> list[Fix]:
    """Fitting combinations of changes to `base`, fastest first, without dominated ones.

    faster=False: the recipe does not fit; try only changes that save memory (and LoRA).
    faster=True: it fits; look for changes that keep it fitting and are >5% faster.
    """
    start = Choice.of(base, grad_accum)
    reference = step_time(base, grad_accum, hw.peak_tflops, hw.nvlink).total
    per_rank = start.micro_batch * start.grad_accum  # sequences per rank per step: kept fixed
    if faster:
        checkpointing = [start.activation_checkpointing, not start.activation_checkpointing]
        micro = [start.micro_batch] + [
            m for m in range(1, per_rank + 1) if per_rank % m == 0 and m != start.micro_batch
        ]
        lora = [start.lora_rank]
    else:
        checkpointing = [start.activation_checkpointing] + (
            [True] if not start.activation_checkpointing else []
        )
        micro = [start.micro_batch] + [
            m for m in range(start.micro_batch - 1, 0, -1) if start.micro_batch % m == 0
        ]
        lora = [start.lora_rank] + ([SUGGESTED_LORA_RANK] if start.lora_rank is None else [])
    fixes: list[Fix] = []
    modes = _memory_modes(start, hw.kind, saving_only=not faster)
    for ckpt, mb, mode, rank in itertools.product(checkpointing, micro, modes, lora):
        choice = Choice(mode[0], mode[1], mode[2], mb, per_rank // mb, ckpt, rank)
        if choice == start:
            continue
        try:
            ev = evaluate(base, choice, hw)
        except MemoryInputError:
            continue
        slowdown = ev.time.total / reference if reference else 1.0
        if not ev.fits or (faster and slowdown > 0.95):
            continue
        changes, overrides = describe_changes(start, choice, recipe, SHIPPED_DS_CONFIGS.get(choice.ds_key))
        fixes.append(Fix(ev, changes, overrides, slowdown))
    # Drop a fix when another one, made of a subset of its kinds of change, is at least as fast.
    kept = [f for f in fixes if not any(g.kinds < f.kinds and g.slowdown <= f.slowdown for g in fixes)]
    # Among fixes of the same kinds (e.g. several micro-batch sizes), keep the fastest.
    best: dict[frozenset[str], Fix] = {}
    for f in kept:
        if f.kinds not in best or f.slowdown < best[f.kinds].slowdown:
            best[f.kinds] = f
    ranked = sorted(best.values(), key=lambda f: (f.changes_training, f.slowdown, len(f.changes)))
    return ranked[:limit]


def search_fixes(base: MemoryInputs, grad_accum: int, hw: Hardware, recipe: Any, limit: int = 6) -> list[Fix]:
    """The cheapest changes that make a run that does not fit (or barely fits) fit."""
    return search(base, grad_accum, hw, recipe, faster=False, limit=limit)


def search_faster(
    base: MemoryInputs, grad_accum: int, hw: Hardware, recipe: Any, limit: int = 3
) -> list[Fix]:
    """Changes that keep a fitting run fitting and make it faster (bigger micro-batch, less offload)."""
    return search(base, grad_accum, hw, recipe, faster=True, limit=limit)


# --- the report -------------------------------------------------------------------------------------


@dataclass
class PlanReport:
    title: str
    hardware: Hardware
    config_line: str
    evaluation: Evaluation
    fixes: list[Fix] = field(default_factory=list)
    faster: list[Fix] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.evaluation.fits


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def verdict(ev: Evaluation, hw: Hardware) -> str:
    parts = []
    if hw.kind == "cuda":
        spare = hw.gpu_mem_bytes - ev.device_bytes
        parts.append(
            f"GPU {ev.device_bytes / GiB:.1f} of {hw.gpu_mem_bytes / GiB:.1f} GiB "
            f"({spare / GiB:+.1f} GiB, {spare / hw.gpu_mem_bytes:+.0%})"
        )
    spare_host = hw.host_ram_bytes - ev.host_bytes
    parts.append(
        f"host RAM {ev.host_bytes / GiB:.1f} of {hw.host_ram_bytes / GiB:.1f} GiB "
        f"({spare_host / GiB:+.1f} GiB, {spare_host / hw.host_ram_bytes:+.0%})"
    )
    if ev.estimate.nvme_bytes:
        parts.append(f"NVMe {ev.estimate.nvme_bytes / GiB:.1f} GiB")
    if ev.fits:
        word = "FITS"
    elif hw.kind == "cuda" and ev.device_bytes <= hw.gpu_mem_bytes and ev.fits_host:
        word = f"TIGHT (under {GPU_HEADROOM:.0%} of GPU memory to spare; the estimate is +-15%)"
    else:
        short = []
        if not ev.fits_device:
            short.append("GPU memory")
        if not ev.fits_host:
            short.append("host RAM")
        word = f"DOES NOT FIT ({' and '.join(short)})"
    return f"{word}: " + "; ".join(parts)


def render(report: PlanReport) -> str:
    ev, hw = report.evaluation, report.hardware
    lines = [report.title, f"hardware: {hw.describe()}", f"config:   {report.config_line}", ""]
    lines.append("memory estimate" + ("" if hw.kind == "cuda" else " (CPU run: all of it is host RAM)"))
    rows = ev.estimate.table() if hw.kind == "cuda" else cpu_rows(ev)
    for key, value in rows:
        lines.append(f"  {key:<44} {value:>11}")
    t = ev.time
    parts = [f"compute {t.compute:.2f}s"]
    for label, value in (
        ("ZeRO comm", t.communication),
        ("PCIe", t.pcie),
        ("CPU Adam", t.cpu_optimizer),
        ("NVMe", t.nvme),
    ):
        if value:
            parts.append(f"{label} {value:.2f}s")
    lines.append(
        f"speed (rough model): ~{t.total:.2f} s/step, ~{t.tokens_per_s:,.0f} tokens/s ({', '.join(parts)})"
    )
    lines.append("")
    lines.append("verdict: " + verdict(ev, hw))
    if report.fixes:
        lines.append("")
        lines.append("cheapest changes that make it fit, fastest first (speed vs the recipe as written):")
        lines.extend(_fix_lines(report.fixes, hw))
    elif not ev.fits:
        lines.append("")
        lines.append(
            "does not fit anywhere: no combination of checkpointing, smaller micro-batch, ZeRO-3, CPU/NVMe "
            "offload and LoRA fits this hardware; add GPUs (--gpus), use bigger cards, or more host RAM"
        )
    if report.faster:
        lines.append("")
        lines.append("faster options that also fit (spare memory spent on speed):")
        lines.extend(_fix_lines(report.faster, hw))
    for note in report.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def cpu_rows(ev: Evaluation) -> list[tuple[str, str]]:
    """The estimate of a CPU run: per-process tensors (the 'GPU' terms) and the node's total."""
    from llm_train.memory import _LABELS

    est, ranks = ev.estimate, ev.inputs.ranks_per_node
    rows = [
        (f"per process: {_LABELS.get(k, k)}", _gib(v))
        for k, v in est.gpu_terms.items()
        if k != "cuda_context_and_slack"
    ]
    rows.append(("per process total (+10% allocator slack)", _gib(ev.device_bytes)))
    rows += [
        (f"host {_LABELS.get(k, k)}", _gib(v))
        for k, v in est.host_terms.items()
        if v and k != "process_overhead"
    ]
    rows.append((f"host {ranks} process(es): torch, Python (no CUDA)", _gib(ranks * CPU_PROCESS_HOST_BYTES)))
    rows.append(("host RAM total (per node, all processes)", _gib(ev.host_bytes)))
    return rows


def _fix_lines(fixes: list[Fix], hw: Hardware) -> list[str]:
    lines = []
    for i, fix in enumerate(fixes, 1):
        fe = fix.evaluation
        gpu = f"GPU {fe.device_bytes / GiB:.1f} GiB, " if hw.kind == "cuda" else ""
        nvme = f", NVMe {fe.estimate.nvme_bytes / GiB:.0f} GiB" if fe.estimate.nvme_bytes else ""
        lines.append(f"  {i}. {_slowdown(fix.slowdown)}  ({gpu}host {fe.host_bytes / GiB:.1f} GiB{nvme})")
        for change in fix.changes:
            lines.append(f"       - {change.text}  [{TYPICAL_COST[change.kind]}]")
        lines.append(f"       overrides: {' '.join(fix.overrides)}")
    return lines


def _slowdown(ratio: float) -> str:
    if ratio >= 1.005:
        return f"{ratio - 1:+.0%} step time"
    if ratio <= 0.995:
        return f"{ratio - 1:+.0%} step time (faster)"
    return "same speed"


def config_line(inp: MemoryInputs, grad_accum: int) -> str:
    offload = (
        f"offload optimizer={inp.offload_optimizer} params={inp.offload_params}"
        if inp.offload_optimizer != "none" or inp.offload_params != "none"
        else "no offload"
    )
    what = f"LoRA r={inp.lora_rank}" if inp.lora_rank else "full fine-tune"
    return (
        f"{what}, ZeRO-{inp.zero_stage}, {offload}, {inp.precision}, micro {inp.micro_batch} x accum "
        f"{grad_accum} x dp {inp.dp}, seq {inp.seq_len}, checkpointing "
        f"{'on' if inp.activation_checkpointing else 'off'}, {inp.attn_impl}"
    )


def plan_recipe(
    recipe_name: str,
    overrides: list[str],
    gpus: int | None = None,
    gpu: str | None = None,
    gpu_mem_gib: float | None = None,
    host_ram_gib: float | None = None,
    detect: bool = True,
) -> PlanReport:
    """The plan for a recipe on the given (or detected, or declared) hardware."""
    from llm_train.recipe import load_recipe
    from llm_train.resolve import resolve_run

    recipe = load_recipe(recipe_name, overrides)
    hw = resolve_hardware(gpus, gpu, gpu_mem_gib, host_ram_gib, recipe, detect)
    run = resolve_run(recipe_name, overrides, world_size=hw.gpus, device=hw.device())
    shape = shape_from_config(run.model_fields)
    base = memory_inputs(run, shape, hw.gpus_per_node)
    start = Choice.of(base, run.plan.grad_accum)
    ev = evaluate(base, start, hw)
    model = run.recipe.model.name_or_path or f"random {shape.model_type}"
    title = f"llm-train plan: {run.recipe.name} ({model}, {shape.num_params / 1e9:.2f}B parameters)"
    if shape.num_params < 1e8:
        title = f"llm-train plan: {run.recipe.name} ({model}, {shape.num_params / 1e6:.1f}M parameters)"
    report = PlanReport(title, hw, config_line(base, run.plan.grad_accum), ev)
    if run.notice:
        report.notes.append(run.notice)
    tight = hw.kind == "cuda" and ev.device_bytes > hw.gpu_limit_bytes
    if not ev.fits or tight:
        report.fixes = search_fixes(base, run.plan.grad_accum, hw, run.recipe)
    else:
        report.faster = search_faster(base, run.plan.grad_accum, hw, run.recipe)
    if ev.estimate.nvme_bytes:
        report.notes.append(
            f"NVMe: before start, deepspeed.nvme_path is checked for {ev.estimate.nvme_bytes / 2**30:.1f} GiB "
            "free per node (and that it exists and is writable)"
        )
    return report


# --- `--recipe auto` ----------------------------------------------------------------------------------


@dataclass
class AutoChoice:
    evaluation: Evaluation
    hardware: Hardware
    model: str
    shape: ModelShape
    seq_len: int
    global_batch: int
    reasons: list[str]

    @property
    def choice(self) -> Choice:
        return self.evaluation.choice

    @property
    def ds_config(self) -> str:
        return SHIPPED_DS_CONFIGS[self.choice.ds_key]

    @property
    def precision(self) -> str:
        if self.hardware.kind == "cpu":
            return "fp32"
        return "bf16" if self.hardware.bf16 else "fp16"


def choose_auto(
    model: str,
    hw: Hardware,
    seq_len: int | None = None,
    global_batch: int = 64,
    lora: str = "fallback",
) -> AutoChoice:
    """The fastest configuration (by the speed model) that fits `hw`.

    lora: "fallback" = LoRA only when no full fine-tune fits; "never"; "always".
    """
    from llm_train.shapes import resolve_shape

    shape = resolve_shape(model)
    seq = seq_len or min(2048, shape.max_position_embeddings)
    precision = "fp32" if hw.kind == "cpu" else ("bf16" if hw.bf16 else "fp16")
    dp = hw.gpus
    micro_options = [m for m in AUTO_MICRO_BATCHES if global_batch % (m * dp) == 0]
    if not micro_options:
        raise UserError(
            f"--global-batch {global_batch} is not a multiple of --gpus {dp}; pick a multiple of {dp}"
        )
    modes = [k for k in SHIPPED_DS_CONFIGS if hw.kind == "cuda" or k[1:] == ("none", "none")]

    def all_evaluations(lora_rank: int | None) -> list[Evaluation]:
        out = []
        for mode, micro, ckpt in itertools.product(modes, micro_options, (False, True)):
            base = MemoryInputs(
                shape=shape,
                world_size=dp,
                gpus_per_node=hw.gpus_per_node,
                zero_stage=mode[0],
                precision=precision,
                micro_batch=micro,
                seq_len=seq,
                activation_checkpointing=ckpt,
                lora_rank=lora_rank,
                overlap_comm=True,
            )
            choice = Choice(mode[0], mode[1], mode[2], micro, global_batch // (micro * dp), ckpt, lora_rank)
            try:
                out.append(evaluate(base, choice, hw))
            except MemoryInputError:
                continue
        return out

    reasons: list[str] = []
    tried = [] if lora == "always" else all_evaluations(None)
    fitting = [e for e in tried if e.fits]
    if not fitting and lora != "never":
        lora_tried = all_evaluations(SUGGESTED_LORA_RANK)
        fitting = [e for e in lora_tried if e.fits]
        if fitting and lora == "fallback":
            reasons.append(
                "no full fine-tune fits (even with ZeRO-3 and CPU/NVMe offload), so this trains "
                f"LoRA adapters (rank {SUGGESTED_LORA_RANK}) on the frozen model"
            )
        tried += lora_tried
    if not fitting:
        raise UserError(_nowhere(model, hw, tried, lora))
    chosen = min(fitting, key=_auto_key)
    reasons.append(f"the fastest of {len(fitting)} fitting configurations (of {len(tried)} estimated)")
    # The evidence for the level of partitioning/offload: the lighter modes that do not fit
    # even at their smallest (micro-batch 1, checkpointing), closest to fitting first.
    by_mode: dict[tuple[int, str, str], list[Evaluation]] = {}
    for e in tried:
        if bool(e.choice.lora_rank) == bool(chosen.choice.lora_rank):
            by_mode.setdefault(e.choice.ds_key, []).append(e)
    misses = [
        min(evs, key=lambda e: _overflow(e, hw))
        for evs in by_mode.values()
        if not any(e.fits for e in evs) and min(e.time.total for e in evs) < chosen.time.total
    ]
    for e in sorted(misses, key=lambda e: _overflow(e, hw))[:3]:
        reasons.append(f"not {_mode_text(e.choice)}: even at its smallest it needs {_needs_text(e, hw)}")
    if chosen.choice.activation_checkpointing:
        reasons.append("activation checkpointing is on because the faster splits without it do not fit")
    if (
        "nvme" in (chosen.choice.offload_optimizer, chosen.choice.offload_params)
        and not chosen.choice.lora_rank
    ):
        reasons.append(
            "NVMe offload is slow; --lora trains LoRA adapters instead, without NVMe and much faster"
        )
    return AutoChoice(chosen, hw, model, shape, seq, global_batch, reasons)


def _mode_text(c: Choice) -> str:
    off = []
    if c.offload_optimizer != "none":
        off.append(f"optimizer on {c.offload_optimizer}")
    if c.offload_params != "none":
        off.append(f"weights on {c.offload_params}")
    return f"ZeRO-{c.zero_stage}" + (f" ({', '.join(off)})" if off else " without offload")


def _overflow(e: Evaluation, hw: Hardware) -> float:
    """How far over the limits an evaluation is (<= 1 fits): the worse of GPU and host."""
    gpu = e.device_bytes / hw.gpu_limit_bytes if hw.kind == "cuda" else 0.0
    return max(gpu, e.host_bytes / max(1, hw.host_limit_bytes))


def _short(ev: Evaluation) -> str:
    c = ev.choice
    text = (
        _mode_text(c)
        + f", micro-batch {c.micro_batch}"
        + (", checkpointing" if c.activation_checkpointing else "")
    )
    return ("LoRA, " if c.lora_rank else "") + text


def _needs_text(ev: Evaluation, hw: Hardware) -> str:
    parts = []
    if not ev.fits_device:
        parts.append(f"{ev.device_bytes / GiB:.1f} GiB per GPU (usable {hw.gpu_limit_bytes / GiB:.1f})")
    if not ev.fits_host:
        parts.append(f"{ev.host_bytes / GiB:.0f} GiB host RAM (usable {hw.host_limit_bytes / GiB:.0f})")
    return " and ".join(parts)


def _nowhere(model: str, hw: Hardware, tried: list[Evaluation], lora: str) -> str:
    """The one-line 'does not fit anywhere' message, with the least-overflowing configuration."""

    closest = min(tried, key=lambda e: _overflow(e, hw))
    what = {"fallback": "full or LoRA", "never": "full", "always": "LoRA"}[lora]
    where = (
        f"{hw.gpus} x {hw.name} ({hw.gpu_mem_bytes / GiB:.1f} GiB)"
        if hw.kind == "cuda"
        else f"{hw.gpus} CPU process(es)"
    )
    return (
        f"{model} does not fit anywhere on {where} with {hw.host_ram_bytes / GiB:.0f} GiB host RAM "
        f"({what} fine-tune, every ZeRO stage, CPU/NVMe offload, checkpointing, micro-batch 1): the closest, "
        f"{_short(closest)}, needs {_needs_text(closest, hw)}; add GPUs (--gpus), bigger cards or more "
        "host RAM, or shorten --seq-len"
    )


def _auto_key(ev: Evaluation) -> tuple[float, int]:
    # Fastest first; among equally fast ones (same step time to the millisecond) the one
    # that needs less memory, e.g. ZeRO-0 over ZeRO-1/2 on a single GPU.
    return (round(ev.time.total, 3), ev.device_bytes + ev.host_bytes)


def auto_recipe_yaml(auto: AutoChoice, data: str | None = None) -> str:
    """A complete recipe for the chosen configuration, with a header like the shipped ones."""
    import yaml

    from llm_train import RECIPES_DIR

    hw, c, ev = auto.hardware, auto.choice, auto.evaluation
    corpus = data or str((RECIPES_DIR / "../llm_train/assets/tiny/corpus.txt").resolve())
    slug = re.sub(r"[^a-z0-9]+", "-", auto.model.lower()).strip("-")[-40:]
    body: dict[str, Any] = {
        "name": f"auto-{slug}",
        "description": f"Auto-planned {'LoRA' if c.lora_rank else 'full'} fine-tune of {auto.model} on {hw.gpus} x {hw.name}",
        "hardware": {
            "device": hw.kind,
            "nodes": -(-hw.gpus // hw.gpus_per_node),
            "processes_per_node": hw.gpus_per_node,
            **(
                {"gpu_name": hw.name, "gpu_mem_gib": round(hw.gpu_mem_bytes / GiB, 2)}
                if hw.kind == "cuda"
                else {}
            ),
            "host_ram_gib": round(ev.host_bytes / GiB + 0.5, 0),
        },
        "model": {"name_or_path": auto.model},
        "data": {"train": [corpus], "eval_fraction": 0.02, "seq_len": auto.seq_len},
        "optim": {
            "lr": 2.0e-4 if c.lora_rank else 1.0e-5,
            "weight_decay": 0.0,
            "warmup_steps": 10,
            "schedule": "cosine",
            "grad_clip": 1.0,
            "micro_batch_size": c.micro_batch,
            "global_batch_size": auto.global_batch,
            "epochs": 1,
            "seed": 42,
        },
        "precision": auto.precision,
        "memory": {"activation_checkpointing": c.activation_checkpointing, "attention": "sdpa"},
        **(
            {"lora": {"rank": c.lora_rank, "alpha": 2.0 * c.lora_rank, "dropout": 0.05}}
            if c.lora_rank
            else {}
        ),
        "deepspeed": {"config": auto.ds_config},
        "output": {"dir": "runs/{name}", "log_every": 10},
        "tracking": {"mode": "disabled"},
    }
    gpu_line = f"{ev.device_bytes / GiB:.1f} GiB per GPU, " if hw.kind == "cuda" else ""
    header = [
        f"# {body['name']}: generated by `llm-train plan --recipe auto --model {auto.model}`.",
        f"# {body['description']}.",
        f"# Planner: needs {gpu_line}{ev.host_bytes / GiB:.0f} GiB host RAM per node; "
        f"~{ev.time.total:.1f} s/step (rough).",
        *(f"# Why: {r}" for r in auto.reasons),
        "# Replace data.train with your data (the bundled demo corpus is a placeholder).",
        "# Launch:   accelerate launch llm_train/train.py --recipe THIS_FILE.yaml",
    ]
    return "\n".join(header) + "\n" + yaml.safe_dump(body, sort_keys=False)


def render_auto(auto: AutoChoice, path: Path | None) -> str:
    ev, hw = auto.evaluation, auto.hardware
    lines = [
        f"llm-train plan --recipe auto: {auto.model} ({auto.shape.num_params / 1e9:.2f}B parameters)",
        f"hardware: {hw.describe()}",
        f"chosen:   {config_line(ev.inputs, ev.choice.grad_accum)}; deepspeed.config={auto.ds_config}",
        f"needs:    {verdict(ev, hw)}",
        f"speed:    ~{ev.time.total:.2f} s/step, ~{ev.time.tokens_per_s:,.0f} tokens/s (rough model)",
        "why:",
        *(f"  - {r}" for r in auto.reasons),
    ]
    if path is not None:
        lines.append(f"recipe written to {path}")
    return "\n".join(lines)


# --- host-RAM guard (called by train.py before anything loads) --------------------------------------------


SKIP_RAM_CHECK_FLAG = "--skip-ram-check"


def check_host_ram(run: Any, available: int | None = None) -> None:
    """Refuse to start when the planner says this node's host RAM cannot hold the run.

    Better one line now than the OS killing a rank mid-load (offload paths keep optimizer
    states and often the weights in pinned host memory). Skipped, with no estimate, for
    model types the estimator does not know; train.py's --skip-ram-check bypasses it when
    you know better than the estimate (an explicit flag, not an environment switch).
    """
    try:
        shape = shape_from_config(run.model_fields)
    except UserError:
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    inp = memory_inputs(run, shape, local or None)
    kind = "cpu" if run.plan.device == "cpu" else "cuda"
    est = estimate_memory(inp)
    device, host = needs(est, inp, kind)
    total = host_ram_bytes() if available is None else available
    if host > total:
        parts = {k.replace("_", " "): v for k, v in est.host_terms.items() if k != "process_overhead"}
        # Loading and training do not overlap: the total takes the larger phase, not the sum.
        parts["model load peak (transient)"] = parts.pop("model load peak", 0)
        ranks = inp.ranks_per_node
        if kind == "cpu":
            parts["processes"] = ranks * CPU_PROCESS_HOST_BYTES
            parts["tensors in the processes"] = ranks * device
        else:
            parts["processes"] = est.host_terms["process_overhead"]
        terms = ", ".join(f"{k} {v / GiB:.1f}" for k, v in parts.items() if v >= 0.05 * GiB)
        raise UserError(
            f"host RAM: {run.recipe.name} needs ~{host / GiB:.1f} GiB per node (planner: {terms} GiB; "
            f"{inp.ranks_per_node} process(es)), this machine has {total / GiB:.1f} GiB; "
            f"run `llm-train plan --recipe {run.recipe.name}` for options (NVMe offload, LoRA, more nodes), "
            f"or pass {SKIP_RAM_CHECK_FLAG} if you know the estimate is wrong"
        )


# --- CLI ------------------------------------------------------------------------------------------------


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="Will it fit? Memory estimate, verdict and the cheapest fixes (or --recipe auto).",
        description="Estimate per-GPU memory, host RAM and speed for a recipe on given hardware; "
        "say whether it fits and rank the cheapest changes that make it fit.",
    )
    p.add_argument("--recipe", required=True, help="A recipe name or YAML path, or 'auto' (with --model).")
    p.add_argument(
        "--model", help="With --recipe auto: a known model id or a local directory with config.json."
    )
    p.add_argument("--gpus", type=int, help="Number of GPUs (processes) in total (default: the recipe's).")
    p.add_argument(
        "--gpu", help="GPU model, e.g. RTX-4090, A100-80GB, H100 (default: detected or the recipe's)."
    )
    p.add_argument("--gpu-mem", type=float, metavar="GIB", help="Memory per GPU in GiB (overrides --gpu's).")
    p.add_argument(
        "--host-ram", type=float, metavar="GIB", help="Host RAM per node in GiB (default: this machine)."
    )
    p.add_argument(
        "--seq-len", type=int, help="With --recipe auto: tokens per sequence (default min(2048, model max))."
    )
    p.add_argument(
        "--global-batch", type=int, default=64, help="With --recipe auto: sequences per optimizer step."
    )
    lora = p.add_mutually_exclusive_group()
    lora.add_argument(
        "--lora", action="store_true", help="With --recipe auto: train LoRA adapters, not all weights."
    )
    lora.add_argument("--no-lora", action="store_true", help="With --recipe auto: never fall back to LoRA.")
    p.add_argument("--write", metavar="PATH", help="With --recipe auto: write the generated recipe here.")
    p.add_argument(
        "--train",
        action="store_true",
        help="With --recipe auto: write the recipe into --output-dir and train it.",
    )
    p.add_argument(
        "--output-dir", help="With --train: where the recipe and the run go (default runs/auto-MODEL)."
    )
    p.add_argument(
        "overrides", nargs="*", metavar="key.sub=value", help="Recipe overrides, e.g. data.seq_len=4096."
    )
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    if args.recipe != "auto":
        for flag in ("model", "write", "output_dir", "seq_len"):
            if getattr(args, flag):
                raise UserError(f"--{flag.replace('_', '-')} only applies to --recipe auto")
        if args.train:
            raise UserError(
                f"--train only applies to --recipe auto; train a recipe with: llm-train train --recipe {args.recipe}"
            )
        report = plan_recipe(args.recipe, args.overrides, args.gpus, args.gpu, args.gpu_mem, args.host_ram)
        print(render(report))
        return 0
    if not args.model:
        raise UserError("--recipe auto needs --model ID_OR_PATH (a known id or a directory with config.json)")
    hw = resolve_hardware(args.gpus, args.gpu, args.gpu_mem, args.host_ram, None)
    mode = "always" if args.lora else "never" if args.no_lora else "fallback"
    auto = choose_auto(args.model, hw, args.seq_len, args.global_batch, lora=mode)
    out_dir = Path(
        args.output_dir or f"runs/auto-{re.sub(r'[^a-z0-9]+', '-', args.model.lower()).strip('-')[-40:]}"
    )
    path = Path(args.write) if args.write else (out_dir / "recipe.yaml" if args.train else None)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(auto_recipe_yaml(auto))
        from llm_train.recipe import load_recipe

        load_recipe(str(path), args.overrides)  # the generated recipe, with overrides, must validate
    print(render_auto(auto, path))
    if not args.train:
        return 0
    assert path is not None
    train_args = ["--recipe", str(path), "--output-dir", str(out_dir / "run"), *args.overrides]
    if hw.gpus > 1:
        import subprocess

        accelerate = Path(sys.executable).with_name("accelerate")
        train_py = Path(__file__).resolve().parent / "train.py"
        cmd = [str(accelerate), "launch", "--num_processes", str(hw.gpus), str(train_py), *train_args]
        print("launching: " + " ".join(cmd), flush=True)
        return subprocess.call(cmd)
    from llm_train.train import main as train_main

    return train_main(train_args)
