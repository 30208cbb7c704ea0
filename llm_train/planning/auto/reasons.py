"""The "why" lines of `--recipe auto`: each one is something the search evaluated (the kind chosen and what
it beat, the runner-up, the lighter configurations that miss, the techniques switched on, the pinning, and
the closest miss when nothing fits). planning/auto/choose.py's choose_auto composes them.
"""

from __future__ import annotations

from collections.abc import Callable

from llm_train.config.hardware import Hardware
from llm_train.planning.auto.request import (
    CHUNKED_LOSS,
    EXACT_BASE_MARGIN,
    FULL,
    LONG_CONTEXT_PINS,
    NO_ALST,
    AutoRequest,
    Kind,
    auto_key,
    fastest_fitting,
    kind_name,
    prefer_exact_base,
)
from llm_train.planning.memory.estimate import estimate_memory
from llm_train.planning.memory.inputs import MemoryInputs
from llm_train.planning.search.candidate import (
    Evaluation,
)
from llm_train.planning.search.fixes import (
    Practicality,
    long_context_text,
    short_config,
)
from llm_train.units import GiB


def policy_cost(full: Evaluation, alternatives: list[Evaluation], lora: str) -> list[str]:
    """What the policy's preference for a full fine-tune costs: the adapters that fit and would be faster (the
    one auto would pick among them), with both step times; nothing when no adapter configuration is faster."""
    best, fitting = fastest_fitting([e for e in alternatives if e.inputs.lora_rank])
    if best is None:
        return []
    best = prefer_exact_base(best, fitting)
    if best.time.total >= full.time.total:
        return []
    why = (
        "as --no-lora asks"
        if lora == "never"
        else "auto's policy: every weight is trained where a practical full fine-tune fits; --lora for adapters"
    )
    return [
        f"full fine-tune preferred ({why}): ~{full.time.total:,.1f} s/step against {kind_name(best.inputs)}'s "
        f"~{best.time.total:,.1f} ({short_config(best.inputs)}, rank {best.inputs.lora_rank})"
    ]


def lora_reasons(
    ask: AutoRequest,
    full: Evaluation | None,
    full_verdict: Practicality | None,
    best_lora: Evaluation,
    lora: str,
    full_tried: list[Evaluation],
    lora_tried: list[Evaluation],
) -> list[str]:
    """Why the choice trains LoRA (or QLoRA) adapters, from what the search evaluated: adapters were asked for
    (a full fine-tune was not planned), or the full fine-tune is impractical, or none fits (with the closest);
    and why the base is 4-bit, against the 16-bit bases it was weighed with."""
    hw, rank = ask.hw, best_lora.inputs.lora_rank
    adapters = f"LoRA adapters (rank {rank}) on the frozen model"
    reasons = []
    if FULL not in ask.kinds:
        asked = f"{ask.lora_keys[0]} configures adapters" if ask.lora_keys else "--lora"
        reasons.append(f"{asked}: this trains {adapters}; a full fine-tune was not planned")
    elif full is not None and full_verdict is not None:
        reasons.append(
            f"a full fine-tune fits ({short_config(full.inputs)}) but is impractical: "
            f"{'; '.join(full_verdict.reasons)}; so this trains {adapters} (--no-lora for the full fine-tune)"
        )
    elif full_tried:
        closest = _closest(ask, full_tried)
        nvme = "" if ask.nvme_bytes else " (NVMe offload is considered only with --nvme-gib N)"
        reasons.append(
            f"no full fine-tune fits{nvme}: the closest, {short_config(closest.inputs)}, needs "
            f"{_needs_text(closest, hw)}; so this trains {adapters}"
        )
    if best_lora.inputs.quantize != "none":
        reasons.append(_quantized_base_reason(ask, best_lora, lora_tried))
    return reasons


def _quantized_base_reason(ask: AutoRequest, chosen: Evaluation, lora_tried: list[Evaluation]) -> str:
    """Why the frozen base is quantised: the user's lora.quantize, or the 16-bit bases it beat or that do not fit."""
    quantize = chosen.inputs.quantize
    bits = 8 if quantize == "int8" else 4  # lora.quantize: nf4 (4-bit) or int8
    what = f"the frozen base loads in {bits} bits (QLoRA, lora.quantize={quantize}; pip install 'llm_train[qlora]')"
    if "quantize" in ask.pins:
        return f"{what}, as lora.quantize={quantize} asks"
    sixteen = [e for e in lora_tried if e.inputs.quantize == "none"]
    fitting = [e for e in sixteen if e.fits]
    if fitting:
        best = min(fitting, key=auto_key)
        return (
            f"{what}: ~{chosen.time.total:,.1f} s/step against ~{best.time.total:,.1f} for the fastest with a "
            f"16-bit base ({short_config(best.inputs)}), faster by more than {EXACT_BASE_MARGIN - 1:.0%}"
        )
    if not sixteen:
        return f"{what}: no configuration with a 16-bit base was estimated"
    closest = _closest(ask, sixteen)
    return (
        f"{what}: no configuration with a 16-bit base fits; the closest, {short_config(closest.inputs)}, needs "
        f"{_needs_text(closest, ask.hw)}"
    )


def runner_up(chosen: Evaluation, fitting: list[Evaluation]) -> list[str]:
    """The fastest fitting configuration of another kind (full, LoRA, QLoRA), else of another DS JSON that is not
    just as fast (ZeRO-1 on one GPU is ZeRO-0), with both step times."""
    others = [e for e in fitting if kind_name(e.inputs) != kind_name(chosen.inputs)]
    if not others:
        others = [e for e in fitting if e.time.total > chosen.time.total * 1.001]
    if not others:
        return []
    second = min(others, key=auto_key)

    def seconds(e: Evaluation) -> str:
        hidden = (
            f" ({e.time.overlapped:,.1f} if prefetch hides the copies)" if e.time.pcie_hideable > 0.05 else ""
        )
        return f"~{e.time.total:,.1f} s/step{hidden}"

    return [
        f"runner-up: {short_config(second.inputs)}{_pinning_text(second.inputs)}: {seconds(second)}, against "
        f"{seconds(chosen)} for this one"
    ]


def _pinning_text(c: MemoryInputs) -> str:
    if c.offload_optimizer == "none" and c.offload_params == "none":
        return ""
    pinning = c.pinning if c.offload_optimizer != "none" else c.param_pinning
    return f", {'pageable' if pinning == 'off' else pinning + '-pinned'} host buffers"


def lighter_misses(ask: AutoRequest, chosen: Evaluation, tried: list[Evaluation]) -> list[str]:
    """The evidence for the level of partitioning/offload: the lighter (faster) modes of the chosen kind
    that do not fit even at their smallest (micro-batch 1, checkpointing), closest to fitting first."""
    hw = ask.hw
    by_mode: dict[tuple[int, str, str], list[Evaluation]] = {}
    for e in tried:
        if kind_name(e.inputs) == kind_name(chosen.inputs):
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
    """Why the choice turns on what costs speed (activation checkpointing, the chunked loss, DeepSpeed ALST,
    NVMe offload), each with the evaluated configurations that say so."""
    c = chosen.inputs
    reasons = []
    if ask.overrides:
        reasons.append(f"planned with your overrides as written: {' '.join(ask.overrides)}")
    if c.activation_checkpointing and "activation_checkpointing" not in ask.pins:
        reasons.append(
            _switch_reason(
                ask, chosen, tried, "activation checkpointing is on", lambda e: not e.activation_checkpointing
            )
        )
    if _pinning_text(c) and "pinning" not in ask.pins:
        reasons.append(_pinning_reason(ask, c))
    if c.long_context == CHUNKED_LOSS and "tiled_loss" not in ask.pins:
        reasons.append(
            _switch_reason(
                ask,
                chosen,
                tried,
                "the loss runs in chunks (memory.tiled_loss: exact, never the whole logits)",
                lambda e: e.long_context == NO_ALST,
            )
        )
    elif c.uses_long_context and not ask.pins & LONG_CONTEXT_PINS:
        reasons.append(_long_context_reason(ask, chosen, tried))
    if c.uses_nvme and not c.lora_rank and lora != "never":
        lighter, _ = fastest_fitting([e for e in tried if e.inputs.lora_rank and not e.inputs.uses_nvme])
        reasons.append(
            "NVMe offload is slow; "
            + (
                f"LoRA adapters (--lora) fit without it: ~{lighter.time.total:,.1f} s/step against "
                f"~{chosen.time.total:,.1f} ({short_config(lighter.inputs)})"
                if lighter is not None
                else "no adapter configuration fits without it either"
            )
        )
    return reasons


def _switch_reason(
    ask: AutoRequest,
    chosen: Evaluation,
    tried: list[Evaluation],
    what: str,
    without: Callable[[MemoryInputs], bool],
) -> str:
    """Why a switch that costs compute is on: the fastest configuration of the chosen kind without it that fits
    (slower, since the choice is the fastest), or the closest one without it when none fits."""
    kind = kind_name(chosen.inputs)
    others = [e for e in tried if kind_name(e.inputs) == kind and without(e.inputs)]
    kind = "full fine-tune" if kind == "full" else kind
    best, _ = fastest_fitting(others)
    if best is not None:
        return (
            f"{what}: it lets a faster configuration fit; the fastest without it, {short_config(best.inputs)}, "
            f"takes ~{best.time.total:,.1f} s/step"
        )
    if not others:
        return f"{what}: no {kind} configuration without it was estimated"
    closest = _closest(ask, others)
    return (
        f"{what}: no {kind} configuration without it fits; the closest, {short_config(closest.inputs)}, needs "
        f"{_needs_text(closest, ask.hw)}"
    )


def _pinning_reason(ask: AutoRequest, c: MemoryInputs) -> str:
    """Why the offload buffers are pinned the way the recipe says (deepspeed.pinning, planning/memory/pinning.py)."""
    pinning = c.pinning if c.offload_optimizer != "none" else c.param_pinning
    native = c.vary(pinning="native", param_pinning="native")
    locked = estimate_memory(native).locked_per_rank
    limit = f"this shell's memlock limit is {ask.memlock.describe()}"
    if pinning == "native":
        return f"deepspeed.pinning=native: exact-size pinned host buffers (~{locked / GiB:.1f} GiB locked per process; {limit})"
    why = (
        f"native pinning would lock ~{locked / GiB:.1f} GiB per process and {limit}"
        if not ask.memlock.allows(locked)
        else "it is the fastest that fits"
    )
    what = (
        "torch's pinned allocator (rounded up to powers of two)"
        if pinning == "torch"
        else "pageable (slower copies)"
    )
    return f"deepspeed.pinning={pinning}: host buffers {what}: {why}"


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


def _closest(ask: AutoRequest, evs: list[Evaluation]) -> Evaluation:
    """The evaluation closest to fitting; without --nvme-gib one without NVMe (NVMe is no option then)."""
    pool = [e for e in evs if not e.inputs.uses_nvme] if not ask.nvme_bytes else evs
    return min(pool or evs, key=lambda e: _overflow(e, ask.hw))


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


def nowhere(model: str, hw: Hardware, tried: list[Evaluation], kinds: list[Kind], nvme_bytes: int) -> str:
    """The one-line 'does not fit anywhere' message, with the least-overflowing configuration."""

    if not tried:
        # Nothing was estimated (every candidate broke a layout rule): there is no closest to report.
        return (
            f"--recipe auto: no configuration of {model} could be estimated on {hw.gpus} GPU(s) with these "
            "flags and overrides (each breaks a layout rule); drop a pinned knob (an override) and plan again"
        )
    # The closest by GPU and host RAM; NVMe space is reported separately (it is the user's to give).
    with_nvme = [e for e in tried if e.fits_device and e.fits_host and not e.fits_nvme]
    # Without --nvme-gib NVMe is not on the table: the closest is one the user can run as told.
    pool = [e for e in tried if not e.inputs.uses_nvme] if not nvme_bytes else tried
    closest = min([e for e in pool if e not in with_nvme] or tried, key=lambda e: _overflow(e, hw))
    nvme_text = ""
    if with_nvme:
        best = min(with_nvme, key=auto_key)
        nvme_text = (
            f"; NVMe offload would fit with --nvme-gib >= {best.estimate.nvme_bytes / GiB:.0f}, at "
            f"~{best.time.total:,.0f} s/step and ~{best.time.tokens_per_s:,.0f} tokens/s"
        )
    names = dict.fromkeys("full" if k == FULL else "QLoRA" if k[1] != "none" else "LoRA" for k in kinds)
    what = " or ".join(names)  # the kinds estimated, as the flags and overrides allowed
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
