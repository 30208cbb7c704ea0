"""DeepSpeed JSON configs: load, check, and make the effective one from the recipe (`effective_config`).

DeepSpeed's own "auto" resolution lives in the HF Trainer; outside it an "auto" reaches
DeepSpeed unresolved. Here every value the recipe owns is filled in before DeepSpeed (or
Accelerate) sees the config, so the config used and the one saved in the run directory
are the same, with no "auto" left. DeepSpeed validates nested sections strictly but
silently ignores unknown top-level keys, so those are checked here (keys that begin with "_" are
comments); config/ds_validate.py runs DeepSpeed's own checks on the result. The NVMe offload
directory belongs to the user's machine, not to a shipped file: the JSON says "auto" and the
recipe's deepspeed.nvme_path fills it (planning/search/guards.check_nvme_path checks the directory itself).
"""

from __future__ import annotations

import copy
import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm_train import DS_CONFIGS_DIR
from llm_train.errors import UserError

# Top-level keys DeepSpeed 0.19 reads (runtime/config.py and the feature configs it builds).
KNOWN_TOP_LEVEL_KEYS = frozenset(
    [
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "optimizer",
        "scheduler",
        "fp16",
        "bf16",
        "bfloat16",
        "amp",
        "torch_autocast",
        "gradient_clipping",
        "prescale_gradients",
        "gradient_predivide_factor",
        "sparse_gradients",
        "zero_optimization",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "steps_per_print",
        "wall_clock_breakdown",
        "dump_state",
        "memory_breakdown",
        "flops_profiler",
        "activation_checkpointing",
        "aio",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
        "elasticity",
        "communication_data_type",
        "data_types",
        "seq_parallel_communication_data_type",
        "checkpoint",
        "data_efficiency",
        "curriculum_learning",
        "compression_training",
        "autotuning",
        "pipeline",
        "tensor_parallel",
        "hybrid_engine",
        "sparse_attention",
        "disable_allgather",
        "dataloader_drop_last",
        "eigenvalue",
        "progressive_layer_drop",
        "quantize_training",
        "nebula",
        "weight_quantization",
        "compile",
        "use_data_before_expert_parallelism",
        "expert_parallel",
        "gradient_allreduce_op",
        "vocabulary_size",
        "legacy_fusion",
        "log_level",
        "lower_precision_safe_modules",
        "managed_gradient_accumulation",
        "disable_python_gc",
        "timers",
        "graph_harvesting",
        "zenflow",
    ]
)


@dataclass(frozen=True)
class RecipeValues:
    """The recipe's slice, as the layout settles it, that the effective DeepSpeed JSON is made from."""

    micro_batch_size: int
    grad_accum: int
    global_batch_size: int
    grad_clip: float
    precision: str  # resolved: bf16 | fp16 | fp32
    hidden_size: int
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    warmup_steps: int
    max_steps: int
    nvme_path: str | None = None  # deepspeed.nvme_path: fills every nvme offload's "nvme_path"
    state_dtype: str = "fp32"  # optim.state_dtype: bf16 = DeepSpeed bf16 master weights + Adam states
    optimizer: str = (
        "adamw"  # optim.name: bitsandbytes' 8-bit AdamW is a ZeRO optimizer DeepSpeed does not list
    )
    largest_weight: int = 0  # elements of the model's largest weight: offload_param.buffer_size "auto" (NVMe)
    # The layout's rules and what this launch adds (effective_config), after the "auto" filling:
    pinning: str = "torch"  # deepspeed.pinning, decided ("auto" is never left): "off" unpins every offload
    tp: int = 1  # the layout's tensor-parallel degree (AutoTP)
    sp: int = 1  # the layout's sequence-parallel degree (Ulysses)
    load_universal: bool = False  # a resume on another layout loads DeepSpeed's universal checkpoint
    flops_profiler: Mapping[str, Any] | None = None  # --flops-profiler: DeepSpeed's flops_profiler section


def find_ds_config(name_or_path: str) -> Path:
    """'zero3' -> ds_configs/zero3.json; anything else is a path."""
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists() or "/" in name_or_path:
        if not path.is_file():
            raise UserError(f"DeepSpeed config {name_or_path}: file not found")
        return path
    candidate = DS_CONFIGS_DIR / f"{name_or_path}.json"
    if candidate.is_file():
        return candidate
    names = sorted(p.stem for p in DS_CONFIGS_DIR.glob("*.json"))
    raise UserError(
        f"unknown DeepSpeed config '{name_or_path}'; shipped: {', '.join(names)}; or give a path to a JSON file"
    )


def load_ds_config(name_or_path: str) -> tuple[Path, dict[str, Any]]:
    path = find_ds_config(name_or_path)
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(
            f"DeepSpeed config {path}: not valid JSON at line {exc.lineno} column {exc.colno} ({exc.msg})"
        ) from None
    if not isinstance(config, dict):
        raise UserError(f"DeepSpeed config {path}: expected a JSON object at the top level")
    check_top_level_keys(config, str(path))
    return path, config


def check_top_level_keys(config: dict[str, Any], source: str) -> None:
    for key in config:
        # "_comment", "_note", ...: a comment, by a convention configs of other tools follow; DeepSpeed
        # ignores it, and so does llm_train, without a word.
        if key not in KNOWN_TOP_LEVEL_KEYS and not key.startswith("_"):
            close = difflib.get_close_matches(key, sorted(KNOWN_TOP_LEVEL_KEYS), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise UserError(
                f"DeepSpeed config {source}: unknown top-level key '{key}' (DeepSpeed would silently "
                f"ignore it); {hint}fix or remove it"
            )


def zero_stage(config: dict[str, Any]) -> int:
    return int(config.get("zero_optimization", {}).get("stage", 0))


def offload_device(config: dict[str, Any], what: str) -> str:
    """'none' | 'cpu' | 'nvme' for what = 'optimizer' or 'param'."""
    section = config.get("zero_optimization", {}).get(f"offload_{what}") or {}
    return str(section.get("device", "none")) or "none"


OFFLOAD_SECTIONS = ("offload_optimizer", "offload_param")
NVME_PATH_KEY = "deepspeed.nvme_path"


def nvme_paths(config: dict[str, Any]) -> dict[str, str]:
    """{"offload_optimizer": path, ...} for each offload that goes to nvme, in a resolved config."""
    zero = config.get("zero_optimization") or {}
    out = {}
    for section in OFFLOAD_SECTIONS:
        offload = zero.get(section) or {}
        if isinstance(offload, dict) and offload.get("device") == "nvme":
            out[section] = str(offload.get("nvme_path"))
    return out


def _same_dir(a: str, b: str) -> bool:
    # DeepSpeed opens the swap files relative to the workers' cwd, which is this process's cwd.
    return os.path.abspath(os.path.expanduser(a)) == os.path.abspath(os.path.expanduser(b))


def _fill_nvme_paths(config: dict[str, Any], recipe_path: str | None, source: str) -> None:
    """Fill every nvme offload's nvme_path from the recipe, in place; refuse a missing or double path.

    The directory is the user's machine, not the config's: the shipped JSON says "auto" and the
    recipe (or `deepspeed.nvme_path=...` on the command line) names it. A recipe path that no
    offload uses is refused too: a setting that silently does nothing hides a wrong config.
    """
    zero = config.get("zero_optimization") or {}
    on_nvme = []
    for section in OFFLOAD_SECTIONS:
        offload = zero.get(section)
        if not isinstance(offload, dict):
            continue
        current = offload.get("nvme_path")
        if offload.get("device") != "nvme":
            if current == "auto":
                # DeepSpeed reads nvme_path only for device "nvme"; an "auto" here stands for nothing.
                del offload["nvme_path"]
            continue
        on_nvme.append(section)
        key = f"zero_optimization.{section}.nvme_path"
        if current is None or current == "auto":
            if recipe_path is None:
                raise UserError(
                    f"DeepSpeed config {source}: {section} goes to nvme but no directory is given; pass "
                    f"{NVME_PATH_KEY}=/path/on/nvme (a directory on a fast local drive) or set nvme_path in "
                    "the recipe's deepspeed: section"
                )
            offload["nvme_path"] = recipe_path
        elif not isinstance(current, str) or not current.strip():
            raise UserError(
                f'DeepSpeed config {source}: {key}={json.dumps(current)} is not a directory; set it to "auto" '
                f"and pass {NVME_PATH_KEY}=/path/on/nvme"
            )
        elif recipe_path is not None and not _same_dir(current, recipe_path):
            raise UserError(
                f"DeepSpeed config {source}: {key}={json.dumps(current)} contradicts {NVME_PATH_KEY} "
                f'(which gives {json.dumps(recipe_path)}); set it to "auto" in the JSON or change {NVME_PATH_KEY}'
            )
    if recipe_path is not None and not on_nvme:
        raise UserError(
            f"{NVME_PATH_KEY}={recipe_path} is set but DeepSpeed config {source} offloads nothing to nvme, so "
            f"it would do nothing; remove {NVME_PATH_KEY} or use deepspeed.config=zero3_offload_nvme"
        )


def precision_of(config: dict[str, Any]) -> str | None:
    """The precision the JSON states explicitly (None when 'auto' or absent)."""
    for name in ("bf16", "fp16"):
        enabled = config.get(name, {}).get("enabled")
        if enabled is True:
            return name
    if config.get("bfloat16", {}).get("enabled") is True:
        return "bf16"
    explicit_off = all(config.get(n, {}).get("enabled") is False for n in ("bf16", "fp16"))
    return "fp32" if explicit_off else None


def zero_bucket_sizes(hidden_size: int) -> dict[str, int]:
    """ZeRO bucket sizes from the hidden size, as the HF Trainer derives its "auto" (HfTrainerDeepSpeedConfig)."""
    h = hidden_size
    return {
        "reduce_bucket_size": h * h,
        "stage3_prefetch_bucket_size": int(0.9 * h * h),
        "stage3_param_persistence_threshold": 10 * h,
    }


_BF16_STATE_PATHS = (("bf16", "bf16_master_weights_and_grads"), ("bf16", "bf16_optimizer_states"))


def _owned_values(v: RecipeValues) -> dict[tuple[str, ...], Any]:
    """Paths the recipe owns, with the values the recipe gives them."""
    buckets = zero_bucket_sizes(v.hidden_size)
    return {
        ("train_micro_batch_size_per_gpu",): v.micro_batch_size,
        ("gradient_accumulation_steps",): v.grad_accum,
        ("train_batch_size",): v.global_batch_size,
        ("gradient_clipping",): v.grad_clip,
        ("bf16", "enabled"): v.precision == "bf16",
        ("fp16", "enabled"): v.precision == "fp16",
        ("optimizer", "params", "lr"): v.lr,
        ("optimizer", "params", "betas"): list(v.betas),
        ("optimizer", "params", "eps"): v.eps,
        ("optimizer", "params", "weight_decay"): v.weight_decay,
        ("scheduler", "params", "warmup_min_lr"): 0.0,
        ("scheduler", "params", "warmup_max_lr"): v.lr,
        ("scheduler", "params", "warmup_num_steps"): v.warmup_steps,
        ("scheduler", "params", "total_num_steps"): v.max_steps,
        **{("zero_optimization", key): size for key, size in buckets.items()},
        # optim.state_dtype=bf16: master weights, gradients and Adam moments all in bf16 (DeepSpeed
        # needs the first for the second; layout.state_dtype_problem says when DeepSpeed accepts them).
        **{path: v.state_dtype == "bf16" for path in _BF16_STATE_PATHS},
    }


# Owned values an explicit JSON value may differ from without being an error: bucket sizes
# are tuning, not semantics.
_TUNABLE = {
    ("zero_optimization", "reduce_bucket_size"),
    ("zero_optimization", "stage3_prefetch_bucket_size"),
    ("zero_optimization", "stage3_param_persistence_threshold"),
}

_RECIPE_KEY_FOR: dict[tuple[str, ...], str] = {
    ("train_micro_batch_size_per_gpu",): "optim.micro_batch_size",
    ("gradient_accumulation_steps",): "optim.grad_accum",
    ("train_batch_size",): "optim.global_batch_size",
    ("gradient_clipping",): "optim.grad_clip",
    ("bf16", "enabled"): "precision",
    ("fp16", "enabled"): "precision",
    ("optimizer", "params", "lr"): "optim.lr",
    ("optimizer", "params", "betas"): "optim.betas",
    ("optimizer", "params", "eps"): "optim.eps",
    ("optimizer", "params", "weight_decay"): "optim.weight_decay",
    ("scheduler", "params", "warmup_max_lr"): "optim.lr",
    ("scheduler", "params", "warmup_num_steps"): "optim.warmup_steps",
    ("scheduler", "params", "total_num_steps"): "optim.max_steps",
    **{path: "optim.state_dtype" for path in _BF16_STATE_PATHS},
}


def _get(config: dict[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = config
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set(config: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = config
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        return abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(b)))
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def fill_autos(config: dict[str, Any], values: RecipeValues, source: str) -> dict[str, Any]:
    """A copy of `config` with every "auto" filled from the recipe and recipe-owned keys checked.

    An explicit JSON value that contradicts the recipe is an error rather than a silent
    winner: the user sees both and picks one.
    """
    resolved = copy.deepcopy(config)
    owned = _owned_values(values)
    for path, value in owned.items():
        current = _get(resolved, path)
        if current == "auto":
            _set(resolved, path, value)
        elif current is None:
            # Precision and clipping are always written: DeepSpeed 0.19 clips at 1.0 when
            # gradient_clipping is absent, and Accelerate must never disagree on precision.
            if path in (("gradient_clipping",), ("bf16", "enabled"), ("fp16", "enabled")) or path[0] in (
                "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps",
                "train_batch_size",
            ):
                _set(resolved, path, value)
            elif path in _BF16_STATE_PATHS and value:
                # Written only when asked for: every other run's JSON stays as it was.
                _set(resolved, path, value)
        elif path not in _TUNABLE and path[0] in resolved and not _same(current, value):
            recipe_key = _RECIPE_KEY_FOR.get(path, "the recipe")
            raise UserError(
                f"DeepSpeed config {source}: {'.'.join(path)}={json.dumps(current)} contradicts "
                f'{recipe_key} (which gives {json.dumps(value)}); set it to "auto" in the JSON '
                f"or change {recipe_key}"
            )
    _fill_nvme_paths(resolved, values.nvme_path, source)
    _fill_param_swap_buffer(resolved, values.largest_weight, source)
    if zero_stage(resolved) == 3:
        # Export gathers the partitioned weights through this switch; without it the saved
        # model would be empty (a classic ZeRO-3 pitfall).
        resolved["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    # DeepSpeed prints its own progress every 10 steps by default; llm_train logs instead.
    resolved.setdefault("steps_per_print", 10**9)
    leftover = list(_find_auto(resolved))
    if leftover:
        raise UserError(
            f'DeepSpeed config {source}: "auto" at {leftover[0]} is not a value llm_train resolves; '
            "give it a concrete value"
        )
    return resolved


# The zero_optimization keys effective_config rewrites for Ulysses sequence parallelism under ZeRO-3.
SP_ZERO3_KEYS = ("reduce_scatter", "contiguous_gradients", "reduce_bucket_size")


def rewrite_notice(config: dict[str, Any], effective: dict[str, Any], source: str) -> str | None:
    """One notice when the effective JSON changes a value the user's DS JSON sets (not "auto", not absent):
    the keys Ulysses under ZeRO-3 needs (effective_config says why), with what they were and are."""
    written = config.get("zero_optimization") or {}
    made = effective.get("zero_optimization") or {}
    changed = [
        f"{key} {json.dumps(written[key])} -> {json.dumps(made.get(key))}"
        for key in SP_ZERO3_KEYS
        if key in written and written[key] != "auto" and written[key] != made.get(key)
    ]
    if not changed:
        return None
    return (
        f"{source}: zero_optimization {', '.join(changed)} for Ulysses sequence parallelism under ZeRO-3 "
        "(DeepSpeed 0.19's reduce-scatter path averages gradients over every rank, not only the "
        "data-parallel ones; the contiguous all-reduce path sums each sequence's share)"
    )


def effective_config(config: dict[str, Any], values: RecipeValues, source: str) -> dict[str, Any]:
    """The JSON DeepSpeed gets, made from the file's `config` (never edited) and `values`, in one place.

    Every "auto" filled and every recipe-owned key checked (`fill_autos`), then the keys the
    layout imposes, then what this launch adds (universal loading, the flops profiler). A run
    whose values change later (config/resolution.py `Resolved.refine`) is made again from the
    same file content and its new values, never edited in place.
    """
    resolved = fill_autos(config, values, source)
    if values.pinning == "off":
        # The recipe's switch, not a contradiction: every offload section's buffers become pageable.
        for section in OFFLOAD_SECTIONS:
            offload = resolved.get("zero_optimization", {}).get(section)
            if isinstance(offload, dict) and offload.get("device", "none") != "none":
                offload["pin_memory"] = False
    if values.tp > 1:
        # Under AutoTP DeepSpeed asserts train_batch = micro x accum x *all* ranks (it is given no
        # mpu, so TP replicas count); the recipe's global batch counts distinct sequences.
        resolved["train_batch_size"] = values.global_batch_size * values.tp
        # Export gathers the TP shards through this switch (accelerate.get_state_dict refuses without it).
        resolved.setdefault("zero_optimization", {})["stage3_gather_16bit_weights_on_model_save"] = True
    if values.sp > 1:
        # zero.Init builds its DeepSpeed config without the sequence-parallel groups and would count
        # every rank as data parallel (train_batch = micro x accum x world); this key is how
        # DeepSpeed's config divides the world by sp in that case (deepspeed/runtime/config.py).
        resolved["sequence_parallel_size"] = values.sp
    if values.sp > 1 and zero_stage(resolved) == 3:
        # Each rank of a sequence-parallel group backpropagates its share of the group's loss, so
        # the group's gradients must be summed and only the data-parallel ranks averaged. DeepSpeed
        # 0.19's ZeRO-3 does that only on its contiguous all-reduce path: its reduce-scatter path
        # averages over every rank (gradients 1/sp of sp=1's: bench/results/ulysses-probe-20261130.txt,
        # stage3.py __avg_scatter_grads), and it takes that path for reduce_scatter=true and for any
        # bucket larger than reduce_bucket_size, i.e. for every weight bigger than the bucket.
        zero = resolved.setdefault("zero_optimization", {})
        zero["reduce_scatter"] = False
        zero["contiguous_gradients"] = True
        zero["reduce_bucket_size"] = max(int(zero.get("reduce_bucket_size") or 0), values.largest_weight)
    if offload_device(resolved, "optimizer") != "none" and "optimizer" not in resolved:
        # llm_train builds DeepSpeed's CPU Adam itself, with the recipe's betas, eps and AdamW's
        # decoupled weight decay. Left at its default (true), this switch makes Accelerate swap it
        # for a new CPU Adam that keeps only lr and weight_decay: Adam with L2 instead of AdamW,
        # betas (0.9, 0.999), and an LR schedule left driving the old optimizer, so the LR froze
        # after a resume.
        resolved["zero_force_ds_cpu_optimizer"] = False
    if values.optimizer != "adamw" and zero_stage(resolved) > 0:
        # DeepSpeed 0.19.8 asserts that a client optimizer under ZeRO is one it lists
        # (zero/utils.py ZERO_SUPPORTED_OPTIMIZERS: torch's Adam(W), its own) unless this is set;
        # bitsandbytes' AdamW8bit is a torch Optimizer stepping the same fp32 partitions.
        resolved["zero_allow_untested_optimizer"] = True
    if values.load_universal:
        resolved["checkpoint"] = {**resolved.get("checkpoint", {}), "load_universal": True}
    if values.flops_profiler is not None:
        # DeepSpeed's flops profiler lives inside the engine and is configured only through this section.
        resolved["flops_profiler"] = dict(values.flops_profiler)
    return resolved


# offload_param.buffer_size's default (deepspeed/runtime/zero/offload_config.py).
DS_PARAM_SWAP_BUFFER_DEFAULT = 100_000_000


def _fill_param_swap_buffer(config: dict[str, Any], largest: int, source: str) -> None:
    """offload_param.buffer_size for NVMe: "auto" is the larger of DeepSpeed's default and the largest
    weight; an explicit value below the largest weight is refused (in place).

    DeepSpeed swaps each parameter through one buffer of `buffer_size` elements and asserts that it
    fits (swap_tensor/partitioned_param_swapper.py 357); its default 1e8 is smaller than the embedding
    of every Llama from 7B up (131M elements for Llama-2-7B, 525M for Llama-3-8B). Sized on the whole
    tensor, an upper bound of any rank's partition.
    """
    offload = (config.get("zero_optimization") or {}).get("offload_param")
    if not isinstance(offload, dict) or offload.get("device") != "nvme":
        return
    size = offload.get("buffer_size", DS_PARAM_SWAP_BUFFER_DEFAULT)
    key = "zero_optimization.offload_param.buffer_size"
    if size == "auto":
        offload["buffer_size"] = max(DS_PARAM_SWAP_BUFFER_DEFAULT, largest)
    elif not isinstance(size, int) or size < largest:
        raise UserError(
            f"DeepSpeed config {source}: {key}={json.dumps(size)} is smaller than the model's largest weight "
            f'({largest:,} elements), which DeepSpeed swaps through one such buffer; set it to "auto" or >= {largest}'
        )


def _find_auto(node: Any, prefix: str = "") -> Any:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _find_auto(value, f"{prefix}.{key}" if prefix else key)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _find_auto(value, f"{prefix}[{i}]")
    elif node == "auto":
        yield prefix
