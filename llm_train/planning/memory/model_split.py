"""One GPU's share of the model: its elements after tensor and pipeline parallelism and ZeRO, and the bytes of
each (weights, gradients, optimizer states, a quantised base). The GPU and host terms of the memory estimate
(planning/memory/estimate.py, planning/memory/host.py) both start from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llm_train.planning.memory.formulas import EIGHT_BIT_STATE_BYTES
from llm_train.planning.memory.inputs import MemoryInputs
from llm_train.planning.memory.quantized_bytes import base_weight_bytes, quantization_state_bytes
from llm_train.planning.model.vision_shapes import LANGUAGE_MODEL


@dataclass(frozen=True)
class ModelSplit:
    """How one GPU's share of the model divides: bytes per element, and elements after tp x pp.

    tp and pp split the model between GPUs before ZeRO partitions it over dp x sp. Approximation: an
    even split (embeddings and lm_head really sit on the first / last pipeline stage, and AutoTP
    leaves norms and embeddings whole).
    """

    weight_bytes: int
    """2 (16-bit) or 4 (fp32); the frozen LoRA base too: it is loaded in the training dtype."""
    grad_bytes: int
    """The gradients' bytes: those of the weights."""
    optim_bytes: float
    """fp32 master + m + v (12), just m + v when the weights are fp32 (8), or bf16 master + m + v (6);
    with an 8-bit optimizer fp32 master + 8-bit m, v (6.03), or just m, v (2.03)."""
    base: float
    """The base model's elements on this GPU's tp x pp share."""
    weights: float
    """Base and LoRA adapters."""
    trainable: float
    """What the optimizer updates: the adapters under LoRA, else the base."""
    persistent: float
    """ZeRO-3: tensors under the persistence threshold (norms, Qwen's q/k/v biases), whole on every GPU."""
    partitioned: float
    """weights - persistent: what ZeRO-3 partitions."""
    on_gpu_weights: float
    """The elements of weights this GPU holds during training."""
    quantized_base: float
    """Bytes of the base at its stored precision (4/8-bit under QLoRA, else weight_bytes each), its
    quantisation state included."""
    quantization_state: float
    """Of those, the nf4 quantisation state: not a parameter, so never partitioned or offloaded."""


def model_split(inp: MemoryInputs) -> ModelSplit:
    """The model's elements on one GPU and their bytes per element (see ModelSplit)."""
    shape = inp.shape
    assert inp.param_persistence_threshold is not None
    mixed = inp.precision != "fp32"
    weight_bytes = 2 if mixed else 4
    optim_bytes: float = 12 if mixed else 8
    if inp.state_dtype == "bf16":
        # bf16 master + m + v (offloaded optimizer only; its host buffers: planning/memory/offload_buffers.py).
        optim_bytes = 6
    if inp.optimizer != "adamw":
        # bitsandbytes' 8-bit m and v: a byte each, plus one fp32 maximum per block of 256 for each;
        # DeepSpeed's fp32 master copy stays under mixed precision (runtime/model/optim.py).
        optim_bytes = (4 if mixed else 0) + EIGHT_BIT_STATE_BYTES
    shard = inp.tp * inp.pp
    base = shape.num_params / shard
    adapters = shape.lora_params(inp.lora_rank, inp.lora_targets) / shard if inp.lora_rank else 0.0
    weights = base + adapters
    trainable = adapters if inp.lora_rank else base
    if shape.vision is not None:
        trainable = _image_text_trainable(inp, adapters, base)
        weights = base + trainable if inp.lora_rank else weights  # the adapters where the run puts them
    stage3 = inp.zero_stage == 3
    persistent = shape.small_tensor_params(inp.param_persistence_threshold) / shard if stage3 else 0.0
    partitioned = weights - persistent
    if stage3:
        on_gpu_weights = persistent + (
            0.0 if inp.offload_params != "none" else partitioned / inp.zero_partitions
        )
    else:
        on_gpu_weights = weights
    return ModelSplit(
        weight_bytes=weight_bytes,
        grad_bytes=weight_bytes,
        optim_bytes=optim_bytes,
        base=base,
        weights=weights,
        trainable=trainable,
        persistent=persistent,
        partitioned=partitioned,
        on_gpu_weights=on_gpu_weights,
        quantized_base=base_weight_bytes(shape, inp.quantize, weight_bytes) / shard,
        quantization_state=quantization_state_bytes(shape, inp.quantize) / shard,
    )


def _image_text_trainable(inp: MemoryInputs, adapters: float, base: float) -> float:
    """What trains in an image-text model under model.freeze (a frozen part keeps its 16-bit weights, counted in
    `base`, and has no gradients or optimizer states). Under LoRA the adapters go where training goes, as the
    run puts them (runtime/model/model.py): on the target-named linears of every part model.freeze leaves out
    (by default the language model alone); the base weights train nowhere."""
    vision = inp.shape.vision
    assert vision is not None
    shard = inp.tp * inp.pp
    freeze = inp.vision.freeze
    if inp.lora_rank:
        language = adapters if LANGUAGE_MODEL not in freeze else 0.0
        return language + vision.lora_params(inp.lora_rank, inp.lora_targets, freeze) / shard
    language = inp.shape.language_model_params / shard if LANGUAGE_MODEL not in freeze else 0.0
    return language + inp.vision.trained_params(vision) / shard


def layers_per_stage(inp: MemoryInputs) -> int:
    """Decoder layers on the first pipeline stage."""
    return math.ceil(inp.shape.num_layers / inp.pp)
