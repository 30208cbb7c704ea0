"""One candidate configuration on given hardware: its memory, its speed, and whether it fits.

The numbers come from `estimate_memory` (planning/memory/estimate.py: per-GPU bytes, host RAM and NVMe per
node) and `step_time` (planning/speed/step_time.py: a first-order step-time model used only to rank
choices). Nothing here loads weights or imports deepspeed.

NVMe is a resource like the others: a configuration that offloads to NVMe fits only when the
user said how much NVMe space the node has (`llm-train plan --nvme-gib N`) and its footprint
is at most that. Without the flag the planner never chooses NVMe: it cannot know the drive
exists, and ZeRO-Infinity is so slow that it should be a deliberate choice.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from llm_train.config.ds_json import load_ds_config
from llm_train.config.hardware import Hardware
from llm_train.config.layout import workers_for
from llm_train.config.objectives import objective_spec
from llm_train.config.recipe_sections import LoraSection
from llm_train.planning.memory.estimate import MemoryEstimate, estimate_memory
from llm_train.planning.memory.formulas import ALLOCATOR_SLACK_FRACTION, PROCESS_HOST_BYTES
from llm_train.planning.memory.generation import GenerationInputs
from llm_train.planning.memory.inputs import DS_ALLGATHER_BUCKET_SIZE, DS_SUB_GROUP_SIZE, MemoryInputs
from llm_train.planning.memory.offload_buffers import SwapSettings
from llm_train.planning.model.shapes import ModelShape
from llm_train.planning.model.vision_shapes import VisionInputs, checkpoint_pixels
from llm_train.planning.speed.step_time import StepTime, step_time_on
from llm_train.units import GiB

# Host RSS of one CPU-only training process before model state (torch, DeepSpeed,
# transformers, tokenizer): ~0.7 GiB measured for tiny-cpu; no CUDA libraries.
CPU_PROCESS_HOST_BYTES = 1 * GiB
# The adapters the planner proposes and `--recipe auto` writes are the recipe schema's defaults (one source of
# truth: config/recipe_sections.py LoraSection): rank, alpha, dropout (PEFT keeps a copy of each adapted input under it:
# planned) and target modules (planning/model/shapes.LORA_TARGETS).
SUGGESTED_LORA = LoraSection()
SUGGESTED_LORA_RANK = SUGGESTED_LORA.rank
SUGGESTED_LORA_DROPOUT = SUGGESTED_LORA.dropout
# Candidate micro-batch sizes for `--recipe auto`.
AUTO_MICRO_BATCHES = (1, 2, 4, 8, 16, 32)

# (ZeRO stage, optimizer offload, parameter offload) -> the shipped ds_configs/ file.
SHIPPED_DS_CONFIGS: dict[tuple[int, str, str], str] = {
    (0, "none", "none"): "zero0",
    (1, "none", "none"): "zero1",
    (2, "none", "none"): "zero2",
    (3, "none", "none"): "zero3",
    (2, "cpu", "none"): "zero2_offload",
    (3, "cpu", "none"): "zero3_offload_optimizer",
    (3, "cpu", "cpu"): "zero3_offload",
    (3, "nvme", "none"): "zero3_offload_optimizer_nvme",
    (3, "nvme", "nvme"): "zero3_offload_nvme",
}

# Rule-of-thumb speed cost of each change, printed beside the model's own estimate.
TYPICAL_COST = {
    "checkpointing": "recomputes the forward: ~+33% compute",
    "micro_batch": "smaller matmuls: ~0-15% slower",
    "zero3": "all-gathers weights every micro-batch: ~+10-30% on PCIe, little on NVLink",
    "offload_optimizer": "CPU Adam + PCIe traffic each step: ~1.2-2x slower step",
    "offload_params": "weights cross PCIe every pass: ~2-4x slower step",
    "nvme": "weights and optimizer stream from the drive: ~5-10x+ slower",
    "lora": "trains adapters, not all weights (a different fine-tune); faster step",
    "bf16_states": "halves the offloaded optimizer's host RAM, but rounds away small updates (measured: eval loss +0.14 "
    "at lr 1e-5, bench/results/bf16-states-quality-*.txt)",
    # Changes that spend spare memory on speed (offered when the recipe already fits).
    "qlora": "a 4-bit NF4 base under the adapters (QLoRA: a different fine-tune); dequantised every forward, "
    "~+20-40% compute",
    "layer_gather": "GRPO's generation gathers each ZeRO-3 layer again for every new token: far slower generation",
    "no_checkpointing": "no recompute in backward",
    "bigger_micro_batch": "fewer, larger micro-batches (and fewer weight fetches under offload)",
    "less_offload": "less partitioning / offload traffic",
    # DeepSpeed ALST (long sequences): exact, the same training, for memory.
    "sequence_parallel": "splits each sequence over GPUs; an all-to-all per layer (cheap on NVLink), more "
    "micro-batches per step for the same global batch",
    "tiled_mlp": "recomputes each MLP tile in backward: ~+10-15% compute",
    "tiled_loss": "recomputes the output layer tile by tile in backward: a few % compute",
    "offload_checkpoints": "copies each layer's checkpoint to host RAM and back over PCIe (overlaps compute)",
    "no_long_context": "switches an ALST technique off: no recompute or copies",
}


# --- one configuration: memory, speed, fit ----------------------------------------------------------


def memory_inputs(run: Any, shape: ModelShape, gpus_per_node: int | None = None) -> MemoryInputs:
    """MemoryInputs for a resolved run, bucket sizes and overlap read from its final DS config."""
    layout, recipe = run.layout, run.recipe
    on_gpu = layout.device != "cpu"
    quantize = recipe.lora.quantize if recipe.lora else "none"
    return MemoryInputs(
        shape=shape,
        layout=layout,
        gpus_per_node=gpus_per_node or min(recipe.hardware.processes_per_node, layout.world_size),
        seq_len=recipe.data.seq_len,
        activation_checkpointing=recipe.memory.activation_checkpointing,
        attn_impl=recipe.memory.attention,
        dense_mask=True,  # packed rows (block-diagonal) and padded rows both carry one
        lora_rank=recipe.lora.rank if recipe.lora else None,
        **(
            {"lora_targets": tuple(recipe.lora.target_modules), "lora_dropout": recipe.lora.dropout > 0}
            if recipe.lora
            else {}
        ),
        quantize=quantize,
        # The run's own device (runtime/engines/zero_engine.py _staged_load).
        quantize_on="gpu" if on_gpu else "cpu",
        zero_init=zero_init_for(quantize),
        direct_load=recipe.model.init == "pretrained",
        state_dtype=recipe.optim.state_dtype,
        optimizer=recipe.optim.name,
        export_adapter_only=bool(recipe.lora and recipe.lora.export == "adapter"),
        tiled_mlp=recipe.memory.tiled_mlp,
        tiled_loss=recipe.memory.tiled_loss,
        liger_loss=recipe.memory.liger_kernels,
        offload_checkpoints=recipe.memory.offload_checkpoints,
        # save_on_cpu(pin_memory=True) on CUDA only (runtime/model/model.py), through torch's allocator.
        checkpoint_pinning="torch" if on_gpu else "off",
        loader_forks=loader_forks_for(recipe.data.loader_workers, layout.offload_optimizer, on_gpu),
        sequences_per_sample=recipe.sequences_per_sample,
        reference=reference_of(recipe),
        generation=generation_of(recipe),
        vision=vision_of(recipe, shape),
        **ds_fields(run.ds_config, recipe.deepspeed.pinning, on_gpu, layout.zero_stage),
    )


def reference_of(recipe: Any) -> str:
    """MemoryInputs.reference of a recipe: DPO's choice; GRPO with beta > 0 scores every micro-batch under the
    initial model live, the same copy (or disabled adapters) DPO's live reference uses (runtime/engines/reference.py)."""
    return str(objective_spec(recipe.objective).reference_of(recipe))


def generation_of(recipe: Any) -> GenerationInputs | None:
    """MemoryInputs.generation of a recipe: GRPO's generation settings (planning/memory/generation.py), else None."""
    if not objective_spec(recipe.objective).generates:
        return None
    grpo = recipe.grpo
    return GenerationInputs(
        grpo.num_generations,
        grpo.max_completion_length,
        grpo.num_iterations,
        grpo.top_p,
        grpo.ds3_gather_for_generation,
        "continuous batching" if grpo.use_transformers_continuous_batching else "generate",
    )


def vision_of(recipe: Any, shape: ModelShape) -> VisionInputs:
    """MemoryInputs.vision of a recipe: model.freeze, and for image_chat data one image per sample at the largest
    size the run lets through: the sources' bounds (max_pixels, else data.image_max_pixels; the largest of them),
    then the checkpoint's processor's own limits. A text model, or an image-text one trained on text, has no
    images."""
    if shape.vision is None:
        return VisionInputs()
    freeze = tuple(recipe.model.freeze)
    images = [s for s in recipe.data.sources("train") if getattr(s, "format", None) == "image_chat"]
    if not images:
        return VisionInputs(freeze=freeze)
    own_min, own_max = checkpoint_pixels(recipe.model.name_or_path)

    def bound(key: str, default: int | None, pick: Any) -> int | None:
        values = [getattr(s, key, None) or getattr(recipe.data, f"image_{key}") for s in images]
        given = [v for v in values if v is not None]
        return pick(given) if given else default

    return VisionInputs(
        freeze=freeze,
        images_per_sample=1,
        min_pixels=bound("min_pixels", None, min),
        max_pixels=bound("max_pixels", None, max),
        processor_min_pixels=own_min,
        processor_max_pixels=own_max,
    )


def zero_init_for(quantize: str) -> bool | None:
    """MemoryInputs.zero_init of a run: transformers loads a quantised base outside zero.Init
    (planning/memory/estimate.py); None (= ZeRO-3) otherwise."""
    return False if quantize != "none" else None


def loader_forks_for(loader_workers: int | None, offload_optimizer: str, on_gpu: bool) -> bool:
    """Whether DataLoader workers fork after DeepSpeed's set-up: config/layout.workers_for (data.loader_workers,
    else none with the optimizer offloaded, else the stream's 2 worker processes on CUDA)."""
    asked = workers_for(loader_workers, offload_optimizer != "none")
    workers = 2 if asked is None else asked
    return workers > 0 and on_gpu


def ds_fields(ds_config: dict[str, Any], pinning: str, on_gpu: bool, stage: int) -> dict[str, Any]:
    """The MemoryInputs fields a DS JSON decides beyond its stage and offload: buckets, overlap, sub-groups,
    NVMe swap settings, and the pinning of its offload sections under deepspeed.pinning (section_pinning).
    "auto" values (HF's) are left to MemoryInputs, which fills them the way the effective JSON does."""
    zero = ds_config.get("zero_optimization", {}) or {}

    def number(key: str, default: int | None) -> int | None:
        value = zero.get(key)
        return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else default

    return {
        "reduce_bucket_size": number("reduce_bucket_size", None),
        "prefetch_bucket_size": number("stage3_prefetch_bucket_size", None),
        # DeepSpeed turns overlap_comm on by default for stage 3 only.
        "overlap_comm": bool(zero.get("overlap_comm", stage == 3)),
        "allgather_bucket_size": number("allgather_bucket_size", DS_ALLGATHER_BUCKET_SIZE)
        or DS_ALLGATHER_BUCKET_SIZE,
        "param_persistence_threshold": number("stage3_param_persistence_threshold", None),
        "sub_group_size": number("sub_group_size", DS_SUB_GROUP_SIZE) or DS_SUB_GROUP_SIZE,
        "swap": swap_settings(ds_config),
        "pinning": section_pinning(zero.get("offload_optimizer"), pinning, on_gpu),
        "param_pinning": section_pinning(zero.get("offload_param"), pinning, on_gpu),
    }


def swap_settings(ds_config: dict[str, Any]) -> SwapSettings:
    """The NVMe swap settings of a DS JSON's offload_optimizer and aio sections (DeepSpeed's defaults if absent)."""
    aio = ds_config.get("aio") or {}
    swap = (ds_config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    return SwapSettings(
        buffer_count=int(swap.get("buffer_count", SwapSettings.buffer_count)),
        pipeline_read=bool(swap.get("pipeline_read", False)),
        pipeline_write=bool(swap.get("pipeline_write", False)),
        intra_op_parallelism=int(aio.get("intra_op_parallelism", SwapSettings.intra_op_parallelism)),
        block_size=int(aio.get("block_size", SwapSettings.block_size)),
    )


@functools.cache
def shipped_settings(
    ds_key: tuple[int, str, str], pinning: str | None = None, on_gpu: bool = True
) -> dict[str, Any]:
    """MemoryInputs fields a shipped DS JSON fixes beyond its stage and offload (`ds_fields`): what the
    planner's candidates of that JSON run with. pinning None: the caller's own pinning fields stay."""
    name = SHIPPED_DS_CONFIGS.get(ds_key)
    if name is None:
        return {}
    _, raw = load_ds_config(name)
    fields = ds_fields(raw, pinning or "torch", on_gpu, ds_key[0])
    if pinning is None:
        del fields["pinning"], fields["param_pinning"]
    return fields


def section_pinning(offload: dict[str, Any] | None, pinning: str, on_gpu: bool) -> str:
    """offload_buffers.PINNINGS for one offload section of a resolved DS JSON under deepspeed.pinning.

    DeepSpeed pins when the section says so (pin_memory defaults to true, offload_config.py); its CPU
    accelerator pins nothing through torch (cpu_accelerator.py), but native pinning mlocks on any
    device. 'auto' becomes native, torch or off before a run starts (planning/memory/pinning.choose_auto); a plan
    made before that counts it as native (`llm-train plan --recipe auto` writes the choice it planned).
    """
    if not bool((offload or {}).get("pin_memory", True)) or pinning == "off":
        return "off"
    if pinning in ("native", "auto"):
        return "native"
    return "torch" if on_gpu else "off"


def needs(est: MemoryEstimate, inp: MemoryInputs, kind: str) -> tuple[int, int]:
    """(bytes per device, host bytes per node). On CPU the "GPU" terms live in host RAM too."""
    if kind != "cpu":
        return est.gpu_bytes, est.host_bytes
    device = sum(v for k, v in est.gpu_terms.items() if k != "cuda_context_and_slack")
    device = int(max(device, est.generation_live) * (1 + ALLOCATOR_SLACK_FRACTION))
    ranks = inp.ranks_per_node
    host = est.host_bytes - ranks * PROCESS_HOST_BYTES + ranks * (CPU_PROCESS_HOST_BYTES + device)
    return device, host


@dataclass(frozen=True)
class Evaluation:
    inputs: MemoryInputs
    """The candidate: a layout (a variation of the run's) and the memory techniques."""
    estimate: MemoryEstimate
    device_bytes: int
    host_bytes: int
    time: StepTime
    fits_device: bool
    fits_host: bool
    fits_nvme: bool = True
    """No NVMe needed, or at most the NVMe space the user declared (--nvme-gib)."""

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host and self.fits_nvme


def evaluate(inp: MemoryInputs, hw: Hardware, nvme_bytes: int = 0) -> Evaluation:
    """Estimate one candidate on `hw`: memory per device and host, step time, whether it fits.

    nvme_bytes: the NVMe space per node the user declared (0 = none: NVMe configurations never fit).
    """
    est = estimate_memory(inp)
    device_bytes, host_bytes = needs(est, inp, hw.kind)
    fits_device = hw.kind == "cpu" or device_bytes <= hw.gpu_limit_bytes
    fits_host = host_bytes <= hw.host_limit_bytes
    fits_nvme = est.nvme_bytes <= nvme_bytes
    speed = step_time_on(inp, hw)
    return Evaluation(inp, est, device_bytes, host_bytes, speed, fits_device, fits_host, fits_nvme)
