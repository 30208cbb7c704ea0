"""Speed switches that are not part of the model or the optimizer: allocator, Liger, torch.compile.

Each is a recipe field (`memory.liger_kernels`, `memory.torch_compile`) or a safe default
(the CUDA allocator's expandable segments), documented in docs/observability.md with
what it costs and what it saves. Fused AdamW on CUDA lives in llm_train/runtime/optim.py.
"""

from __future__ import annotations

import functools
import inspect
import os
import shutil
import sys
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, ParamSpec, TypeVar, cast

from llm_train.config.hardware import describe_pairs
from llm_train.config.recipe import MemorySection
from llm_train.errors import UserError

if TYPE_CHECKING:
    from accelerate.utils import TorchDynamoPlugin

ALLOC_CONF = "expandable_segments:True"

P = ParamSpec("P")  # the wrapped function's parameters (the op loader, DeepSpeed's Muon kernels)
R = TypeVar("R")


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


def prepare_op_loads() -> None:
    """Call before DeepSpeed loads or builds an op in this process (the three functions below say why)."""
    remember_cpu_info()
    use_environment_ninja()
    build_ops_without_debug_info()


def remember_cpu_info() -> bool:
    """Ask py-cpuinfo once per process instead of at every DeepSpeed op that loads.

    DeepSpeed 0.19.8 calls `cpuinfo.get_cpu_info()` in each op builder's cpu_arch() and simd_width()
    (ops/op_builder/builder.py) and again when DeepSpeedCPUAdam is made (ops/adam/cpu_adam.py): 3
    calls in a CPU-offload worker, 5 with the async-I/O op of NVMe offload. Each call starts a Python
    subprocess that probes and times the CPU: 1.1 s apiece measured on 2 cores, 2.3 s of the 4.7 s
    "deepspeed init" of a tiny zero3_offload worker. The answer is the machine's and DeepSpeed only
    reads it (arch, flags, vendor), so one call per process serves every op. Returns False without
    py-cpuinfo (DeepSpeed then falls back to lscpu itself).
    """
    try:
        import cpuinfo  # type: ignore[import-untyped]  # py-cpuinfo ships no type hints
    except ImportError:
        return False
    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):  # not wrapped yet in this process
        cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)
    return True


# What build_ops_without_debug_info adds to every op's compiler flags (the last -g option wins).
NO_DEBUG_INFO = "-g0"


def build_ops_without_debug_info() -> bool:
    """JIT-build DeepSpeed's ops without debug information: the same code, a third less compile time.

    DeepSpeed compiles its ops with `-g` (op_builder/builder.py cxx_args), and each source includes
    torch/extension.h: writing the debug information of all of torch's headers was a third of the
    work. One async-I/O source measured on 2 cores: 38.7 CPU-s with -g, 26.4 with -g0; the first
    launch of a CPU-offload recipe builds cpu_adam (106 CPU-s with -g), NVMe offload async_io (362).
    The flag goes last in the flags DeepSpeed hands to torch.utils.cpp_extension.load, which every op
    builder imports when it builds. Every process that loads ops calls prepare_op_loads, so all build
    with the same flags (torch rebuilds an op whose command line changed). Returns False once done.
    """
    import torch.utils.cpp_extension as cpp_extension

    load = cpp_extension.load
    if getattr(load, "adds_no_debug_info", False):
        return False

    load_without_debug_info = _adding_cflag(load, NO_DEBUG_INFO)
    load_without_debug_info.adds_no_debug_info = True  # type: ignore[attr-defined]
    cpp_extension.load = load_without_debug_info
    return True


def _adding_cflag(load: Callable[P, R], flag: str) -> Callable[P, R]:
    """`load` (torch.utils.cpp_extension.load) with `flag` last in its extra_cflags."""

    @functools.wraps(load)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        given = cast("list[str] | None", kwargs.get("extra_cflags"))  # load's own annotation
        kwargs["extra_cflags"] = [*(given or []), flag]
        return load(*args, **kwargs)

    return call


def use_environment_ninja(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Build DeepSpeed's ops with this Python environment's own `ninja`, whatever PATH finds first.

    torch JIT-builds DeepSpeed's ops (cpu_adam, async_io, the CPU shared-memory all-reduce) with the
    first `ninja` on PATH, into one folder per op. A virtual environment has its own (pip's ninja, a
    DeepSpeed requirement) and the system often another (/usr/bin/ninja), and they do not read each
    other's build log: ninja 1.13.2 found "command line changed" for every object ninja 1.11.1 had
    built, and rebuilt it. A launch from an activated environment after one from a plain shell (or the
    other way round) then rebuilt cpu_adam and the rest: 30-90 s per op on 2 cores. Returns whether
    PATH changed (not when the environment has no ninja or PATH already finds it).
    """
    own = Path(sys.executable).parent / "ninja"
    if not own.is_file() or shutil.which("ninja", path=environ.get("PATH")) == str(own):
        return False
    environ["PATH"] = os.pathsep.join(p for p in (str(own.parent), environ.get("PATH", "")) if p)
    return True


def defer_muon_compile() -> bool:
    """torch.compile DeepSpeed's Muon kernels when Muon first runs, not when DeepSpeed asks whether it runs.

    DeepSpeed 0.19.8 imports deepspeed/runtime/zero/muon/original_muon.py in every ZeRO engine (its
    optimizer check, stage_1_and_2, stage3 and the bf16 optimizer each ask whether the optimizer is
    Muon), and that module applies `torch.compile` to three functions at import. Applying it imports
    torch's inductor compiler: 1.0 s of CPU per process, measured on 2 cores, in every ZeRO worker,
    for kernels no llm_train recipe runs. That module is the only user of
    deepspeed.runtime.compiler.compile(); its replacement here applies the same torch.compile to each
    function at its first call. Call before DeepSpeed builds an engine; returns False once the module
    is imported (too late to matter) or without DeepSpeed.
    """
    if "deepspeed.runtime.zero.muon.original_muon" in sys.modules:
        return False
    try:
        import torch
        from deepspeed.runtime import compiler
    except ImportError:
        return False

    def compile_at_first_call() -> Callable[[Callable[P, R]], Callable[P, R]]:
        def decorate(fn: Callable[P, R]) -> Callable[P, R]:
            compiled: Callable[P, R] | None = None

            @functools.wraps(fn)
            def call(*args: P.args, **kwargs: P.kwargs) -> R:
                nonlocal compiled
                if compiled is None:
                    compiled = torch.compile(fn)
                return compiled(*args, **kwargs)

            return call

        return decorate

    compiler.compile = compile_at_first_call
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
    # memory.tiled_loss replaces the model's forward on the instance (runtime/chunked_loss.py), which
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
