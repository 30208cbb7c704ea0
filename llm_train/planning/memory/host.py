"""The memory estimate's host-RAM and NVMe terms, per node: offload buffers as DeepSpeed allocates them
(planning/memory/offload_buffers.py), NVMe-offloaded parameters, offloaded activation checkpoints, the model-load
peak, the final export, and the peak over those phases. Conventions: planning/memory/estimate.py's docstring
(Host RAM, Export, Loading, QLoRA).
"""

from __future__ import annotations

import functools

from llm_train.planning.memory.formulas import (
    CHECKPOINT_SHARD_BYTES,
    DS_NVME_PARAM_BUFFER_COUNT,
    DS_NVME_PARAM_BUFFER_SIZE,
    DS_NVME_PARAM_MAX_IN_CPU,
    EXPORT_SHARD_BYTES,
    PROCESS_HOST_BYTES,
    QUANTIZE_RETAINED_BYTES_PER_WEIGHT,
    QUANTIZE_WORKSPACE_BYTES_PER_WEIGHT,
)
from llm_train.planning.memory.inputs import MemoryInputs
from llm_train.planning.memory.model_split import ModelSplit, layers_per_stage
from llm_train.planning.memory.offload_buffers import (
    HostBuffer,
    OffloadRank,
    cpu_optimizer_buffers,
    cpu_parameter_buffers,
    held_bytes,
    loader_fork_copies,
    nvme_optimizer_buffers,
    nvme_optimizer_bytes,
)
from llm_train.planning.memory.quantized_bytes import (
    NF4_PACKED_BYTES_PER_WEIGHT,
    base_weight_bytes,
    largest_quantized_weight,
    quantization_state_bytes,
    quantized_weight_params,
)


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
    offload: what it allocates, buffer by buffer, read from its source (planning/memory/offload_buffers.py)."""
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
    to the end (runtime/model/tiling.py).
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
    """What one rank's CPU / NVMe offload depends on (planning/memory/offload_buffers.py)."""
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
        frozen=inp.vision.freeze if inp.shape.vision is not None else (),
    )


def host_buffers(inp: MemoryInputs) -> list[HostBuffer]:
    """One rank's host allocations for its offloaded optimizer and parameters, as DeepSpeed makes them."""
    return list(_rank_buffers(offload_rank(inp), inp.offload_optimizer, inp.offload_params))


# The planner's search evaluates many candidates whose offload is the same (they differ in micro-batch,
# sequence or checkpointing, which size no host buffer): built once per distinct rank.
@functools.lru_cache(maxsize=4096)
def _rank_buffers(rank: OffloadRank, offload_optimizer: str, offload_params: str) -> tuple[HostBuffer, ...]:
    buffers: list[HostBuffer] = []
    if offload_optimizer == "cpu":
        buffers += cpu_optimizer_buffers(rank)
    elif offload_optimizer == "nvme":
        buffers += nvme_optimizer_buffers(rank)
    if offload_params == "cpu":
        buffers += cpu_parameter_buffers(rank)
    return tuple(buffers)


def export_peak_bytes(inp: MemoryInputs) -> float:
    """Host bytes the final export adds on the busiest node (see the module docstring).

    ZeRO engine: rank 0 holds the gathered 16-bit model, which save_hf_model writes as it is: one
    copy of the whole model. LoRA: written layer by layer from the GPU (runtime/export/sharded.py),
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
