"""The memory estimate's inputs: one training configuration as far as memory is concerned.

`MemoryInputs` holds the layout (config.layout: world, degrees, ZeRO stage, offload, precision,
batch) and the memory techniques, resolves DeepSpeed's and Hugging Face's "auto" defaults to
numbers, and refuses, as a `MemoryInputError`, every combination a run would refuse, so the
planner never proposes one. planning/memory/estimate.py turns it into bytes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from llm_train.config.attention_kernel import FLEX_KERNELS, KERNELS
from llm_train.config.ds_json import zero_bucket_sizes
from llm_train.config.layout import (
    EIGHT_BIT_OPTIMIZERS,
    Layout,
    LayoutError,
    optimizer_problem,
    quantized_layout_problem,
    sequence_parallel_message,
    sequence_parallel_problem,
    state_dtype_problem,
)
from llm_train.config.recipe_sections import MemorySection
from llm_train.errors import UserError
from llm_train.planning.memory.generation import GenerationInputs
from llm_train.planning.memory.offload_buffers import PINNINGS, SwapSettings
from llm_train.planning.memory.quantized_bytes import QUANTIZE_DEVICES, QUANTIZE_MODES
from llm_train.planning.model.shapes import LORA_TARGETS, ModelShape
from llm_train.planning.model.vision_shapes import VisionInputs

# The recipe schema's memory switches: the estimate's defaults are the run's (one source of truth; a test
# ties them, tests/unit/test_lora_defaults.py). memory.attention's default, "auto", is resolved per card by
# the run; the estimate's default kernel is sdpa, what "auto" gives where nothing faster is installed.
SCHEMA_MEMORY = MemorySection()

# DeepSpeed defaults (deepspeed/runtime/zero/config.py) the inputs start from.
DS_ALLGATHER_BUCKET_SIZE = 500_000_000  # stage 1/2 (HF's "auto" does not touch it)
DS_SUB_GROUP_SIZE = 1_000_000_000

# memory.attention's kernels (config/attention_kernel.py). Only sdpa (and eager) receive the dense s x s mask
# for packed or padded rows; flex_attention's block mask is (b x s/128 x s/128) int32 tensors, a few
# hundred KiB at 32k tokens, and sdpa_flex never builds the dense one.
ATTN_IMPLS = KERNELS


class MemoryInputError(UserError, ValueError):
    """An impossible or unsupported combination of memory-plan inputs."""


# Layout rules broken through MemoryInputs.of, told in its argument names (keyed by LayoutError.rule).
_API_MESSAGES = {
    "degrees": "world_size {world_size} is not divisible by tp*pp = {tp}*{pp}; world_size = dp * tp * pp",
    "degrees_sp": (
        "world_size {world_size} is not divisible by tp*pp*sp = {tp}*{pp}*{sp}; world_size = dp * tp * pp * sp"
    ),
    "sp_combination": "sp > 1 cannot be combined with tp or pp (got sp={sp}, tp={tp}, pp={pp})",
    "params": "offload_params needs zero_stage 3 (only ZeRO-3 partitions parameters)",
    "optimizer": "offload_optimizer needs zero_stage 1, 2 or 3",
    "nvme_optimizer": "offload_optimizer 'nvme' needs zero_stage 3 (use 'cpu' with stage 1/2)",
}
STATE_DTYPES = ("fp32", "bf16")
REFERENCES = ("none", "cached", "live")
_STATE_DTYPE_MESSAGES = {
    "state_precision": "state_dtype 'bf16' needs precision 'bf16'",
    "state_pipeline": "state_dtype 'bf16' is not supported with pp > 1",
    "state_offload": "state_dtype 'bf16' needs offload_optimizer 'cpu' (DeepSpeed's CPU Adam keeps them)",
    "state_nvme": "state_dtype 'bf16' needs offload_optimizer 'cpu', not 'nvme'",
}
_QUANTIZED_MESSAGES = {
    "quantized_offload": "quantize can offload parameters only as nf4 to the cpu (offload_params 'cpu')",
    "quantized_sp": "quantize is not supported with sp > 1",
}
_LAYOUT_FIELDS = {
    "zero_stage",
    "offload_optimizer",
    "offload_params",
    "precision",
    "micro_batch_size",
    "grad_accum",
    "sp",
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
    activation_checkpointing: bool = SCHEMA_MEMORY.activation_checkpointing
    attn_impl: str = "sdpa"
    dense_mask: bool = False
    """The rows carry an attention mask (packed rows: block-diagonal; padded rows), which sdpa receives
    as [micro x 1 x s x s] without sequence parallelism (Ulysses drops it); flash-attention-2,
    flex_attention and sdpa_flex build none."""
    lora_rank: int | None = None
    """LoRA rank on q,k,v,o,gate,up,down; the base model is frozen. None = full fine-tune."""
    lora_targets: tuple[str, ...] = LORA_TARGETS
    """lora.target_modules: the linear modules that get adapters."""
    lora_dropout: bool = False
    """lora.dropout > 0: PEFT keeps a dropped-out copy of each adapted layer's input for backward. Off unless
    the caller says so, not the schema's 0.05: this is a switch of the estimate, and every estimate of
    adapters the run will train sets it from the schema (candidate.memory_inputs from a recipe, auto's kinds
    from suggested_lora, search's LoRA fix from SUGGESTED_LORA_DROPOUT); a planner API caller spelling out
    `lora_rank` alone asks for the adapters without that copy."""
    quantize: str = "none"
    """QLoRA: the frozen base's linear layers in "nf4" or "int8" (bitsandbytes); needs lora_rank."""
    quantize_on: str = "gpu"
    """Where an nf4 base staged on the host under ZeRO-3 is quantised as it loads (runtime/model/quantized_base.py
    `quantizing_on`): "gpu", one weight at a time on the run's GPU, or "cpu" (a CPU run: bitsandbytes' CPU
    backend)."""
    direct_load: bool = True
    """Pretrained weights read tensor by tensor onto the GPU or into zero.Init's partitions (False: a
    randomly initialised model, built whole on the host first)."""
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
    optimizer: str = "adamw"
    """optim.name: "adamw" (fp32 m and v), or bitsandbytes' "adamw_8bit" / "paged_adamw_8bit" (8-bit m and v)."""
    export_adapter_only: bool = False
    """LoRA runs that export only the adapter (lora.export=adapter): no merged copy of the model."""
    pinning: str = "torch"
    """How the offload_optimizer buffers are pinned (offload_buffers.PINNINGS): "torch" (DeepSpeed 0.19.8's
    default: torch rounds each pinned buffer up to a power of two), "native" (exact-size mlock,
    DS_PIN_MEMORY_BACKEND=native) or "off" (the DS JSON's pin_memory false: pageable, exact)."""
    param_pinning: str = "torch"
    """The same for the offload_param buffers (the DS JSON's offload_param.pin_memory)."""
    checkpoint_pinning: str = "torch"
    """memory.offload_checkpoints: "torch" on CUDA (save_on_cpu(pin_memory=True): torch's pinned
    allocator, rounded up to a power of two per checkpoint) or "off" (CPU: plain host tensors)."""
    swap: SwapSettings = SwapSettings()
    """The NVMe swap settings of offload_optimizer (buffer count, pipelining, aio alignment)."""
    loader_forks: bool = False
    """DataLoader workers are forked after DeepSpeed's set-up (data.loader_workers > 0; 2 by default on
    CUDA): they keep a copy-on-write twin of the pageable optimizer state (planning/memory/offload_buffers.py)."""
    tiled_mlp: bool = SCHEMA_MEMORY.tiled_mlp
    """memory.tiled_mlp: MLP intermediates for one tile of tokens, not per layer."""
    tiled_loss: bool = SCHEMA_MEMORY.tiled_loss
    """memory.tiled_loss: logits and loss in chunks of tokens; the full logits tensor never exists."""
    liger_loss: bool = SCHEMA_MEMORY.liger_kernels
    """memory.liger_kernels: the chunked loss is Liger's fused linear cross-entropy where it can run
    (`liger_computes_loss`)."""
    offload_checkpoints: bool = SCHEMA_MEMORY.offload_checkpoints
    """memory.offload_checkpoints: the checkpointed hidden states wait in host RAM (needs checkpointing)."""
    sequences_per_sample: int = 1
    """Rows per sample: 2 for preference pairs (chosen and rejected), else 1 (micro_batch counts samples)."""
    reference: str = "none"
    """DPO's reference: "none" (lm, simpo), "cached" (log-probs computed before training) or "live" (scored
    every step: a frozen copy of the model, or under LoRA the base with the adapters disabled)."""
    generation: GenerationInputs | None = None
    """objective grpo: what each rank generates per step (planning/memory/generation.py); None: no generation."""
    vision: VisionInputs = VisionInputs()
    """An image-text model's frozen parts and images per sample (planning/model/vision_shapes.py); a text model's
    shape has no vision part, so this changes nothing there."""

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
        for name in ("pinning", "param_pinning", "checkpoint_pinning"):
            if getattr(self, name) not in PINNINGS:
                raise MemoryInputError(
                    f"{name} must be one of {', '.join(PINNINGS)}, got '{getattr(self, name)}'"
                )
        if self.lora_rank is not None and self.lora_rank < 1:
            raise MemoryInputError(f"lora_rank must be >= 1 or None, got {self.lora_rank}")
        if self.quantize not in QUANTIZE_MODES:
            raise MemoryInputError(
                f"quantize must be one of {', '.join(QUANTIZE_MODES)}, got '{self.quantize}'"
            )
        if self.quantize_on not in QUANTIZE_DEVICES:
            raise MemoryInputError(
                f"quantize_on must be one of {', '.join(QUANTIZE_DEVICES)}, got '{self.quantize_on}'"
            )
        if self.quantize != "none" and self.lora_rank is None:
            raise MemoryInputError("quantize needs lora_rank: a quantised base trains adapters only (QLoRA)")
        # The run's QLoRA rules (config.layout), so the planner never proposes what a run refuses.
        broken = quantized_layout_problem(self.quantize, self.offload_params, self.sp)
        if broken is not None:
            raise MemoryInputError(_QUANTIZED_MESSAGES[broken])
        if self.state_dtype not in STATE_DTYPES:
            raise MemoryInputError(
                f"state_dtype must be one of {', '.join(STATE_DTYPES)}, got '{self.state_dtype}'"
            )
        # The recipe's own rule (config.layout), so the planner never proposes what a run refuses.
        broken = state_dtype_problem(self.state_dtype, self.precision, self.offload_optimizer, self.pp)
        if broken is not None:
            raise MemoryInputError(_STATE_DTYPE_MESSAGES[broken])
        if self.optimizer not in ("adamw", *EIGHT_BIT_OPTIMIZERS):
            raise MemoryInputError(f"optimizer must be adamw or one of {', '.join(EIGHT_BIT_OPTIMIZERS)}")
        # The recipe's own rule (config.layout), so the planner never proposes what a run refuses.
        if optimizer_problem(self.optimizer, self.offload_optimizer, self.zero_stage) is not None:
            raise MemoryInputError(
                f"optimizer '{self.optimizer}' needs the optimizer on the GPU and zero_stage 0-2"
            )
        if self.offload_checkpoints and not self.activation_checkpointing:
            raise MemoryInputError("offload_checkpoints needs activation_checkpointing")
        if self.reference not in REFERENCES or self.sequences_per_sample not in (1, 2):
            raise MemoryInputError(
                f"reference must be one of {', '.join(REFERENCES)} and sequences_per_sample 1 or 2, got "
                f"{self.reference!r}, {self.sequences_per_sample}"
            )
        # The run's Ulysses rules (config.layout, config.parallel), so the planner never proposes what a run refuses.
        shape = self.shape
        broken = sequence_parallel_problem(self.sp, self.seq_len, shape.num_heads, shape.num_kv_heads)
        if broken is not None:
            raise MemoryInputError(
                sequence_parallel_message(broken, self.sp, self.seq_len, shape.num_heads, shape.num_kv_heads)
            )
        if self.sp > 1 and self.attn_impl not in ("sdpa", "flash_attention_2"):
            raise MemoryInputError(
                f"sp > 1 needs attn_impl 'sdpa' or 'flash_attention_2' (the run refuses {self.attn_impl})"
            )
        if self.attn_impl in FLEX_KERNELS and (self.tp > 1 or self.pp > 1):
            raise MemoryInputError(f"attn_impl '{self.attn_impl}' needs tp = pp = 1 (the run refuses it)")

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
        sp: int = 1,
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
                sp=sp,
            )
        except LayoutError as exc:
            rule = "degrees_sp" if exc.rule == "degrees" and sp > 1 else exc.rule
            raise MemoryInputError(_API_MESSAGES.get(rule, str(exc)).format(**locals())) from None
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
        """What the planner turns: the DS JSON, micro-batch and accumulation, checkpointing, LoRA, state
        dtype, and the long-context ones (sequence parallelism and the ALST memory switches)."""
        return (
            self.ds_key,
            self.micro_batch,
            self.grad_accum,
            self.activation_checkpointing,
            self.lora_rank,
            self.quantize,
            self.state_dtype,
            self.long_context,
        )

    @property
    def long_context(self) -> tuple[int, bool, bool, bool]:
        """(sp, tiled_mlp, tiled_loss, offload_checkpoints): the DeepSpeed ALST techniques in use."""
        return (self.sp, self.tiled_mlp, self.tiled_loss, self.offload_checkpoints)

    @property
    def uses_long_context(self) -> bool:
        """Sequence parallelism or any ALST memory switch is on (exact: the same training, more memory)."""
        return self.long_context != (1, False, False, False)

    @property
    def mlp_is_tiled(self) -> bool:
        """memory.tiled_mlp and more than one tile: a row of at most hidden_size tokens runs untiled."""
        return self.tiled_mlp and self.local_tokens > self.shape.hidden_size

    @property
    def liger_computes_loss(self) -> bool:
        """Liger's kernel computes the chunked loss: it reads the output layer's weight directly, so not under
        ZeRO-3 (partitioned) nor on pipeline stages (runtime/loss/chunked.py `liger_runs`)."""
        plain_head = not (self.lora_rank and "lm_head" in self.lora_targets)
        return self.tiled_loss and self.liger_loss and self.zero_stage < 3 and self.pp == 1 and plain_head

    @property
    def lora_dropout_targets(self) -> tuple[str, ...]:
        """The LoRA targets whose inputs PEFT's dropout copies (none without LoRA or without dropout)."""
        return self.lora_targets if self.lora_rank and self.lora_dropout else ()

    @property
    def rows(self) -> int:
        """Rows of seq_len tokens per micro-batch: micro_batch samples of sequences_per_sample rows each."""
        return self.micro_batch * self.sequences_per_sample

    @property
    def generation_rows(self) -> int:
        """Sequences one generate call writes: the rank's whole step, micro x accum completions (runtime/rl/grpo.py)."""
        return self.micro_batch * self.grad_accum if self.generation else 0

    @property
    def reference_copy(self) -> bool:
        """A frozen copy of the model is held for DPO's reference (live, without LoRA)."""
        return self.reference == "live" and not self.lora_rank

    @property
    def local_tokens(self) -> int:
        """Tokens of each sequence one rank holds: seq_len / sp."""
        return self.seq_len // self.sp

    @property
    def zero_partitions(self) -> int:
        """Ranks ZeRO partitions over: dp x sp (DeepSpeed's sequence-data-parallel group)."""
        return self.dp * self.sp

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
    sp = property(lambda self: self.layout.sp)

    @property
    def ranks_per_node(self) -> int:
        assert self.gpus_per_node is not None
        return min(self.gpus_per_node, self.world_size)

    @property
    def num_nodes(self) -> int:
        return math.ceil(self.world_size / self.ranks_per_node)
