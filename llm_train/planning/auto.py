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
    shipped_settings,
)
from llm_train.planning.memory import GiB
from llm_train.planning.memory_inputs import MemoryInputError, MemoryInputs
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
    A composer: the request, the candidates of each kind evaluated, the pick, then why.
    """
    ask = auto_request(model, hw, seq_len, global_batch, nvme_gib)
    full_tried = [] if lora == "always" else fitting_search(ask, None)
    lora_all = lora_search(ask)
    lora_tried = [] if lora == "never" else lora_all
    tried = full_tried + lora_tried
    # A verdict judges the configuration against everything this hardware could run instead, LoRA
    # included even under --no-lora: the flag says what to choose, not how fast the choice is.
    alternatives = full_tried + lora_all
    chosen, fitting, reasons = pick(ask, full_tried, lora_tried, alternatives, lora)
    practicality = judge(chosen, alternatives)
    reasons.append(f"the fastest of {len(fitting)} fitting configurations (of {len(tried)} estimated)")
    reasons += lighter_misses(ask, chosen, tried)
    reasons += technique_reasons(ask, chosen, tried, lora)
    return AutoChoice(
        chosen, hw, model, ask.shape, ask.seq_len, global_batch, reasons, practicality, ask.nvme_bytes
    )


@dataclass(frozen=True)
class AutoRequest:
    """What `--recipe auto` is asked: a model on hardware, at a sequence length and global batch."""

    model: str
    shape: ModelShape
    hw: Hardware
    seq_len: int
    global_batch: int
    nvme_bytes: int
    """NVMe space per node the user declared (--nvme-gib); 0: NVMe offload never fits."""

    @property
    def precision(self) -> str:
        return default_precision(self.hw.kind, self.hw.bf16)

    @property
    def modes(self) -> list[tuple[int, str, str]]:
        """The shipped DS JSONs' (stage, optimizer offload, parameter offload); offload only on CUDA."""
        return [k for k in SHIPPED_DS_CONFIGS if self.hw.kind == "cuda" or k[1:] == ("none", "none")]


def auto_request(
    model: str, hw: Hardware, seq_len: int | None, global_batch: int, nvme_gib: float | None
) -> AutoRequest:
    """The request with its defaults filled (seq_len: min(2048, the model's maximum)), or UserError
    when no micro-batch divides the global batch over the GPUs."""
    nvme_bytes = int((nvme_gib or 0) * GiB)
    shape = shape_of(model)
    seq = seq_len or min(2048, shape.max_position_embeddings)
    dp = hw.gpus
    if not any(global_batch % (m * dp) == 0 for m in AUTO_MICRO_BATCHES):
        raise UserError(
            f"--global-batch {global_batch} is not a multiple of --gpus {dp}; pick a multiple of {dp}"
        )
    return AutoRequest(model, shape, hw, seq, global_batch, nvme_bytes)


# (sp, tiled_mlp, tiled_loss, offload_checkpoints) without any DeepSpeed ALST technique.
NO_ALST = (1, False, False, False)
# The chunked loss alone (memory.tiled_loss): not only for long rows, a 128k-vocabulary loss costs 12 bytes
# per logit without it, so it is always a candidate; the ranking takes it where it lets a faster
# configuration fit (its ~2% of compute loses to the dense loss where both fit alike).
CHUNKED_LOSS = (1, False, True, False)


def candidates(
    ask: AutoRequest, lora_rank: int | None, long_context: list[tuple[int, bool, bool, bool]], quantize: str
) -> list[MemoryInputs]:
    """Every shipped DS JSON x micro-batch x checkpointing x long-context option that the layout (and
    sequence-parallel) rules accept and whose micro-batch divides the global batch."""
    hw, dp = ask.hw, ask.hw.gpus
    out = []
    states = ("fp32",)  # never bf16 states: see the module docstring
    for mode, micro, ckpt, state, (sp, tiled_mlp, tiled_loss, offload_ckpt) in itertools.product(
        ask.modes, AUTO_MICRO_BATCHES, (False, True), states, long_context
    ):
        ranks = dp // sp  # data-parallel ranks: sp of the GPUs share each sequence
        if ask.global_batch % (micro * ranks):
            continue
        try:
            candidate = MemoryInputs.of(
                shape=ask.shape,
                world_size=dp,
                zero_stage=mode[0],
                offload_optimizer=mode[1],
                offload_params=mode[2],
                precision=ask.precision,
                micro_batch=micro,
                grad_accum=ask.global_batch // (micro * ranks),
                sp=sp,
                gpus_per_node=hw.gpus_per_node,
                seq_len=ask.seq_len,
                activation_checkpointing=ckpt,
                lora_rank=lora_rank,
                quantize=quantize,
                overlap_comm=True,
                state_dtype=state,
                tiled_mlp=tiled_mlp,
                tiled_loss=tiled_loss,
                offload_checkpoints=offload_ckpt,
                # The generated recipe asks for deepspeed.pinning=auto: exact-size buffers.
                pinning="native" if mode[1] != "none" else "torch",
                param_pinning="native" if mode[2] != "none" else "torch",
                **shipped_settings(mode),
            )
        except MemoryInputError:
            continue  # a combination the layout (or sequence-parallel) rules refuse
        out.append(candidate)
    return out


def fitting_search(ask: AutoRequest, lora_rank: int | None, quantize: str = "none") -> list[Evaluation]:
    """The candidates of one kind evaluated: without ALST; with it too when nothing fits without
    (only a long sequence needs it)."""
    first = [NO_ALST, CHUNKED_LOSS]
    out = [evaluate(c, ask.hw, ask.nvme_bytes) for c in candidates(ask, lora_rank, first, quantize)]
    if not any(e.fits for e in out):
        probe = MemoryInputs.of(
            shape=ask.shape, world_size=ask.hw.gpus, gpus_per_node=ask.hw.gpus_per_node, seq_len=ask.seq_len
        )
        options = [o for o in long_context_options(probe)[1:] if o != CHUNKED_LOSS]
        out += [evaluate(c, ask.hw, ask.nvme_bytes) for c in candidates(ask, lora_rank, options, quantize)]
    return out


def lora_search(ask: AutoRequest) -> list[Evaluation]:
    """LoRA candidates evaluated, and QLoRA's (the same adapters on a 4-bit base, bitsandbytes) on CUDA
    when no 16-bit base fits."""
    lora_all = fitting_search(ask, SUGGESTED_LORA_RANK)
    if not any(e.fits for e in lora_all) and ask.hw.kind == "cuda":
        lora_all += fitting_search(ask, SUGGESTED_LORA_RANK, "nf4")
    return lora_all


def fastest_fitting(tried: list[Evaluation]) -> tuple[Evaluation | None, list[Evaluation]]:
    """(the first by `_auto_key` of those that fit, or None; all that fit)."""
    fitting = [e for e in tried if e.fits]
    return (min(fitting, key=_auto_key) if fitting else None), fitting


def pick(
    ask: AutoRequest,
    full_tried: list[Evaluation],
    lora_tried: list[Evaluation],
    alternatives: list[Evaluation],
    lora: str,
) -> tuple[Evaluation, list[Evaluation], list[str]]:
    """(the choice, the fitting configurations of its kind, why LoRA when it is LoRA).

    The fastest full fine-tune that fits, unless it is impractical and a practical LoRA fits; else the
    fastest LoRA that fits; else UserError with the closest miss.
    """
    full, full_fitting = fastest_fitting(full_tried)
    best_lora, lora_fitting = fastest_fitting(lora_tried)
    full_verdict = judge(full, alternatives) if full is not None else None
    # LoRA replaces an impractical full fine-tune only when it is practical itself.
    lora_helps = best_lora is not None and judge(best_lora, alternatives).practical
    if full is not None and full_verdict is not None and (full_verdict.practical or not lora_helps):
        return full, full_fitting, []
    if best_lora is None:
        raise UserError(_nowhere(ask.model, ask.hw, full_tried + lora_tried, lora, ask.nvme_bytes))
    return best_lora, lora_fitting, lora_reasons(ask, full, full_verdict, best_lora, lora)


def lora_reasons(
    ask: AutoRequest,
    full: Evaluation | None,
    full_verdict: Practicality | None,
    best_lora: Evaluation,
    lora: str,
) -> list[str]:
    """Why the choice trains LoRA (or QLoRA) adapters: the full fine-tune is impractical or fits nowhere."""
    reasons = []
    if full is not None and full_verdict is not None:
        reasons.append(
            f"a full fine-tune fits ({short_config(full.inputs)}) but is impractical: "
            f"{'; '.join(full_verdict.reasons)}; so this trains LoRA adapters (rank {SUGGESTED_LORA_RANK}) "
            "on the frozen model (--no-lora for the full fine-tune)"
        )
    elif lora == "fallback":
        nvme = "" if ask.nvme_bytes else " (NVMe offload is considered only with --nvme-gib N)"
        reasons.append(
            "no full fine-tune fits, even with ZeRO-3 and CPU offload"
            f"{nvme}, so this trains LoRA adapters (rank {SUGGESTED_LORA_RANK}) on the frozen model"
        )
    if best_lora.inputs.quantize != "none":
        reasons.append(
            "16-bit LoRA does not fit either, so the frozen base loads in 4 bits (QLoRA, lora.quantize=nf4; "
            "pip install 'llm_train[qlora]')"
        )
    return reasons


def lighter_misses(ask: AutoRequest, chosen: Evaluation, tried: list[Evaluation]) -> list[str]:
    """The evidence for the level of partitioning/offload: the lighter (faster) modes of the chosen kind
    that do not fit even at their smallest (micro-batch 1, checkpointing), closest to fitting first."""
    hw = ask.hw
    by_mode: dict[tuple[int, str, str], list[Evaluation]] = {}
    for e in tried:
        if bool(e.inputs.lora_rank) == bool(chosen.inputs.lora_rank):
            by_mode.setdefault(e.inputs.ds_key, []).append(e)
    misses = [
        min(evs, key=lambda e: _overflow(e, hw))
        for evs in by_mode.values()
        if not any(e.fits for e in evs)
        and min(e.time.total for e in evs) < chosen.time.total
        and (ask.nvme_bytes or not evs[0].inputs.uses_nvme)  # NVMe is no option without --nvme-gib
    ]
    return [
        f"not {_mode_text(e.inputs)}: even at its smallest it needs {_needs_text(e, hw)}"
        for e in sorted(misses, key=lambda e: _overflow(e, hw))[:3]
    ]


def technique_reasons(ask: AutoRequest, chosen: Evaluation, tried: list[Evaluation], lora: str) -> list[str]:
    """Why the choice turns on what costs speed: activation checkpointing, DeepSpeed ALST, NVMe offload."""
    c = chosen.inputs
    reasons = []
    if c.activation_checkpointing:
        reasons.append("activation checkpointing is on because the faster splits without it do not fit")
    if c.long_context == CHUNKED_LOSS:
        reasons.append(
            "the loss runs in chunks (memory.tiled_loss: exact, never the whole logits) because it fits more"
        )
    elif c.uses_long_context:
        reasons.append(_long_context_reason(ask, chosen, tried))
    if c.uses_nvme and not c.lora_rank and lora != "never":
        reasons.append(
            "NVMe offload is slow; --lora trains LoRA adapters instead, without NVMe and much faster"
        )
    return reasons


def _long_context_reason(ask: AutoRequest, chosen: Evaluation, tried: list[Evaluation]) -> str:
    """ALST is on because the sequence needs it: the closest configuration of the same kind without it."""
    hw = ask.hw
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
    return (
        f"--seq-len {ask.seq_len} needs DeepSpeed ALST ({long_context_text(chosen.inputs)}; exact, the same "
        f"training){evidence}"
    )


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
        "deepspeed": {
            "config": auto.ds_config,
            **({"sequence_parallel": c.sp} if c.sp > 1 else {}),
            # Exact-size host buffers when offloading (planning/pinning.py), as the plan assumed.
            **({"pinning": "auto"} if c.offload_optimizer != "none" or c.offload_params != "none" else {}),
        },
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
