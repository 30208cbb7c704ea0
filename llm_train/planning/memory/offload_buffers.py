"""Host RAM of DeepSpeed's CPU and NVMe offload, allocation by allocation (DeepSpeed 0.19.8, torch 2.13).

estimate.py takes its host terms for `offload_optimizer: cpu | nvme` and `offload_param: cpu` from
here. Each `HostBuffer` is one allocation (or one kind of allocation) in DeepSpeed's source, cited
where it is built (paths under deepspeed/; line numbers of 0.19.8). The first H200 run of
7b-rtx4090 (bench/results/host-ram-7b-offload-20261130.txt) was killed by the kernel in its first
step after the planner, counting 16 bytes per parameter, had said 103 GiB. What makes the real
number larger:

1. How a pinned buffer is allocated decides its size: the pinning choice (`PINNINGS`).
   - "torch" (DeepSpeed's default): `tensor.pin_memory()` (accelerator/abstract_accelerator.py
     `_torch_pin_memory`), i.e. torch's CachingHostAllocator, whose `allocate`
     (ATen/core/CachingHostAllocator.h) returns `PowerOf2Ceil(size)` bytes for any request up to
     `pinned_max_round_threshold_mb` (c10/core/AllocatorConfig.h: unlimited unless
     PYTORCH_CUDA_ALLOC_CONF sets it). A freed block stays cached, page-locked, until the process
     ends. DeepSpeed's CPU accelerator (cpu_accelerator.py `pin_memory`) pins nothing this way.
   - "native" (`DS_PIN_MEMORY_BACKEND=native`, deepspeed/utils/pin_memory.py): posix_memalign + mlock
     of the exact request (ops/csrc/pin_memory/page_alloc.cpp), whole pages; it counts against the
     process's memlock limit (RLIMIT_MEMLOCK, `ulimit -l`) unless it has CAP_IPC_LOCK. On this CPU
     machine tiny-cpu under ZeRO-3 + CPU offload locked 29,756 kB, every page of it accounted for
     below (tests/e2e/test_host_offload.py measures it against these rows).
   - "off" (`pin_memory: false` in the DS JSON): pageable buffers of the exact size.
   DeepSpeed's async-I/O buffers (NVMe swapping) are always mlocked exactly, whatever the choice
   (ops/csrc/aio/py_lib/deepspeed_py_io_handle.cpp `new_cpu_locked_tensor`).
2. ZeRO-3 holds the gradient partitions twice under CPU offload: the flat 16-bit buffer the
   reduce-scatter lands in (runtime/zero/stage3.py 791-795, `_setup_for_real_optimizer`; dtype =
   the model's, engine.py `get_data_types`, as no recipe sets grad_accum_dtype) and the master-dtype
   `.grad` of each optimizer sub-group (stage3.py 1337-1342, `initialize_optimizer_states`), both
   pinned.
3. CPU Adam creates m and v at its first step (ops/adam/cpu_adam.py 153-164), pageable: the set-up
   holds master + gradients only, and the first optimizer step is where the host peaks.
4. DataLoader workers are forked (data/dealer.py `_fork_context`) at the first batch, after
   DeepSpeed has set up. A forked child keeps the pre-fork version of every private page the
   parent later writes (copy-on-write): the pageable master weights CPU Adam rewrites every step
   (and, after a resume, m and v), the gradient buffers when they are pageable or mlocked
   (posix_memalign memory is private). torch's CUDA pinned blocks are shared mappings, not copied.
5. Under NVMe offload (ZeRO-Infinity) the master, m and v of every sub-group of at least
   max(1 MiB, aio block_size) live on the drive (swap_tensor/optimizer_utils.py
   `is_swappable_tensor`), and so does the fp32 gradient of each of its tensors that is itself that
   large (a smaller one waits in host RAM: `_swap_out_gradients`, `unswapped_gradients`); the host keeps the flat 16-bit gradient buffer and `buffer_count` swap
   buffers, each as large as the largest sub-group rounded up to the I/O alignment
   (optimizer_utils.py `_io_aligned_numel`, swap_tensor/utils.py `SwapBufferManager`). A sub-group
   in flight takes 4 of them (master, m, v and its gradient: partitioned_optimizer_swapper.py
   `required_buffer_count`); pipelined read needs the next one's 4 too, pipelined write the
   previous one's.

Not counted: transients of the set-up (a pageable twin of each buffer while `pin_memory()` copies
it, defragment's 16-bit CPU copy of the partitions, runtime/zero/utils.py 221; the fp32 buffer of
the largest sub-group `initialize_optimizer_states` zero-fills): all are freed before CPU Adam
allocates m and v, whose 8 bytes per parameter exceed them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from llm_train.planning.memory.quantized_bytes import QUANTIZED_MODULES, packed_numel
from llm_train.planning.model.shapes import LORA_TARGETS, ModelShape
from llm_train.planning.model.vision_shapes import LANGUAGE_MODEL

PINNINGS = ("torch", "native", "off")
"""How DeepSpeed's pinned host buffers are allocated (module docstring, fact 1)."""
PAGE_BYTES = 4096
# swap_tensor/utils.py: requests under MIN_AIO_BYTES are not swapped; I/O is aligned to
# AIO_ALIGNED_BYTES x aio.intra_op_parallelism bytes.
MIN_AIO_BYTES = 1024**2
AIO_ALIGNED_BYTES = 1024
# partitioned_optimizer_swapper.py `required_buffer_count`: master, m, v and the gradient.
SWAP_BUFFERS_PER_SUB_GROUP = 4


def held_bytes(nbytes: float, pinning: str) -> float:
    """Host bytes one allocation of `nbytes` really takes under a pinning choice (module docstring, fact 1)."""
    if nbytes <= 0:
        return 0.0
    if pinning == "torch":
        return float(1 << (math.ceil(nbytes) - 1).bit_length())
    if pinning == "native":
        return float(math.ceil(nbytes / PAGE_BYTES) * PAGE_BYTES)
    return float(math.ceil(nbytes))


@dataclass(frozen=True)
class HostBuffer:
    """One kind of host allocation: what it is, its sizes, how it is allocated, when it exists."""

    term: str
    """The estimate.py host term it belongs to."""
    what: str
    sizes: tuple[float, ...]
    """Bytes requested, one entry per allocation."""
    how: str = "pinned"
    """'pinned' (the pinning choice of its section applies), 'pageable', or 'locked' (async I/O: mlock)."""
    section: str = "optimizer"
    """Whose pin_memory applies: 'optimizer' (offload_optimizer) or 'param' (offload_param)."""
    released: bool = False
    """Adam's m and v: freed before the final export (runtime/model/optim.py `release_moments`)."""
    step_only: bool = False
    """Exists only while the optimizer steps (a transient of the step)."""
    rewritten: bool = True
    """Written after the loader workers fork (every step), so a forked child keeps the old pages."""

    def allocator(self, pinning: str) -> str:
        """The allocator that serves it under `pinning`: 'torch', 'native' (exact mlock) or 'off'."""
        if self.how == "locked":
            return "native"
        return pinning if self.how == "pinned" else "off"

    def held(self, pinning: str) -> float:
        return _held(self.sizes, self.allocator(pinning))

    def locked(self, pinning: str) -> float:
        """Bytes counted against the memlock limit (mlock: native pinning and async I/O)."""
        return self.held(pinning) if self.allocator(pinning) == "native" else 0.0

    def fork_copied(self, pinning: str) -> float:
        """What a forked loader worker keeps of it (fact 4): private pages the parent rewrites."""
        return self.held(pinning) if self.rewritten and self.allocator(pinning) != "torch" else 0.0


def trainable_tensors(
    shape: ModelShape,
    lora_rank: int | None,
    lora_targets: tuple[str, ...] = LORA_TARGETS,
    frozen: tuple[str, ...] = (),
) -> tuple[list[int], list[int]]:
    """Numels of the trainable tensors in the order the model registers them, in runtime/model/optim.py's
    two optimizer groups (`_param_groups`): (matrices, decayed; vectors: norms and biases).

    A full fine-tune trains every tensor (embedding, per layer q, k, v, o, gate, up, down and the
    two norms, final norm, head); LoRA trains A (r x n_in) and B (n_out x r) of each projection in
    lora.target_modules of every layer, in the layer's order, then lm_head's if it is a target
    (shapes.lora_params counts the same). An image-text model's parts not in `frozen` (model.freeze) train
    too: whole in a full fine-tune, through adapters on their target-named linears under LoRA; "language_model"
    in `frozen` leaves the language model out.
    """
    matrices: list[int] = []
    vectors: list[int] = []

    def add(name: str, numels: tuple[int, ...]) -> None:
        for k, n in enumerate(numels):  # a linear's numels are (weight, bias); a norm's (weight,)
            (vectors if k > 0 or "norm" in name else matrices).append(n)

    if lora_rank:
        # Adapters where the run puts them (runtime/model/model.py): the language model's, unless it is frozen,
        # then those on an unfrozen vision part's target-named linears.
        r = lora_rank
        adapted = [sides for name, sides in shape.lora_projections().items() if name in lora_targets]
        per_layer = [n for n_in, n_out in adapted for n in (r * n_in, n_out * r)]
        head_adapter = [r * shape.hidden_size, shape.vocab_size * r] if "lm_head" in lora_targets else []
        language = per_layer * shape.num_layers + head_adapter if LANGUAGE_MODEL not in frozen else []
        vision = shape.vision.lora_tensors(r, lora_targets, frozen) if shape.vision is not None else []
        return language + [n for pair in vision for n in pair], []
    if shape.vision is not None:
        for name, numels, count in shape.vision.modules():
            if name.split(".", 1)[0] not in frozen:
                for _ in range(count):
                    add(name, numels)
    vision_matrices, vision_vectors = matrices, vectors
    matrices, vectors = [], []
    # The language model's modules: the fixed twelve of every decoder, then per-layer extras (Gemma 3's norms).
    text = [m for m in shape.modules() if "." not in m[0]]
    embed, *layer, norm, head = text[:12]
    layer += text[12:]
    if LANGUAGE_MODEL not in frozen:
        add(embed[0], embed[1])
        for _ in range(shape.num_layers):
            for name, numels, _count in layer:
                add(name, numels)
        add(norm[0], norm[1])
        if head[2]:  # an untied head
            add(head[0], head[1])
    return matrices + vision_matrices, vectors + vision_vectors


# The planner's search (planning/auto/choose.py) makes one OffloadRank per candidate, tens of thousands
# per `plan --recipe auto`, nearly all of one model: rebuilding its tensor list, partitions and sub-groups
# each time, and summing the same buffers' pages, was most of the search's time (a 13B grid of 15 searches:
# 18.3 s, of which sub_group_members 19.8 and held 9.7 of 56.5 profiled). The results are pure functions of
# hashable frozen inputs, kept here once each.
@functools.lru_cache(maxsize=256)
def _trainable_groups(
    shape: ModelShape, lora_rank: int | None, lora_targets: tuple[str, ...], frozen: tuple[str, ...]
) -> tuple[tuple[int, ...], ...]:
    """trainable_tensors' non-empty groups, immutable (shared by every caller)."""
    return tuple(tuple(g) for g in trainable_tensors(shape, lora_rank, lora_targets, frozen) if g)


@functools.lru_cache(maxsize=4096)
def _held(sizes: tuple[float, ...], allocator: str) -> float:
    return sum(held_bytes(size, allocator) for size in sizes)


def stored_tensors(shape: ModelShape, quantize: str, storage_bytes: int) -> list[int]:
    """Numels of every tensor of the base as the run stores it: an nf4 projection's weight packed into
    the storage dtype (quantized.packed_numel), everything else as it is."""
    if quantize != "nf4":
        return [n for group in trainable_tensors(shape, None) for n in group]
    embed, *layer, norm, head = shape.modules()
    out = list(embed[1])
    for _ in range(shape.num_layers):
        for name, numels, _count in layer:
            out += [
                packed_numel(n, quantize, storage_bytes) if k == 0 and name in QUANTIZED_MODULES else n
                for k, n in enumerate(numels)
            ]
    out += list(norm[1]) + (list(head[1]) if head[2] else [])
    return out


def zero3_sub_groups(numels: Sequence[int], sub_group_size: int) -> list[int]:
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
class SwapSettings:
    """The DS JSON's NVMe swap settings that size host buffers (offload_optimizer and the aio section)."""

    buffer_count: int = 4
    """offload_optimizer.buffer_count (DeepSpeed's default 4: one sub-group in flight)."""
    pipeline_read: bool = False
    pipeline_write: bool = False
    intra_op_parallelism: int = 1
    """aio.intra_op_parallelism: I/O is aligned to 1 KiB per thread."""
    block_size: int = 1024**2
    """aio.block_size: a sub-group smaller than max(1 MiB, this) is not swapped."""

    @property
    def buffers_needed(self) -> int:
        """Swap buffers a step takes at once (module docstring, fact 5)."""
        return SWAP_BUFFERS_PER_SUB_GROUP * (1 + int(self.pipeline_read) + int(self.pipeline_write))


@dataclass(frozen=True)
class OffloadRank:
    """What one rank's offload depends on."""

    shape: ModelShape
    lora_rank: int | None
    zero_stage: int
    partitions: int
    """Ranks ZeRO partitions over (dp x sp)."""
    shard: int
    """tp x pp: each rank's share of every tensor before ZeRO (an even split, as estimate.py assumes)."""
    model_bytes: int
    """16-bit (2) or fp32 (4) model: the dtype of the gradient buffers."""
    state_bytes: int
    """Master weights, their gradients and Adam's m and v: 4 (fp32) or 2 (optim.state_dtype bf16)."""
    sub_group_size: int
    grad_accum: int
    pinning: str
    """How the offload_optimizer buffers are pinned (PINNINGS)."""
    params_offloaded: bool
    loader_forks: bool
    param_pinning: str = "torch"
    """How the offload_param buffers are pinned (PINNINGS)."""
    swap: SwapSettings = SwapSettings()
    quantize: str = "none"
    """QLoRA's base (planning/memory/quantized_bytes.py): nf4 projections are stored packed, in fewer elements."""
    lora_targets: tuple[str, ...] = LORA_TARGETS
    frozen: tuple[str, ...] = ()
    """model.freeze of an image-text model (its frozen parts hold no optimizer state); () for a text model."""

    def pinning_of(self, buffer: HostBuffer) -> str:
        return self.param_pinning if buffer.section == "param" else self.pinning

    def trainable_groups(self) -> tuple[tuple[int, ...], ...]:
        """Numels of the trainable tensors per optimizer parameter group (`trainable_tensors`), non-empty."""
        return _trainable_groups(self.shape, self.lora_rank, self.lora_targets, self.frozen)

    def parts(self) -> tuple[tuple[int, ...], ...]:
        """This rank's ZeRO-3 partition of every trainable tensor, per optimizer parameter group."""
        return _partitioned(self.trainable_groups(), self.shard, self.partitions)

    def sub_groups(self) -> list[int]:
        """Elements of this rank's ZeRO-3 optimizer sub-groups, in order."""
        return [sum(members) for members in self.sub_group_members()]

    def sub_group_members(self) -> tuple[tuple[int, ...], ...]:
        """This rank's partition of each tensor, grouped into its ZeRO-3 optimizer sub-groups."""
        return _sub_group_members(self.parts(), self.sub_group_size)


def _part(numel: int, shard: int, partitions: int) -> int:
    """One rank's ZeRO-3 partition of a tensor (padded up to a multiple of the partition count)."""
    return math.ceil(numel / shard / partitions)


@functools.lru_cache(maxsize=1024)
def _partitioned(
    groups: tuple[tuple[int, ...], ...], shard: int, partitions: int
) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(_part(n, shard, partitions) for n in group) for group in groups)


@functools.lru_cache(maxsize=1024)
def _sub_group_members(
    parts: tuple[tuple[int, ...], ...], sub_group_size: int
) -> tuple[tuple[int, ...], ...]:
    out = []
    for part in parts:
        start = 0
        for size in zero3_sub_groups(part, sub_group_size):
            end, total = start, 0
            while total < size:
                total += part[end]
                end += 1
            out.append(tuple(part[start:end]))
            start = end
    return tuple(out)


def _sub_group_optimizer_buffers(
    state: int, subs: list[int], master: str, moments: str, gradient: str
) -> list[HostBuffer]:
    """What CPU Adam keeps in host RAM for these ZeRO-3 sub-groups (elements each), under these labels.

    stage3.py 1157-1160 (`_create_fp32_partitions`): the master of each sub-group, a pageable copy in
    the master dtype; cpu_adam.py 161-164: m and v, pageable, at the first step; stage3.py 1337-1342:
    each sub-group's gradient in the master dtype, pinned on its own.
    """
    return [
        HostBuffer("offloaded_optimizer_states", master, tuple(state * s for s in subs), how="pageable"),
        HostBuffer(
            "offloaded_optimizer_states",
            moments,
            tuple(state * s for s in subs for _ in (0, 1)),
            how="pageable",
            released=True,
        ),
        HostBuffer("offloaded_fp32_gradients", gradient, tuple(state * s for s in subs)),
    ]


def _step_transient(rank: OffloadRank, largest: int) -> list[HostBuffer]:
    # stage3.py 2860 (`_reassign_or_swap_out_partitioned_parameters`) copies the updated master of a
    # sub-group into the 16-bit partition on the GPU; a blocking copy that changes dtype converts on
    # the CPU first (ATen cuda/Copy.cu `copy_kernel_cuda`): one 16-bit temporary of the sub-group.
    # With the parameters offloaded the destination is on the CPU: no temporary.
    if rank.state_bytes == rank.model_bytes or rank.params_offloaded:
        return []
    return [
        HostBuffer(
            "optimizer_step_transient",
            "16-bit copy of one sub-group on its way to the GPU (stage3.py 2860)",
            (rank.model_bytes * largest,),
            how="pageable",
            step_only=True,
            rewritten=False,
        )
    ]


def cpu_optimizer_buffers(rank: OffloadRank) -> list[HostBuffer]:
    """Host allocations of one rank's `offload_optimizer: cpu` (module docstring for the facts)."""
    state, low = rank.state_bytes, rank.model_bytes
    if rank.zero_stage == 3:
        subs = rank.sub_groups()
        elements = sum(subs)
        return [
            *_sub_group_optimizer_buffers(
                state,
                subs,
                "master weights (stage3.py 1157)",
                "Adam m and v (cpu_adam.py 161)",
                "master-dtype gradient per sub-group (stage3.py 1337)",
            ),
            # stage3.py 791-795: one flat buffer of every partition's 16-bit gradient, pinned.
            HostBuffer(
                "offload_16bit_buffers",
                "flat 16-bit gradient partitions (stage3.py 791)",
                (low * elements,),
            ),
            *_step_transient(rank, max(subs)),
        ]
    # ZeRO-1/2 flatten each parameter group and partition it whole (stage_1_and_2.py).
    groups = rank.trainable_groups()
    parts = [math.ceil(sum(n / rank.shard for n in g) / rank.partitions) for g in groups]
    largest = max(max(g) for g in groups) / rank.shard
    buffers = [
        # 559-565: the master partition, pinned; 934-941: its gradient, pinned; cpu_adam.py: m and v.
        HostBuffer(
            "offloaded_optimizer_states",
            "master weights (stage_1_and_2.py 559)",
            tuple(state * p for p in parts),
        ),
        HostBuffer(
            "offloaded_optimizer_states",
            "Adam m and v (cpu_adam.py 161)",
            tuple(state * p for p in parts for _ in (0, 1)),
            how="pageable",
            released=True,
        ),
        HostBuffer(
            "offloaded_fp32_gradients",
            "gradient partition (stage_1_and_2.py 934)",
            tuple(state * p for p in parts),
        ),
        # 566-575: a 16-bit copy of the partition (the step writes it, then sends it to the GPU);
        # 656-658: a staging buffer as large as the largest trainable tensor; both pinned.
        HostBuffer(
            "offload_16bit_buffers",
            "16-bit copy of the partition (stage_1_and_2.py 566)",
            tuple(low * p for p in parts),
        ),
        HostBuffer(
            "offload_16bit_buffers",
            "staging buffer (stage_1_and_2.py 656)",
            (low * largest,),
            rewritten=False,
        ),
    ]
    if rank.grad_accum > 1 and state == 4:
        # 1822-1826: with accumulation, a pinned 16-bit buffer per tensor of the partition (about
        # 1/partitions of them, each whole).
        every = [n / rank.shard for g in groups for n in g]
        share = every[: math.ceil(len(every) / rank.partitions)] if rank.partitions > 1 else every
        buffers.append(
            HostBuffer(
                "offload_16bit_buffers",
                "accumulation buffers (stage_1_and_2.py 1822)",
                tuple(low * n for n in share),
            )
        )
    return buffers


def nvme_optimizer_buffers(rank: OffloadRank) -> list[HostBuffer]:
    """Host allocations of one rank's `offload_optimizer: nvme` (ZeRO-3; module docstring, fact 5)."""
    state, low, swap = rank.state_bytes, rank.model_bytes, rank.swap
    subs = rank.sub_groups()
    swapped = [s for s in subs if s * state >= max(MIN_AIO_BYTES, swap.block_size)]
    kept = [s for s in subs if s * state < max(MIN_AIO_BYTES, swap.block_size)]
    buffers = [
        HostBuffer(
            "offload_16bit_buffers", "flat 16-bit gradient partitions (stage3.py 791)", (low * sum(subs),)
        )
    ]
    if swapped:
        # optimizer_utils.py 183-191: SwapBufferManager of buffer_count buffers of the largest sub-group,
        # aligned for the I/O threads; allocated by the aio handle, always mlocked.
        alignment = AIO_ALIGNED_BYTES * swap.intra_op_parallelism // state
        largest = math.ceil(max(swapped) / alignment) * alignment
        buffers.append(
            HostBuffer(
                "optimizer_swap_buffers",
                f"{swap.buffer_count} swap buffers of the largest sub-group (swap_tensor/utils.py 192)",
                (state * largest,) * swap.buffer_count,
                how="locked",
            )
        )
    if kept:
        # Sub-groups too small to swap stay in host RAM like CPU offload's (stage3.py 1160, 1337).
        buffers += _sub_group_optimizer_buffers(
            state,
            kept,
            "master of unswapped sub-groups",
            "Adam m and v of unswapped sub-groups",
            "gradient of unswapped sub-groups",
        )
    return [*buffers, *_step_transient(rank, max(subs))]


def nvme_optimizer_bytes(rank: OffloadRank) -> float:
    """Drive bytes of one rank's swapped optimizer: master, m and v of each swapped sub-group, and the
    gradient of each of its tensors that is itself large enough to swap (a smaller tensor's gradient
    waits in host RAM: optimizer_utils.py `_swap_out_gradients`, `unswapped_gradients`). Every step
    reads these bytes and writes them back."""
    swap = rank.swap
    return _swapped_bytes(
        rank.sub_group_members(), rank.state_bytes, swap.intra_op_parallelism, swap.block_size
    )


@functools.lru_cache(maxsize=1024)
def _swapped_bytes(
    sub_groups: tuple[tuple[int, ...], ...], state: int, intra_op_parallelism: int, block_size: int
) -> float:
    alignment = AIO_ALIGNED_BYTES * intra_op_parallelism // state
    floor = max(MIN_AIO_BYTES, block_size)
    total = 0.0
    for members in sub_groups:
        if sum(members) * state < floor:
            continue
        total += (SWAP_BUFFERS_PER_SUB_GROUP - 1) * state * math.ceil(sum(members) / alignment) * alignment
        total += state * sum(n for n in members if n * state >= floor)
    return total


def cpu_parameter_buffers(rank: OffloadRank) -> list[HostBuffer]:
    """Host allocations of one rank's `offload_param: cpu` (ZeRO-3): the 16-bit parameter partitions.

    zero.Init gives every tensor's partition its own pinned block, the small ones ZeRO-3 keeps whole
    on the GPU included (runtime/zero/partition_parameters.py 1829-1843: measured, 9 norm blocks of
    tiny-cpu); the optimizer then moves the trainable ones into one flat pinned buffer per parameter
    group (stage3.py 906-907 and 881-883, `_move_to_flat_buffer`). The blocks it leaves stay
    allocated when pinned: torch's pinned cache keeps them (fact 1), and under native pinning they
    are still referenced (measured on CPU: all 39 blocks of tiny-cpu alive after the optimizer's
    set-up). Unpinned they are freed, and only the frozen tensors' blocks (LoRA's base) remain. An nf4
    base's blocks hold its packed codes (`stored_tensors`): a quarter of the elements in bf16 storage.
    """
    low = rank.model_bytes
    parts = rank.parts()
    every, trainable = _parameter_blocks(
        parts, rank.shape, rank.quantize, low, bool(rank.lora_rank), rank.shard, rank.partitions
    )
    blocks = every if rank.param_pinning != "off" else every[: len(every) - trainable]
    buffers = [
        HostBuffer(
            "offloaded_parameters",
            "flat 16-bit parameter partitions (stage3.py 906)",
            tuple(low * sum(g) for g in parts),
            section="param",
        ),
    ]
    if blocks:
        buffers.append(
            HostBuffer(
                "offloaded_parameters",
                "zero.Init's per-tensor blocks (partition_parameters.py 1843)",
                tuple(low * n for n in blocks),
                section="param",
                rewritten=False,
            )
        )
    return buffers


@functools.lru_cache(maxsize=1024)
def _parameter_blocks(
    parts: tuple[tuple[int, ...], ...],
    shape: ModelShape,
    quantize: str,
    storage_bytes: int,
    lora: bool,
    shard: int,
    partitions: int,
) -> tuple[tuple[int, ...], int]:
    """zero.Init's blocks of one rank (elements each), and how many of them (the last ones) hold trainable
    tensors (`parts`: the trainable tensors' partitions)."""
    trainable = [n for group in parts for n in group]
    every = [_part(n, shard, partitions) for n in stored_tensors(shape, quantize, storage_bytes)]
    if lora:
        every += trainable  # LoRA's adapters are created after the base model, outside zero.Init's blocks
    return tuple(every), len(trainable)


def loader_fork_copies(rank: OffloadRank, buffers: list[HostBuffer]) -> float:
    """Fact 4, for a resumed run (m and v exist before the fork too): the worst case is every private
    page the optimizer rewrites held twice."""
    if not rank.loader_forks:
        return 0.0
    return sum(b.fork_copied(rank.pinning_of(b)) for b in buffers if not b.step_only)
