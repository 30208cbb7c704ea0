"""Per-GPU, host-RAM and NVMe memory estimate for one training configuration.

Used by `llm-train plan` and `--dry-run` to say, before any weights load, whether a
recipe fits the user's GPUs and host RAM. Pure arithmetic: no torch or deepspeed
import, so it answers in milliseconds. Its input, one configuration (`MemoryInputs`), and
the rules that refuse impossible ones are in planning/memory/inputs.py.

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
allocates, read from its source in planning/memory/offload_buffers.py, under the run's pinning choice
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
logits (runtime/loss/chunked.py): one chunk's working set instead of transformers' whole
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

Export. At the end of a full fine-tune (runtime/engines/zero_engine.py `export`) rank 0 holds the gathered
16-bit model on the CPU (Accelerate's get_state_dict: ZeRO-3's consolidated 16-bit state dict, or a
CPU clone of the module's); `save_hf_model` writes it without another copy (it clones only tensors
that share storage). Before gathering, every rank frees its Adam moments (runtime/model/optim.py
`release_moments`: the final checkpoint is committed, the run is over), two thirds of the
offloaded optimizer state. The export phase is therefore the training phase, less the
offloaded moments, plus the gathered copy; the host peak is the larger of the phases. A LoRA run
writes final/ layer by layer from the GPU (runtime/export/sharded.py): the host holds one shard of
EXPORT_SHARD_BYTES (or the largest tensor, if larger) for a merged export, the adapters for an
adapter export.

Loading. A pretrained model is read from its checkpoint one tensor at a time, straight onto the GPU
(transformers' device_map; ZeRO-0/1/2) or into zero.Init's partitions (ZeRO-3): the host holds the
safetensors shard being read (CHECKPOINT_SHARD_BYTES), never the model. Only a randomly initialised
model (`direct_load=False`) is built whole on the host first.

QLoRA (`quantize`): the decoder layers' linear weights in 4 or 8 bits, the rest 16-bit
(planning/memory/quantized_bytes.py), plus one dequantised 16-bit copy of the layer computing. Under ZeRO-0/1/2
the base loads straight onto each GPU. Under ZeRO-3 an nf4 base is staged on the host, whole on every
rank (transformers skips zero.Init for a quantised model), each weight quantised as it loads on the run's
device (`quantize_on`), and zero.Init(module=...) partitions it from there tensor by tensor
(runtime/model/quantized_base.py). Quantised on the CPU (a CPU run), the host's load peak is ranks x (the staged base
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
from dataclasses import dataclass, field

from llm_train.planning.memory.formulas import (
    ALLOCATOR_SLACK_FRACTION,
    CUDA_CONTEXT_BYTES,
    DS_ALLREDUCE_BUCKET_SIZE,
    OVERLAP_COMM_FACTOR,
    activation_bytes_per_layer,
    chunked_loss_bytes,
    liger_loss_bytes,
    logits_bytes,
    mlp_tile_bytes,
    sequence_parallel_buffer_bytes,
)
from llm_train.planning.memory.generation import kv_cache_bytes, prefill_bytes, sampling_bytes

# The host terms, the model's split and the per-token formulas live in their own modules (host.py,
# model_split.py, formulas.py): import them from there, not through this module (tests/unit/test_no_facades.py).
from llm_train.planning.memory.host import (
    host_peak_bytes,
    host_terms,
    nvme_space_bytes,
)
from llm_train.planning.memory.inputs import MemoryInputs
from llm_train.planning.memory.model_split import ModelSplit, layers_per_stage, model_split
from llm_train.planning.memory.quantized_bytes import dequantized_layer_bytes, staged_quantize_gpu_bytes
from llm_train.planning.model.vision_shapes import VISION_TOWER
from llm_train.units import GiB

# --- the estimator ------------------------------------------------------------------------------


_LABELS = {
    "parameters": "parameters",
    "dequantized_weight": "dequantised 4/8-bit weight (transient)",
    "quantization_state": "4-bit quantisation state (absmax; whole on every GPU)",
    "gradients": "gradients",
    "optimizer_states": "optimizer states",
    "activations": "activations",
    "vision_activations": "vision tower activations",
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
    "generation_gathered_parameters": "generation: gathered parameters",
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
    """objective grpo: the GPU terms only generation has (planning/memory/generation.py); empty otherwise."""
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
    if inp.shape.vision is not None and inp.vision.images_per_sample:
        terms["vision_activations"] = vision_activation_bytes(inp)
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


def vision_activation_bytes(inp: MemoryInputs) -> float:
    """The vision tower's activations over a micro-batch's images, at the largest size the processor lets
    through (planning/model/vision_shapes.py). A frozen tower keeps nothing for backward (neither its weights nor its
    pixel inputs need a gradient, so autograd saves no tensor): one layer's working set while it runs. A
    trained one keeps every layer's, or under activation checkpointing (transformers checkpoints the vision
    blocks too) each layer's 16-bit input plus one layer recomputed. The image tokens themselves are counted in
    the language model's activations: they are part of its data.seq_len.
    """
    vision = inp.shape.vision
    assert vision is not None
    patches = inp.rows * inp.vision.images_per_sample * inp.vision.geometry(vision).max_patches
    layer = vision.layer_activation_bytes(patches)
    if VISION_TOWER in inp.vision.freeze:
        total = float(layer)
    elif inp.activation_checkpointing:
        total = vision.num_layers * 2.0 * patches * vision.hidden_size + layer
    else:
        total = float(vision.num_layers * layer)
    return total * (2 if inp.precision == "fp32" else 1)


def logits_and_loss_bytes(inp: MemoryInputs) -> int:
    """The output layer and loss over the rank's tokens: transformers' dense loss, or the chunked one
    under memory.tiled_loss (Liger's kernel where the run uses it, see `liger_computes_loss`).

    Logits live on the last pipeline stage; adding them to the first stage's activations over-counts
    a little when pp > 1 (conservative).
    """
    tokens = inp.local_tokens * inp.rows
    logit_bytes = 4 if inp.precision == "fp32" else 2
    if inp.generation is not None:
        # GRPO scores completion tokens only: runtime/loss/grpo.py completion_logps keeps the last completion + 1
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
    """The GPU terms of GRPO's generate call that training does not have (planning/memory/generation.py); {} without
    generation. Under ZeRO-3 compat.gathered_for_generation gathers every partitioned parameter at once, at its
    stored bytes (a 4-bit base packed), beside the shard the rank keeps (one layer's with
    grpo.ds3_gather_for_generation false)."""
    gen = inp.generation
    if gen is None:
        return {}
    shape, rows, dtype = inp.shape, inp.generation_rows, split.weight_bytes
    terms: dict[str, float] = {}
    if inp.zero_stage == 3:
        stored = split.quantized_base - split.quantization_state + (split.weights - split.base) * dtype
        gathered = stored * split.partitioned / split.weights
        # ds3_gather_for_generation false: the hooks hold one layer's parameters at a time (an average layer's
        # share of the partitioned bytes; the prefetch bucket is in deepspeed_buffers already).
        terms["generation_gathered_parameters"] = (
            gathered if gen.gather_whole else gathered / shape.num_layers
        )
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
