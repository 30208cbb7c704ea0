"""A first-order step-time model, to rank memory-saving choices by what they cost in speed.

`llm-train plan` has to say *which* change makes a run fit at the smallest cost, and
`--recipe auto` has to pick the fastest configuration that fits. Both need relative
speeds, not a benchmark: this model adds up the time of the work that does not overlap
(compute, the exposed part of host<->GPU copies, the CPU optimizer, NVMe traffic, the
exposed part of ZeRO communication). It ranks correctly the cases that matter
(activation checkpointing ~ +1/3 compute; parameter offload pays PCIe per micro-batch,
optimizer offload per step; NVMe is slowest) and its absolute numbers are rough (+-50%).

The consumer path, where the choice between QLoRA and 16-bit LoRA with offload is made (every choice
ranks by `StepTime.total`, which counts every copy whole; `StepTime.overlapped` is the figure if
prefetch hides what it can, printed beside it until a GPU run measures which one holds):
- host<->GPU copies run at the card's own link (PCIe generation x lanes, config/hardware.py), at
  PINNED_COPY_EFFICIENCY of its raw rate from pinned buffers (deepspeed.pinning native or torch) and
  PAGEABLE_COPY_EFFICIENCY from pageable ones (off);
- ZeRO-3 prefetches the next module's weights while the current one computes, so a pinned fetch costs
  only what exceeds the part of its pass's compute it can hide behind (FETCH_OVERLAP), plus the first module's fetch that nothing hides (`_exposed`);
  a pageable copy is synchronous and hides behind nothing. The same holds for gradients streamed to the
  host during backward and for offloaded activation checkpoints;
- QLoRA: bitsandbytes dequantises each 4/8-bit weight to 16 bits for every matmul that uses it (forward,
  the input gradient in backward, and the recompute): per micro-batch, whatever its size, it reads the
  packed bytes and writes the 16-bit copy at the card's memory bandwidth (`dequantize_seconds`).
docs/planning.md lists every constant with its source.

Pure arithmetic on `MemoryInputs`; no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_train.config.hardware import (
    NVME_READ_BYTES_PER_S,
    NVME_WRITE_BYTES_PER_S,
    PCIE_LANE_BYTES_PER_S,
    UNKNOWN_GPU_MEMORY_GBS,
    Hardware,
)
from llm_train.planning.memory.generation import GenerationTime, decode_step_seconds, kv_bytes_per_token
from llm_train.planning.memory.host import offload_rank
from llm_train.planning.memory.inputs import MemoryInputs
from llm_train.planning.memory.model_split import model_split
from llm_train.planning.memory.offload_buffers import nvme_optimizer_bytes
from llm_train.planning.memory.quantized_bytes import (
    NF4_PACKED_BYTES_PER_WEIGHT,
    base_weight_bytes,
    quantization_state_bytes,
    quantized_weight_params,
)
from llm_train.planning.model.vision_shapes import LANGUAGE_MODEL, PROJECTOR, VISION_TOWER
from llm_train.planning.speed.flops import training_flops_per_token

# Fraction of dense peak that a well-fed training step reaches (MFU); 35-50% is typical
# for 7B-class models with SDPA/flash attention on one node.
PEAK_EFFICIENCY = 0.40
# Small micro-batches starve the tensor cores: efficiency falls as tokens / (tokens + this).
EFFICIENCY_HALF_TOKENS = 256
# Host<->GPU copies, as a fraction of the link's raw rate (PCIE_LANE_BYTES_PER_S x lanes). From pinned
# memory the copy engine streams at ~80% of it (CUDA samples' bandwidthTest: ~26 GB/s of 31.5 on PCIe 4.0
# x16, ~12-13 of 15.75 on 3.0 x16); DeepSpeed's offload moves mid-sized tensors, one module's at a time, so
# we take 0.7. Pageable memory is staged by the CPU through a pinned driver buffer, chunk by chunk, and the
# copy blocks the host (CUDA C++ Best Practices Guide, "Pinned Memory"; "How to Optimize Data Transfers in
# CUDA C/C++", NVIDIA developer blog): about half the pinned rate, 0.35, and no overlap with compute.
PINNED_COPY_EFFICIENCY = 0.7
PAGEABLE_COPY_EFFICIENCY = 0.35
# The link of a PCIe 4.0 x16 card (callers that name no hardware).
DEFAULT_PCIE_BYTES_PER_S = PCIE_LANE_BYTES_PER_S[4] * 16
# bitsandbytes' dequantisation kernels are elementwise and memory-bound: they stream at a fraction of the
# card's memory bandwidth; 0.7 is what elementwise kernels typically reach (an assumption until
# bench/gpu_run.sh A measures QLoRA against 16-bit LoRA on a GPU).
DEQUANTIZE_BANDWIDTH_EFFICIENCY = 0.7
# How much of a pass's compute a pinned ZeRO-3 parameter fetch can hide behind: DeepSpeed prefetches at
# most stage3_prefetch_bucket_size elements ahead (0.9 h^2: a fraction of one decoder layer), each module's
# hook waits for its own fetch, and with more than one GPU the partition is copied with a blocking .to()
# (deepspeed/runtime/zero/partition_parameters.py, all_gather_coalesced, 0.19.8; one GPU copies
# non_blocking). Half is an assumption until a GPU run measures it.
FETCH_OVERLAP = 0.5
# GPU<->GPU bus bandwidth for collectives: NVLink (SXM boards), PCIe switch, or the
# network between nodes (a 200 Gb/s InfiniBand/RoCE link per GPU).
NVLINK_BYTES_PER_S = 150e9
PCIE_P2P_BYTES_PER_S = 10e9
INTER_NODE_BYTES_PER_S = 25e9
# DeepSpeed CPU Adam on a desktop/workstation CPU: it streams ~30 bytes per parameter
# (fp32 grad in, m/v/master read and written, 16-bit weight out), so it is memory-bandwidth
# bound at ~1.5e9 parameters/s per node (DDR5, all cores), shared by the node's ranks.
CPU_ADAM_PARAMS_PER_S = 1.5e9
CPU_ADAM_BYTES_PER_PARAM = 30
# With bf16 states (optim.state_dtype=bf16) it streams 2 (bf16 grad) + 12 (bf16 m/v/master read and
# written) + 2 (weight out) = 16 bytes per parameter instead of 30: proportionally faster.
CPU_ADAM_BF16_BYTES_PER_PARAM = 16
# With overlap_comm, ZeRO hides about half of its communication behind compute.
OVERLAPPED_COMM_EXPOSED = 0.5
# ZeRO-3's per-module gather/release hooks and bookkeeping cost time even on one GPU.
ZERO3_COMPUTE_OVERHEAD = 0.05


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, by component (they are added: little of it overlaps)."""

    compute: float
    communication: float
    pcie: float
    """Host<->GPU copies, all of them: ranking counts them whole (the overlap below is assumed, not measured)."""
    cpu_optimizer: float
    nvme: float
    tokens_per_step: int
    nvme_read_bytes: float = 0.0
    """Bytes read from the NVMe drive per step (per node)."""
    nvme_write_bytes: float = 0.0
    dequantize: float = 0.0
    """QLoRA: bitsandbytes turning the 4/8-bit weights into 16-bit ones for every matmul."""
    pcie_bytes: float = 0.0
    """Bytes each rank moves over its host link per step (both directions)."""
    pcie_hideable: float = 0.0
    """Seconds of those copies that prefetch and streaming could hide behind compute (FETCH_OVERLAP)."""
    generation: float = 0.0
    """objective grpo: the generate call's seconds per optimizer step (one call serves num_iterations steps)."""
    generation_call: GenerationTime | None = None
    """objective grpo: one generate call, by part (planning/memory/generation.py); None without generation."""

    @property
    def overlapped(self) -> float:
        """Seconds per step if prefetch hides what it can: the optimistic figure, printed beside `total`.
        Choices rank by `total`, which holds whether or not the overlap happens."""
        return self.total - self.pcie_hideable

    @property
    def total(self) -> float:
        return self.training + self.generation

    @property
    def training(self) -> float:
        """Seconds of the forward, backward and update: the step without generation."""
        return (
            self.compute + self.dequantize + self.communication + self.pcie + self.cpu_optimizer + self.nvme
        )

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.total if self.total > 0 else 0.0


def flops_per_token(inp: MemoryInputs) -> float:
    """Training FLOPs per token on one model replica (planning/speed/flops.py), as the hardware runs them:
    LoRA trains only its adapters, activation checkpointing recomputes the forward, and the ALST
    tiles recompute their part once more in backward (the MLP, the output layer)."""
    shape = inp.shape
    if shape.vision is not None:
        return _image_text_flops_per_token(inp)
    trainable = shape.lora_params(inp.lora_rank, inp.lora_targets) if inp.lora_rank else shape.num_params
    frozen = shape.num_params if inp.lora_rank else 0
    return _language_flops_per_token(inp, trainable, frozen)


def _language_flops_per_token(inp: MemoryInputs, trainable: float, frozen: float) -> float:
    """The language model's training FLOPs per token, with the recomputation tiled MLPs and the tiled loss add."""
    shape = inp.shape
    flops = training_flops_per_token(
        trainable,
        shape.num_layers,
        shape.num_heads,
        shape.head_dim,
        inp.seq_len,
        frozen=frozen,
        recompute=inp.activation_checkpointing,
    )
    if inp.mlp_is_tiled:
        flops += 2.0 * 3 * shape.hidden_size * shape.intermediate_size * shape.num_layers
    if inp.tiled_loss:
        flops += 2.0 * shape.vocab_size * shape.hidden_size
    return flops


def _image_text_flops_per_token(inp: MemoryInputs) -> float:
    """flops_per_token of an image-text model: the language model's per token (its data.seq_len includes the image
    tokens), plus its vision part's per sample spread over the sample's tokens: the tower's matmuls over every
    patch and the projector's over every image token: 2 FLOPs per weight forward, 6 where the part trains whole,
    4 where adapters on it (or a learning part below it) need its input gradients; a frozen tower's input needs
    none. Its attention over the patches is left out (under 5% at SigLIP's 4096 patches of width 1152)."""
    shape, vision = inp.shape, inp.shape.vision
    assert vision is not None
    language = float(shape.language_model_params)
    freeze = inp.vision.freeze
    if LANGUAGE_MODEL in freeze:
        trainable, frozen = 0.0, language
    elif inp.lora_rank:
        trainable, frozen = float(shape.lora_params(inp.lora_rank, inp.lora_targets)), language
    else:
        trainable, frozen = language, 0.0
    flops = _language_flops_per_token(inp, trainable, frozen)
    images = inp.vision.images_per_sample
    if images:
        geometry = inp.vision.geometry(vision)
        per_pass = {VISION_TOWER: geometry.max_patches, PROJECTOR: geometry.max_tokens}
        tower_learns = VISION_TOWER not in freeze
        for part, positions in per_pass.items():
            if part not in freeze:  # trained whole (6), or through adapters: forward and input gradients (4)
                per_weight = 4.0 if inp.lora_rank else 6.0
            else:  # frozen: a forward, and the input gradients a learning tower below needs
                per_weight = 4.0 if part == PROJECTOR and tower_learns else 2.0
            flops += per_weight * vision.part_params(part) * positions * images / inp.seq_len
    return flops


def reference_flops_per_token(inp: MemoryInputs) -> float:
    """Forward FLOPs per token of the whole model (DPO's reference: no backward, no recompute)."""
    shape = inp.shape
    return (
        training_flops_per_token(
            shape.num_params, shape.num_layers, shape.num_heads, shape.head_dim, inp.seq_len
        )
        / 3.0
    )


def reference_pass_seconds(inp: MemoryInputs, grad_accum: int, peak_tflops: float) -> float:
    """Seconds of DPO's cached-reference pass per optimizer step's worth of pairs (one forward of each)."""
    tokens = grad_accum * inp.rows * inp.seq_len / (inp.tp * inp.pp * inp.sp)
    rank_tokens = inp.rows * inp.seq_len / inp.sp
    efficiency = PEAK_EFFICIENCY * rank_tokens / (rank_tokens + EFFICIENCY_HALF_TOKENS)
    return tokens * reference_flops_per_token(inp) / (peak_tflops * 1e12 * efficiency)


def step_time_on(inp: MemoryInputs, hw: Hardware, grad_accum: int | None = None) -> StepTime:
    """`step_time` on `hw`: its peak, interconnect, drive, host link and memory bandwidth."""
    return step_time(
        inp,
        inp.grad_accum if grad_accum is None else grad_accum,
        hw.peak_tflops,
        hw.nvlink,
        hw.nvme_read_bytes_per_s,
        hw.nvme_write_bytes_per_s,
        pcie_bytes_per_s=hw.pcie_bytes_per_s if hw.kind == "cuda" else DEFAULT_PCIE_BYTES_PER_S,
        memory_bytes_per_s=hw.memory_bytes_per_s,
    )


def copy_bytes_per_s(pinning: str, pcie_bytes_per_s: float) -> float:
    """What host<->GPU copies from buffers of this pinning (offload_buffers.PINNINGS) reach on the link."""
    return pcie_bytes_per_s * (PAGEABLE_COPY_EFFICIENCY if pinning == "off" else PINNED_COPY_EFFICIENCY)


def _exposed(transfer: float, compute: float, layers: int, pinned: bool) -> float:
    """Seconds a transfer adds to `compute` it runs beside. Pinned, it is prefetched (or streamed) module by
    module behind the compute: what exceeds FETCH_OVERLAP of the compute
    shows, plus the first module's share, which nothing
    hides. Pageable, the copy blocks the host and hides behind nothing."""
    if not pinned:
        return transfer
    return max(0.0, transfer - FETCH_OVERLAP * compute) + transfer / max(1, layers)


# bitsandbytes' CPU quantiser, one process with the 2-core test machine to itself: 6.8M and 10.5M weights/s
# on 2- and 4-layer models of Llama-3-8B's layer shape (bench/results/qlora-staged-load-*).
CPU_QUANTIZE_WEIGHTS_PER_S = 7e6
CHECKPOINT_BYTES_PER_PARAM = 2  # public checkpoints are 16-bit


@dataclass(frozen=True)
class StagedLoad:
    """Start-up of an nf4 base staged on the host under ZeRO-3 (runtime/model/quantized_base.py), per node, seconds."""

    read: float
    """Every rank reads the whole 16-bit checkpoint from the drive (no credit for the page cache)."""
    copies: float
    """Each rank's weights to its GPU and their codes back, pageable copies (GPU quantisation)."""
    quantize: float
    """bitsandbytes' CPU quantiser (a CPU run); on a GPU its kernel is memory-bound: left out."""
    checkpoint_bytes: float

    @property
    def total(self) -> float:
        # transformers' loader reads, copies and quantises one tensor after another (sync loading with
        # on-the-fly quantisation): nothing overlaps.
        return self.read + self.copies + self.quantize


def staged_load(
    inp: MemoryInputs, drive_read_bytes_per_s: float, pcie_bytes_per_s: float
) -> StagedLoad | None:
    """How long a staged nf4 base takes to load, by where it is quantised (None: the run stages none).

    Quantised on the GPU, the load is bounded by reading the checkpoint: each of the node's ranks reads all
    of it at the drive's speed, sharing the drive (when they read in step the page cache serves the later
    reader, so up to ranks times faster), then copies each weight to its card and the codes back over
    its own link. On the CPU it is bounded by bitsandbytes' CPU quantiser.
    """
    if inp.quantize != "nf4" or inp.zero_stage != 3:
        return None
    checkpoint = inp.shape.num_params * CHECKPOINT_BYTES_PER_PARAM
    weights = quantized_weight_params(inp.shape)
    read = inp.ranks_per_node * checkpoint / drive_read_bytes_per_s
    if inp.quantize_on == "cpu":
        return StagedLoad(read, 0.0, weights / CPU_QUANTIZE_WEIGHTS_PER_S, checkpoint)
    moved = weights * (CHECKPOINT_BYTES_PER_PARAM + NF4_PACKED_BYTES_PER_WEIGHT)
    return StagedLoad(read, moved / copy_bytes_per_s("off", pcie_bytes_per_s), 0.0, checkpoint)


def dequantize_seconds(inp: MemoryInputs, grad_accum: int, memory_bytes_per_s: float) -> float:
    """QLoRA: seconds per step bitsandbytes spends turning the packed base into 16-bit weights.

    Every quantised weight is dequantised for each matmul that uses it: forward, the input gradient in
    backward (bitsandbytes' MatMul4Bit.backward dequantises again), the recompute under checkpointing, and
    DPO's live reference forward; each time the kernel reads the packed bytes and writes the 16-bit copy.
    The count is per micro-batch, whatever its tokens: small micro-batches pay it most.
    """
    if inp.quantize == "none":
        return 0.0
    shape = inp.shape
    wbytes = 2 if inp.precision != "fp32" else 4
    quantized = quantized_weight_params(shape)
    packed = base_weight_bytes(shape, inp.quantize, wbytes) - (shape.num_params - quantized) * wbytes
    passes = 2 + (1 if inp.activation_checkpointing else 0) + (1 if inp.reference == "live" else 0)
    per_pass = (packed + quantized * wbytes) / (inp.tp * inp.pp)
    return grad_accum * passes * per_pass / (memory_bytes_per_s * DEQUANTIZE_BANDWIDTH_EFFICIENCY)


def interconnect_bytes_per_s(inp: MemoryInputs, nvlink: bool) -> float:
    """The bus ZeRO's collectives cross: the network between nodes, else NVLink or a PCIe switch."""
    if inp.num_nodes > 1:
        return INTER_NODE_BYTES_PER_S
    return NVLINK_BYTES_PER_S if nvlink else PCIE_P2P_BYTES_PER_S


def generation_time(
    inp: MemoryInputs,
    grad_accum: int,
    peak_tflops: float,
    nvlink: bool = False,
    pcie_bytes_per_s: float = DEFAULT_PCIE_BYTES_PER_S,
    memory_bytes_per_s: float = UNKNOWN_GPU_MEMORY_GBS * 1e9,
) -> GenerationTime | None:
    """One GRPO generate call on one rank (planning/memory/generation.py: a rough model until measured); None without
    generation. The prefill is a forward at the training efficiency; each decode step is bounded by streaming
    the weights (a 4-bit base dequantised: packed read, 16-bit copy written and read) and the cache, by its
    compute, or by the per-layer launch overhead."""
    gen = inp.generation
    if gen is None:
        return None
    shape = inp.shape
    wbytes = 2 if inp.precision != "fp32" else 4
    rows = inp.micro_batch * grad_accum
    prompt, completion = gen.prompt_tokens(inp.seq_len), gen.completion_tokens
    peak = peak_tflops * 1e12
    forward_flops = (
        training_flops_per_token(shape.num_params, shape.num_layers, shape.num_heads, shape.head_dim, prompt)
        / 3.0
    )
    tokens = rows * prompt
    prefill = tokens * forward_flops / (peak * PEAK_EFFICIENCY * tokens / (tokens + EFFICIENCY_HALF_TOKENS))
    weights = base_weight_bytes(shape, inp.quantize, wbytes) - quantization_state_bytes(shape, inp.quantize)
    if inp.lora_rank:
        weights += shape.lora_params(inp.lora_rank, inp.lora_targets) * wbytes
    if inp.quantize != "none":
        dequantized = quantized_weight_params(shape) * wbytes
        prefill += (weights + dequantized) / (memory_bytes_per_s * DEQUANTIZE_BANDWIDTH_EFFICIENCY)
        weights += 2 * dequantized  # each decode step writes the 16-bit copy and its matmul reads it
    cache = rows * (prompt + completion / 2) * kv_bytes_per_token(shape, wbytes)  # the mean step's cache
    step, bound = decode_step_seconds(shape, weights, cache, rows, peak * PEAK_EFFICIENCY, memory_bytes_per_s)
    gather = 0.0
    dp = inp.zero_partitions
    if inp.zero_stage == 3:
        stored = weights if inp.quantize == "none" else weights - 2 * dequantized
        gather = stored * (dp - 1) / dp / interconnect_bytes_per_s(inp, nvlink)
        if inp.offload_params != "none":
            gather += stored / dp / copy_bytes_per_s(inp.param_pinning, pcie_bytes_per_s)
        if not gen.gather_whole:  # the hooks gather the model again for every forward: prefill + each token
            gather *= completion + 1
    old_logps = reference_pass_seconds(inp, grad_accum, peak_tflops) if gen.num_iterations > 1 else 0.0
    return GenerationTime(prefill, completion * step, gather, old_logps, rows * completion, step, bound)


@dataclass(frozen=True)
class _Weights:
    """One rank's share of the model as the step moves it: elements after tp x pp, and bytes as stored."""

    wbytes: int
    """2 (16-bit) or 4 (fp32) per weight."""
    weights: float
    trainable: float
    """The adapters under LoRA, else every weight."""
    stored: float
    """Bytes of the weights as stored: a QLoRA base travels (all-gathers, offload fetches) packed; its
    quantisation state stays on every GPU (planning/memory/estimate.py), so it never travels."""

    @classmethod
    def of(cls, inp: MemoryInputs) -> _Weights:
        shape = inp.shape
        wbytes = 2 if inp.precision != "fp32" else 4
        shard = inp.tp * inp.pp
        trainable = (
            shape.lora_params(inp.lora_rank, inp.lora_targets) if inp.lora_rank else shape.num_params
        ) / shard
        if (
            shape.vision is not None
        ):  # an image-text model: what model.freeze leaves (planning/memory/model_split.py)
            trainable = model_split(inp).trainable
        stored = (
            base_weight_bytes(shape, inp.quantize, wbytes) - quantization_state_bytes(shape, inp.quantize)
        ) / shard
        stored += trainable * wbytes if inp.lora_rank else 0
        return cls(wbytes, shape.num_params / shard, trainable, stored)


def compute_seconds(inp: MemoryInputs, grad_accum: int, peak_tflops: float) -> float:
    """The forward and backward of every micro-batch (and DPO's live reference forward), at PEAK_EFFICIENCY
    scaled down for small micro-batches; ZeRO-3's hooks add ZERO3_COMPUTE_OVERHEAD."""
    shard = inp.tp * inp.pp
    tokens_micro = inp.rows * inp.seq_len  # a preference pair trains two rows
    tokens_rank = tokens_micro / inp.sp  # each of the sp ranks computes its slice of the sequence
    efficiency = PEAK_EFFICIENCY * tokens_rank / (tokens_rank + EFFICIENCY_HALF_TOKENS)
    flops_micro = flops_per_token(inp) * tokens_micro / (shard * inp.sp)
    if inp.reference == "live":
        # DPO's reference scores the same rows every micro-batch: one forward of the whole model.
        flops_micro += reference_flops_per_token(inp) * tokens_micro / (shard * inp.sp)
    compute = grad_accum * flops_micro / (peak_tflops * 1e12 * efficiency)
    if inp.zero_stage == 3:
        compute *= 1 + ZERO3_COMPUTE_OVERHEAD
    return compute


def communication_seconds(inp: MemoryInputs, grad_accum: int, w: _Weights, nvlink: bool) -> float:
    """ZeRO's collectives (ring: each GPU sends and receives ~(dp-1)/dp of the tensor per pass), the exposed
    part under overlap_comm, plus Ulysses' all-to-alls."""
    dp, stage = inp.zero_partitions, inp.zero_stage
    comm_bytes = 0.0
    if dp > 1:
        ring = (dp - 1) / dp
        passes = 3 if inp.activation_checkpointing else 2  # parameter all-gathers per micro-batch
        if stage <= 1:
            comm_bytes = 2 * w.trainable * w.wbytes * ring  # one all-reduce per step
        elif stage == 2:
            # Gradients are reduce-scattered every micro-batch, weights all-gathered once per step.
            comm_bytes = (grad_accum * w.trainable + w.weights) * w.wbytes * ring
        else:
            comm_bytes = grad_accum * (passes * w.stored + w.trainable * w.wbytes) * ring
            if inp.reference_copy:  # the sharded frozen reference is gathered for its forward
                comm_bytes += grad_accum * w.weights * w.wbytes * ring
    exposed = OVERLAPPED_COMM_EXPOSED if inp.overlap_comm else 1.0
    communication = exposed * comm_bytes / interconnect_bytes_per_s(inp, nvlink)
    if inp.sp > 1:
        # Ulysses: per layer and pass (forward, backward, + recompute) q, k, v and the output of the
        # rank's tokens cross an all-to-all, (sp-1)/sp of them to other GPUs of the node; not overlapped.
        passes = 3 if inp.activation_checkpointing else 2
        tokens_rank = inp.rows * inp.seq_len / inp.sp
        a2a = 4 * tokens_rank * inp.shape.hidden_size * w.wbytes * (inp.sp - 1) / inp.sp
        intra = NVLINK_BYTES_PER_S if nvlink else PCIE_P2P_BYTES_PER_S
        communication += grad_accum * inp.shape.num_layers * passes * a2a / intra
    return communication


@dataclass(frozen=True)
class _HostCopies:
    """ZeRO-Offload / ZeRO-Infinity's host<->GPU traffic of one step on one rank."""

    exposed: float
    """Seconds the step waits for them (what prefetch and streaming cannot hide, `_exposed`)."""
    raw: float
    """Seconds of all of them, counted whole."""
    moved: float
    """Bytes over the rank's host link, both directions."""


def host_copy_seconds(
    inp: MemoryInputs, grad_accum: int, w: _Weights, compute: float, pcie_bytes_per_s: float
) -> _HostCopies:
    """Each kind of copy over the rank's own PCIe link at its buffers' pinning, hidden behind the compute it
    runs beside where it can be (_exposed)."""
    layers, dp = inp.shape.num_layers, inp.zero_partitions
    exposed = moved = raw = 0.0
    fetches = 3 if inp.activation_checkpointing else 2  # forward, backward (+ recompute)
    if inp.offload_optimizer != "none":
        # 16-bit gradients leave the GPU every micro-batch during backward (ZeRO-2/3 accumulate on the
        # host; the backward is ~2/3 of the compute); the updated 16-bit weights come back once per step,
        # after CPU Adam, with nothing to hide behind, unless the parameters live on the host.
        grads = grad_accum * w.trainable / dp * w.wbytes
        rate = copy_bytes_per_s(inp.pinning, pcie_bytes_per_s)
        pinned = inp.pinning != "off" and inp.overlap_comm
        exposed += _exposed(grads / rate, compute * 2 / 3, layers, pinned)
        moved += grads
        raw += grads / rate
        if inp.offload_params == "none":
            exposed += w.trainable / dp * w.wbytes / rate
            moved += w.trainable / dp * w.wbytes
            raw += w.trainable / dp * w.wbytes / rate
    if inp.offload_params != "none":
        fetched = grad_accum * fetches * w.stored / dp
        seconds = fetched / copy_bytes_per_s(inp.param_pinning, pcie_bytes_per_s)
        exposed += _exposed(seconds, compute, layers, inp.param_pinning != "off")
        moved += fetched
        raw += seconds
    if inp.offload_checkpoints:
        # Each layer's 16-bit checkpoint goes to the host in forward and comes back in backward, copied on
        # a side stream from pinned memory (save_on_cpu(pin_memory=True)): it overlaps the compute.
        tokens_rank = inp.rows * inp.seq_len / inp.sp
        checkpoints = grad_accum * layers * 2 * (2 * tokens_rank * inp.shape.hidden_size)
        pinned = inp.checkpoint_pinning != "off"
        seconds = checkpoints / copy_bytes_per_s(inp.checkpoint_pinning, pcie_bytes_per_s)
        exposed += _exposed(seconds, compute, layers, pinned)
        moved += checkpoints
        raw += seconds
    return _HostCopies(exposed, raw, moved)


def nvme_bytes(inp: MemoryInputs, grad_accum: int, w: _Weights) -> tuple[float, float]:
    """(read, written) bytes per step on the node's drive: swapped parameters and optimizer sub-groups."""
    ranks, dp = inp.ranks_per_node, inp.zero_partitions
    fetches = 3 if inp.activation_checkpointing else 2
    read = written = 0.0
    if inp.offload_params == "nvme":
        # Swapped in from the drive (shared by the node's ranks) for every pass; written back once a step.
        read += ranks * grad_accum * fetches * w.stored / dp
        written += ranks * w.stored / dp
    if inp.offload_optimizer == "nvme":
        # Every swapped sub-group: master, m, v and its large tensors' gradients read in at the step; the
        # gradients written out at the accumulation boundary and master, m, v written back after the
        # update (planning/memory/offload_buffers.py, its docstring on NVMe offload). The same bytes each way.
        swapped = ranks * nvme_optimizer_bytes(offload_rank(inp))
        read += swapped
        written += swapped
    return read, written


def cpu_adam_seconds(inp: MemoryInputs, w: _Weights, nvme: float) -> float:
    """DeepSpeed's CPU Adam over this rank's partition, the node's ranks sharing CPU_ADAM_PARAMS_PER_S;
    pipelined NVMe swapping hides it behind the drive's traffic."""
    if inp.offload_optimizer == "none":
        return 0.0
    cpu_optimizer = w.trainable / inp.zero_partitions / (CPU_ADAM_PARAMS_PER_S / inp.ranks_per_node)
    if inp.state_dtype == "bf16":
        cpu_optimizer *= CPU_ADAM_BF16_BYTES_PER_PARAM / CPU_ADAM_BYTES_PER_PARAM
    if inp.offload_optimizer == "nvme" and (inp.swap.pipeline_read or inp.swap.pipeline_write):
        cpu_optimizer -= min(cpu_optimizer, nvme)
    return cpu_optimizer


def step_time(
    inp: MemoryInputs,
    grad_accum: int,
    peak_tflops: float,
    nvlink: bool = False,
    nvme_read_bytes_per_s: float = NVME_READ_BYTES_PER_S,
    nvme_write_bytes_per_s: float = NVME_WRITE_BYTES_PER_S,
    pcie_bytes_per_s: float = DEFAULT_PCIE_BYTES_PER_S,
    memory_bytes_per_s: float = UNKNOWN_GPU_MEMORY_GBS * 1e9,
) -> StepTime:
    """Estimated seconds per optimizer step on each rank for `inp` with `grad_accum` micro-batches: the sum
    of its parts, each a function above.

    NVMe traffic is timed at the drive's read and write speeds, one after the other: a drive shares
    its bandwidth between directions, and the swapper reads a sub-group's state before it writes
    the updated one back (pipelined read/write overlap the swaps with CPU Adam, not with each other).
    """
    w = _Weights.of(inp)
    compute = compute_seconds(inp, grad_accum, peak_tflops)
    copies = host_copy_seconds(inp, grad_accum, w, compute, pcie_bytes_per_s)
    nvme_read, nvme_write = nvme_bytes(inp, grad_accum, w)
    nvme = nvme_read / nvme_read_bytes_per_s + nvme_write / nvme_write_bytes_per_s
    call = generation_time(inp, grad_accum, peak_tflops, nvlink, pcie_bytes_per_s, memory_bytes_per_s)
    return StepTime(
        compute=compute,
        communication=communication_seconds(inp, grad_accum, w, nvlink),
        pcie=copies.raw,
        cpu_optimizer=cpu_adam_seconds(inp, w, nvme),
        nvme=nvme,
        tokens_per_step=grad_accum * inp.rows * inp.seq_len * inp.dp,
        nvme_read_bytes=nvme_read,
        nvme_write_bytes=nvme_write,
        dequantize=dequantize_seconds(inp, grad_accum, memory_bytes_per_s),
        pcie_bytes=copies.moved,
        pcie_hideable=copies.raw - copies.exposed,
        generation=call.total / inp.generation.num_iterations if call and inp.generation else 0.0,
        generation_call=call,
    )
