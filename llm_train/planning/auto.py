"""`--recipe auto`: the fastest configuration of a model that fits given hardware, as a recipe."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm_train import RECIPES_DIR
from llm_train.config.hardware import Hardware
from llm_train.config.layout import default_precision
from llm_train.errors import UserError
from llm_train.planning.fit import (
    AUTO_MICRO_BATCHES,
    SHIPPED_DS_CONFIGS,
    SUGGESTED_LORA_RANK,
    Evaluation,
    evaluate,
)
from llm_train.planning.memory import (
    GiB,
    MemoryInputError,
    MemoryInputs,
)
from llm_train.planning.report import config_line, verdict
from llm_train.planning.shapes import ModelShape, shape_of

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
    def inputs(self) -> MemoryInputs:
        return self.evaluation.inputs

    @property
    def ds_config(self) -> str:
        return SHIPPED_DS_CONFIGS[self.inputs.ds_key]

    @property
    def precision(self) -> str:
        return default_precision(self.hardware.kind, self.hardware.bf16)


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

    shape = shape_of(model)
    seq = seq_len or min(2048, shape.max_position_embeddings)
    precision = default_precision(hw.kind, hw.bf16)
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
            try:
                candidate = MemoryInputs.of(
                    shape=shape,
                    world_size=dp,
                    zero_stage=mode[0],
                    offload_optimizer=mode[1],
                    offload_params=mode[2],
                    precision=precision,
                    micro_batch=micro,
                    grad_accum=global_batch // (micro * dp),
                    gpus_per_node=hw.gpus_per_node,
                    seq_len=seq,
                    activation_checkpointing=ckpt,
                    lora_rank=lora_rank,
                    overlap_comm=True,
                )
            except MemoryInputError:
                continue  # a combination the layout rules refuse
            out.append(evaluate(candidate, hw))
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
        if bool(e.inputs.lora_rank) == bool(chosen.inputs.lora_rank):
            by_mode.setdefault(e.inputs.ds_key, []).append(e)
    misses = [
        min(evs, key=lambda e: _overflow(e, hw))
        for evs in by_mode.values()
        if not any(e.fits for e in evs) and min(e.time.total for e in evs) < chosen.time.total
    ]
    for e in sorted(misses, key=lambda e: _overflow(e, hw))[:3]:
        reasons.append(f"not {_mode_text(e.inputs)}: even at its smallest it needs {_needs_text(e, hw)}")
    if chosen.inputs.activation_checkpointing:
        reasons.append("activation checkpointing is on because the faster splits without it do not fit")
    if (
        "nvme" in (chosen.inputs.offload_optimizer, chosen.inputs.offload_params)
        and not chosen.inputs.lora_rank
    ):
        reasons.append(
            "NVMe offload is slow; --lora trains LoRA adapters instead, without NVMe and much faster"
        )
    return AutoChoice(chosen, hw, model, shape, seq, global_batch, reasons)


def _mode_text(c: MemoryInputs) -> str:
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
    c = ev.inputs
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

    hw, c, ev = auto.hardware, auto.inputs, auto.evaluation
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
        f"chosen:   {config_line(ev.inputs, ev.inputs.grad_accum)}; deepspeed.config={auto.ds_config}",
        f"needs:    {verdict(ev, hw)}",
        f"speed:    ~{ev.time.total:.2f} s/step, ~{ev.time.tokens_per_s:,.0f} tokens/s (rough model)",
        "why:",
        *(f"  - {r}" for r in auto.reasons),
    ]
    if path is not None:
        lines.append(f"recipe written to {path}")
    return "\n".join(lines)
