"""Host RAM of DeepSpeed's CPU offload, allocation by allocation (DeepSpeed 0.19.8, torch 2.13).

memory.py takes its host terms for `offload_optimizer: cpu` and `offload_param: cpu` from here.
Each number is one allocation in DeepSpeed's source, cited where it is counted (paths under
deepspeed/; line numbers of 0.19.8). Four facts make them larger than the "12 + 4 bytes per
parameter" of the ZeRO-Offload paper; the first H200 run of 7b-rtx4090 (bench/results/
host-ram-7b-offload-20261130.txt) was killed by the kernel in its first step after the planner,
counting 16 bytes per parameter, had said 103 GiB:

1. Pinned buffers are rounded up to a power of two. DeepSpeed pins with `tensor.pin_memory()`
   (accelerator/abstract_accelerator.py `_torch_pin_memory`; its mlock backend is opt-in,
   DS_PIN_MEMORY_BACKEND=native), i.e. torch's CachingHostAllocator, whose `allocate`
   (ATen/core/CachingHostAllocator.h) returns `PowerOf2Ceil(size)` bytes for any request up to
   `pinned_max_round_threshold_mb` / `pinned_max_cached_size_mb` (c10/core/AllocatorConfig.h:
   unlimited unless PYTORCH_CUDA_ALLOC_CONF sets them). A freed pinned block stays in that
   allocator's cache (`maybe_cache_block`), page-locked, until the process ends.
2. ZeRO-3 holds the gradient partitions twice: the flat 16-bit buffer the reduce-scatter lands
   in (runtime/zero/stage3.py 791-795, `_setup_for_real_optimizer`; dtype = the model's, engine.py
   `get_data_types`, as no recipe sets grad_accum_dtype) and the master-dtype `.grad` of each
   optimizer sub-group (stage3.py 1337-1342, `initialize_optimizer_states`), each pinned.
3. CPU Adam creates m and v at its first step (ops/adam/cpu_adam.py 153-164), pageable: the set-up
   holds master + gradients only, and the first optimizer step is where the host peaks.
4. DataLoader workers are forked (data/stream.py `_fork_context`) at the first batch, after
   DeepSpeed has set up. A forked child keeps the pre-fork version of every private page the
   parent later writes (copy-on-write), and CPU Adam rewrites the pageable master weights (and,
   after a resume, m and v) in place every step: while workers live, the host holds that state
   twice. Pinned buffers are shared mappings and are not copied.

Not counted: transients of the set-up (a pageable twin of each buffer while `pin_memory()` copies
it, defragment's 16-bit CPU copy of the partitions, runtime/zero/utils.py 221): all are freed
before CPU Adam allocates m and v, whose 4 or 8 bytes per parameter exceed them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llm_train.planning.shapes import ModelShape


def pinned_bytes(nbytes: float, pinned: bool = True) -> float:
    """Host bytes a buffer of `nbytes` really takes: rounded up to a power of two when pinned (fact 1)."""
    if not pinned or nbytes <= 0:
        return float(max(nbytes, 0))
    return float(1 << (math.ceil(nbytes) - 1).bit_length())


def trainable_tensors(shape: ModelShape, lora_rank: int | None) -> tuple[list[int], list[int]]:
    """Numels of the trainable tensors in the order the model registers them, in runtime/optim.py's
    two optimizer groups (`_param_groups`): (matrices, decayed; vectors: norms and biases).

    A full fine-tune trains every tensor (embedding, per layer q, k, v, o, gate, up, down and the
    two norms, final norm, head); LoRA trains A (r x n_in) and B (n_out x r) of the seven
    projections of every layer (shapes.lora_params counts the same).
    """
    if lora_rank:
        h, i, q, kv, r = shape.hidden_size, shape.intermediate_size, shape.q_dim, shape.kv_dim, lora_rank
        projections = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
        per_layer = [n for n_in, n_out in projections for n in (r * n_in, n_out * r)]
        return per_layer * shape.num_layers, []
    embed, *layer, norm, head = shape.modules()
    matrices: list[int] = []
    vectors: list[int] = []

    def add(name: str, numels: tuple[int, ...]) -> None:
        for k, n in enumerate(numels):  # a linear's numels are (weight, bias); a norm's (weight,)
            (vectors if k > 0 or "norm" in name else matrices).append(n)

    add(embed[0], embed[1])
    for _ in range(shape.num_layers):
        for name, numels, _count in layer:
            add(name, numels)
    add(norm[0], norm[1])
    if head[2]:  # an untied head
        add(head[0], head[1])
    return matrices, vectors


def zero3_sub_groups(numels: list[int], sub_group_size: int) -> list[int]:
    """Elements of each ZeRO-3 optimizer sub-group of one parameter group (stage3.py 1210-1233,
    `_create_fp16_sub_groups`): a sub-group closes at the first tensor that brings it to
    `sub_group_size` or more, so it overshoots by up to one tensor; a group no larger stays whole."""
    if not numels:
        return []
    if sub_group_size >= sum(numels):
        return [sum(numels)]
    groups, size = [], 0
    for k, n in enumerate(numels):
        size += n
        if size >= sub_group_size or k == len(numels) - 1:
            groups.append(size)
            size = 0
    return groups


@dataclass(frozen=True)
class OffloadRank:
    """What one rank's CPU offload depends on."""

    shape: ModelShape
    lora_rank: int | None
    zero_stage: int
    partitions: int
    """Ranks ZeRO partitions over (dp x sp)."""
    shard: int
    """tp x pp: each rank's share of every tensor before ZeRO (an even split, as memory.py assumes)."""
    model_bytes: int
    """16-bit (2) or fp32 (4) model: the dtype of the gradient buffers."""
    state_bytes: int
    """Master weights, their gradients and Adam's m and v: 4 (fp32) or 2 (optim.state_dtype bf16)."""
    sub_group_size: int
    grad_accum: int
    pin_memory: bool
    params_offloaded: bool
    loader_forks: bool
    persistence_threshold: int = 0
    """ZeRO-3 keeps tensors under this many elements whole on the GPU (stage3_param_persistence_threshold)."""

    def part(self, numel: int) -> int:
        """This rank's ZeRO-3 partition of one tensor (padded up to a multiple of the partition count)."""
        return math.ceil(numel / self.shard / self.partitions)


@dataclass(frozen=True)
class CpuOptimizerHost:
    """Host bytes of one rank's CPU-offloaded optimizer at its peak (the optimizer step)."""

    states: float
    """Master weights + Adam m + v (the master pinned, hence rounded, under ZeRO-1/2)."""
    moments: float
    """Adam m + v: freed before the final export (runtime/optim.py `release_moments`)."""
    gradients: float
    """The master-dtype gradient partitions CPU Adam steps on (pinned)."""
    buffers: float
    """16-bit buffers: ZeRO-3's flat gradient partitions; ZeRO-1/2's parameter copy and staging."""
    step_transient: float
    """A 16-bit CPU copy of one sub-group while its updated master goes back to the GPU."""
    fork_copies: float
    """Pre-fork pages of the pageable optimizer state that forked loader workers keep (fact 4)."""


def cpu_optimizer_host(rank: OffloadRank) -> CpuOptimizerHost:
    """Host bytes of one rank's `offload_optimizer: cpu` (module docstring for the facts)."""
    pin, state, low = rank.pin_memory, rank.state_bytes, rank.model_bytes
    groups = [g for g in trainable_tensors(rank.shape, rank.lora_rank) if g]
    if rank.zero_stage == 3:
        parts = [[rank.part(n) for n in g] for g in groups]
        elements = sum(sum(p) for p in parts)
        subs = [s for p in parts for s in zero3_sub_groups(p, rank.sub_group_size)]
        # stage3.py 1157-1160 (`_create_fp32_partitions`): the master of each sub-group, a pageable
        # CPU copy in the master dtype; cpu_adam.py 161-164: m and v, pageable, at the first step.
        master, moments = state * elements, 2 * state * elements
        # stage3.py 1337-1342: each sub-group's gradient in the master dtype, pinned on its own.
        gradients = sum(pinned_bytes(state * s, pin) for s in subs)
        # stage3.py 791-795: one flat buffer of every partition's 16-bit gradient, pinned.
        buffers = pinned_bytes(low * elements, pin)
        # stage3.py 2860 (`_reassign_or_swap_out_partitioned_parameters`) copies the updated master
        # of a sub-group into the 16-bit partition on the GPU; a blocking copy that changes dtype
        # converts on the CPU first (ATen cuda/Copy.cu `copy_kernel_cuda`): one 16-bit temporary of
        # the sub-group. With the parameters offloaded the destination is on the CPU: no temporary.
        transient = low * max(subs) if state != low and not rank.params_offloaded else 0.0
        pageable = master + moments
        states = master + moments
    else:
        # ZeRO-1/2 flatten each parameter group and partition it whole (stage_1_and_2.py).
        parts_12 = [math.ceil(sum(n / rank.shard for n in g) / rank.partitions) for g in groups]
        elements = sum(parts_12)
        # 559-565: the master partition, pinned; 934-941: its gradient, pinned; cpu_adam.py: m, v.
        master = sum(pinned_bytes(state * p, pin) for p in parts_12)
        moments = 2 * state * elements
        gradients = sum(pinned_bytes(state * p, pin) for p in parts_12)
        # 566-575: a 16-bit copy of the partition (the step writes it, then sends it to the GPU);
        # 656-658: a staging buffer as large as the largest trainable tensor; both pinned.
        largest = max(max(g) for g in groups) / rank.shard
        buffers = sum(pinned_bytes(low * p, pin) for p in parts_12) + pinned_bytes(low * largest, pin)
        if rank.grad_accum > 1 and state == 4:
            # 1822-1826: with accumulation, a pinned 16-bit buffer per tensor of the partition
            # (about 1/partitions of them, each whole).
            every = [n / rank.shard for g in groups for n in g]
            buffers += sum(pinned_bytes(low * n, pin) for n in every) / rank.partitions
        transient = 0.0
        pageable = moments + (0.0 if pin else state * elements)
        states = master + moments
    # Fact 4, for a resumed run (m and v exist before the fork too): the worst case is every
    # pageable byte of optimizer state held twice.
    fork_copies = pageable if rank.loader_forks else 0.0
    return CpuOptimizerHost(states, moments, gradients, buffers, transient, fork_copies)


def cpu_parameters_host(rank: OffloadRank) -> float:
    """Host bytes of one rank's `offload_param: cpu` (ZeRO-3): the 16-bit parameter partitions.

    zero.Init gives every tensor's partition its own pinned block (runtime/zero/
    partition_parameters.py 1829-1843; the persistent small tensors stay on the GPU); the optimizer then moves the trainable ones into one flat
    pinned buffer per parameter group (stage3.py 906-907 and 881-883, `_move_to_flat_buffer`). The
    blocks it leaves are freed into torch's pinned cache, which keeps them (fact 1); unpinned, they go
    back to the OS and only the frozen tensors' blocks (LoRA's base) remain.
    """
    pin, low = rank.pin_memory, rank.model_bytes
    groups = [g for g in trainable_tensors(rank.shape, rank.lora_rank) if g]
    flat = sum(pinned_bytes(low * sum(rank.part(n) for n in g), pin) for g in groups)

    def blocks(tensors: list[list[int]]) -> float:
        offloaded = (n for g in tensors for n in g if n >= rank.persistence_threshold)
        return sum(pinned_bytes(low * rank.part(n), pin) for n in offloaded)

    trainable_blocks = blocks(groups)
    all_blocks = blocks(list(trainable_tensors(rank.shape, None)))
    if rank.lora_rank:
        # LoRA's adapters are created after the base model, outside zero.Init's per-tensor blocks.
        all_blocks += trainable_blocks
    kept_blocks = all_blocks if pin else all_blocks - trainable_blocks
    return flat + kept_blocks
