"""Per-GPU, host-RAM and NVMe memory estimate for one training configuration.

Used by `llm-train plan` and `--dry-run` to say, before any weights load, whether a
recipe fits the user's GPUs and host RAM. Pure arithmetic: no torch or deepspeed
import, so it answers in milliseconds. Its input, one configuration (`MemoryInputs`), and
the rules that refuse impossible ones are in planning/memory_inputs.py.

Conventions (read this before comparing numbers with other tools)
-----------------------------------------------------------------
Model states. We count mixed-precision Adam at **16 bytes per parameter**:
2 (16-bit weights) + 2 (16-bit gradients) + 12 (fp32 master weights, Adam m and v).
That is the accounting of the ZeRO paper (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", section 3.1: "2Psi + 2Psi +
K*Psi with K = 12"); tests/unit/planner_reference.py's `zero_paper_model_states` reproduces its
worked example (7.5B parameters, 64 GPUs: 120 / 31.4 / 16.6 / 1.9 GB for stages 0-3). Pure fp32
training is 4 + 4 + 8 = 16 bytes too, split differently (no separate master copy).

DeepSpeed's own estimators (`estimate_zero2_model_states_mem_needs`,
`estimate_zero3_model_states_mem_needs`) count **18** bytes per parameter: they add
4 bytes of fp32 gradients, because DeepSpeed's optimizers upcast the gradient
partition to fp32 before the Adam step (and ZeRO-Offload keeps that fp32 gradient
next to the optimizer state on the host). On the GPU without offload that fp32
partition is transient (allocated for the step, then freed), so we leave it out of
the steady-state GPU terms and let the allocator slack cover it; on the host, under
offload, it is persistent and we do count it (`offloaded_fp32_gradients`).
The tests check the estimator against both conventions: tests/unit/planner_reference.py
reproduces DeepSpeed's two functions exactly.

Host RAM under CPU and NVMe offload is not a bytes-per-parameter convention but what DeepSpeed 0.19.8
allocates, read from its source in planning/offload_buffers.py, under the run's pinning choice
(deepspeed.pinning): for a ZeRO-3 + CPU-Adam 7B with fp32 states at the first optimizer step, master 4
+ m, v 8 + the sub-groups' fp32 gradients 4 + the flat 16-bit gradient buffer 2 bytes per parameter,
the last two rounded up to powers of two by torch's pinned allocator (DeepSpeed's default) or exact
(native mlock, or unpinned), plus a 16-bit copy of one sub-group in flight, plus, while forked
DataLoader workers live, a second copy of the pages the step rewrites. With the optimizer on NVMe the
host keeps the flat 16-bit gradients and the swap buffers. The first H200 run of 7b-rtx4090 was killed
by the kernel in that step on a 125.9 GiB machine after this estimate had said 103 GiB
(bench/results/host-ram-7b-offload-20261130.txt).

Activations. Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", section 4): per layer s*b*h*(34 + 5*a*s/h) bytes with eager
attention; with tensor parallel degree t and no sequence parallelism (DeepSpeed
AutoTP has none) s*b*h*(10 + 24/t + 5*a*s/(h*t)): the 10 (layer-norm inputs,
dropout masks, residual) is replicated on every TP rank. SDPA / FlashAttention
never keep the s x s score matrix, which removes the 5*a*s/h term. Full activation
checkpointing keeps only each layer's 16-bit input (2*s*b*h) plus one layer's full
activations while it is recomputed. Of the 24/t, 16/t is the MLP's intermediates for a
4h GeLU MLP; our models have SwiGLU MLPs, whose backward keeps four [tokens x
intermediate] 16-bit tensors (gate, up, SiLU(gate), their product: 8*i bytes per token,
counted with torch's saved-tensor hooks on a HF LlamaMLP), so we count those instead
(s*b*8*i/t: 21.5*s*b*h for Llama-2-7B, 28*s*b*h for Llama-3-8B). Without dropout the
rest is a little less; the estimate claims ~15%.

Long context (DeepSpeed ALST: Ulysses sequence parallelism and the memory switches).
With sequence-parallel degree sp every rank holds s/sp tokens of every activation; inside
attention the all-to-all hands it all s tokens of heads/sp heads, the same bytes. So the
per-layer terms, the checkpoints and the logits are those of s/sp tokens (eager's score
matrix is a/sp heads x s x s). The all-to-all itself needs send/receive room for q, k, v and
the attention output of the layer being computed: 4*(s/sp)*b*h 16-bit values (k and v
counted at full width, an upper bound under GQA). ZeRO partitions over all dp*sp ranks
(DeepSpeed's sequence-data-parallel group). `memory.tiled_mlp` (DeepSpeed's TiledMLP) runs
each MLP over tiles of `hidden_size` tokens and recomputes it per tile in backward: its
intermediates exist for one tile (and that tile's gradients), not per layer.
`memory.tiled_loss` computes logits and loss in chunks of at most LOSS_CHUNK_LOGITS_BYTES of fp32
logits (runtime/chunked_loss.py): one chunk's working set instead of transformers' whole
[tokens x vocabulary] logits, their fp32 copy, log-softmax and its gradients (12 bytes per logit). `memory.offload_checkpoints` keeps the per-layer checkpointed
hidden states in pinned host RAM between forward and backward: on the GPU stays the one
being copied; the host holds all of them, each in a block of torch's pinned allocator, rounded up to
a power of two, that stays cached for the next step (save_on_cpu(pin_memory=True) on CUDA).

8-bit optimizer states (`optimizer`, optim.name: bitsandbytes' AdamW8bit / PagedAdamW8bit, on the GPU
under ZeRO-0/1/2): m and v take a byte each plus a block maximum (EIGHT_BIT_STATE_BYTES), the fp32
master copy stays: 6.03 bytes per trained parameter of optimizer state instead of 12. The paged
variant can move them to host RAM under GPU pressure; the estimate keeps them on the GPU.

Low-precision optimizer states (`state_dtype="bf16"`, DeepSpeed's bf16_master_weights_and_grads +
bf16_optimizer_states, CPU offload only): the offloaded master weights, Adam m and v are 2 bytes
each instead of 4 (6 instead of 12 per parameter) and the host gradient partition is bf16 (2
instead of 4): 8 bytes per offloaded parameter on the host instead of 16.

Preference tuning (objective dpo / simpo). A micro-batch of m pairs is 2m rows of seq_len (chosen
and rejected; shorter when the batch's pairs are, the estimate takes seq_len): activations, logits
and masks are those of 2m sequences (`sequences_per_sample`). DPO's reference costs no memory when
its log-probs are cached (one forward pass before training) or, under LoRA, when the base with the
adapters disabled scores it live; a live frozen copy without LoRA adds its 16-bit weights, sharded
like the policy's under ZeRO-3 (on the host with parameter offload) and whole on every GPU under
stages 0-2 (TRL's prepare_deepspeed runs it at stage 0). It runs under no_grad before the policy's
forward, so its activations and logits are freed before the policy's exist: no term.

Export. At the end of a full fine-tune (runtime/zero_engine.py `export`) rank 0 holds the gathered
16-bit model on the CPU (Accelerate's get_state_dict: ZeRO-3's consolidated 16-bit state dict, or a
CPU clone of the module's); `save_hf_model` writes it without another copy (it clones only tensors
that share storage). Before gathering, every rank frees its Adam moments (runtime/optim.py
`release_moments`: the final checkpoint is committed, the run is over), two thirds of the
offloaded optimizer state. The export phase is therefore the training phase, less the
offloaded moments, plus the gathered copy; the host peak is the larger of the phases. A LoRA run
writes final/ layer by layer from the GPU (runtime/sharded_export.py): the host holds one shard of
EXPORT_SHARD_BYTES (or the largest tensor, if larger) for a merged export, the adapters for an
adapter export.

Loading. A pretrained model is read from its checkpoint one tensor at a time, straight onto the GPU
(transformers' device_map; ZeRO-0/1/2) or into zero.Init's partitions (ZeRO-3): the host holds the
safetensors shard being read (CHECKPOINT_SHARD_BYTES), never the model. Only a randomly initialised
model (`direct_load=False`) is built whole on the host first.

QLoRA (`quantize`): the decoder layers' linear weights in 4 or 8 bits, the rest 16-bit
(planning/quantized_bytes.py), plus one dequantised 16-bit copy of the layer computing. Under ZeRO-0/1/2
the base loads straight onto each GPU. Under ZeRO-3 an nf4 base is staged on the host, whole on every
rank (transformers skips zero.Init for a quantised model), each weight quantised as it loads on the run's
device (`quantize_on`), and zero.Init(module=...) partitions it from there tensor by tensor
(runtime/quantized_base.py). Quantised on the CPU (a CPU run), the host's load peak is ranks x (the staged base
+ the quantiser's working set and the loader's freed temporaries, measured: QUANTIZE_*_BYTES_PER_WEIGHT).
Quantised on the GPU, one weight at a time with its codes sent back to the host, the host holds the staged
base less its quantisation state (that stays on the GPU), the largest weight as read and its codes, and
the same freed temporaries (measured on the CPU path: an upper bound, the GPU path frees no fp32
copies); the GPU holds the state of the whole base and the weight being quantised
(quantized.staged_quantize_gpu_bytes), far less than training. zero.Init never holds more than one
whole tensor of it on the GPU (less than the gathered module training holds). The packed
codes are partitioned like any weight (and offloaded with offload_param: cpu); the quantisation state
(absmax, NF4_STATE_BYTES_PER_WEIGHT) is no parameter and stays whole on every GPU. An int8 base under
ZeRO-3 still loads whole onto each GPU first (its scales are not moved off it), so there the GPU's peak
is the larger of that load and training.

Units: bytes everywhere; `GiB` (2**30) in tables. GPU terms are per GPU (the
busiest one: first pipeline stage); host terms and NVMe are per node.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from llm_train.planning.generation import kv_cache_bytes, prefill_bytes, sampling_bytes
from llm_train.planning.memory_inputs import ATTN_IMPLS, MemoryInputError, MemoryInputs
from llm_train.planning.offload_buffers import (
    HostBuffer,
    OffloadRank,
    cpu_optimizer_buffers,
    cpu_parameter_buffers,
    held_bytes,
    loader_fork_copies,
    nvme_optimizer_buffers,
    nvme_optimizer_bytes,
)
from llm_train.planning.quantized_bytes import (
    NF4_PACKED_BYTES_PER_WEIGHT,
    base_weight_bytes,
    dequantized_layer_bytes,
    largest_quantized_weight,
    quantization_state_bytes,
    quantized_weight_params,
    staged_quantize_gpu_bytes,
)
from llm_train.planning.shapes import ModelShape
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
# A LoRA run's final/ shards (runtime/sharded_export.py): the host's share of a merged export.
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
# extrapolated to 70B). The run hands those back to the OS once the base is loaded (runtime/quantized_base.py
# `release_freed_host_memory`: after malloc_trim the excess measured ~0.15 GB at both sizes), so they are
# a load-phase term only.
QUANTIZE_WORKSPACE_BYTES_PER_WEIGHT = 16
QUANTIZE_RETAINED_BYTES_PER_WEIGHT = 0.28
# The chunked loss (memory.tiled_loss): each chunk of a micro-batch's tokens holds at most this many
# bytes of fp32 logits (runtime/chunked_loss.py cuts its chunks by this same constant). 64 MiB keeps a
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
# tests/unit/test_loss_memory.py; the output object is dropped after `.loss`, as the engines do).
DENSE_LOSS_BYTES_PER_LOGIT = 12
# The chunked loss per logit of one chunk (runtime/chunked_loss.py), by the logits' bytes: at its peak
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


# --- the estimator ------------------------------------------------------------------------------


_LABELS = {
    "parameters": "parameters",
    "dequantized_weight": "dequantised 4/8-bit weight (transient)",
    "quantization_state": "4-bit quantisation state (absmax; whole on every GPU)",
    "gradients": "gradients",
    "optimizer_states": "optimizer states",
    "activations": "activations",
    "sequence_parallel_buffers": "Ulysses all-to-all buffers",
    "logits_and_loss": "logits and loss",
    "attention_mask": "sdpa attention mask (s x s)",
    "deepspeed_buffers": "DeepSpeed buffers",
    "cuda_context_and_slack": "CUDA context + allocator slack",
    "offloaded_optimizer_states": "offloaded optimizer states (master, m, v)",
    "offloaded_fp32_gradients": "offloaded master-dtype gradients",
    "offload_16bit_buffers": "offload 16-bit gradient/parameter buffers",
    "optimizer_step_transient": "optimizer step: 16-bit copy of one sub-group (transient)",
    "loader_fork_copies": "forked loader workers: copy-on-write twin of the optimizer state",
    "optimizer_swap_buffers": "optimizer NVMe swap buffers (mlocked)",
    "offloaded_parameters": "offloaded parameters",
    "offloaded_checkpoints": "offloaded activation checkpoints (pinned)",
    "reference_model": "DPO reference model (frozen copy, 16-bit)",
    "offloaded_reference_parameters": "offloaded DPO reference parameters",
    "param_swap_buffers": "parameter NVMe swap buffers (mlocked)",
    "process_overhead": "processes (torch, CUDA libs, Python)",
    "model_load_peak": "model load peak (transient)",
    "export_peak": "final export (transient)",
    "generation_gathered_parameters": "generation: gathered model",
    "generation_kv_cache": "generation: key-value cache",
    "generation_prefill": "generation: prefill, one layer",
    "generation_sampling": "generation: sampling logits",
}
# The training terms generation runs beside (GRPO generates between optimizer steps): the model states and
# DeepSpeed's buffers stay allocated (gradients counted: conservative), a 4-bit base dequantises each layer
# for generation's matmuls too; training's activations, logits and masks do not exist yet.
HELD_THROUGH_GENERATION = (
    "parameters",
    "gradients",
    "optimizer_states",
    "deepspeed_buffers",
    "reference_model",
    "dequantized_weight",
    "quantization_state",
)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


@dataclass(frozen=True)
class MemoryEstimate:
    """Result of `estimate_memory`. GPU numbers per GPU, host and NVMe per node, all bytes."""

    gpu_terms: dict[str, int]
    host_terms: dict[str, int]
    nvme_bytes: int
    gpu_bytes: int
    host_bytes: int
    convention: str
    locked_per_rank: int = 0
    """Host bytes one process mlocks (native pinning, async-I/O buffers): what its memlock limit must allow."""
    generation_terms: dict[str, int] = field(default_factory=dict)
    """objective grpo: the GPU terms only generation has (planning/generation.py); empty otherwise."""
    generation_live: int = 0
    """The generation phase's live tensors: HELD_THROUGH_GENERATION's terms and generation_terms."""

    @property
    def generation_bytes(self) -> int:
        """The generation phase's GPU total, with the CUDA context and allocator slack (0: no generation)."""
        if not self.generation_terms:
            return 0
        return int(CUDA_CONTEXT_BYTES + (1 + ALLOCATOR_SLACK_FRACTION) * self.generation_live)

    def table(self) -> list[tuple[str, str]]:
        rows = [(f"GPU {_LABELS.get(k, k)}", _gib(v)) for k, v in self.gpu_terms.items()]
        total = "GPU total (per GPU)"
        if self.generation_terms:  # GRPO: generation runs between steps, beside the states training holds
            rows.append(("GPU training phase total", _gib(sum(self.gpu_terms.values()))))
            rows += [(f"GPU {_LABELS.get(k, k)}", _gib(v)) for k, v in self.generation_terms.items()]
            rows.append(("GPU generation phase total (+ held states)", _gib(self.generation_bytes)))
            total = "GPU total (per GPU, the larger phase)"
        rows.append((total, _gib(self.gpu_bytes)))
        rows += [(f"host {_LABELS.get(k, k)}", _gib(v)) for k, v in self.host_terms.items() if v]
        rows.append(("host RAM total (per node)", _gib(self.host_bytes)))
        if self.nvme_bytes:
            rows.append(("NVMe (per node)", _gib(self.nvme_bytes)))
        return rows


CONVENTION = (
    "model states: mixed-precision Adam at 16 B/param (2 weights + 2 grads + 12 fp32 master/m/v, "
    "ZeRO paper); DeepSpeed's estimators count 18 (fp32 grads too). Activations: Korthikanti et al. "
    "2022. GPU per GPU (first pipeline stage), host and NVMe per node; host total = processes + "
    "max(load phase, training phase, training phase - offloaded Adam moments + export copy)."
)


def estimate_memory(inp: MemoryInputs) -> MemoryEstimate:
    """Estimate GPU (per GPU), host RAM and NVMe (per node) bytes for `inp`.

    A composer: the model's split over the GPUs, then the GPU terms, the host terms and their peak
    over the load, training and export phases, and the NVMe space (the module docstring has the
    conventions of each).
    """
    split = model_split(inp)
    activations, offloaded_checkpoints = activation_bytes(inp)
    reference_gpu, reference_host = reference_model_bytes(inp, split)
    gpu = gpu_terms(inp, split, activations, reference_gpu)
    host, released, locked = host_terms(inp, split, offloaded_checkpoints, reference_host)
    gpu_int = {k: int(v) for k, v in gpu.items()}
    generation = {k: int(v) for k, v in generation_gpu_terms(inp, split).items()}
    live = sum(v for k, v in gpu_int.items() if k in HELD_THROUGH_GENERATION) + sum(generation.values())
    phases = MemoryEstimate(
        gpu_terms=gpu_int,
        host_terms={k: int(v) for k, v in host.items()},
        nvme_bytes=int(nvme_space_bytes(inp, split)),
        gpu_bytes=0,
        host_bytes=int(host_peak_bytes(inp, host, released)),
        convention=CONVENTION,
        locked_per_rank=int(locked),
        generation_terms=generation,
        generation_live=live if generation else 0,
    )
    peak = max(gpu_peak_bytes(inp, split, sum(gpu_int.values())), phases.generation_bytes)
    return dataclasses.replace(phases, gpu_bytes=peak)


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
        # bf16 master + m + v (offloaded optimizer only; its host buffers: planning/offload_buffers.py).
        optim_bytes = 6
    if inp.optimizer != "adamw":
        # bitsandbytes' 8-bit m and v: a byte each, plus one fp32 maximum per block of 256 for each;
        # DeepSpeed's fp32 master copy stays under mixed precision (runtime/optim.py).
        optim_bytes = (4 if mixed else 0) + EIGHT_BIT_STATE_BYTES
    shard = inp.tp * inp.pp
    base = shape.num_params / shard
    adapters = shape.lora_params(inp.lora_rank, inp.lora_targets) / shard if inp.lora_rank else 0.0
    weights = base + adapters
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
        trainable=adapters if inp.lora_rank else base,
        persistent=persistent,
        partitioned=partitioned,
        on_gpu_weights=on_gpu_weights,
        quantized_base=base_weight_bytes(shape, inp.quantize, weight_bytes) / shard,
        quantization_state=quantization_state_bytes(shape, inp.quantize) / shard,
    )


# --- GPU terms (per GPU: the busiest, the first pipeline stage) ----------------------------------------


def gpu_terms(
    inp: MemoryInputs, split: ModelSplit, activations: float, reference_gpu: float
) -> dict[str, float]:
    """Every GPU term, in the order the tables print them, with the CUDA context and allocator slack last."""
    terms = {
        **gpu_model_state_terms(inp, split),
        "activations": activations,
        "logits_and_loss": logits_and_loss_bytes(inp),
        "deepspeed_buffers": deepspeed_buffer_bytes(inp, split),
    }
    if inp.reference_copy:
        terms["reference_model"] = reference_gpu
    if inp.quantize != "none":
        terms["dequantized_weight"] = dequantized_layer_bytes(
            inp.shape, inp.quantize, split.weight_bytes, inp.tp
        )
    if split.quantization_state:
        terms["quantization_state"] = split.quantization_state
    if inp.dense_mask and inp.attn_impl == "sdpa" and inp.sp == 1:
        terms["attention_mask"] = attention_mask_bytes(inp)
    if inp.sp > 1:
        terms["sequence_parallel_buffers"] = sequence_parallel_buffer_bytes(
            inp.shape, inp.local_tokens, inp.rows, split.weight_bytes
        )
    terms["cuda_context_and_slack"] = CUDA_CONTEXT_BYTES + ALLOCATOR_SLACK_FRACTION * sum(terms.values())
    return terms


def gpu_model_state_terms(inp: MemoryInputs, split: ModelSplit) -> dict[str, float]:
    """The model states this GPU holds: its parameters, gradients and optimizer states (ZeRO's partitions)."""
    stage, dp = inp.zero_stage, inp.zero_partitions
    offload_opt = inp.offload_optimizer != "none"
    params = split.on_gpu_weights * split.weight_bytes
    if inp.quantize != "none":
        # The base's share of what this GPU holds, at the quantised bytes (ZeRO-3 partitions the
        # packed storage like any weight); adapters stay in the training dtype. The quantisation
        # state is a term of its own (gpu_terms): whole on every GPU.
        base_on_gpu = split.on_gpu_weights * split.base / split.weights
        stored = split.quantized_base - split.quantization_state
        params += base_on_gpu * (stored / split.base - split.weight_bytes)
    # Under ZeRO-2/3 offload, gradients stream through the reduce buckets to the host
    # optimizer. Stage 1 with offload is counted as keeping its full 16-bit gradients
    # until the step (conservative: DeepSpeed's estimator only covers stage 2).
    trainable = split.trainable
    grads = 0.0 if stage >= 2 and offload_opt else trainable * split.grad_bytes / (dp if stage >= 2 else 1)
    optim = 0.0 if offload_opt else trainable * split.optim_bytes / (dp if stage >= 1 else 1)
    return {"parameters": params, "gradients": grads, "optimizer_states": optim}


def layers_per_stage(inp: MemoryInputs) -> int:
    """Decoder layers on the first pipeline stage."""
    return math.ceil(inp.shape.num_layers / inp.pp)


def activation_bytes(inp: MemoryInputs) -> tuple[float, float]:
    """(GPU activations, checkpoints offloaded to the host) of the rank's seq_len / sp tokens.

    Under 1F1B the first pipeline stage holds pp micro-batches in flight.
    """
    shape = inp.shape
    in_flight = inp.pp
    tokens, b = inp.local_tokens, inp.rows  # a preference pair is two rows
    per_layer = activation_bytes_per_layer(
        shape,
        inp.seq_len,
        b,
        inp.attn_impl,
        inp.tp,
        inp.sp,
        tiled_mlp=inp.mlp_is_tiled,
        norm_upcast=inp.precision != "fp32",
        lora_dropout=inp.lora_dropout_targets,
    )
    # Tiled MLP: no layer keeps its MLP intermediates; the one tile being recomputed holds them
    # (and their gradients), once.
    mlp_tile = mlp_tile_bytes(shape, tokens, b, inp.tp, inp.lora_dropout_targets) if inp.mlp_is_tiled else 0.0
    full_layer = per_layer + mlp_tile
    offloaded_checkpoints = 0.0
    if inp.activation_checkpointing:
        # Each layer keeps its 16-bit input (replicated across tp: AutoTP has no Megatron-style
        # sequence parallelism; Ulysses splits it, tokens = seq_len / sp); in backward one layer at
        # a time is recomputed with its full activations.
        checkpointed = 2 * tokens * b * shape.hidden_size
        kept = layers_per_stage(inp) * in_flight * checkpointed
        if inp.offload_checkpoints:
            # They wait in host RAM; the GPU holds the one being copied out or back.
            offloaded_checkpoints, kept = kept, checkpointed
        activations = kept + full_layer
    else:
        activations = layers_per_stage(inp) * in_flight * per_layer + mlp_tile
    if inp.precision == "fp32":
        # The formulas above count 16-bit activations; an fp32 run (CPU) keeps every one in 4 bytes.
        activations *= 2
        offloaded_checkpoints *= 2
    return activations, offloaded_checkpoints


def logits_and_loss_bytes(inp: MemoryInputs) -> int:
    """The output layer and loss over the rank's tokens: transformers' dense loss, or the chunked one
    under memory.tiled_loss (Liger's kernel where the run uses it, see `liger_computes_loss`).

    Logits live on the last pipeline stage; adding them to the first stage's activations over-counts
    a little when pp > 1 (conservative).
    """
    tokens = inp.local_tokens * inp.rows
    logit_bytes = 4 if inp.precision == "fp32" else 2
    if inp.generation is not None:
        # GRPO scores completion tokens only: grpo_loss.completion_logps keeps the last completion + 1
        # positions' logits (logits_to_keep) and takes their fp32 log-softmax.
        return logits_bytes(inp.shape, inp.generation.completion_tokens + 1, inp.rows)
    if not inp.tiled_loss:
        return logits_bytes(inp.shape, inp.local_tokens, inp.rows)
    if inp.liger_computes_loss:
        return liger_loss_bytes(inp.shape, tokens, logit_bytes)
    return chunked_loss_bytes(inp.shape, tokens, logit_bytes, head_trains=inp.lora_rank is None)


def deepspeed_buffer_bytes(inp: MemoryInputs, split: ModelSplit) -> float:
    """DeepSpeed's communication buffers (elements x bytes), each capped by what it can cover."""
    assert inp.reduce_bucket_size is not None and inp.prefetch_bucket_size is not None
    stage, dp = inp.zero_stage, inp.zero_partitions
    trainable, weight_bytes = split.trainable, split.weight_bytes
    overlap = OVERLAP_COMM_FACTOR if inp.overlap_comm else 1.0
    if stage == 0:
        # The engine flattens up to allreduce_bucket_size gradients per all-reduce.
        return min(DS_ALLREDUCE_BUCKET_SIZE, trainable) * split.grad_bytes if dp > 1 else 0.0
    if stage in (1, 2):
        # Stage 1/2 all-gather only the updated (trainable) partitions; frozen LoRA bases stay put.
        elems = min(inp.reduce_bucket_size, trainable) + min(inp.allgather_bucket_size, trainable)
        return elems * weight_bytes * overlap
    elems = min(inp.reduce_bucket_size, trainable) + min(inp.prefetch_bucket_size, split.weights)
    buffers = elems * weight_bytes * overlap
    if dp > 1 or inp.offload_params != "none" or inp.offload_optimizer != "none":
        # The module being computed is gathered whole, and its full gradient exists
        # before reduce-scatter: DeepSpeed's 4 * largest_layer_params at 16 bit.
        buffers += 2 * weight_bytes * inp.shape.largest_layer_params / inp.tp
    return buffers


def reference_model_bytes(inp: MemoryInputs, split: ModelSplit) -> tuple[float, float]:
    """(per GPU, per node on the host) bytes of DPO's frozen reference copy; (0, 0) without one.

    Partitioned like the policy's weights under ZeRO-3 (on the host with parameter offload), else a
    whole copy on every GPU.
    """
    if not inp.reference_copy:
        return 0.0, 0.0
    if inp.zero_stage != 3:
        return split.base * split.weight_bytes, 0.0
    dp = inp.zero_partitions
    on_host = inp.offload_params != "none"
    gpu = (split.persistent + (0.0 if on_host else split.partitioned / dp)) * split.weight_bytes
    host = inp.ranks_per_node * split.partitioned / dp * split.weight_bytes if on_host else 0.0
    return gpu, host


def attention_mask_bytes(inp: MemoryInputs) -> float:
    """sdpa's dense s x s masks: HF's bool mask and the additive copies the layers keep for backward.

    HF builds one bool [b, 1, s, s] mask per forward; torch's sdpa turns it into an additive mask of
    the compute dtype in each layer and keeps it for backward (measured on CPU at 8k: ~+1.1 GiB for 4
    fp32 layers, bench/results/long-context-memory-*.txt). With checkpointing one layer's copy is
    alive at a time. Not yet measured on a GPU.
    """
    layers_alive = 1 if inp.activation_checkpointing else layers_per_stage(inp)
    square = inp.rows * inp.seq_len * inp.seq_len
    act_bytes = 4 if inp.precision == "fp32" else 2
    return square * (1 + act_bytes * layers_alive)


def generation_gpu_terms(inp: MemoryInputs, split: ModelSplit) -> dict[str, float]:
    """The GPU terms of GRPO's generate call that training does not have (planning/generation.py); {} without
    generation. Under ZeRO-3 compat.gathered_for_generation gathers every partitioned parameter at once, at its
    stored bytes (a 4-bit base packed), beside the shard the rank keeps."""
    gen = inp.generation
    if gen is None:
        return {}
    shape, rows, dtype = inp.shape, inp.generation_rows, split.weight_bytes
    terms: dict[str, float] = {}
    if inp.zero_stage == 3:
        stored = split.quantized_base - split.quantization_state + (split.weights - split.base) * dtype
        terms["generation_gathered_parameters"] = stored * split.partitioned / split.weights
    terms["generation_kv_cache"] = kv_cache_bytes(shape, rows, gen.cache_tokens(inp.seq_len), dtype)
    terms["generation_prefill"] = prefill_bytes(shape, rows, gen.prompt_tokens(inp.seq_len), dtype)
    terms["generation_sampling"] = sampling_bytes(shape, rows, dtype, gen.top_p)
    return terms


def gpu_peak_bytes(inp: MemoryInputs, split: ModelSplit, training: int) -> int:
    """The GPU's peak: training, or a QLoRA load under ZeRO-3 when it is larger (model_load_gpu_bytes)."""
    return max(training, int(model_load_gpu_bytes(inp, split)))


def model_load_gpu_bytes(inp: MemoryInputs, split: ModelSplit) -> float:
    """What a QLoRA base under ZeRO-3 holds on each GPU while it loads, before training (0: no such phase).

    transformers loads an int8 base whole onto each GPU (it skips zero.Init); the ZeRO-3 engine then
    partitions it. An nf4 base is staged on the host instead, quantised on the GPU weight by weight
    (module docstring): the quantisation state of the base and the weight being quantised.
    """
    if inp.quantize == "int8" and inp.zero_stage == 3 and inp.zero_partitions > 1:
        return split.quantized_base + CUDA_CONTEXT_BYTES
    if inp.quantize == "nf4" and inp.zero_stage == 3 and inp.quantize_on == "gpu":
        return staged_quantize_gpu_bytes(inp.shape, split.weight_bytes) + CUDA_CONTEXT_BYTES
    return 0.0


# --- host terms (per node: `ranks_per_node` processes share it) -------------------------------------------


def host_terms(
    inp: MemoryInputs, split: ModelSplit, offloaded_checkpoints: float, reference_host: float
) -> tuple[dict[str, float], float, float]:
    """(host bytes per node by term, the bytes freed before the export, bytes one rank mlocks)."""
    ranks = inp.ranks_per_node
    host, released, locked = offload_buffer_terms(inp)
    if inp.offload_params == "nvme":
        swap, flat = nvme_parameter_host_bytes(inp, split)
        host["param_swap_buffers"] = ranks * swap
        locked += swap
        host["offloaded_parameters"] += ranks * flat
        locked += flat if inp.param_pinning == "native" else 0.0
    if offloaded_checkpoints:
        host["offloaded_checkpoints"] = offloaded_checkpoint_host_bytes(inp, offloaded_checkpoints)
    if reference_host:
        host["offloaded_reference_parameters"] = reference_host
    host["process_overhead"] = ranks * PROCESS_HOST_BYTES
    host["model_load_peak"] = model_load_peak_bytes(inp, split)
    host["export_peak"] = export_peak_bytes(inp)
    return host, released, locked


def offload_buffer_terms(inp: MemoryInputs) -> tuple[dict[str, float], float, float]:
    """(host terms, bytes freed before the export, bytes one rank mlocks) of DeepSpeed's CPU and NVMe
    offload: what it allocates, buffer by buffer, read from its source (planning/offload_buffers.py)."""
    ranks = inp.ranks_per_node
    host: dict[str, float] = {
        "offloaded_optimizer_states": 0.0,
        "offloaded_fp32_gradients": 0.0,
        "optimizer_swap_buffers": 0.0,
        "offloaded_parameters": 0.0,
        "param_swap_buffers": 0.0,
    }
    rank = offload_rank(inp)
    buffers = host_buffers(inp)
    for buffer in buffers:
        host[buffer.term] = host.get(buffer.term, 0.0) + ranks * buffer.held(rank.pinning_of(buffer))
    if inp.offload_optimizer != "none":
        host["loader_fork_copies"] = ranks * loader_fork_copies(rank, buffers)
    # Adam's m and v on the host and the step's transients: gone before the export.
    released = ranks * sum(b.held(rank.pinning_of(b)) for b in buffers if b.released or b.step_only)
    locked = sum(b.locked(rank.pinning_of(b)) for b in buffers)
    return host, released, locked


def nvme_parameter_host_bytes(inp: MemoryInputs, split: ModelSplit) -> tuple[float, float]:
    """(swap buffers, flat partition buffer) one rank holds in host RAM for parameters on NVMe."""
    weight_bytes = split.weight_bytes
    # DeepSpeed requires buffer_size >= the largest parameter tensor, so the configured 1e8 grows
    # to vocab*hidden for these models; the aio handle mlocks them (partitioned_param_swapper.py 131).
    buffer_elems = max(DS_NVME_PARAM_BUFFER_SIZE, inp.shape.largest_layer_params / inp.tp)
    swap = DS_NVME_PARAM_BUFFER_COUNT * held_bytes(buffer_elems * weight_bytes, "native")
    # stage3.py 888-907: up to offload_param.max_in_cpu elements of the partitions also stay in a
    # flat host buffer (pinned as the section says), the first parameter groups first.
    in_cpu = min(DS_NVME_PARAM_MAX_IN_CPU, split.partitioned / inp.zero_partitions)
    flat = held_bytes(in_cpu * weight_bytes, inp.param_pinning)
    return swap, flat


def offloaded_checkpoint_host_bytes(inp: MemoryInputs, offloaded_checkpoints: float) -> float:
    """Host bytes per node of memory.offload_checkpoints' checkpointed hidden states.

    save_on_cpu(pin_memory=True) pins each checkpoint in torch's pinned allocator, rounded up to a
    power of two, and torch keeps the freed blocks cached for the next step's: a training-phase term
    to the end (runtime/tiling.py).
    """
    count = layers_per_stage(inp) * inp.pp
    return inp.ranks_per_node * count * held_bytes(offloaded_checkpoints / count, inp.checkpoint_pinning)


def model_load_peak_bytes(inp: MemoryInputs, split: ModelSplit) -> float:
    """Host bytes per node while the model loads (see the module docstring's Loading)."""
    ranks, weight_bytes = inp.ranks_per_node, split.weight_bytes
    full_model = inp.shape.num_params * weight_bytes
    if inp.quantize == "nf4" and inp.zero_stage == 3:
        # Staged on the host, whole on every rank, then partitioned from there (module docstring).
        staged = base_weight_bytes(inp.shape, inp.quantize, weight_bytes)
        largest = largest_quantized_weight(inp.shape)
        retained = QUANTIZE_RETAINED_BYTES_PER_WEIGHT * quantized_weight_params(inp.shape)
        if inp.quantize_on == "cpu":
            workspace = QUANTIZE_WORKSPACE_BYTES_PER_WEIGHT * largest
            return ranks * (staged + workspace + retained)
        # Quantised on the GPU: the state stays there; the host holds the weight read from the checkpoint
        # and its codes coming back. The freed temporaries: the CPU path's measurement, an upper bound
        # until bench/gpu_run.sh B measures this path (bench/qlora_staged_load.py --staging cuda).
        state = quantization_state_bytes(inp.shape, inp.quantize)
        in_flight = largest * (weight_bytes + NF4_PACKED_BYTES_PER_WEIGHT)
        return ranks * (staged - state + in_flight + retained)
    if inp.zero_init or (inp.direct_load and inp.pp == 1):
        # zero.Init, or straight onto the GPU: no rank materialises the model on the host; each
        # reads one checkpoint shard at a time and keeps only its own tensors, on its device.
        return ranks * min(CHECKPOINT_SHARD_BYTES, full_model)
    if inp.pp > 1:
        # A pipeline stage is built as its own module (~1/pp of the layers) and reads only its
        # tensors from the checkpoint, one at a time; the first and last stages also hold the
        # embedding or the head, hence one largest tensor on top. (init: random builds the whole
        # model once per rank instead; that path is for tiny test models.)
        stage = full_model / inp.pp + inp.shape.largest_layer_params * weight_bytes
        return ranks * min(full_model, stage)
    # Without zero.Init every rank on the node loads the full 16-bit model on the
    # CPU before DeepSpeed moves it to the GPU (the classic host-RAM OOM at load).
    return ranks * full_model


def host_peak_bytes(inp: MemoryInputs, host: dict[str, float], released: float) -> float:
    """The host's peak per node: the processes plus the largest of the load, training and export phases.

    Load and training phases do not overlap: without zero.Init the CPU copy is gone before the
    optimizer states are allocated; with it, offloaded parameter partitions already sit in host RAM
    while the shards stream in. The export comes at the end of training, with every training-phase
    buffer still allocated, less the Adam moments freed before it (`released`).
    """
    load_phase = host["model_load_peak"] + (host["offloaded_parameters"] if inp.zero_init else 0.0)
    train_phase = sum(
        v for k, v in host.items() if k not in ("model_load_peak", "process_overhead", "export_peak")
    )
    export_phase = train_phase - released + host["export_peak"]
    return host["process_overhead"] + max(load_phase, train_phase, export_phase)


def nvme_space_bytes(inp: MemoryInputs, split: ModelSplit) -> float:
    """NVMe space per node: the swapped optimizer states and/or the parameter partitions."""
    ranks = inp.ranks_per_node
    nvme = 0.0
    if inp.offload_optimizer == "nvme":
        nvme += ranks * nvme_optimizer_bytes(offload_rank(inp))
    if inp.offload_params == "nvme":
        nvme += ranks * split.partitioned / inp.zero_partitions * split.weight_bytes
    return nvme


def offload_rank(inp: MemoryInputs) -> OffloadRank:
    """What one rank's CPU / NVMe offload depends on (planning/offload_buffers.py)."""
    mixed = inp.precision != "fp32"
    return OffloadRank(
        shape=inp.shape,
        lora_rank=inp.lora_rank,
        lora_targets=inp.lora_targets,
        zero_stage=inp.zero_stage,
        partitions=inp.zero_partitions,
        shard=inp.tp * inp.pp,
        model_bytes=2 if mixed else 4,
        state_bytes=2 if inp.state_dtype == "bf16" else 4,
        sub_group_size=inp.sub_group_size,
        grad_accum=inp.grad_accum,
        pinning=inp.pinning,
        params_offloaded=inp.offload_params != "none",
        quantize=inp.quantize,
        loader_forks=inp.loader_forks,
        param_pinning=inp.param_pinning,
        swap=inp.swap,
    )


def host_buffers(inp: MemoryInputs) -> list[HostBuffer]:
    """One rank's host allocations for its offloaded optimizer and parameters, as DeepSpeed makes them."""
    rank = offload_rank(inp)
    buffers: list[HostBuffer] = []
    if inp.offload_optimizer == "cpu":
        buffers += cpu_optimizer_buffers(rank)
    elif inp.offload_optimizer == "nvme":
        buffers += nvme_optimizer_buffers(rank)
    if inp.offload_params == "cpu":
        buffers += cpu_parameter_buffers(rank)
    return buffers


def export_peak_bytes(inp: MemoryInputs) -> float:
    """Host bytes the final export adds on the busiest node (see the module docstring).

    ZeRO engine: rank 0 holds the gathered 16-bit model, which save_hf_model writes as it is: one
    copy of the whole model. LoRA: written layer by layer from the GPU (runtime/sharded_export.py),
    so one shard, or the largest tensor if larger (merged), or the adapters (adapter). Pipeline engine: each stage's data-parallel rank 0
    copies its stage's weights to the CPU once (pipeline_model.stage_hf_state).
    """
    weight_bytes = 2 if inp.precision != "fp32" else 4
    full_model = inp.shape.num_params * weight_bytes
    if inp.pp > 1:
        return min(inp.pp, inp.ranks_per_node) * full_model / inp.pp
    if inp.lora_rank:
        if inp.export_adapter_only:
            return inp.shape.lora_params(inp.lora_rank, inp.lora_targets) * weight_bytes
        return min(full_model, max(EXPORT_SHARD_BYTES, inp.shape.largest_layer_params * weight_bytes))
    return 1.0 * full_model
