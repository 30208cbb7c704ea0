"""`--recipe auto`: the fastest configuration of a model that fits given hardware, as a recipe.

Preference, in order: a full fine-tune without NVMe, then NVMe offload (only with --nvme-gib).
Optimizer states stay fp32: bf16 states (optim.state_dtype=bf16) halve the offloaded optimizer's
host RAM, but their measured quality cost is too high to pick them for anyone
(bench/results/bf16-states-quality-*.txt: at lr 1e-5 they kept 8% of fp32's eval-loss gain), so
`plan` only reports what they would save. A full fine-tune that fits but is impractical
(search.judge) gives way to LoRA unless --no-lora; the choice carries its verdict.

Long sequences: when no configuration of a kind (full fine-tune, or LoRA) fits at --seq-len, the
DeepSpeed ALST techniques join the candidates: Ulysses sequence parallelism (search.
sequence_parallel_degrees) and the tiled MLP, tiled loss and checkpoint-offload switches. They
train exactly the same model, so a full fine-tune with them comes before LoRA.
"""

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
from llm_train.planning.search import (
    LONG_CONTEXT_SWITCHES,
    Practicality,
    judge,
    long_context_options,
    long_context_text,
    short_config,
)
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
    practicality: Practicality
    nvme_bytes: int = 0

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
    nvme_gib: float | None = None,
) -> AutoChoice:
    """The fastest configuration (by the speed model) that fits `hw`, in the order of the module docstring.

    lora: "fallback" = LoRA only when no full fine-tune fits, or the one that fits is impractical;
    "never"; "always". nvme_gib: NVMe space per node (--nvme-gib); without it no NVMe offload.
    """
    nvme_bytes = int((nvme_gib or 0) * GiB)

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
    plain = (1, False, False, False)

    def all_evaluations(
        lora_rank: int | None, long_context: list[tuple[int, bool, bool, bool]], quantize: str = "none"
    ) -> list[Evaluation]:
        out = []
        states = ("fp32",)  # never bf16 states: see the module docstring
        for mode, micro, ckpt, state, (sp, tiled_mlp, tiled_loss, offload_ckpt) in itertools.product(
            modes, AUTO_MICRO_BATCHES, (False, True), states, long_context
        ):
            ranks = dp // sp  # data-parallel ranks: sp of the GPUs share each sequence
            if global_batch % (micro * ranks):
                continue
            try:
                candidate = MemoryInputs.of(
                    shape=shape,
                    world_size=dp,
                    zero_stage=mode[0],
                    offload_optimizer=mode[1],
                    offload_params=mode[2],
                    precision=precision,
                    micro_batch=micro,
                    grad_accum=global_batch // (micro * ranks),
                    sp=sp,
                    gpus_per_node=hw.gpus_per_node,
                    seq_len=seq,
                    activation_checkpointing=ckpt,
                    lora_rank=lora_rank,
                    quantize=quantize,
                    overlap_comm=True,
                    state_dtype=state,
                    tiled_mlp=tiled_mlp,
                    tiled_loss=tiled_loss,
                    offload_checkpoints=offload_ckpt,
                )
            except MemoryInputError:
                continue  # a combination the layout (or sequence-parallel) rules refuse
            out.append(evaluate(candidate, hw, nvme_bytes))
        return out

    def evaluations(lora_rank: int | None, quantize: str = "none") -> list[Evaluation]:
        """Without ALST; with it too when nothing fits without (only a long sequence needs it)."""
        out = all_evaluations(lora_rank, [plain], quantize)
        if not any(e.fits for e in out):
            probe = MemoryInputs.of(shape=shape, world_size=dp, gpus_per_node=hw.gpus_per_node, seq_len=seq)
            out += all_evaluations(lora_rank, long_context_options(probe)[1:], quantize)
        return out

    reasons: list[str] = []
    full_tried = [] if lora == "always" else evaluations(None)
    lora_all = evaluations(SUGGESTED_LORA_RANK)
    if not any(e.fits for e in lora_all) and hw.kind == "cuda":
        # QLoRA: the same adapters on a 4-bit base (bitsandbytes), when the 16-bit base does not fit.
        lora_all += evaluations(SUGGESTED_LORA_RANK, "nf4")
    lora_tried = [] if lora == "never" else lora_all
    full_fitting = [e for e in full_tried if e.fits]
    lora_fitting = [e for e in lora_tried if e.fits]
    tried = full_tried + lora_tried
    # A verdict judges the configuration against everything this hardware could run instead, LoRA
    # included even under --no-lora: the flag says what to choose, not how fast the choice is.
    alternatives = full_tried + lora_all
    full = min(full_fitting, key=_auto_key) if full_fitting else None
    full_verdict = judge(full, alternatives) if full is not None else None
    best_lora = min(lora_fitting, key=_auto_key) if lora_fitting else None
    # LoRA replaces an impractical full fine-tune only when it is practical itself.
    lora_helps = best_lora is not None and judge(best_lora, alternatives).practical
    if full is not None and full_verdict is not None and (full_verdict.practical or not lora_helps):
        chosen, fitting = full, full_fitting
    elif best_lora is not None:
        chosen, fitting = best_lora, lora_fitting
        if full is not None and full_verdict is not None:
            reasons.append(
                f"a full fine-tune fits ({short_config(full.inputs)}) but is impractical: "
                f"{'; '.join(full_verdict.reasons)}; so this trains LoRA adapters (rank {SUGGESTED_LORA_RANK}) "
                "on the frozen model (--no-lora for the full fine-tune)"
            )
        elif lora == "fallback":
            nvme = "" if nvme_bytes else " (NVMe offload is considered only with --nvme-gib N)"
            reasons.append(
                "no full fine-tune fits, even with ZeRO-3 and CPU offload"
                f"{nvme}, so this trains LoRA adapters (rank {SUGGESTED_LORA_RANK}) on the frozen model"
            )
        if best_lora.inputs.quantize != "none":
            reasons.append(
                "16-bit LoRA does not fit either, so the frozen base loads in 4 bits (QLoRA, lora.quantize=nf4; "
                "pip install 'llm_train[qlora]')"
            )
    else:
        raise UserError(_nowhere(model, hw, tried, lora, nvme_bytes))
    practicality = judge(chosen, alternatives)
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
        if not any(e.fits for e in evs)
        and min(e.time.total for e in evs) < chosen.time.total
        and (nvme_bytes or not evs[0].inputs.uses_nvme)  # NVMe is no option without --nvme-gib
    ]
    for e in sorted(misses, key=lambda e: _overflow(e, hw))[:3]:
        reasons.append(f"not {_mode_text(e.inputs)}: even at its smallest it needs {_needs_text(e, hw)}")
    if chosen.inputs.activation_checkpointing:
        reasons.append("activation checkpointing is on because the faster splits without it do not fit")
    if chosen.inputs.uses_long_context:
        same_kind = [
            e
            for e in tried
            if not e.inputs.uses_long_context and bool(e.inputs.lora_rank) == bool(chosen.inputs.lora_rank)
        ]
        closest = min(same_kind, key=lambda e: _overflow(e, hw)) if same_kind else None
        evidence = (
            f": the closest without, {short_config(closest.inputs)}, needs {_needs_text(closest, hw)}"
            if closest
            else ""
        )
        reasons.append(
            f"--seq-len {seq} needs DeepSpeed ALST ({long_context_text(chosen.inputs)}; exact, the same "
            f"training){evidence}"
        )
    if chosen.inputs.uses_nvme and not chosen.inputs.lora_rank and lora != "never":
        reasons.append(
            "NVMe offload is slow; --lora trains LoRA adapters instead, without NVMe and much faster"
        )
    return AutoChoice(chosen, hw, model, shape, seq, global_batch, reasons, practicality, nvme_bytes)


def _mode_text(c: MemoryInputs) -> str:
    """ZeRO stage and offload in words (the level of partitioning a miss is reported at)."""
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


def _needs_text(ev: Evaluation, hw: Hardware) -> str:
    parts = []
    if not ev.fits_device:
        parts.append(f"{ev.device_bytes / GiB:.1f} GiB per GPU (usable {hw.gpu_limit_bytes / GiB:.1f})")
    if not ev.fits_host:
        export = ev.estimate.host_terms.get("export_peak", 0)
        parts.append(
            f"{ev.host_bytes / GiB:.0f} GiB host RAM (usable {hw.host_limit_bytes / GiB:.0f}; "
            f"{export / GiB:.0f} of it the final export)"
        )
    if not ev.fits_nvme:
        parts.append(f"{ev.estimate.nvme_bytes / GiB:.0f} GiB of NVMe (--nvme-gib)")
    return " and ".join(parts)


def _nowhere(model: str, hw: Hardware, tried: list[Evaluation], lora: str, nvme_bytes: int) -> str:
    """The one-line 'does not fit anywhere' message, with the least-overflowing configuration."""

    # The closest by GPU and host RAM; NVMe space is reported separately (it is the user's to give).
    with_nvme = [e for e in tried if e.fits_device and e.fits_host and not e.fits_nvme]
    # Without --nvme-gib NVMe is not on the table: the closest is one the user can run as told.
    pool = [e for e in tried if not e.inputs.uses_nvme] if not nvme_bytes else tried
    closest = min([e for e in pool if e not in with_nvme] or tried, key=lambda e: _overflow(e, hw))
    nvme_text = ""
    if with_nvme:
        best = min(with_nvme, key=_auto_key)
        nvme_text = (
            f"; NVMe offload would fit with --nvme-gib >= {best.estimate.nvme_bytes / GiB:.0f}, at "
            f"~{best.time.total:,.0f} s/step and ~{best.time.tokens_per_s:,.0f} tokens/s"
        )
    what = {"fallback": "full or LoRA", "never": "full", "always": "LoRA"}[lora]
    alst = (
        ", sequence parallel, tiled MLP/loss, checkpoint offload"
        if any(e.inputs.uses_long_context for e in tried)
        else ""
    )
    where = (
        f"{hw.gpus} x {hw.name} ({hw.gpu_mem_bytes / GiB:.1f} GiB)"
        if hw.kind == "cuda"
        else f"{hw.gpus} CPU process(es)"
    )
    offload = "CPU/NVMe offload" if nvme_bytes else "CPU offload"
    return (
        f"{model} DOES NOT FIT anywhere on {where} with {hw.host_ram_bytes / GiB:.0f} GiB host RAM "
        f"({what} fine-tune, every ZeRO stage, {offload}, checkpointing, micro-batch 1{alst}): "
        f"the closest, {short_config(closest.inputs)}, needs {_needs_text(closest, hw)}{nvme_text}; add GPUs "
        "(--gpus), bigger cards or more host RAM, or shorten --seq-len"
    )


def _auto_key(ev: Evaluation) -> tuple[bool, bool, float, int]:
    # Without NVMe before with it, fp32 optimizer states before bf16 ones (module docstring), then
    # fastest; among equally fast ones (same step time to the millisecond) the one that needs
    # less memory, e.g. ZeRO-0 over ZeRO-1/2 on a single GPU.
    c = ev.inputs
    return (c.uses_nvme, c.state_dtype == "bf16", round(ev.time.total, 3), ev.device_bytes + ev.host_bytes)


def _kind(c: MemoryInputs) -> str:
    if not c.lora_rank:
        return "full"
    return "QLoRA" if c.quantize != "none" else "LoRA"


def auto_recipe_yaml(auto: AutoChoice, data: str | None = None) -> str:
    """A complete recipe for the chosen configuration, with a header like the shipped ones."""
    import yaml

    hw, c, ev = auto.hardware, auto.inputs, auto.evaluation
    corpus = data or str((RECIPES_DIR / "../llm_train/assets/tiny/corpus.txt").resolve())
    # Under sequence parallelism sdpa sees one causal sequence per row: one sample per row.
    packing = {"packing": "padded"} if c.sp > 1 else {}
    switches = {name: True for name, _ in LONG_CONTEXT_SWITCHES if getattr(c, name)}
    slug = re.sub(r"[^a-z0-9]+", "-", auto.model.lower()).strip("-")[-40:]
    body: dict[str, Any] = {
        "name": f"auto-{slug}",
        "description": f"Auto-planned {_kind(c)} fine-tune of {auto.model} on {hw.gpus} x {hw.name}",
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
        "data": {"train": [corpus], "eval_fraction": 0.02, "seq_len": auto.seq_len, **packing},
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
            **({"state_dtype": "bf16"} if c.state_dtype == "bf16" else {}),
        },
        "precision": auto.precision,
        "memory": {"activation_checkpointing": c.activation_checkpointing, "attention": "auto", **switches},
        **(
            {
                "lora": {
                    "rank": c.lora_rank,
                    "alpha": 2.0 * c.lora_rank,
                    "dropout": 0.05,
                    **({"quantize": c.quantize} if c.quantize != "none" else {}),
                }
            }
            if c.lora_rank
            else {}
        ),
        "deepspeed": {"config": auto.ds_config, **({"sequence_parallel": c.sp} if c.sp > 1 else {})},
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
        f"needs:    {verdict(ev, hw, auto.practicality, auto.nvme_bytes)}",
        f"speed:    ~{ev.time.total:.2f} s/step, ~{ev.time.tokens_per_s:,.0f} tokens/s (rough model)",
        *([f"instead:  {auto.practicality.instead}"] if auto.practicality.instead else []),
        "why:",
        *(f"  - {r}" for r in auto.reasons),
    ]
    if path is not None:
        lines.append(f"recipe written to {path}")
    return "\n".join(lines)
