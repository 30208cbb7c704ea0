"""A first-order step-time model, to rank memory-saving choices by what they cost in speed.

`llm-train plan` has to say *which* change makes a run fit at the smallest cost, and
`--recipe auto` has to pick the fastest configuration that fits. Both need relative
speeds, not a benchmark: this model adds up the time of the work that does not overlap
well on a single node (compute, host<->GPU copies, the CPU optimizer, NVMe traffic, the
exposed part of ZeRO communication). It ranks correctly the cases that matter
(activation checkpointing ~ +1/3 compute; parameter offload pays PCIe per micro-batch,
optimizer offload per step; NVMe is slowest) and its absolute numbers are rough (+-50%).

Pure arithmetic on `MemoryInputs`; no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_train.config.hardware import NVME_READ_BYTES_PER_S, NVME_WRITE_BYTES_PER_S
from llm_train.planning.flops import training_flops_per_token
from llm_train.planning.memory import offload_rank
from llm_train.planning.memory_inputs import MemoryInputs
from llm_train.planning.offload_buffers import nvme_optimizer_bytes

# Fraction of dense peak that a well-fed training step reaches (MFU); 35-50% is typical
# for 7B-class models with SDPA/flash attention on one node.
PEAK_EFFICIENCY = 0.40
# Small micro-batches starve the tensor cores: efficiency falls as tokens / (tokens + this).
EFFICIENCY_HALF_TOKENS = 256
# Host<->GPU copies from pinned memory over PCIe 4.0 x16: ~25 GB/s peak, ~12 sustained
# for ZeRO-Offload's many mid-sized transfers.
PCIE_BYTES_PER_S = 12e9
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
# QLoRA: bitsandbytes dequantises every 4/8-bit weight to 16 bits for each matmul (forward, the
# recompute, and the input gradient in backward) instead of reading it: assumed ~30% more step time
# than 16-bit LoRA, until bench/consumer_check.sh measures both on a GPU.
QUANTIZED_COMPUTE_OVERHEAD = 0.30


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, by component (they are added: little of it overlaps)."""

    compute: float
    communication: float
    pcie: float
    cpu_optimizer: float
    nvme: float
    tokens_per_step: int
    nvme_read_bytes: float = 0.0
    """Bytes read from the NVMe drive per step (per node)."""
    nvme_write_bytes: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.communication + self.pcie + self.cpu_optimizer + self.nvme

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.total if self.total > 0 else 0.0


def flops_per_token(inp: MemoryInputs) -> float:
    """Training FLOPs per token on one model replica (planning/flops.py), as the hardware runs them:
    LoRA trains only its adapters, activation checkpointing recomputes the forward, and the ALST
    tiles recompute their part once more in backward (the MLP, the output layer)."""
    shape = inp.shape
    trainable = shape.lora_params(inp.lora_rank) if inp.lora_rank else shape.num_params
    frozen = shape.num_params if inp.lora_rank else 0
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


def step_time(
    inp: MemoryInputs,
    grad_accum: int,
    peak_tflops: float,
    nvlink: bool = False,
    nvme_read_bytes_per_s: float = NVME_READ_BYTES_PER_S,
    nvme_write_bytes_per_s: float = NVME_WRITE_BYTES_PER_S,
) -> StepTime:
    """Estimated seconds per optimizer step on each rank for `inp` with `grad_accum` micro-batches.

    NVMe traffic is timed at the drive's read and write speeds, one after the other: a drive shares
    its bandwidth between directions, and the swapper reads a sub-group's state before it writes
    the updated one back (pipelined read/write overlap the swaps with CPU Adam, not with each other).
    """
    shape = inp.shape
    mixed = inp.precision != "fp32"
    wbytes = 2 if mixed else 4
    shard = inp.tp * inp.pp
    weights = shape.num_params / shard
    trainable = (shape.lora_params(inp.lora_rank) if inp.lora_rank else shape.num_params) / shard
    # ZeRO partitions (and communicates) over the data- and sequence-parallel ranks together.
    dp, ranks, stage = inp.zero_partitions, inp.ranks_per_node, inp.zero_stage
    tokens_micro = inp.rows * inp.seq_len  # a preference pair trains two rows
    tokens_rank = tokens_micro / inp.sp  # each of the sp ranks computes its slice of the sequence

    efficiency = PEAK_EFFICIENCY * tokens_rank / (tokens_rank + EFFICIENCY_HALF_TOKENS)
    flops_micro = flops_per_token(inp) * tokens_micro / (shard * inp.sp)
    if inp.reference == "live":
        # DPO's reference scores the same rows every micro-batch: one forward of the whole model.
        flops_micro += reference_flops_per_token(inp) * tokens_micro / (shard * inp.sp)
    compute = grad_accum * flops_micro / (peak_tflops * 1e12 * efficiency)
    if stage == 3:
        compute *= 1 + ZERO3_COMPUTE_OVERHEAD
    if inp.quantize != "none":
        compute *= 1 + QUANTIZED_COMPUTE_OVERHEAD

    # ZeRO collectives (ring: each GPU sends/receives ~(dp-1)/dp of the tensor per pass).
    comm_bytes = 0.0
    if dp > 1:
        ring = (dp - 1) / dp
        passes = 3 if inp.activation_checkpointing else 2  # parameter all-gathers per micro-batch
        if stage <= 1:
            comm_bytes = 2 * trainable * wbytes * ring  # one all-reduce per step
        elif stage == 2:
            # Gradients are reduce-scattered every micro-batch, weights all-gathered once per step.
            comm_bytes = (grad_accum * trainable + weights) * wbytes * ring
        else:
            comm_bytes = grad_accum * (passes * weights + trainable) * wbytes * ring
            if inp.reference_copy:  # the sharded frozen reference is gathered for its forward
                comm_bytes += grad_accum * weights * wbytes * ring
    if inp.num_nodes > 1:
        bandwidth = INTER_NODE_BYTES_PER_S
    else:
        bandwidth = NVLINK_BYTES_PER_S if nvlink else PCIE_P2P_BYTES_PER_S
    exposed = OVERLAPPED_COMM_EXPOSED if inp.overlap_comm else 1.0
    communication = exposed * comm_bytes / bandwidth
    if inp.sp > 1:
        # Ulysses: per layer and pass (forward, backward, + recompute) q, k, v and the output of the
        # rank's tokens cross an all-to-all, (sp-1)/sp of them to other GPUs of the node; not overlapped.
        passes = 3 if inp.activation_checkpointing else 2
        a2a = 4 * tokens_rank * shape.hidden_size * wbytes * (inp.sp - 1) / inp.sp
        intra = NVLINK_BYTES_PER_S if nvlink else PCIE_P2P_BYTES_PER_S
        communication += grad_accum * shape.num_layers * passes * a2a / intra

    # Host <-> GPU traffic of ZeRO-Offload / ZeRO-Infinity, per rank over its own PCIe link.
    pcie_bytes = 0.0
    nvme_read = nvme_write = 0.0
    fetches = 3 if inp.activation_checkpointing else 2  # forward, backward (+ recompute)
    if inp.offload_optimizer != "none":
        # 16-bit gradients leave the GPU every micro-batch (ZeRO-2/3 accumulate on the host);
        # updated 16-bit weights come back once per step unless the parameters live on the host.
        pcie_bytes += grad_accum * trainable / dp * wbytes
        if inp.offload_params == "none":
            pcie_bytes += trainable / dp * wbytes
    if inp.offload_params != "none":
        pcie_bytes += grad_accum * fetches * weights / dp * wbytes
    if inp.offload_checkpoints:
        # Each layer's 16-bit checkpoint goes to the host in forward and comes back in backward.
        pcie_bytes += grad_accum * shape.num_layers * 2 * (2 * tokens_rank * shape.hidden_size)
    if inp.offload_params == "nvme":
        # Swapped in from the drive (shared by the node's ranks) for every pass; written back once a step.
        nvme_read += ranks * grad_accum * fetches * weights / dp * wbytes
        nvme_write += ranks * weights / dp * wbytes
    if inp.offload_optimizer == "nvme":
        # Every swapped sub-group: master, m, v and its large tensors' gradients read in at the step; the
        # gradients written out at the accumulation boundary and master, m, v written back after the
        # update (planning/offload_buffers.py, its docstring on NVMe offload). The same bytes each way.
        swapped = ranks * nvme_optimizer_bytes(offload_rank(inp))
        nvme_read += swapped
        nvme_write += swapped
    pcie = pcie_bytes / PCIE_BYTES_PER_S
    nvme = nvme_read / nvme_read_bytes_per_s + nvme_write / nvme_write_bytes_per_s

    cpu_optimizer = 0.0
    if inp.offload_optimizer != "none":
        cpu_optimizer = trainable / dp / (CPU_ADAM_PARAMS_PER_S / ranks)
        if inp.state_dtype == "bf16":
            cpu_optimizer *= CPU_ADAM_BF16_BYTES_PER_PARAM / CPU_ADAM_BYTES_PER_PARAM
        if inp.offload_optimizer == "nvme" and (inp.swap.pipeline_read or inp.swap.pipeline_write):
            # Pipelined swapping hides CPU Adam behind the drive's traffic.
            hidden = min(cpu_optimizer, nvme)
            cpu_optimizer -= hidden

    return StepTime(
        compute=compute,
        communication=communication,
        pcie=pcie,
        cpu_optimizer=cpu_optimizer,
        nvme=nvme,
        tokens_per_step=grad_accum * tokens_micro * inp.dp,
        nvme_read_bytes=nvme_read,
        nvme_write_bytes=nvme_write,
    )
