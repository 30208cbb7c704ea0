"""The compatibility boundary: every patch of a library's internals and every workaround of a library's
behaviour, each with the version it was verified on.

llm_train drives DeepSpeed's engine (and through it torch's extension builder, py-cpuinfo,
bitsandbytes and Accelerate) in ways no API promises: it skips an op build, caches a probe,
appends a compiler flag, defers a compile, completes a checkpoint load and repairs what a load
leaves wrong. Each of those lives here, is listed in `WORKAROUNDS` with the library version it was
checked against, and is guarded: where the library no longer has what a
patch replaces, the patch does nothing and says so (returns False). The one exception to "lives here": the workarounds of
QLoRA's 4-bit base (`quantizing_on`, `keep_training_layout`) are steps of that base's own load and
evaluation, so they live beside it in runtime/model/quantized_base.py; `WORKAROUNDS` still lists them, with
that module (`Workaround.module`), and tests/unit/test_compat.py holds them to the same rules.

It is one module of some 600 lines on purpose: the boundary is read whole when a library moves (which
patches exist, what each replaces, on which version), and a module per library would scatter that list.

`WINDOWS` holds, for every library whose internals llm_train touches, the versions the suite passed on
and what may break outside them. pyproject.toml's dependencies state the same windows
(tests/unit/test_compat.py keeps the two equal, every workaround's `verified` inside its library's window,
and every DeepSpeed version the package's comments cite inside DeepSpeed's). `llm-train doctor` and the start
of a run warn in one line per installed library outside its window. The exact set the suite last passed on
is requirements-lock.txt, which `make install` installs.

Moving a window to a new release: `make test-latest` (tools/canary.py) installs the newest releases into a
separate environment and runs the unit tier and a few e2e runs on them; where it passes, re-read each
workaround's source location in the new release, raise the window here and in pyproject.toml and each
`verified`, then refresh the lock (`make lock`) in a commit of its own that passes the full suite
(docs/development.md).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import sys
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, cast

if TYPE_CHECKING:
    import torch
    from deepspeed import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine as DeepSpeedPipelineEngine


@dataclass(frozen=True)
class Window:
    """The releases of one library the suite passed on, and what may break outside them."""

    library: str  # the distribution's name, as pip and pyproject.toml spell it
    tested: str  # a version specifier: pyproject.toml's dependency says the same
    breaks: str  # what of llm_train leans on this library's internals


# Each lower end is a release the suite ran on (requirements-lock.txt, or the lock before it); each upper end
# stops before the next minor release, since these libraries change internals in minor releases.
# lm-eval's is a patch release: its 0.4.x releases reshaped the results and model wrappers llm-train eval
# reads. datasets is used through public calls only (load_dataset, map, Features): a major release bounds it.
WINDOWS = (
    Window(
        "deepspeed",
        ">=0.19.8,<0.20",
        "the checkpoint repairs (NVMe and universal resume), op-build speed-ups and pipeline workarounds below",
    ),
    Window(
        "transformers",
        ">=5.24,<5.26",
        "QLoRA's staged 4-bit load, ZeRO-3 model builds, packed-row attention masks, the export check",
    ),
    Window(
        "accelerate",
        ">=1.16,<1.17",
        "the launch (llm_train checks its arguments with accelerate's own parser)",
    ),
    Window("peft", ">=0.21.2,<0.22", "LoRA and QLoRA adapters: wrapping, merging and adapter export"),
    Window("bitsandbytes", ">=0.50.2,<0.51", "QLoRA's 4-bit layers and 8-bit optimizers"),
    Window("lm-eval", ">=0.4.13,<0.4.14", "llm-train eval and eval.tasks (its HF model wrapper and results)"),
    Window("datasets", ">=5.2,<6", "data preparation and streaming (load_dataset, map, Arrow features)"),
)
WINDOW = {w.library: w for w in WINDOWS}
# The DeepSpeed releases every DeepSpeed workaround below was verified on.
DEEPSPEED_TESTED = WINDOW["deepspeed"].tested

# The library internals llm_train names, outside any public API: "module:attribute", the modules that use it.
# A name a library may move or drop in any release is used only if it is listed here, and
# tests/unit/test_compat.py both fails on an import of an unlisted one and resolves every listed one against
# the installed libraries, so a release that takes one away fails the suite (and `make test-latest`, the
# canary, the day it appears) instead of a user's run. Public: each library's top level and
# PUBLIC_MODULES; everything else imported from these libraries is listed.
PUBLIC_MODULES = (
    "transformers.utils", "transformers.utils.logging", "transformers.integrations", "transformers.modeling_outputs",
    "accelerate.utils", "bitsandbytes.nn", "peft.tuners.lora",
)  # fmt: skip
INTERNALS: dict[str, str] = {
    "transformers.core_model_loading:revert_weight_conversion": "runtime/export/verify.py (save_pretrained's key names)",
    "transformers.quantizers.auto:AUTO_QUANTIZER_MAPPING": "runtime/model/quantized_base.py quantizing_on (the staged 4-bit load)",
    "transformers.quantizers.quantizer_bnb_4bit:Bnb4BitHfQuantizer": "runtime/model/quantized_base.py",
    "transformers.integrations.bitsandbytes:Bnb4bitQuantize": "runtime/model/quantized_base.py (the staged quantize op)",
    "transformers.integrations.deepspeed:_hf_deepspeed_config_weak_ref": "compat.without_hf_zero3_config",
    "transformers.integrations.deepspeed:unset_hf_deepspeed_config": "runtime/engines/zero_engine.py, compat",
    "transformers.integrations.sdpa_attention:sdpa_attention_forward": "runtime/model/document_attention.py",
    "transformers.integrations.flex_attention:flex_attention_forward": "runtime/model/document_attention.py",
    "transformers.masking_utils:flex_attention_mask": "runtime/model/document_attention.py (per-document blocks)",
    "transformers.masking_utils:AttentionMaskInterface": "runtime/model/document_attention.py",
    "transformers.loss.loss_utils:LOSS_MAPPING": "runtime/loss/chunked.py (the model's own loss, by name)",
    "transformers.modeling_layers:GradientCheckpointingLayer": "runtime/model/tiling.py",
    "transformers.masking_utils:find_packed_sequence_indices": "data/packing.py (packed rows kept apart)",
    "accelerate.commands.launch:_validate_launch_command": "runtime/base/launch_env.py (accelerate's own reading)",
    "accelerate.commands.launch:launch_command_parser": "runtime/base/launch_env.py",
    "accelerate.commands.config:default_config_file": "runtime/base/launch_env.py",
    "accelerate.utils.dataclasses:DeepSpeedSequenceParallelConfig": "runtime/engines/sequence_parallel.py (Ulysses)",
    "peft.utils.integrations:dequantize_bnb_weight": "runtime/model/quantized_base.py (the merged export of QLoRA)",
    "deepspeed.accelerator:get_accelerator": "runtime/engines/pipeline_engine.py",
    "deepspeed.ops.adam:DeepSpeedCPUAdam": "runtime/model/optim.py (CPU Adam for the offloaded optimizer)",
    "deepspeed.ops.op_builder:AsyncIOBuilder": "commands/doctor.py (can the async I/O op build)",
    "deepspeed.pipe:LayerSpec": "runtime/engines/pipeline_model.py",
    "deepspeed.pipe:PipelineModule": "runtime/engines/pipeline_model.py",
    "deepspeed.pipe:TiedLayerSpec": "runtime/engines/pipeline_model.py",
    "deepspeed.runtime.pipe.engine:PipelineEngine": "runtime/engines/pipeline_model.py",
    "deepspeed.runtime.activation_checkpointing.config:ACT_CHKPT_DEFAULT": "config/ds_validate.py",
    "deepspeed.runtime.config:DeepSpeedConfig": "config/ds_validate.py (DeepSpeed's own reading of the JSON)",
    "deepspeed.runtime.swap_tensor.aio_config:AIO_DEFAULT_DICT": "config/ds_validate.py",
    "deepspeed.runtime.compiler:compile": "compat.defer_muon_compile (replaced by a compile at first call)",
    "deepspeed.runtime.sequence_parallel.ulysses_sp:TiledMLP": "runtime/model/tiling.py",
    "deepspeed.utils.groups:_get_sequence_parallel_group": "runtime/engines/zero_engine.py (Ulysses' group)",
    "deepspeed.utils.groups:get_tensor_model_parallel_group": "runtime/engines/zero_engine.py (AutoTP's group)",
    "deepspeed.utils.zero_to_fp32:get_fp32_state_dict_from_zero_checkpoint": "runtime/export/from_checkpoint.py",
    "lm_eval.models.huggingface:HFLM": "runtime/benchmark.py (lm-eval's HF model wrapper)",
    "lm_eval.tasks:TaskManager": "runtime/benchmark.py",
    "lm_eval.utils:make_table": "runtime/benchmark.py",
}

P = ParamSpec("P")  # the wrapped function's parameters (the op loader, DeepSpeed's Muon kernels)
R = TypeVar("R")


@dataclass(frozen=True)
class Workaround:
    """One patch or workaround of this module: the function, the library it bends, the version checked."""

    name: str  # the function in `module`
    library: str
    verified: str  # the library version it was checked against
    what: str  # what goes wrong without it
    module: str = "llm_train.runtime.base.compat"  # where the function lives (see the module docstring)


QUANTIZED_BASE = "llm_train.runtime.model.quantized_base"
WORKAROUNDS = (
    Workaround(
        "remember_cpu_info", "deepspeed", "0.19.8", "every op load starts a 1.1 s py-cpuinfo subprocess"
    ),
    Workaround(
        "use_environment_ninja", "deepspeed", "0.19.8", "a second ninja on PATH rebuilds every JIT op"
    ),
    Workaround("build_ops_without_debug_info", "deepspeed", "0.19.8", "-g costs a third of each op build"),
    Workaround(
        "defer_muon_compile", "deepspeed", "0.19.8", "every ZeRO engine imports inductor (1 s) for Muon"
    ),
    Workaround(
        "skip_unused_shm_op", "deepspeed", "0.19.8", "the CPU backend builds an op (71 CPU-s) nothing calls"
    ),
    Workaround(
        "restore_swapped_state", "deepspeed", "0.19.8", "an NVMe-offload resume restarts Adam at step 0"
    ),
    Workaround(
        "load_universal_checkpoint",
        "deepspeed",
        "0.19.8",
        "a ZeRO-3 universal load gives every group the first one's weight decay and one shared step",
    ),
    Workaround(
        "clip_fp32_across_stages",
        "deepspeed",
        "0.19.8",
        "fp32 pipeline clipping takes the norm of the first stage only",
    ),
    Workaround(
        "keep_fp32_rope_buffers", "deepspeed", "0.19.8", "initialize casts RoPE frequencies to bf16/fp16"
    ),
    Workaround(
        "keep_training_layout",
        "bitsandbytes",
        "0.50.2",
        "an eval forward on CPU repacks 4-bit weights",
        QUANTIZED_BASE,
    ),
    Workaround(
        "without_hf_zero3_config",
        "transformers",
        "5.25",
        "a plain model built during a ZeRO-3 run is built partitioned, inside zero.Init",
    ),
    Workaround("no_progress_bars", "lm_eval", "0.4.13", "lm-eval draws its request bars on every rank 0"),
    Workaround(
        "quantizing_on",
        "transformers",
        "5.25",
        "a 4-bit base is quantised where it is placed: on the host (slow) or whole on the GPU (too large)",
        QUANTIZED_BASE,
    ),
    Workaround(
        "hub_kernels_off",
        "transformers",
        "5.25",
        "from_pretrained fetches Hub kernels it was not asked for; offline the run dies before step 1",
    ),
    Workaround(
        "gathered_for_generation",
        "deepspeed",
        "0.19.8",
        "generate on a ZeRO-3 module inside GatheredParameters fails on exit: a param left in flight",
    ),
)


def installed_version(library: str) -> str | None:
    """The installed release of `library` (its distribution name), read without importing it; None if absent."""
    try:
        return metadata.version(library)
    except metadata.PackageNotFoundError:
        return None


def version_problem(library: str, version: str | None = None) -> tuple[str, str] | None:
    """(problem, fix) when `library` (at `version`, else as installed) is outside its window; None inside or absent."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    window = WINDOW[library]
    version = version or installed_version(library)
    if version is None:
        return None  # not installed: the import that needs it says so
    try:
        inside = Version(version) in SpecifierSet(window.tested)
    except InvalidVersion:
        inside = False
    if inside:
        return None
    return (
        f"{library} {version} is outside the versions llm_train is tested with ({window.tested}): "
        f"may break {window.breaks}",
        f"pip install '{library}{window.tested}'",
    )


def version_problems() -> list[tuple[str, str]]:
    """(problem, fix) for every installed library outside its window, in WINDOWS' order."""
    return [problem for w in WINDOWS if (problem := version_problem(w.library)) is not None]


def version_warnings() -> list[str]:
    """The lines a run starts with: one per installed library outside its window (none inside)."""
    return [f"warning: {problem}; {fix}" for problem, fix in version_problems()]


# ------------------------------------------------------------ before DeepSpeed loads or builds an op


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

    DeepSpeed 0.19.8 compiles its ops with `-g` (op_builder/builder.py cxx_args), and each source includes
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

    torch JIT-builds DeepSpeed 0.19.8's ops (cpu_adam, async_io, the CPU shared-memory all-reduce) with the
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


def hub_kernels_off(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Keep transformers from replacing a model's layers with kernels it downloads from the Hub, unless the user
    set USE_HUB_KERNELS themselves.

    transformers 5.25's from_pretrained kernelizes every model by default once the `kernels` package is
    installed (a DeepSpeed/bitsandbytes/PEFT environment has it), fetching repositories such as
    kernels-community/rotary from the Hub as it loads. Offline (HF_HUB_OFFLINE=1, a cluster without the Hub)
    that fetch raised inside `kernelize` and the run died before step 1: measured on one H100 on 2026-12-06,
    every consumer case of bench/gpu_run.sh A (QLoRA, LoRA, the 64k QLoRA, GRPO). Online it would run code
    from the Hub that no recipe asked for, under numbers the planner and the benches measured without it.
    transformers reads the variable at each load (integrations/hub_kernels.py `_kernels_enabled`), and
    releases before hub kernels ignore it. A user who wants them sets USE_HUB_KERNELS=YES: kept as given.
    Returns whether it set the variable.
    """
    if "USE_HUB_KERNELS" in environ:
        return False
    environ["USE_HUB_KERNELS"] = "NO"
    return True


# ------------------------------------------------------------ before DeepSpeed builds an engine or a world


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


def skip_unused_shm_op() -> bool:
    """Never build DeepSpeed's shared-memory all-reduce op: no llm_train run calls what uses it.

    DeepSpeed 0.19.8's TorchBackend (deepspeed/comm/torch.py) JIT-builds that op whenever the CPU
    accelerator starts its process group, then maps its shared-memory segments. The op's only caller
    is `inference_all_reduce`, which AutoTP's row-parallel layers reach in inference mode only
    (DeepSpeed inference); in training they all-reduce through the process group, and ZeRO never
    calls it. Building it cost 70.8 CPU-s on an environment's first CPU launch (`make demo` on a
    fresh machine, every clean CI run; measured on 2 cores) and loading it ~0.2 s in every worker
    after that. GPU accelerators have no such op. Call before DeepSpeed starts its process group;
    returns False without DeepSpeed, or where its backend no longer builds the op this way.
    """
    import importlib

    try:  # by its full name: `from deepspeed.comm import torch` is torch itself, re-exported there
        deepspeed_torch_backend: Any = importlib.import_module("deepspeed.comm.torch")  # untyped module
    except ImportError:
        return False
    if not callable(getattr(deepspeed_torch_backend, "build_shm_op", None)):
        return False
    deepspeed_torch_backend.build_shm_op = lambda: None  # TorchBackend then all-reduces via torch
    return True


# ------------------------------------------------------------ loading a checkpoint into the engine


def load_engine_checkpoint(
    engine: DeepSpeedEngine, load_dir: str, tag: str, *, universal: bool, strict: bool
) -> None:
    """`engine.load_checkpoint` with what DeepSpeed 0.19.8 leaves out or wrong put right.

    `universal`: `load_dir` is DeepSpeed's universal checkpoint (load_universal_checkpoint);
    `strict`: every module weight must be in the checkpoint (False for a LoRA run, whose checkpoint
    holds the adapters only while the base already loaded stays).
    """
    per_group = _per_group_settings(engine)
    engine.load_checkpoint(
        load_dir,
        tag=tag,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        load_module_strict=strict,
    )
    restore_swapped_state(engine, load_dir, tag)  # NVMe offload: what DeepSpeed's load skips
    if universal:
        load_universal_checkpoint(engine, per_group)


def restore_swapped_state(engine: DeepSpeedEngine, load_dir: str, tag: str) -> bool:
    """Resuming a run whose optimizer is on NVMe: what DeepSpeed 0.19.8's load leaves out, put back.

    With `offload_optimizer: nvme`, ZeRO-3 keeps each swapped sub-group's fp32 master, Adam m and v in
    swap files under NVME_PATH/zero_stage_3/optimizer/rankR. `engine.save_checkpoint` copies those files
    into the checkpoint (engine.py 4937-4950, `offloaded_tensors/rankR`, gradients left out) and
    `engine.load_checkpoint` copies them back (engine.py 4469-4481). But on that path it skips the ZeRO
    optimizer's own state (engine.py 4456: `load_zero_checkpoint and not self.zero_nvme_offload_optimizer()`):
    CPU Adam's step counts, and the master, m and v of the sub-groups too small to swap (under
    max(1 MiB, aio block_size): the norms). The first step after a resume then creates m and v anew at
    step 0 and ignores the files: measured on CPU (tests/e2e/test_host_offload.py), the resumed losses
    left the uninterrupted run's at the first resumed step (7.9238 against 7.9234 on tiny-cpu).

    This runs DeepSpeed's own ZeRO load after the engine's (`_load_zero_checkpoint`, the step it
    skipped), then points each swapped sub-group's Adam states at the restored files: the checkpoint
    holds them as empty tensors (swapped out when it was saved), which the swapper would not swap back
    in (`is_swappable_tensor`: too small), so each becomes a zero-stride placeholder of the sub-group's
    size, whose storage the next swap-in replaces with the file's contents (optimizer_utils.py
    `set_swap_buffers`). No full-size host copy is made. Returns whether there was anything to do
    (False without NVMe optimizer offload).
    """
    import torch

    optimizer = engine.optimizer
    swapper = getattr(optimizer, "optimizer_swapper", None)
    if swapper is None:
        return False
    engine._load_zero_checkpoint(load_dir, tag, load_optimizer_states=True)
    for i, master in enumerate(optimizer.fp32_partitioned_groups_flat):
        if not optimizer._swappable_optimizer_subgroup(i):
            continue  # held in host RAM: _load_zero_checkpoint restored it whole
        numel = int(optimizer.fp16_partitioned_groups_flat_numel[i])
        state = optimizer.optimizer.state.get(master, {})
        for key, value in list(state.items()):
            if torch.is_tensor(value) and value.numel() == 0:
                state[key] = torch.zeros(1, dtype=value.dtype).expand(numel)
    swapper.purge_state()  # the state tensors are named (and their files found) again at the next swap-in
    return True


def load_universal_checkpoint(engine: DeepSpeedEngine, per_group: list[dict[str, Any]]) -> None:
    """After a universal load: each param group's own settings back (`per_group`: as built), own step counters.

    DeepSpeed 0.19.8's ZeRO-3 universal load (stage3.py load_hp_checkpoint_state_from_checkpoint_dir_stage3)
    copies the first param group's hyperparameters into every group ("generally the same"), so the
    no-decay group (norms, biases: runtime/model/optim.py) came back with weight decay: a 2 -> 1
    zero3_offload resume ended 3.2e-5 off in the weights. The same load sets each sub-group's
    `state["step"]` to one and the same tensor (the first saved state's); torch's Adam/AdamW increments
    it in place once per sub-group, so with two param groups (decay and no decay) the bias correction
    ran two steps per step (a plain ZeRO-3 resume moved the step 6 loss by 4.3e-3; DeepSpeed's CPU Adam
    keeps its own count and was not affected). With both fixed, both are exact
    (tests/e2e/test_resume_anywhere.py).
    """
    import torch

    for group, own in zip(_param_groups(engine), per_group, strict=True):
        group.update(own)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for state in getattr(inner, "state", {}).values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()


def _param_groups(engine: DeepSpeedEngine) -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = engine.optimizer.param_groups
    return groups


def _per_group_settings(engine: DeepSpeedEngine) -> list[dict[str, Any]]:
    """The optimizer settings that differ between param groups (weight decay), per group, as built."""
    groups = _param_groups(engine)
    keys = {k for g in groups for k in g if k != "params"}
    differing = {k for k in keys if len({repr(g.get(k)) for g in groups}) > 1}
    return [{k: g[k] for k in differing if k in g} for g in groups]


# ------------------------------------------------------------ the pipeline engine


def keep_fp32_rope_buffers(module: torch.nn.Module) -> Callable[[torch.nn.Module], None]:
    """Take the fp32 RoPE frequency buffers before `deepspeed.initialize`; call the result on the engine's module.

    DeepSpeed 0.19.8's pipeline engine casts buffers along with weights to bf16/fp16; RoPE
    frequencies must stay fp32 (transformers computes cos/sin from them in fp32), or positions far
    into the sequence lose precision.
    """
    saved = {
        name: buffer.detach().clone()
        for name, buffer in module.named_buffers()
        if name.rsplit(".", 1)[-1] in ("inv_freq", "original_inv_freq")
    }

    def restore(cast_module: torch.nn.Module) -> None:
        for name, value in saved.items():
            owner, _, leaf = name.rpartition(".")
            target = cast_module.get_submodule(owner)
            setattr(target, leaf, value.to(getattr(target, leaf).device))

    return restore


def clip_fp32_across_stages(
    engine: DeepSpeedPipelineEngine, pipe_sum: Callable[[torch.Tensor], torch.Tensor]
) -> bool:
    """ZeRO-0 in fp32: clip on the norm over every stage, and keep that norm for the metrics.

    DeepSpeed 0.19.8 clips these gradients with `clip_grad_norm_(mpu=grid)`, which keeps only
    the parameters of model-parallel rank 0, i.e. of the first stage, and then averages the
    norm over the whole world: the clip factor is wrong as soon as clipping is active (losses
    drifted ~1e-3 from a single process in 3 steps). Gradients are already summed over
    data-parallel ranks and tied copies here, so one all-reduce over the pipeline (`pipe_sum`) suffices.
    Returns whether the engine's clipping was replaced (not under ZeRO or 16-bit precision).
    """
    import torch

    if engine.zero_optimization_stage() or engine.bfloat16_enabled() or engine.fp16_enabled():
        return False

    def clip() -> None:
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        # A tied embedding's second copy (on the last stage) is marked replicated: count it once.
        owned = [
            p.grad
            for p in engine.module.parameters()
            if p.grad is not None and not getattr(p, "ds_pipe_replicated", False)
        ]
        squares = torch.zeros((), device=grads[0].device, dtype=torch.float32)
        for grad in owned:
            squares += grad.detach().float().pow(2).sum()
        norm = pipe_sum(squares).sqrt()
        coef = torch.clamp(engine.gradient_clipping() / (norm + 1e-6), max=1.0)  # as torch/DeepSpeed clip
        for grad in grads:
            grad.detach().mul_(coef.to(grad.dtype))
        engine._global_grad_norm = float(norm)

    engine.clip_fp32_gradients = clip
    return True


@contextlib.contextmanager
def gathered_for_generation(engine: DeepSpeedEngine) -> Iterator[None]:
    """The whole ZeRO-3 model on every rank, without ZeRO-3's module hooks, while the block generates.

    With every weight gathered (`GatheredParameters`) the per-module hooks still run on each of
    generate's forwards and prefetch parameters; leaving the context then fails with "Cannot partition a
    param in flight" (deepspeed 0.19.8, seen on the first GRPO step under ZeRO-3, 2 gloo processes). The
    hooks are taken off the parameter-offload coordinator for the block and registered again after it, with
    the coordinator's recorded trace invalidated (generation's module order is not training's). TRL's
    unwrap_model_for_generation does the same (trl/models/utils.py).
    """
    import deepspeed

    optimizer = engine.optimizer
    offload = getattr(optimizer, "parameter_offload", optimizer)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        for param in offload.module.parameters(recurse=True):
            param.ds_active_sub_modules.clear()
        for hook in [*offload.forward_hooks, *offload.backward_hooks]:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            coordinator = getattr(offload, "param_coordinator", None)
            if coordinator is not None and not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()
            offload._register_deepspeed_module(offload.module)


# ------------------------------------------------------------ transformers, lm-eval


@contextlib.contextmanager
def without_hf_zero3_config() -> Iterator[None]:
    """Build a plain (unpartitioned) model while a ZeRO-3 run is registered with transformers.

    transformers builds every model inside zero.Init while a ZeRO-3 config is registered
    (integrations/deepspeed.py is_deepspeed_zero3_enabled, transformers 5.24, unchanged in 5.25): the registration
    (a module-level weak reference) is removed while the block runs, and put back after it.
    """
    from transformers.integrations import deepspeed as hf_deepspeed

    registered = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = registered


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """lm-eval's request bars off: lm_eval 0.4.13 makes them with tqdm(disable=rank != 0), which nothing
    else switches.

    tqdm reads TQDM_DISABLE when it is imported (long before lm-eval), so the bars are disabled by
    giving tqdm's constructor that default while lm-eval runs.
    """
    from tqdm import tqdm

    original = tqdm.__init__

    def quiet_init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        original(self, *args, **kwargs)

    tqdm.__init__ = quiet_init
    try:
        yield
    finally:
        tqdm.__init__ = original
