"""Optimizer and learning-rate schedule for the recipe's `optim` section.

When the DeepSpeed JSON has its own "optimizer"/"scheduler" sections (configs written for
other tools often do), DeepSpeed builds them from the resolved JSON and these are not used.

`optim.name`: torch's AdamW, or bitsandbytes' AdamW8bit / PagedAdamW8bit (Dettmers et al. 2022,
"8-bit Optimizers via Block-wise Quantization"): Adam's m and v as uint8 codes in blocks of 256
with one fp32 maximum per block (bitsandbytes 0.50). DeepSpeed steps it as a client optimizer over
its fp32 master partitions (ZeRO-0/1/2; config/layout.py refuses optimizer offload and ZeRO-3), so
the master weights stay fp32 and only the moments shrink: 2 bytes per trained parameter instead of
8. Tensors under bitsandbytes' `min_8bit_size` (4096 elements: norms, under ZeRO-0 in fp32) keep
32-bit moments, as in bitsandbytes. On CPU the 8-bit optimizers run too; the paged one warns and
runs unpaged (paging needs CUDA unified memory). DeepSpeed 0.19.8's ZeRO-1/2 checkpoint (rigid, its
default) stores the base optimizer's own `state_dict()`, which bitsandbytes writes and reads whole
(codes, block maxima and maps): a resume on the same layout is exact (tests/e2e/test_optim_8bit.py).
Its universal checkpoint (a resume on another layout) knows only Adam's exp_avg / exp_avg_sq, so that
resume is refused (runtime/checkpointing/resume.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from llm_train.config.layout import EIGHT_BIT_OPTIMIZERS
from llm_train.config.recipe_sections import OptimSection
from llm_train.errors import UserError
from llm_train.runtime.model.quantized_base import INSTALL_HINT


def lr_factor(step: int, optim: OptimSection, max_steps: int) -> float:
    """Multiplier of optim.lr at optimizer step `step` (0-based): linear warmup, then decay."""
    if step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - optim.warmup_steps) / max(1, max_steps - optim.warmup_steps))
    floor = optim.min_lr_ratio
    if optim.schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    # No decay on biases and norm weights (1-D tensors), the usual LLM practice. Under ZeRO-3 every
    # parameter built in zero.Init is an empty 1-D placeholder; its real shape is `ds_shape` (without
    # it every matrix landed in the no-decay group: weight decay silently 0, one optimizer group).
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for param in model.parameters():
        if param.requires_grad:
            (decay if len(getattr(param, "ds_shape", param.shape)) >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(
    model: torch.nn.Module, optim: OptimSection, offload_optimizer: str
) -> torch.optim.Optimizer:
    groups = _param_groups(model, optim.weight_decay)
    if offload_optimizer != "none":
        # ZeRO-Offload steps the optimizer on the CPU; DeepSpeed refuses a plain torch
        # optimizer there ("ZeRO-Offload with a client optimizer"), its CPU Adam is the fast one.
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        # optim.state_dtype=bf16: the moments take the dtype of the (bf16) master weights. DeepSpeed's
        # bf16_optimizer_states asserts this flag is off rather than setting it on a client optimizer.
        return DeepSpeedCPUAdam(
            groups,
            lr=optim.lr,
            betas=optim.betas,
            eps=optim.eps,
            adamw_mode=True,
            fp32_optimizer_states=optim.state_dtype == "fp32",
        )
    if optim.name in EIGHT_BIT_OPTIMIZERS:
        import bitsandbytes as bnb

        eight_bit = bnb.optim.PagedAdamW8bit if optim.name == "paged_adamw_8bit" else bnb.optim.AdamW8bit
        return eight_bit(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps)
    # Fused AdamW on CUDA and on the CPU alike (torch >= 2.4 has both kernels): one pass over each
    # tensor instead of torch's per-tensor loop of ~8 elementwise ops. On the CPU the loop was ~3% of
    # a tiny-cpu step (torch.profiler: lerp_/mul_/addcmul_/sqrt/div/addcdiv_ against one
    # _fused_adamw_, 8x faster on a 1.9M-element flat ZeRO partition), and the HF Trainer's default
    # (`adamw_torch_fused` in transformers 5.24 with torch >= 2.8) is this kernel on both devices. Its arithmetic is ordered
    # differently: updates agree with the loop's to ~1 ulp (tests/unit/test_optim.py).
    return torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps, fused=True)


def is_eight_bit(optimizer: Any) -> bool:
    """The optimizer DeepSpeed steps (inside its ZeRO or bf16 wrapper) is one of bitsandbytes' 8-bit ones."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return hasattr(inner, "name2qmap") and hasattr(inner, "fill_qmap")


def check_optimizer_package(optim: OptimSection) -> None:
    """Refuse in one line, before any worker starts, an 8-bit optimizer on a machine without bitsandbytes."""
    if optim.name not in EIGHT_BIT_OPTIMIZERS:
        return
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise UserError(
            f"optim.name={optim.name} needs bitsandbytes, which does not import ({exc}); {INSTALL_HINT}, "
            "or set optim.name=adamw"
        ) from None


def build_scheduler(
    optimizer: torch.optim.Optimizer, optim: OptimSection, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, optim, max_steps))


def release_moments(optimizer: torch.optim.Optimizer) -> int:
    """Drop the Adam moments of an optimizer whose run is over; returns the bytes freed (this rank).

    At the end of a run the final checkpoint is already committed and only the export is
    left, which gathers a 16-bit copy of the model into host RAM. With the optimizer
    offloaded the moments are two thirds of the host's optimizer state (m and v of master,
    m, v), so freeing them first keeps the export inside the training phase's footprint
    (planning/memory/estimate.py counts it that way). DeepSpeed's ZeRO and bf16 wrappers keep the
    optimizer that steps, and its state, in `.optimizer`.
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    state = getattr(inner, "state", None)
    if not isinstance(state, dict):
        return 0
    freed = sum(
        value.numel() * value.element_size()
        for per_param in state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    )
    state.clear()
    return freed
