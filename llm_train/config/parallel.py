"""Which tensor / pipeline / data-parallel combinations a run may use, checked before anything loads.

layout.make_layout splits the world into dp x tp x pp; this module checks the split against the
model's shape and against what DeepSpeed 0.19 (and transformers) actually support, so a bad
combination fails in `--dry-run` and at launch with one line that shows every factor,
instead of minutes later inside DeepSpeed. No torch import: dry runs stay fast.

Supported (verified on CPU with loss parity against one process: tests/e2e/test_parallel.py runs
TP + ZeRO-1 and PP + ZeRO-1; TP with ZeRO-0/2, ZeRO-3 from scratch and PP with ZeRO-0 were run by hand):
  tensor parallel (AutoTP)  x data parallel  with ZeRO-0/1/2 (and ZeRO-3 for init: random)
  pipeline (PipelineModule) x data parallel  with ZeRO-0/1, Llama / Mistral / Qwen2
    (without LoRA, checkpoint.on_nonfinite=skip, Liger kernels, torch.compile, --flops-profiler)
  Ulysses sequence parallel x data parallel with ZeRO-2/3 (ZeRO-0/1 and offload accepted, not run
    end to end), sdpa or flash-attention-2, padded rows (packed rows with flash-attention-2 only),
    through Accelerate's ParallelismConfig (tests/e2e/test_sequence_parallel.py: losses and gradient
    norms against sp=1 within 1e-5, ZeRO-3 and ZeRO-2)
  preference objectives (dpo, simpo) with ZeRO data parallelism only: each rank scores whole sequences
  grpo likewise, with the step's completions over every rank whole groups of grpo.num_generations
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llm_train.config.attention_kernel import FLEX_KERNELS
from llm_train.config.layout import (
    Layout,
    quantized_layout_problem,
    sequence_parallel_message,
    sequence_parallel_problem,
)
from llm_train.config.model_families import PIPELINE_MODEL_TYPES
from llm_train.config.model_kind import is_image_text, text_fields
from llm_train.config.objectives import LayoutPart, objective_spec
from llm_train.config.recipe import Recipe
from llm_train.errors import UserError

SUPPORTED = (
    "supported: tensor parallel x data parallel with ZeRO-0/1/2 (ds_configs/zero1_tp, zero2_tp), "
    "pipeline x data parallel with ZeRO-0/1 (deepspeed.pipeline_stages=N with ds_configs/zero1)"
)


def check_parallel(layout: Layout, recipe: Recipe, fields: dict[str, Any], ds_source: str) -> None:
    """Raise a one-line UserError for the first combination that cannot run."""
    tp, pp = layout.tp, layout.pp
    degrees = f"world size {layout.world_size} = {layout.degrees}"
    if is_image_text(fields) and (tp > 1 or pp > 1 or layout.sp > 1):
        # Pipeline stages are built for decoder stacks alone (pipeline_model.py), AutoTP and Ulysses are not
        # verified with a vision tower in front of the language model: refused, not half-working.
        raise UserError(
            f"{degrees}: model_type {fields.get('model_type')} is an image-text model, which trains with data "
            "parallelism and ZeRO only (tensor, pipeline and sequence parallel are not supported for it); use "
            "deepspeed.config=zero3 (or zero3_offload), which shards the whole model over every rank"
        )
    fields = text_fields(fields)  # heads and layers are the language model's
    _check_objective(layout, recipe, degrees)
    if tp > 1 and pp > 1:
        raise UserError(
            f"{degrees}: tensor parallel (tensor_parallel.autotp_size={tp} in {ds_source}) cannot be combined "
            f"with pipeline parallel (deepspeed.pipeline_stages={pp}): DeepSpeed's AutoTP shards models driven "
            f"through Accelerate, not PipelineModule stages; {SUPPORTED}"
        )
    attention = recipe.memory.attention
    if attention in FLEX_KERNELS and (tp > 1 or pp > 1 or layout.sp > 1):
        # Pipeline stages build their own masks, DeepSpeed's Ulysses attention wraps sdpa / flash-attention
        # only, and flex under AutoTP is not verified (config/attention_kernel.py).
        raise UserError(
            f"{degrees}: memory.attention={attention} runs on the plain ZeRO path only (tp = pp = sp = 1); "
            "use memory.attention=auto (flash_attention_2 where installed, else sdpa)"
        )
    if pp > 1:
        _check_pipeline(layout, recipe, fields, ds_source, degrees)
    if tp > 1:
        _check_tensor_parallel(layout, recipe, fields, ds_source, degrees)
    if layout.sp > 1:
        _check_sequence_parallel(layout, recipe, fields, degrees)
    if recipe.lora is not None and recipe.lora.quantize != "none":
        _check_quantized(layout, recipe, ds_source, degrees)


def _check_quantized(layout: Layout, recipe: Recipe, ds_source: str, degrees: str) -> None:
    """QLoRA (lora.quantize): what bitsandbytes layers cannot do under DeepSpeed, refused before anything loads.

    Pipeline stages and AutoTP are refused for every LoRA run above. ZeRO-3 partitions the packed
    nf4 storage like any 16-bit tensor (its dtype is the compute dtype), and with offload_param on
    the CPU keeps the partitions in host RAM and fetches them per module, like any weight; the
    quantisation state (absmax, code book) is not a parameter: the run puts it on the GPU once,
    whole (runtime/model/quantized_base.py), so both travel as they must. NVMe swapping of the packed storage
    and int8 (whose scales live beside the weight) are not verified.
    """
    quantize = recipe.lora.quantize if recipe.lora else "none"
    asked = f"lora.quantize={quantize}"
    broken = quantized_layout_problem(quantize, layout.offload_params, layout.sp)
    if broken == "quantized_offload":
        raise UserError(
            f"{asked} cannot offload parameters to {layout.offload_params} (offload_param.device in {ds_source}): "
            "only nf4 weights go to the CPU (ds_configs/zero3_offload); use lora.quantize=nf4 with "
            "zero3_offload, or zero2, zero3 or zero3_offload_optimizer (the adapters' optimizer on the CPU)"
        )
    if broken == "quantized_sp":
        raise UserError(
            f"{degrees}: {asked} is not supported with deepspeed.sequence_parallel={layout.sp} (not verified "
            "with bitsandbytes layers); use lora.quantize=none or deepspeed.sequence_parallel=1"
        )
    for setting, on, fix in (
        (f"memory.torch_compile={recipe.memory.torch_compile}", recipe.memory.torch_compile != "off", "off"),
        ("memory.liger_kernels=true", recipe.memory.liger_kernels, "false"),
    ):
        if on:
            raise UserError(
                f"{setting} is not supported with {asked} (not verified with bitsandbytes layers); "
                f"set {setting.split('=')[0]}={fix}"
            )


def _check_objective(layout: Layout, recipe: Recipe, degrees: str) -> None:
    """Preference and RL objectives score whole sequences on one rank: what splits a sequence or its logits is
    refused; GRPO's groups are generated whole on one rank."""
    spec = objective_spec(recipe.objective)
    asked = f"objective={recipe.objective}"
    why: dict[str, tuple[LayoutPart, int, str]] = {
        "deepspeed.pipeline_stages": (
            "pipeline",
            layout.pp,
            "DeepSpeed's pipeline engine computes a token loss on its last stage and hands back no logits to "
            "score the chosen and rejected sequences by",
        ),
        "tensor_parallel.autotp_size": (
            "tensor_parallel",
            layout.tp,
            "AutoTP may split the output layer over the vocabulary, so no rank holds a sequence's log-probs "
            "(not verified)",
        ),
        "deepspeed.sequence_parallel": (
            "sequence_parallel",
            layout.sp,
            "Ulysses splits each sequence over ranks, so no rank holds a sequence's log-prob",
        ),
    }
    # objective grpo with pipeline stages: refused by the recipe itself (recipe.py), before the pipeline's rules.
    for setting, (part, degree, reason) in why.items():
        if degree > 1 and part not in spec.layouts:
            raise UserError(
                f"{degrees}: {asked} is not supported with {setting}={degree}: {reason}; train "
                f"{'with GRPO' if spec.generates else 'preferences'} with ZeRO data parallelism "
                "(ZeRO-0..3, offload, LoRA)"
            )
    if spec.generates:
        # TRL's rule: the step's completions over every rank form whole groups; a group may span ranks
        # (runtime/rl/grpo.py gathers the rewards before the advantages).
        total = layout.micro_batch_size * layout.grad_accum * layout.dp
        generations = recipe.grpo.num_generations
        if total % generations:
            raise UserError(
                f"grpo.num_generations={generations} does not divide the step's completions (micro batch "
                f"{layout.micro_batch_size} x accumulation {layout.grad_accum} x {layout.dp} data-parallel ranks = "
                f"{total}); make optim.micro_batch_size x grad_accum x ranks a multiple of {generations}"
            )


def _check_sequence_parallel(layout: Layout, recipe: Recipe, fields: dict[str, Any], degrees: str) -> None:
    sp, memory = layout.sp, recipe.memory
    seq_len = recipe.data.seq_len
    heads = int(fields.get("num_attention_heads") or sp)  # a shape unknown offline: only seq_len is checked
    kv_heads = int(fields.get("num_key_value_heads") or heads)
    broken = sequence_parallel_problem(sp, seq_len, heads, kv_heads)
    if broken:
        raise UserError(f"{degrees}: " + sequence_parallel_message(broken, sp, seq_len, heads, kv_heads))
    asked = f"deepspeed.sequence_parallel={sp}"
    if memory.attention == "eager":
        raise UserError(
            f"{degrees}: {asked} does not run with memory.attention=eager (DeepSpeed's Ulysses attention "
            "needs a kernel that masks by position, and eager would build an O(seq_len^2) mask); use "
            "memory.attention=sdpa or flash_attention_2"
        )
    if recipe.data.packing == "packed" and memory.attention != "flash_attention_2":
        raise UserError(
            f"{degrees}: {asked} with data.packing=packed would let packed samples attend to each other: "
            f"Ulysses drops the block mask and memory.attention={memory.attention} sees only one causal "
            "sequence; use data.packing=padded, or memory.attention=flash_attention_2 (its varlen kernel "
            "restarts at every sample's position 0)"
        )
    unsupported = {
        "memory.liger_kernels=true": memory.liger_kernels,
        f"memory.torch_compile={memory.torch_compile}": memory.torch_compile != "off",
    }
    for setting, asked_for in unsupported.items():
        if asked_for:
            raise UserError(
                f"{degrees}: {setting} is not supported with {asked} (not verified with Ulysses attention); "
                f"set {setting.split('=')[0]}={'off' if 'compile' in setting else 'false'}"
            )


def _check_pipeline(
    layout: Layout, recipe: Recipe, fields: dict[str, Any], ds_source: str, degrees: str
) -> None:
    pp = layout.pp
    if recipe.lora is not None:
        raise UserError(
            f"{degrees}: lora is not supported with deepspeed.pipeline_stages={pp}; "
            "train LoRA with ZeRO (deepspeed.pipeline_stages=1)"
        )
    # What the pipeline engine cannot do, refused here rather than ignored at run time.
    unsupported = {
        "checkpoint.on_nonfinite=skip": (
            recipe.checkpoint.on_nonfinite == "skip",
            "the 1F1B schedule runs backward before every micro-batch's loss is known; use "
            "checkpoint.on_nonfinite=stop",
        ),
        "memory.liger_kernels=true": (
            recipe.memory.liger_kernels,
            "Liger patches the HF model classes, which pipeline stages do not use; set memory.liger_kernels=false",
        ),
        f"memory.torch_compile={recipe.memory.torch_compile}": (
            recipe.memory.torch_compile != "off",
            "DeepSpeed's pipeline engine does not compile its stages; set memory.torch_compile=off",
        ),
        "memory.tiled_mlp=true": (
            recipe.memory.tiled_mlp,
            "the tiled MLP patches the HF decoder layers' forward, which pipeline stages replace; set "
            "memory.tiled_mlp=false",
        ),
        "memory.offload_checkpoints=true": (
            recipe.memory.offload_checkpoints,
            "the pipeline engine checkpoints through DeepSpeed's own activation checkpointing; set "
            "memory.offload_checkpoints=false",
        ),
    }
    for setting, (asked, why) in unsupported.items():
        if asked:
            raise UserError(f"{setting} is not supported with deepspeed.pipeline_stages={pp}: {why}")
    model_type = fields.get("model_type")
    if model_type is not None and model_type not in PIPELINE_MODEL_TYPES:
        raise UserError(
            f"{degrees}: deepspeed.pipeline_stages={pp} supports model types {', '.join(PIPELINE_MODEL_TYPES)}; "
            f"model.name_or_path={recipe.model.name_or_path} is '{model_type}'"
        )
    layers = fields.get("num_hidden_layers")
    if layers is not None and int(layers) < pp:
        raise UserError(
            f"{degrees}: deepspeed.pipeline_stages={pp} needs at least {pp} decoder layers, the model has "
            f"num_hidden_layers={layers}; use at most {layers} stages"
        )


def _check_tensor_parallel(
    layout: Layout, recipe: Recipe, fields: dict[str, Any], ds_source: str, degrees: str
) -> None:
    tp, stage = layout.tp, layout.zero_stage
    if stage == 3 and recipe.model.init == "pretrained":
        # DeepSpeed 0.19.8 trains ZeRO-3 + AutoTP, but transformers (5.x) refuses to load a checkpoint
        # into a model built under zero.Init with tensor_parallel set ("Weight conversions ... with
        # DeepSpeed Tensor Parallelism are not yet implemented").
        raise UserError(
            f"{degrees}: ZeRO-3 with tensor_parallel.autotp_size={tp} ({ds_source}) cannot load pretrained "
            "weights (transformers refuses checkpoints under ZeRO-3 + AutoTP); use ds_configs/zero1_tp or "
            "zero2_tp, or ZeRO-3 without tensor_parallel"
        )
    if recipe.lora is not None:
        raise UserError(
            f"{degrees}: lora is not supported with tensor_parallel.autotp_size={tp} ({ds_source}); "
            "train LoRA with ZeRO alone"
        )
    heads = fields.get("num_attention_heads")
    kv_heads = fields.get("num_key_value_heads") or heads
    if heads is not None and kv_heads is not None and (int(heads) % tp or int(kv_heads) % tp):
        raise UserError(
            f"{degrees}: tensor_parallel.autotp_size={tp} must divide the attention heads, the model has "
            f"num_attention_heads={heads} and num_key_value_heads={kv_heads}; pick a tp that divides both"
        )


def tensor_parallel_shards(ds_dir: Path) -> int:
    """How many AutoTP weight shards a DeepSpeed checkpoint holds (1: not tensor parallel).

    Each TP rank saves its slice of every split weight in its own model-states file; a pipeline
    checkpoint also has one such file per stage, next to its per-layer files, and is not TP.
    """
    model_files = list(ds_dir.glob("mp_rank_*_model_states.pt"))
    if any(ds_dir.glob("layer_*-model_states.pt")):
        return 1
    return max(1, len(model_files))
