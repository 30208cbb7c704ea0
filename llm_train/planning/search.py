"""The cheapest changes that make a configuration fit (or run faster), found by search.

Fixes are searched, not listed from a script: every combination of activation
checkpointing, a smaller micro-batch (more accumulation, same global batch), ZeRO-3,
optimizer offload, parameter offload, NVMe offload and LoRA is estimated; those that fit
are ranked by estimated step time, and a combination is dropped when a subset of its
changes already fits at least as fast. Changes that alter what is trained (LoRA) are
ranked after those that train the same model.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from llm_train.config.hardware import Hardware
from llm_train.planning.fit import SHIPPED_DS_CONFIGS, SUGGESTED_LORA_RANK, Evaluation, evaluate
from llm_train.planning.memory import (
    MemoryInputError,
    MemoryInputs,
)
from llm_train.planning.speed import step_time

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
    base: MemoryInputs, new: MemoryInputs, recipe: Any, ds_name: str | None
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


def _memory_modes(base: MemoryInputs, kind: str, saving_only: bool) -> list[tuple[int, str, str]]:
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
    start = base if base.grad_accum == grad_accum else base.vary(grad_accum=grad_accum)
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
        try:
            candidate = start.vary(
                zero_stage=mode[0],
                offload_optimizer=mode[1],
                offload_params=mode[2],
                micro_batch_size=mb,
                grad_accum=per_rank // mb,
                activation_checkpointing=ckpt,
                lora_rank=rank,
                zero_init=None,  # follows the stage
            )
        except MemoryInputError:
            continue  # a combination the layout rules refuse
        if candidate.knobs == start.knobs:
            continue
        ev = evaluate(candidate, hw)
        slowdown = ev.time.total / reference if reference else 1.0
        if not ev.fits or (faster and slowdown > 0.95):
            continue
        changes, overrides = describe_changes(
            start, candidate, recipe, SHIPPED_DS_CONFIGS.get(candidate.ds_key)
        )
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
