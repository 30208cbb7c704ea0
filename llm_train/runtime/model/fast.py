"""Speed switches that are not part of the model or the optimizer: allocator, Liger, torch.compile.

Each is a recipe field (`memory.liger_kernels`, `memory.torch_compile`) or a safe default
(the CUDA allocator's expandable segments), documented in docs/observability.md with
what it costs and what it saves. Fused AdamW on CUDA lives in llm_train/runtime/model/optim.py.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import MutableMapping
from typing import TYPE_CHECKING

from llm_train.config.hardware import describe_pairs
from llm_train.config.recipe_sections import MemorySection
from llm_train.errors import UserError

if TYPE_CHECKING:
    from accelerate.utils import TorchDynamoPlugin

ALLOC_CONF = "expandable_segments:True"


def set_cuda_alloc_conf() -> bool:
    """Use expandable segments in the CUDA caching allocator unless the user configured it.

    Expandable segments let the allocator grow a segment instead of carving new fixed
    blocks, which removes most fragmentation OOMs of long runs with varying shapes (eval,
    the last partial batch, ZeRO-3's gathered parameters) at no measured speed cost.

    The allocator reads the variable once, when CUDA is first initialised, and asking the
    device for its name or bf16 support (hardware detection) already initialises it. So the
    entry point calls this before anything touches torch.cuda, and this function itself asks
    torch nothing: on a machine without CUDA the variable is simply unused. Workers the entry
    point starts inherit it. Returns whether it set the variable.
    """
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ or "PYTORCH_ALLOC_CONF" in os.environ:
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF
    return True


# NCCL's own switch; NCCL_P2P_LEVEL is the finer one. A user who set either has decided already.
NCCL_P2P_VARS = ("NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL")


def disable_nccl_p2p(
    pairs_without_p2p: list[tuple[int, int]], environ: MutableMapping[str, str] = os.environ
) -> str | None:
    """Set NCCL_P2P_DISABLE=1 when some pair of this node's GPUs has no peer-to-peer access.

    On such GPUs (RTX 40xx, many PCIe boards) NCCL's P2P transport hangs or fails instead of
    falling back; with P2P off NCCL goes through host shared memory, slower but working. NCCL
    reads the variable when the process group initialises, so the entry point calls this right
    after hardware detection. A value the user set (even "0") is kept. Returns the one-line
    notice, or None when nothing was changed.
    """
    if not pairs_without_p2p or any(name in environ for name in NCCL_P2P_VARS):
        return None
    environ["NCCL_P2P_DISABLE"] = "1"
    return (
        f"GPUs {describe_pairs(pairs_without_p2p)} have no peer-to-peer access: set NCCL_P2P_DISABLE=1 so "
        "NCCL does not hang (export NCCL_P2P_DISABLE=0 to keep P2P)"
    )


def check_attention_kernel(memory: MemorySection) -> None:
    """flash_attention_2 only when its package is importable: refuse in one line before any worker starts.

    With it, packed batches (position ids restarting per sample, no attention mask) run
    padding-free through flash-attn's variable-length kernel; without the package
    transformers would fail inside every worker while loading the model.
    """
    if memory.attention != "flash_attention_2":
        return
    try:
        import flash_attn  # noqa: F401
    except ImportError as exc:
        raise UserError(
            f"memory.attention=flash_attention_2 but flash-attn does not import ({exc}); "
            "pip install flash-attn --no-build-isolation, or set memory.attention=sdpa"
        ) from None


def apply_liger(memory: MemorySection, model_type: str | None, zero_stage: int) -> str | None:
    """Patch the model classes with Liger kernels before the model is built; returns a notice or None.

    Under ZeRO-3 the fused linear cross-entropy is left out: it reads lm_head.weight
    without calling lm_head, so ZeRO-3 never gathers that partitioned weight.
    """
    if not getattr(memory, "liger_kernels", False):
        return None
    import torch

    if not torch.cuda.is_available():
        raise UserError(
            "memory.liger_kernels=true needs a CUDA GPU (Liger's kernels are Triton); set memory.liger_kernels=false"
        )
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        raise UserError(
            "memory.liger_kernels=true needs the liger-kernel package: pip install liger-kernel "
            "(or set memory.liger_kernels=false)"
        ) from None
    patch = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type or "")
    if patch is None:
        known = ", ".join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))
        raise UserError(
            f"memory.liger_kernels=true: Liger has no kernels for model_type '{model_type}'; supported: {known}"
        )
    # memory.tiled_loss replaces the model's forward on the instance (runtime/loss/chunked.py), which
    # bypasses Liger's patched class forward: it calls Liger's fused kernel itself where it can run.
    tiled_loss = getattr(memory, "tiled_loss", False)
    fused = zero_stage != 3 and not tiled_loss
    wanted = {"fused_linear_cross_entropy": fused, "cross_entropy": not fused and not tiled_loss}
    accepted = inspect.signature(patch).parameters
    patch(**{k: v for k, v in wanted.items() if k in accepted})
    if tiled_loss:
        where = (
            "chunked: ZeRO-3 partitions the output layer"
            if zero_stage == 3
            else "Liger's fused linear cross-entropy"
        )
        return f"Liger kernels on (RMSNorm, RoPE, SwiGLU; memory.tiled_loss: {where})"
    if zero_stage == 3:
        return "Liger kernels on (without fused linear cross-entropy, which ZeRO-3 cannot feed)"
    return "Liger kernels on (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy)"


def dynamo_plugin(memory: MemorySection) -> TorchDynamoPlugin:
    """Accelerate's TorchDynamoPlugin for memory.torch_compile; `prepare` compiles the DeepSpeed engine's module.

    'layers' is Accelerate's regional compilation for DeepSpeed (accelerate.utils.compile_regions_deepspeed):
    each decoder layer (a repeated block) and the few other leaf modules are compiled in place with
    `module.compile()`, so parameter names, DeepSpeed's hooks and checkpoints are those of the plain
    model, and the compiled layer graph is reused by every layer: one layer's compile time instead of
    the whole model's (https://pytorch.org/tutorials/recipes/regional_compilation.html). 'model' is
    DeepSpeed's own `engine.compile()`. Every field is set here, so an accelerate config's
    ACCELERATE_DYNAMO_* variables never switch compilation on or off behind the recipe's back.
    """
    from accelerate.utils import TorchDynamoPlugin

    compile_ = getattr(memory, "torch_compile", "off")
    return TorchDynamoPlugin(
        backend="no" if compile_ == "off" else "inductor",
        mode="default",
        fullgraph=False,
        use_regional_compilation=compile_ == "layers",
    )


def compile_notice(memory: MemorySection) -> str | None:
    compile_ = getattr(memory, "torch_compile", "off")
    if compile_ == "off":
        return None
    what = "each decoder layer, in place" if compile_ == "layers" else "the whole model, via DeepSpeed"
    return f"torch.compile on ({what}): the first steps are slow while graphs compile"
