"""The memory estimate's constants and per-token formulas: activations per layer, the MLP tiles, the logits
and the loss (dense, chunked, Liger's), Ulysses' buffers.

Pure functions of a model shape and token counts, so the runtime (runtime/loss/chunked.py cuts its chunks
by `loss_chunks`) and the measured-line tests read the same numbers the estimate adds up. The conventions
behind them (Korthikanti et al. 2022, ALST, the chunked loss) are in planning/memory/estimate.py's docstring.
"""

from __future__ import annotations

import math

from llm_train.planning.memory.inputs import ATTN_IMPLS, MemoryInputError
from llm_train.planning.model.shapes import ModelShape
from llm_train.units import GiB

# CUDA context (driver, cuBLAS/cuDNN handles, NCCL communicators) that `torch.cuda`
# never reports as allocated: ~0.3-0.6 GiB on Hopper/Ada with recent CUDA.
CUDA_CONTEXT_BYTES = GiB // 2
# PyTorch's caching allocator rounds blocks and fragments under the changing
# activation shapes of training; 5-15% over live tensors is typical, we take 10%.
ALLOCATOR_SLACK_FRACTION = 0.10
# Host RSS of one training process before any model state: Python, torch + CUDA
# libraries, DeepSpeed, tokenizer and data loader. Rough (2-4 GiB measured typically).
PROCESS_HOST_BYTES = 3 * GiB
# Hugging Face's default `max_shard_size` when checkpoints are saved ("5GB").
# With zero.Init each rank reads one shard at a time into CPU memory, partitions
# it, and frees it, so the load peak per rank is one shard, not the model; loading
# straight to the GPU (device_map) maps one shard file at a time the same way.
CHECKPOINT_SHARD_BYTES = 5 * 10**9
# A LoRA run's final/ shards (runtime/export/sharded.py): the host's share of a merged export.
EXPORT_SHARD_BYTES = 2 * GiB
# DeepSpeed's "overlap_comm uses 4.5x the allgather_bucket_size and
# reduce_bucket_size values" (its ZeRO config documentation).
OVERLAP_COMM_FACTOR = 4.5
# DeepSpeed defaults (deepspeed/runtime/zero/config.py, offload_config.py, engine).
DS_ALLREDUCE_BUCKET_SIZE = 500_000_000  # stage 0 gradient all-reduce bucket (elements)
DS_NVME_PARAM_BUFFER_COUNT = 5  # offload_param.buffer_count
DS_NVME_PARAM_BUFFER_SIZE = 100_000_000  # offload_param.buffer_size (elements)
DS_NVME_PARAM_MAX_IN_CPU = 1_000_000_000  # offload_param.max_in_cpu (elements; the shipped JSON's too)

# The staged load's peak over the staged base itself (bench/qlora_staged_load.py; bench/results/
# qlora-staged-load-*: 2- and 4-layer models of Llama-3-8B's layer shape on CPU, transformers 5.24,
# bitsandbytes 0.50, glibc malloc). bitsandbytes' CPU quantiser works on fp32 copies of the weight it
# quantises (the copy, its scaled values, int32 codes, then the packed bytes) while transformers' loader
# reads the next tensors: ~16 B per weight of the largest quantised tensor. And the freed temporaries of
# the smaller tensors stay in glibc's arenas, growing with the model: ~0.28 B per quantised weight (the
# two models' peaks exceeded the staged base by 1.03 and 1.16 GB; a straight line through two points,
# extrapolated to 70B). The run hands those back to the OS once the base is loaded (runtime/model/quantized_base.py
# `release_freed_host_memory`: after malloc_trim the excess measured ~0.15 GB at both sizes), so they are
# a load-phase term only.
QUANTIZE_WORKSPACE_BYTES_PER_WEIGHT = 16
QUANTIZE_RETAINED_BYTES_PER_WEIGHT = 0.28
# The chunked loss (memory.tiled_loss): each chunk of a micro-batch's tokens holds at most this many
# bytes of fp32 logits (runtime/loss/chunked.py cuts its chunks by this same constant). 64 MiB keeps a
# chunk's working set (CHUNK_BYTES_PER_LOGIT: ~3 times its fp32 logits) under a quarter GiB: the loss
# of 2 x 2048 tokens of a 128k vocabulary runs in 32 chunks of 128 tokens, each still a large matmul;
# ALST's 1 GiB slices are more than a whole 2048-token row.
LOSS_CHUNK_LOGITS_BYTES = 64 * 2**20
# bitsandbytes' 8-bit Adam per parameter: m and v as uint8 codes, each with one fp32 block maximum per 256
# elements (bitsandbytes 0.50.2's blockwise states, read on CPU: state1/state2 uint8, absmax1/absmax2 fp32).
EIGHT_BIT_STATE_BYTES = 2 * (1 + 4 / 256)
# The all-to-all of Ulysses attention regroups q, k, v and the attention output of one layer.
SP_ALL_TO_ALL_TENSORS = 4


# --- activations --------------------------------------------------------------------------------

# transformers' RMSNorm (LlamaRMSNorm and its copies) upcasts its input to fp32 and keeps that copy for
# backward: 4 bytes per hidden element, two norms per decoder layer, under bf16/fp16 (with fp32 weights
# the upcast is the input itself). Measured on CPU (tests/unit/test_memory_lines.py): without it the
# bf16 activation line was 14% under the measured peak, with it within 2%.
NORM_UPCAST_BYTES_PER_HIDDEN = 2 * 4


def mlp_intermediate_bytes_per_token(shape: ModelShape, tp: int = 1) -> float:
    """What a SwiGLU MLP keeps for backward per token: gate, up, SiLU(gate) and their product, 16-bit."""
    return 4 * 2 * shape.intermediate_size / tp


def activation_bytes_per_layer(
    shape: ModelShape,
    seq_len: int,
    micro_batch: int,
    attn_impl: str = "sdpa",
    tp: int = 1,
    sp: int = 1,
    tiled_mlp: bool = False,
    norm_upcast: bool = False,
    lora_dropout: tuple[str, ...] = (),
) -> float:
    """Korthikanti et al. 2022 per-layer activations (16-bit) on one rank, without recomputation,
    with the SwiGLU MLP's own intermediates (module docstring).

    `norm_upcast` (16-bit training): transformers' RMSNorm computes in fp32 and keeps that fp32 copy
    of its input for backward: NORM_UPCAST_BYTES_PER_HIDDEN x h more per token (measured, see there).
    `lora_dropout`: the LoRA targets whose input PEFT's dropout copies (lora.dropout > 0; the MLP's in its
    tiles under `tiled_mlp`, see `mlp_tile_bytes`).

    sdpa / flash_attention_2: s*b*(h*(10 + 8/t) + 8*i/t); eager adds s*b*h*5*a*s/(h*t).
    Under sequence parallelism the rank holds s/sp tokens (and a/sp heads of eager's s x s
    scores); with `tiled_mlp` the MLP intermediates are not kept per layer (see `mlp_tile_bytes`).
    """
    s, b, h, a = seq_len, micro_batch, shape.hidden_size, shape.num_heads
    per_token = h * (10 + 8 / tp) + (NORM_UPCAST_BYTES_PER_HIDDEN * h if norm_upcast else 0)
    per_token += lora_dropout_bytes_per_token(shape, lora_dropout, mlp=False, tp=tp)
    if not tiled_mlp:
        per_token += mlp_intermediate_bytes_per_token(shape, tp)
        per_token += lora_dropout_bytes_per_token(shape, lora_dropout, mlp=True, tp=tp)
    if attn_impl == "eager":
        # The s x s attention scores, softmax output and dropout mask of every head (a/sp heads
        # per rank under sequence parallelism: per local token, the coefficient of the full s).
        per_token += h * 5 * a * s / (h * tp)
    elif attn_impl not in ATTN_IMPLS:
        raise MemoryInputError(f"attn_impl must be one of {', '.join(ATTN_IMPLS)}, got '{attn_impl}'")
    return s / sp * b * per_token


# PEFT's LoRA dropout (lora.dropout > 0) makes its own copy of each adapted layer's input for the adapter
# and keeps it, with its 1-byte mask, for backward: per token, the input's width x (2 + 1) bytes in 16 bits.
# Measured on CPU (tests/unit/test_memory_lines.py): without this term a LoRA layer with dropout 0.05 was 25%
# over the estimate, with it within 15%.
LORA_DROPOUT_BYTES_PER_ELEMENT = 2 + 1
_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


def lora_dropout_bytes_per_token(
    shape: ModelShape, targets: tuple[str, ...], mlp: bool, tp: int = 1
) -> float:
    """PEFT's dropout copies per token and layer: of the attention targets (`mlp` False) or the MLP ones."""
    width = {
        "q_proj": shape.hidden_size,
        "k_proj": shape.hidden_size,
        "v_proj": shape.hidden_size,
        "o_proj": shape.q_dim / tp,
        "gate_proj": shape.hidden_size,
        "up_proj": shape.hidden_size,
        "down_proj": shape.intermediate_size / tp,
    }
    chosen = [t for t in set(targets) if t in width and (t in _MLP_TARGETS) == mlp]
    return sum(width[t] for t in chosen) * LORA_DROPOUT_BYTES_PER_ELEMENT


def mlp_tile_tokens(shape: ModelShape, tokens: int) -> int:
    """Tokens per TiledMLP tile: DeepSpeed cuts a sequence of n tokens into ceil(n / hidden_size) tiles."""
    return math.ceil(tokens / math.ceil(tokens / shape.hidden_size))


def mlp_tile_bytes(
    shape: ModelShape, tokens: int, micro_batch: int, tp: int = 1, lora_dropout: tuple[str, ...] = ()
) -> float:
    """The tiled MLP's working set: one tile's intermediates (and LoRA dropout copies) and their gradients
    while it is recomputed."""
    per_token = mlp_intermediate_bytes_per_token(shape, tp) + lora_dropout_bytes_per_token(
        shape, lora_dropout, mlp=True, tp=tp
    )
    return 2 * micro_batch * mlp_tile_tokens(shape, tokens) * per_token


def loss_chunks(tokens: int, vocab: int, chunk_bytes: int = LOSS_CHUNK_LOGITS_BYTES) -> int:
    """Chunks the chunked loss cuts `tokens` into: enough that one holds at most `chunk_bytes` of fp32 logits."""
    return max(1, min(tokens, math.ceil(tokens * vocab * 4 / chunk_bytes)))


# Bytes per logit at the peak of transformers' loss (logits, fp32 upcast, log-softmax kept for
# backward, its gradient in and out): 12 with 16-bit and with fp32 logits alike (measured on CPU,
# tests/unit/test_memory_lines.py's loss line; the output object is dropped after `.loss`, as the engines do).
DENSE_LOSS_BYTES_PER_LOGIT = 12
# The chunked loss per logit of one chunk (runtime/loss/chunked.py), by the logits' bytes: at its peak
# the log-softmax, its gradient and the logits' fp32 gradient; while the output layer's backward runs,
# the logits' gradient in their dtype.
CHUNK_BYTES_PER_LOGIT = {2: 12, 4: 12}
HEAD_BACKWARD_BYTES_PER_LOGIT = {2: 2, 4: 4}


def logits_bytes(shape: ModelShape, seq_len: int, micro_batch: int) -> int:
    """transformers' loss over the whole [tokens x vocabulary] logits: DENSE_LOSS_BYTES_PER_LOGIT each.

    Not sharded by tensor parallelism (AutoTP leaves lm_head whole).
    """
    return shape.vocab_size * seq_len * micro_batch * DENSE_LOSS_BYTES_PER_LOGIT


def chunked_loss_bytes(
    shape: ModelShape,
    tokens: int,
    logit_bytes: int,
    head_trains: bool,
    chunk_bytes: int = LOSS_CHUNK_LOGITS_BYTES,
) -> int:
    """The chunked loss's peak over `tokens` (all rows of a micro-batch): the gradient of the hidden
    states it returns, and one chunk's working set, or, when the output layer trains over several
    chunks, its backward's share (the logits and their gradient) and one more [vocab x hidden] weight
    gradient while each chunk's is added into the running one, if that is more."""
    chunks = loss_chunks(tokens, shape.vocab_size, chunk_bytes)
    logits = math.ceil(tokens / chunks) * shape.vocab_size
    working = logits * CHUNK_BYTES_PER_LOGIT[logit_bytes]
    if head_trains and chunks > 1:
        accumulating = logits * HEAD_BACKWARD_BYTES_PER_LOGIT[logit_bytes]
        working = max(working, accumulating + shape.vocab_size * shape.hidden_size * logit_bytes)
    return working + tokens * shape.hidden_size * logit_bytes


def liger_loss_bytes(shape: ModelShape, tokens: int, logit_bytes: int) -> int:
    """Liger 0.8.5's fused linear cross-entropy over `tokens` with per-token losses (read from its source,
    ops/fused_linear_cross_entropy.py; not measured here: it needs CUDA): chunks of next_pow2(tokens /
    ceil(vocab / hidden)) tokens, whose logits buffer and scaled gradient are in the logits' dtype, the
    gradient of the hidden states (made in forward and again in backward) and the fp32 losses."""
    per_chunk = 2 ** math.ceil(math.log2(math.ceil(tokens / math.ceil(shape.vocab_size / shape.hidden_size))))
    chunk_tokens = min(tokens, per_chunk)
    return (
        2 * chunk_tokens * shape.vocab_size * logit_bytes
        + 2 * tokens * shape.hidden_size * logit_bytes
        + 4 * tokens
    )


def sequence_parallel_buffer_bytes(
    shape: ModelShape, local_tokens: int, micro_batch: int, dtype_bytes: int
) -> int:
    """Ulysses all-to-all room for one layer: q, k, v and the output of its local tokens, regrouped by head."""
    return SP_ALL_TO_ALL_TENSORS * local_tokens * micro_batch * shape.hidden_size * dtype_bytes
