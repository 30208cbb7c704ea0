"""Per-GPU, host-RAM and NVMe memory estimate for one training configuration.

Used by `llm-train plan` and `--dry-run` to say, before any weights load, whether a
recipe fits the user's GPUs and host RAM. Pure arithmetic: no torch or deepspeed
import, so it answers in milliseconds.

Conventions (read this before comparing numbers with other tools)
-----------------------------------------------------------------
Model states. We count mixed-precision Adam at **16 bytes per parameter**:
2 (16-bit weights) + 2 (16-bit gradients) + 12 (fp32 master weights, Adam m and v).
That is the accounting of the ZeRO paper (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", section 3.1: "2Psi + 2Psi +
K*Psi with K = 12"), and `zero_paper_model_states` reproduces its worked example
(7.5B parameters, 64 GPUs: 120 / 31.4 / 16.6 / 1.9 GB for stages 0-3). Pure fp32
training is 4 + 4 + 8 = 16 bytes too, split differently (no separate master copy).

DeepSpeed's own estimators (`estimate_zero2_model_states_mem_needs`,
`estimate_zero3_model_states_mem_needs`) count **18** bytes per parameter: they add
4 bytes of fp32 gradients, because DeepSpeed's optimizers upcast the gradient
partition to fp32 before the Adam step (and ZeRO-Offload keeps that fp32 gradient
next to the optimizer state on the host). On the GPU without offload that fp32
partition is transient (allocated for the step, then freed), so we leave it out of
the steady-state GPU terms and let the allocator slack cover it; on the host, under
offload, it is persistent and we do count it (`offloaded_fp32_gradients`), which
makes our host numbers agree with DeepSpeed's (16 bytes/param of optimizer + fp32
gradient, +2 when parameters are offloaded too), minus its 1.5x buffer factor.
`deepspeed_zero2_model_states` / `deepspeed_zero3_model_states` reproduce DeepSpeed's
functions exactly for anyone who wants that convention.

Activations. Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", section 4): per layer s*b*h*(34 + 5*a*s/h) bytes with eager
attention; with tensor parallel degree t and no sequence parallelism (DeepSpeed
AutoTP has none) s*b*h*(10 + 24/t + 5*a*s/(h*t)): the 10 (layer-norm inputs,
dropout masks, residual) is replicated on every TP rank. SDPA / FlashAttention
never keep the s x s score matrix, which removes the 5*a*s/h term. Full activation
checkpointing keeps only each layer's 16-bit input (2*s*b*h) plus one layer's full
activations while it is recomputed. The formula assumes a 4h GeLU MLP and dropout;
Llama-style SwiGLU MLPs keep a little more and dropout-free models a little less;
it is within ~15% either way, which is the precision this estimate claims.

Low-precision optimizer states (`state_dtype="bf16"`, DeepSpeed's bf16_master_weights_and_grads +
bf16_optimizer_states, CPU offload only): the offloaded master weights, Adam m and v are 2 bytes
each instead of 4 (6 instead of 12 per parameter) and the host gradient partition is bf16 (2
instead of 4): 8 bytes per offloaded parameter on the host instead of 16.

Export. At the end of a run (runtime/zero_engine.py `export`) rank 0 holds the gathered 16-bit
model on the CPU (Accelerate's get_state_dict: ZeRO-3's consolidated 16-bit state dict, or a CPU
clone of the module's); `save_hf_model` writes it without another copy (it clones only tensors
that share storage). Before gathering, every rank frees its Adam moments (runtime/optim.py
`release_moments`: the final checkpoint is committed, the run is over), two thirds of the
offloaded optimizer state. The export phase is therefore the training phase, less the
offloaded moments, plus the gathered copy; the host peak is the larger of the phases.

Units: bytes everywhere; `GiB` (2**30) in tables. GPU terms are per GPU (the
busiest one: first pipeline stage); host terms and NVMe are per node.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from llm_train.config.ds_json import zero_bucket_sizes
from llm_train.config.layout import Layout, LayoutError, state_dtype_problem
from llm_train.errors import UserError
from llm_train.planning.shapes import ModelShape

GiB = 1024**3

# CUDA context (driver, cuBLAS/cuDNN handles, NCCL communicators) that `torch.cuda`
# never reports as allocated: ~0.3-0.6 GiB on Hopper/Ada with recent CUDA.
CUDA_CONTEXT_BYTES = GiB // 2
# PyTorch's caching allocator rounds blocks and fragments under the changing
# activation shapes of training; 5-15% over live tensors is typical, we take 10%.
ALLOCATOR_SLACK_FRACTION = 0.10
# Host RSS of one training process before any model state: Python, torch + CUDA
# libraries, DeepSpeed, tokenizer and data loader. Rough (2-4 GiB measured typically).
PROCESS_HOST_BYTES = 3 * GiB
# Of the offloaded optimizer state (master weights, Adam m and v, all one dtype), the part
# runtime/optim.py `release_moments` frees before the export: m and v.
ADAM_MOMENT_SHARE = 2 / 3
# Hugging Face's default `max_shard_size` when checkpoints are saved ("5GB").
# With zero.Init each rank reads one shard at a time into CPU memory, partitions
# it, and frees it, so the load peak per rank is one shard, not the model.
CHECKPOINT_SHARD_BYTES = 5 * 10**9
# DeepSpeed's "overlap_comm uses 4.5x the allgather_bucket_size and
# reduce_bucket_size values" (its ZeRO config documentation).
OVERLAP_COMM_FACTOR = 4.5
# DeepSpeed defaults (deepspeed/runtime/zero/config.py, offload_config.py, engine).
DS_ALLREDUCE_BUCKET_SIZE = 500_000_000  # stage 0 gradient all-reduce bucket (elements)
DS_ALLGATHER_BUCKET_SIZE = 500_000_000  # stage 1/2 (HF's "auto" does not touch it)
DS_SUB_GROUP_SIZE = 1_000_000_000
DS_NVME_OPTIMIZER_BUFFER_COUNT = 4  # offload_optimizer.buffer_count
DS_NVME_PARAM_BUFFER_COUNT = 5  # offload_param.buffer_count
DS_NVME_PARAM_BUFFER_SIZE = 100_000_000  # offload_param.buffer_size (elements)

ATTN_IMPLS = ("sdpa", "flash_attention_2", "eager")


class MemoryInputError(UserError, ValueError):
    """An impossible or unsupported combination of memory-plan inputs."""


# --- the ZeRO paper and DeepSpeed conventions, for reference and cross-checks ----------------------


def zero_paper_model_states(params: float, dp: int, stage: int) -> float:
    """Bytes of model states per GPU, ZeRO paper Figure 1 convention (16 bytes/param, K = 12).

    Stage 0: 16 P; 1 (P_os): 4 P + 12 P/dp; 2 (P_os+g): 2 P + 14 P/dp; 3 (P_os+g+p): 16 P/dp.
    """
    k = 12
    if stage == 0:
        return (2 + 2 + k) * params
    if stage == 1:
        return (2 + 2) * params + k * params / dp
    if stage == 2:
        return 2 * params + (2 + k) * params / dp
    if stage == 3:
        return (2 + 2 + k) * params / dp
    raise MemoryInputError(f"zero stage must be 0, 1, 2 or 3, got {stage}")


def deepspeed_zero2_model_states(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int]:
    """(cpu_bytes, gpu_bytes): exactly `deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs`.

    Same expressions in the same order so float rounding matches bit for bit.
    cpu_bytes is per node; gpu_bytes per GPU. Counts 18 bytes/param (see module doc).
    """
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def deepspeed_zero3_model_states(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int, int]:
    """(cpu_bytes, gpu_bytes, largest_layer_bytes): exactly DeepSpeed's `estimate_zero3_model_states_mem_needs`.

    Mirrors deepspeed/runtime/zero/stage3.py expression by expression, including its
    third return value (4 bytes per parameter of the largest layer, gathered on GPU).
    """
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params

    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            if zero_init:
                cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = (
                    total_params * max(4 * num_gpus_per_node, 18 * gpus_factor) * additional_buffer_factor
                )
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            if zero_init:
                cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = (
                    total_params * max(4 * num_gpus_per_node, 16 * gpus_factor) * additional_buffer_factor
                )
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


# --- activations --------------------------------------------------------------------------------


def activation_bytes_per_layer(
    shape: ModelShape, seq_len: int, micro_batch: int, attn_impl: str = "sdpa", tp: int = 1
) -> float:
    """Korthikanti et al. 2022 per-layer activations (16-bit), without recomputation.

    eager: s*b*h*(10 + 24/t + 5*a*s/(h*t)); sdpa / flash_attention_2: s*b*h*(10 + 24/t).
    At t = 1 these are the familiar s*b*h*(34 + 5*a*s/h) and 34*s*b*h.
    """
    s, b, h, a = seq_len, micro_batch, shape.hidden_size, shape.num_heads
    per_token_coeff = 10 + 24 / tp
    if attn_impl == "eager":
        # The s x s attention scores, softmax output and dropout mask of every head.
        per_token_coeff += 5 * a * s / (h * tp)
    elif attn_impl not in ATTN_IMPLS:
        raise MemoryInputError(f"attn_impl must be one of {', '.join(ATTN_IMPLS)}, got '{attn_impl}'")
    return s * b * h * per_token_coeff


def logits_bytes(shape: ModelShape, seq_len: int, micro_batch: int) -> int:
    """Logits upcast to fp32 for the loss (vocab*s*b*4), times 2 for their gradient.

    Not sharded by tensor parallelism (AutoTP leaves lm_head whole) and not
    chunked (HF computes the full logits tensor before the loss).
    """
    return shape.vocab_size * seq_len * micro_batch * 4 * 2


# --- the estimator ------------------------------------------------------------------------------


# Layout rules broken through MemoryInputs.of, told in its argument names (keyed by LayoutError.rule).
_API_MESSAGES = {
    "degrees": "world_size {world_size} is not divisible by tp*pp = {tp}*{pp}; world_size = dp * tp * pp",
    "params": "offload_params needs zero_stage 3 (only ZeRO-3 partitions parameters)",
    "optimizer": "offload_optimizer needs zero_stage 1, 2 or 3",
    "nvme_optimizer": "offload_optimizer 'nvme' needs zero_stage 3 (use 'cpu' with stage 1/2)",
}
STATE_DTYPES = ("fp32", "bf16")
_STATE_DTYPE_MESSAGES = {
    "state_precision": "state_dtype 'bf16' needs precision 'bf16'",
    "state_pipeline": "state_dtype 'bf16' is not supported with pp > 1",
    "state_offload": "state_dtype 'bf16' needs offload_optimizer 'cpu' (DeepSpeed's CPU Adam keeps them)",
    "state_nvme": "state_dtype 'bf16' needs offload_optimizer 'cpu', not 'nvme'",
}
_LAYOUT_FIELDS = {
    "zero_stage",
    "offload_optimizer",
    "offload_params",
    "precision",
    "micro_batch_size",
    "grad_accum",
}


@dataclass(frozen=True)
class MemoryInputs:
    """One training configuration, as far as memory is concerned."""

    shape: ModelShape
    layout: Layout
    """World, degrees, ZeRO stage, offload, precision and batch (config.layout checks their rules)."""
    gpus_per_node: int | None = None
    """GPUs (ranks) per node; None = min(world_size, 8)."""
    seq_len: int = 2048
    activation_checkpointing: bool = False
    attn_impl: str = "sdpa"
    lora_rank: int | None = None
    """LoRA rank on q,k,v,o,gate,up,down; the base model is frozen. None = full fine-tune."""
    reduce_bucket_size: int | None = None
    """Elements; None = hidden*hidden (HF's "auto")."""
    prefetch_bucket_size: int | None = None
    """ZeRO-3 elements; None = int(0.9*hidden*hidden) (HF's "auto")."""
    overlap_comm: bool = True
    allgather_bucket_size: int = DS_ALLGATHER_BUCKET_SIZE
    """ZeRO-1/2 elements; DeepSpeed's default, HF's "auto" does not set it."""
    param_persistence_threshold: int | None = None
    """ZeRO-3: tensors below this many elements stay whole on every GPU; None = 10*hidden."""
    sub_group_size: int = DS_SUB_GROUP_SIZE
    zero_init: bool | None = None
    """Model built under deepspeed.zero.Init; None = (zero_stage == 3)."""
    state_dtype: str = "fp32"
    """Offloaded master weights, gradients and Adam states: "fp32", or "bf16" (optim.state_dtype)."""
    export_adapter_only: bool = False
    """LoRA runs that export only the adapter (lora.export=adapter): no merged copy of the model."""

    def __post_init__(self) -> None:
        buckets = zero_bucket_sizes(self.shape.hidden_size)
        # Resolve the "auto" defaults once, so every reader sees concrete numbers.
        if self.gpus_per_node is None:
            object.__setattr__(self, "gpus_per_node", min(self.world_size, 8))
        if self.reduce_bucket_size is None:
            object.__setattr__(self, "reduce_bucket_size", buckets["reduce_bucket_size"])
        if self.prefetch_bucket_size is None:
            object.__setattr__(self, "prefetch_bucket_size", buckets["stage3_prefetch_bucket_size"])
        if self.param_persistence_threshold is None:
            object.__setattr__(
                self, "param_persistence_threshold", buckets["stage3_param_persistence_threshold"]
            )
        if self.zero_init is None:
            object.__setattr__(self, "zero_init", self.zero_stage == 3)
        self._validate()

    def _validate(self) -> None:
        for name in ("seq_len", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise MemoryInputError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.attn_impl not in ATTN_IMPLS:
            raise MemoryInputError(
                f"attn_impl must be one of {', '.join(ATTN_IMPLS)}, got '{self.attn_impl}'"
            )
        if self.lora_rank is not None and self.lora_rank < 1:
            raise MemoryInputError(f"lora_rank must be >= 1 or None, got {self.lora_rank}")
        if self.state_dtype not in STATE_DTYPES:
            raise MemoryInputError(
                f"state_dtype must be one of {', '.join(STATE_DTYPES)}, got '{self.state_dtype}'"
            )
        # The recipe's own rule (config.layout), so the planner never proposes what a run refuses.
        broken = state_dtype_problem(self.state_dtype, self.precision, self.offload_optimizer, self.pp)
        if broken is not None:
            raise MemoryInputError(_STATE_DTYPE_MESSAGES[broken])

    @classmethod
    def of(
        cls,
        shape: ModelShape,
        world_size: int,
        tp: int = 1,
        pp: int = 1,
        zero_stage: int = 0,
        offload_optimizer: str = "none",
        offload_params: str = "none",
        precision: str = "bf16",
        micro_batch: int = 1,
        grad_accum: int = 1,
        **rest: Any,
    ) -> MemoryInputs:
        """Inputs from the layout's fields spelled out (the planner's API and its tests)."""
        try:
            layout = Layout(
                world_size=world_size,
                tp=tp,
                pp=pp,
                zero_stage=zero_stage,
                offload_optimizer=offload_optimizer,
                offload_params=offload_params,
                precision=precision,
                micro_batch_size=micro_batch,
                grad_accum=grad_accum,
            )
        except LayoutError as exc:
            raise MemoryInputError(_API_MESSAGES.get(exc.rule, str(exc)).format(**locals())) from None
        return cls(shape=shape, layout=layout, **rest)

    def vary(self, **changes: Any) -> MemoryInputs:
        """These inputs with layout fields and/or memory techniques changed (the planner's candidates)."""
        layout_changes = {k: changes.pop(k) for k in list(changes) if k in _LAYOUT_FIELDS}
        layout = self.layout
        if layout_changes:
            try:
                layout = layout.vary(**layout_changes)
            except LayoutError as exc:
                raise MemoryInputError(str(exc)) from None
        return dataclasses.replace(self, layout=layout, **changes)

    @property
    def ds_key(self) -> tuple[int, str, str]:
        """(ZeRO stage, optimizer offload, parameter offload): which shipped DS JSON it needs."""
        return (self.zero_stage, self.offload_optimizer, self.offload_params)

    @property
    def knobs(self) -> tuple[Any, ...]:
        """What the planner turns: the DS JSON, micro-batch and accumulation, checkpointing, LoRA, state dtype."""
        return (
            self.ds_key,
            self.micro_batch,
            self.grad_accum,
            self.activation_checkpointing,
            self.lora_rank,
            self.state_dtype,
        )

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in (self.offload_optimizer, self.offload_params)

    # The layout's fields, read as the estimator reads them.
    world_size = property(lambda self: self.layout.world_size)
    tp = property(lambda self: self.layout.tp)
    pp = property(lambda self: self.layout.pp)
    dp = property(lambda self: self.layout.dp)
    zero_stage = property(lambda self: self.layout.zero_stage)
    offload_optimizer = property(lambda self: self.layout.offload_optimizer)
    offload_params = property(lambda self: self.layout.offload_params)
    precision = property(lambda self: self.layout.precision)
    micro_batch = property(lambda self: self.layout.micro_batch_size)
    grad_accum = property(lambda self: self.layout.grad_accum)

    @property
    def ranks_per_node(self) -> int:
        assert self.gpus_per_node is not None
        return min(self.gpus_per_node, self.world_size)

    @property
    def num_nodes(self) -> int:
        return math.ceil(self.world_size / self.ranks_per_node)


_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_states": "optimizer states",
    "activations": "activations",
    "logits_and_loss": "logits and loss",
    "deepspeed_buffers": "DeepSpeed buffers",
    "cuda_context_and_slack": "CUDA context + allocator slack",
    "offloaded_optimizer_states": "offloaded optimizer states (pinned)",
    "offloaded_fp32_gradients": "offloaded gradients (pinned)",
    "optimizer_swap_buffers": "optimizer NVMe swap buffers (pinned)",
    "offloaded_parameters": "offloaded parameters (pinned)",
    "param_swap_buffers": "parameter NVMe swap buffers (pinned)",
    "process_overhead": "processes (torch, CUDA libs, Python)",
    "model_load_peak": "model load peak (transient)",
    "export_peak": "final export: gathered model (transient)",
}


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

    def table(self) -> list[tuple[str, str]]:
        rows = [(f"GPU {_LABELS.get(k, k)}", _gib(v)) for k, v in self.gpu_terms.items()]
        rows.append(("GPU total (per GPU)", _gib(self.gpu_bytes)))
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
    """Estimate GPU (per GPU), host RAM and NVMe (per node) bytes for `inp`."""
    shape = inp.shape
    h = shape.hidden_size
    assert inp.reduce_bucket_size is not None and inp.prefetch_bucket_size is not None
    assert inp.param_persistence_threshold is not None
    stage, dp, ranks = inp.zero_stage, inp.dp, inp.ranks_per_node
    mixed = inp.precision != "fp32"
    weight_bytes = 2 if mixed else 4  # the frozen LoRA base too: it is loaded in the training dtype
    grad_bytes = weight_bytes
    optim_bytes = 12 if mixed else 8  # fp32 master + m + v, or just m + v when weights are fp32
    host_grad_bytes = 4  # CPU Adam's fp32 copy of the gradient partition
    if inp.state_dtype == "bf16":
        # bf16 master + m + v, and the host gradient partition in bf16 (offloaded optimizer only).
        optim_bytes, host_grad_bytes = 6, 2

    # tp and pp split the model between GPUs before ZeRO partitions it over dp.
    # Approximation: an even split (embeddings and lm_head really sit on the first /
    # last pipeline stage, and AutoTP leaves norms and embeddings whole).
    shard = inp.tp * inp.pp
    base = shape.num_params / shard
    adapters = shape.lora_params(inp.lora_rank) / shard if inp.lora_rank else 0.0
    weights = base + adapters
    trainable = adapters if inp.lora_rank else base
    # ZeRO-3 keeps tensors under the persistence threshold (norms, Qwen's q/k/v
    # biases) whole on every GPU.
    persistent = shape.small_tensor_params(inp.param_persistence_threshold) / shard if stage == 3 else 0.0
    partitioned = weights - persistent
    offload_opt = inp.offload_optimizer != "none"

    # -- GPU: model states
    if stage == 3:
        on_gpu_weights = persistent + (0.0 if inp.offload_params != "none" else partitioned / dp)
    else:
        on_gpu_weights = weights
    params_gpu = on_gpu_weights * weight_bytes

    # Under ZeRO-2/3 offload, gradients stream through the reduce buckets to the host
    # optimizer. Stage 1 with offload is counted as keeping its full 16-bit gradients
    # until the step (conservative: DeepSpeed's estimator only covers stage 2).
    grads_gpu = 0.0 if stage >= 2 and offload_opt else trainable * grad_bytes / (dp if stage >= 2 else 1)
    optim_gpu = 0.0 if offload_opt else trainable * optim_bytes / (dp if stage >= 1 else 1)

    # -- GPU: activations. Under 1F1B the first pipeline stage holds pp micro-batches in flight.
    layers_per_stage = math.ceil(shape.num_layers / inp.pp)
    in_flight = inp.pp
    full_layer = activation_bytes_per_layer(shape, inp.seq_len, inp.micro_batch, inp.attn_impl, inp.tp)
    if inp.activation_checkpointing:
        # Each layer keeps its 16-bit input (replicated across tp: no sequence parallel);
        # in backward one layer at a time is recomputed with its full activations.
        checkpointed = 2 * inp.seq_len * inp.micro_batch * h
        activations = layers_per_stage * in_flight * checkpointed + full_layer
    else:
        activations = layers_per_stage * in_flight * full_layer
    # Logits live on the last pipeline stage; adding them to the first stage's
    # activations over-counts a little when pp > 1 (conservative).
    logits = logits_bytes(shape, inp.seq_len, inp.micro_batch)

    # -- GPU: DeepSpeed communication buffers (elements x bytes), capped by what they can cover.
    overlap = OVERLAP_COMM_FACTOR if inp.overlap_comm else 1.0
    if stage == 0:
        # The engine flattens up to allreduce_bucket_size gradients per all-reduce.
        buffers = min(DS_ALLREDUCE_BUCKET_SIZE, trainable) * grad_bytes if dp > 1 else 0.0
    elif stage in (1, 2):
        # Stage 1/2 all-gather only the updated (trainable) partitions; frozen LoRA bases stay put.
        elems = min(inp.reduce_bucket_size, trainable) + min(inp.allgather_bucket_size, trainable)
        buffers = elems * weight_bytes * overlap
    else:
        elems = min(inp.reduce_bucket_size, trainable) + min(inp.prefetch_bucket_size, weights)
        buffers = elems * weight_bytes * overlap
        if dp > 1 or inp.offload_params != "none" or offload_opt:
            # The module being computed is gathered whole, and its full gradient exists
            # before reduce-scatter: DeepSpeed's 4 * largest_layer_params at 16 bit.
            buffers += 2 * weight_bytes * shape.largest_layer_params / inp.tp

    gpu_terms: dict[str, float] = {
        "parameters": params_gpu,
        "gradients": grads_gpu,
        "optimizer_states": optim_gpu,
        "activations": activations,
        "logits_and_loss": logits,
        "deepspeed_buffers": buffers,
    }
    gpu_terms["cuda_context_and_slack"] = CUDA_CONTEXT_BYTES + ALLOCATOR_SLACK_FRACTION * sum(
        gpu_terms.values()
    )

    # -- host (per node: `ranks` processes share it)
    opt_part = trainable / dp  # this rank's optimizer partition (elements)
    host: dict[str, float] = {
        "offloaded_optimizer_states": 0.0,
        "offloaded_fp32_gradients": 0.0,
        "optimizer_swap_buffers": 0.0,
        "offloaded_parameters": 0.0,
        "param_swap_buffers": 0.0,
    }
    nvme = 0.0
    if inp.offload_optimizer == "cpu":
        host["offloaded_optimizer_states"] = ranks * opt_part * optim_bytes
        # CPU Adam steps on an fp32 (bf16 with bf16 states) copy of the gradient partition on the host.
        host["offloaded_fp32_gradients"] = ranks * opt_part * host_grad_bytes
    elif inp.offload_optimizer == "nvme":
        nvme += ranks * opt_part * (optim_bytes + 4)
        # Pinned swap-in/out buffers, each as large as the biggest optimizer sub-group.
        host["optimizer_swap_buffers"] = (
            ranks * DS_NVME_OPTIMIZER_BUFFER_COUNT * min(inp.sub_group_size, opt_part) * 4
        )
    if inp.offload_params == "cpu":
        host["offloaded_parameters"] = ranks * partitioned / dp * weight_bytes
    elif inp.offload_params == "nvme":
        nvme += ranks * partitioned / dp * weight_bytes
        # DeepSpeed requires buffer_size >= the largest parameter tensor, so the
        # configured 1e8 grows to vocab*hidden for these models.
        buffer_elems = max(DS_NVME_PARAM_BUFFER_SIZE, shape.largest_layer_params / inp.tp)
        host["param_swap_buffers"] = ranks * DS_NVME_PARAM_BUFFER_COUNT * buffer_elems * weight_bytes
    host["process_overhead"] = ranks * PROCESS_HOST_BYTES
    full_model = shape.num_params * weight_bytes
    if inp.zero_init:
        # zero.Init: no rank materialises the model; each reads one checkpoint shard
        # at a time, keeps its partition and frees the rest.
        host["model_load_peak"] = ranks * min(CHECKPOINT_SHARD_BYTES, full_model)
    elif inp.pp > 1:
        # A pipeline stage is built as its own module (~1/pp of the layers) and reads only its
        # tensors from the checkpoint, one at a time; the first and last stages also hold the
        # embedding or the head, hence one largest tensor on top. (init: random builds the whole
        # model once per rank instead; that path is for tiny test models.)
        stage = full_model / inp.pp + shape.largest_layer_params * weight_bytes
        host["model_load_peak"] = ranks * min(full_model, stage)
    else:
        # Without zero.Init every rank on the node loads the full 16-bit model on the
        # CPU before DeepSpeed moves it to the GPU (the classic host-RAM OOM at load).
        host["model_load_peak"] = ranks * full_model

    host["export_peak"] = export_peak_bytes(inp)

    # Load and training phases do not overlap: without zero.Init the CPU copy is
    # gone before the optimizer states are allocated; with it, offloaded parameter
    # partitions already sit in host RAM while the shards stream in. The export comes
    # at the end of training, with every training-phase buffer still allocated.
    load_phase = host["model_load_peak"] + (host["offloaded_parameters"] if inp.zero_init else 0.0)
    train_phase = sum(
        v for k, v in host.items() if k not in ("model_load_peak", "process_overhead", "export_peak")
    )
    moments = ADAM_MOMENT_SHARE * host["offloaded_optimizer_states"]  # freed before the export
    export_phase = train_phase - moments + host["export_peak"]
    host_total = host["process_overhead"] + max(load_phase, train_phase, export_phase)

    gpu_int = {k: int(v) for k, v in gpu_terms.items()}
    return MemoryEstimate(
        gpu_terms=gpu_int,
        host_terms={k: int(v) for k, v in host.items()},
        nvme_bytes=int(nvme),
        gpu_bytes=sum(gpu_int.values()),
        host_bytes=int(host_total),
        convention=CONVENTION,
    )


def export_peak_bytes(inp: MemoryInputs) -> float:
    """Host bytes the final export adds on the busiest node (see the module docstring).

    ZeRO engine: rank 0 holds the gathered 16-bit model, which save_hf_model writes as it is: one
    copy of the whole model. LoRA merged: a second, since lora.merged_state_dict builds new
    tensors for every adapted projection (nearly all the weights); LoRA adapter: the gathered
    model only (the adapters are tiny). Pipeline engine: each stage's data-parallel rank 0
    copies its stage's weights to the CPU once (pipeline_model.stage_hf_state).
    """
    full_model = inp.shape.num_params * (2 if inp.precision != "fp32" else 4)
    if inp.pp > 1:
        return min(inp.pp, inp.ranks_per_node) * full_model / inp.pp
    if inp.lora_rank:
        return (1.0 if inp.export_adapter_only else 2.0) * full_model
    return 1.0 * full_model
