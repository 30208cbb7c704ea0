"""Bytes of a QLoRA base (`lora.quantize`): which weights bitsandbytes quantises, and to how many bytes.

transformers' bitsandbytes integration replaces every `nn.Linear` of the decoder layers (q, k, v,
o, gate, up, down) and leaves the embeddings, the norms and the output layer in the 16-bit
training dtype (the output embeddings are never converted; `nn.Embedding` has no bitsandbytes
layer). Per quantised weight element, as bitsandbytes 0.50 stores it (measured on a 1024 x 4096
weight: 0.5161 B for NF4 with double quantisation, against 0.5159 from the formula below plus the
two 16- and 256-entry code tables):
- nf4 (double quantisation, blocks of 64): 4-bit codes 0.5 B, one 8-bit absmax per block (1/64 B),
  one fp32 absmax per 256 blocks (4 / (64 x 256) B);
- int8 (LLM.int8()): 1 B, plus one fp32 scale per output row (4 / in_features B).
Biases stay 16-bit.

While a quantised layer computes, bitsandbytes dequantises its weight to the compute dtype (in
forward, and again for the input gradient in backward): one 16-bit copy of the layer being
computed exists at a time.

Quantising one weight of n elements on the GPU (a staged base: runtime/model/quantized_base.py `quantizing_on`;
bitsandbytes 0.50.2 `functional.quantize_4bit` and its CUDA kernel, backends/cuda/ops.py 384-420)
allocates there, besides the 16-bit weight itself: the packed codes (n / 2 B), the fp32 absmax of each
block of 64 (4n / 64 B) and, for double quantisation, that absmax less its mean (another 4n / 64 B),
which `quantize_blockwise` turns into the one-byte absmax and nested fp32 absmax of the state; the
fp32 absmax and its difference are freed once the state exists.
"""

from __future__ import annotations

import math

from llm_train.planning.model.shapes import ModelShape

QUANTIZE_MODES = ("none", "nf4", "int8")
QUANTIZE_DEVICES = ("gpu", "cpu")
QUANTIZED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NF4_BLOCK = 64
NF4_NESTED_BLOCK = 256
NF4_PACKED_BYTES_PER_WEIGHT = 0.5
# The quantisation state (absmax per block, fp32 absmax per nested block): not a parameter, so ZeRO-3
# never partitions or offloads it; the run keeps it whole on every GPU (runtime/model/quantized_base.py).
NF4_STATE_BYTES_PER_WEIGHT = 1 / NF4_BLOCK + 4 / (NF4_BLOCK * NF4_NESTED_BLOCK)
NF4_BYTES_PER_WEIGHT = NF4_PACKED_BYTES_PER_WEIGHT + NF4_STATE_BYTES_PER_WEIGHT
# Beyond the 16-bit weight and its state: what quantising it on the GPU holds at once (module docstring).
NF4_QUANTIZE_TEMPORARY_BYTES_PER_WEIGHT = NF4_PACKED_BYTES_PER_WEIGHT + 2 * 4 / NF4_BLOCK


def _in_features(shape: ModelShape, module: str) -> int:
    if module == "o_proj":
        return shape.q_dim
    if module == "down_proj":
        return shape.intermediate_size
    return shape.hidden_size


def quantized_weight_params(shape: ModelShape) -> int:
    """Weight elements bitsandbytes quantises (the decoder layers' linear weights, not their biases)."""
    return sum(numels[0] * count for name, numels, count in shape.modules() if name in QUANTIZED_MODULES)


def base_weight_bytes(shape: ModelShape, quantize: str, weight_bytes: int) -> float:
    """Bytes of the whole base model's weights: quantised projections plus everything left 16-bit."""
    if quantize == "none":
        return float(shape.num_params * weight_bytes)
    quantized = 0.0
    for name, numels, count in shape.modules():
        if name not in QUANTIZED_MODULES:
            continue
        per_weight = NF4_BYTES_PER_WEIGHT if quantize == "nf4" else 1 + 4 / _in_features(shape, name)
        quantized += numels[0] * count * per_weight
    return quantized + (shape.num_params - quantized_weight_params(shape)) * weight_bytes


def largest_quantized_weight(shape: ModelShape) -> int:
    """Weights of the largest tensor bitsandbytes quantises (an MLP projection, for these models)."""
    return max(numels[0] for name, numels, _ in shape.modules() if name in QUANTIZED_MODULES)


def dequantized_layer_bytes(shape: ModelShape, quantize: str, weight_bytes: int, tp: int = 1) -> float:
    """The 16-bit copy of the largest quantised weight while it computes (0 when nothing is quantised)."""
    if quantize == "none":
        return 0.0
    return largest_quantized_weight(shape) * weight_bytes / tp


def quantization_state_bytes(shape: ModelShape, quantize: str) -> float:
    """Bytes of the nf4 quantisation state of the whole base (0 otherwise: int8's scales are counted with
    its weights, which ZeRO-3 does not partition apart from them here)."""
    if quantize != "nf4":
        return 0.0
    return quantized_weight_params(shape) * NF4_STATE_BYTES_PER_WEIGHT


def packed_numel(numel: int, quantize: str, storage_bytes: int) -> int:
    """Elements of the tensor bitsandbytes stores an nf4 weight of `numel` weights in: 4 bits each, packed
    into the storage dtype (the compute dtype: bf16 a quarter of the weights, fp32 an eighth)."""
    if quantize != "nf4":
        return numel
    return math.ceil(numel * NF4_PACKED_BYTES_PER_WEIGHT / storage_bytes)


def staged_quantize_gpu_bytes(shape: ModelShape, weight_bytes: int) -> float:
    """The GPU's bytes while an nf4 base loads quantised there weight by weight (runtime/model/quantized_base.py
    `quantizing_on`), at the largest weight: the quantisation state of every weight (it stays on the GPU,
    the run keeps it there), and the largest weight in 16 bits with its codes and absmax temporaries.
    The packed codes go back to the host as each weight is done: the 4-bit base is never on the GPU."""
    largest = largest_quantized_weight(shape)
    return quantization_state_bytes(shape, "nf4") + largest * (
        weight_bytes + NF4_QUANTIZE_TEMPORARY_BYTES_PER_WEIGHT
    )
