"""The layout of a run: how one recipe maps onto the processes of this launch (world = dp x tp x pp x sp).

Everything that depends on the world size is decided here, once, before any weights are
loaded: the data/tensor/pipeline degrees, the ZeRO stage and offload read from the
DeepSpeed JSON, the precision the device can do, and the batch arithmetic
(global = micro x accumulation x data-parallel size) that DeepSpeed asserts on later in
a far less readable way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from llm_train.config import ds_json
from llm_train.config.hardware import Device
from llm_train.config.recipe import Recipe
from llm_train.errors import UserError

# --- the rules of a layout, each written once (the run, the memory estimator and the planner ask these) ---

PIPELINE_MAX_ZERO_STAGE = 1  # DeepSpeed refuses ZeRO-2/3 with pipeline parallelism


def degrees_divide(world_size: int, tp: int, pp: int, sp: int = 1) -> bool:
    """world size = data parallel x tensor parallel x pipeline parallel x sequence parallel."""
    return world_size % (tp * pp * sp) == 0


def sequence_parallel_problem(sp: int, seq_len: int, heads: int, kv_heads: int) -> str | None:
    """Which Ulysses rule a model and sequence length break for degree `sp`: 'sp_seq_len' (each rank
    holds seq_len / sp tokens), 'sp_heads' (the all-to-all hands each rank heads / sp attention
    heads), 'sp_kv_heads' (likewise the KV heads); None when fine."""
    if sp == 1:
        return None
    if seq_len % sp:
        return "sp_seq_len"
    if heads % sp:
        return "sp_heads"
    if kv_heads % sp:
        return "sp_kv_heads"
    return None


def sequence_parallel_message(rule: str, sp: int, seq_len: int, heads: int, kv_heads: int) -> str:
    """A broken Ulysses rule in the recipe keys a user changes."""
    asked = f"deepspeed.sequence_parallel={sp}"
    return {
        "sp_seq_len": (
            f"{asked} splits each sequence over {sp} ranks, but data.seq_len={seq_len} is not divisible by "
            f"{sp}; use a data.seq_len that is a multiple of {sp}"
        ),
        "sp_heads": (
            f"{asked} gives each rank num_attention_heads / {sp} heads, but the model has {heads} attention "
            f"heads; use a sequence-parallel degree that divides {heads}"
        ),
        "sp_kv_heads": (
            f"{asked} gives each rank num_key_value_heads / {sp} KV heads, but the model has {kv_heads}; "
            f"use a sequence-parallel degree that divides {kv_heads}"
        ),
    }[rule]


def offload_problem(zero_stage: int, offload_optimizer: str, offload_params: str) -> str | None:
    """Which offload rule a combination breaks: 'params' (needs ZeRO-3), 'optimizer' (needs ZeRO >= 1),
    'nvme_optimizer' (needs ZeRO-3: stage 1/2 would treat nvme as CPU and fill host RAM); None when fine."""
    if offload_params != "none" and zero_stage != 3:
        return "params"
    if offload_optimizer != "none" and zero_stage == 0:
        return "optimizer"
    if offload_optimizer == "nvme" and zero_stage != 3:
        return "nvme_optimizer"
    return None


def state_dtype_problem(state_dtype: str, precision: str, offload_optimizer: str, pp: int) -> str | None:
    """Which rule optimizer states in `state_dtype` break: 'state_precision' (bf16 states need bf16
    training), 'state_offload' (DeepSpeed 0.19 keeps bf16 master weights only with the optimizer
    offloaded to its CPU Adam), 'state_nvme' (only the CPU path is verified), 'state_pipeline' (the
    pipeline engine is not verified with them); None when fine or when the states are fp32."""
    if state_dtype == "fp32":
        return None
    if pp > 1:  # first: it is the engine, not a setting, that would have to change
        return "state_pipeline"
    if precision != "bf16":
        return "state_precision"
    if offload_optimizer == "none":
        return "state_offload"
    if offload_optimizer != "cpu":
        return "state_nvme"
    return None


def quantized_layout_problem(quantize: str, offload_params: str, sp: int) -> str | None:
    """Which rule a QLoRA base (lora.quantize) breaks: 'quantized_offload' (only nf4 parameters go to
    the CPU) or 'quantized_sp' (not verified with sequence parallelism); None when fine or unquantised.
    Why: config/parallel.py's _check_quantized, which words them for the recipe (the planner its own way)."""
    if quantize == "none":
        return None
    if offload_params != "none" and (offload_params, quantize) != ("cpu", "nf4"):
        return "quantized_offload"
    if sp > 1:
        return "quantized_sp"
    return None


EIGHT_BIT_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit")


def optimizer_problem(name: str, offload_optimizer: str, zero_stage: int) -> str | None:
    """Which rule optim.name breaks: 'optimizer_offload' (DeepSpeed's optimizer offload steps its own CPU
    Adam, never a client optimizer's 8-bit states) or 'optimizer_stage3' (bitsandbytes' optimizers over
    ZeRO-3's partitions are not verified); None when fine."""
    if name not in EIGHT_BIT_OPTIMIZERS:
        return None
    if offload_optimizer != "none":
        return "optimizer_offload"
    if zero_stage == 3:
        return "optimizer_stage3"
    return None


def workers_for(requested: int | None, optimizer_offloaded: bool) -> int | None:
    """How many DataLoader workers a rank forks: data.loader_workers when set; else none when the
    optimizer lives in host RAM; else None (the stream's own default: 2 on CUDA).

    Workers fork at the first batch, after DeepSpeed has built its CPU optimizer state, and every
    page the CPU Adam rewrites is then copied for each worker (copy-on-write): two workers on a 7B
    with the optimizer offloaded would add 25-75 GiB of host RAM
    (bench/results/host-ram-7b-offload-20261130.txt).
    """
    if requested is not None:
        return requested
    return 0 if optimizer_offloaded else None


def default_precision(kind: str, bf16: bool) -> str:
    """What precision=auto means on a device: fp32 on CPU, bf16 where the GPU has it, else fp16."""
    if kind == "cpu":
        return "fp32"
    return "bf16" if bf16 else "fp16"


def choose_precision(requested: str, json_precision: str | None, device: Device) -> tuple[str, str | None]:
    """The precision to train in, and a one-line notice when it was chosen for the user."""
    if requested == "auto" and json_precision is not None:
        requested = json_precision
    if requested == "auto":
        chosen = default_precision(device.kind, device.bf16)
        if chosen != "fp16":
            return chosen, None
        return (
            "fp16",
            f"{device.name} has no bf16; training in fp16 with dynamic loss scaling (precision=auto)",
        )
    if requested == "bf16" and not device.bf16:
        cc = ".".join(map(str, device.compute_capability or ()))
        raise UserError(
            f"precision=bf16 but {device.name} (compute capability {cc}) has no bf16; "
            "set precision=fp16 or precision=auto"
        )
    if requested == "fp16" and device.kind == "cpu":
        # The one home of this rule: it holds for the device that trains (a recipe's declared
        # hardware in a dry run, the detected one at start), whatever the recipe or JSON asked for.
        raise UserError("precision=fp16 is not supported on CPU; set precision=fp32 or precision=bf16")
    return requested, None


OFFLOAD_DEVICES = ("none", "cpu", "nvme")
PRECISIONS = ("bf16", "fp16", "fp32")


class LayoutError(UserError, ValueError):
    """A layout that breaks one of the rules below; `rule` says which, so each caller can phrase it
    in its own terms (recipe keys for a run, field names for the planner's API)."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(message)
        self.rule = rule


def check_degrees(world_size: int, tp: int, pp: int, sp: int = 1) -> None:
    for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp), ("sp", sp)):
        if value < 1:
            raise LayoutError("positive", f"{name} must be >= 1, got {value}")
    if sp > 1 and (tp > 1 or pp > 1):
        # Ulysses through Accelerate builds its own sequence/data groups over the whole world; DeepSpeed's
        # AutoTP and pipeline grids would need to be nested with them, which neither library does.
        raise LayoutError(
            "sp_combination",
            f"sequence parallel sp={sp} cannot be combined with tensor parallel (tp={tp}) or pipeline "
            f"parallel (pp={pp})",
        )
    if not degrees_divide(world_size, tp, pp, sp):
        raise LayoutError(
            "degrees",
            f"world size {world_size} is not divisible by tp x pp x sp = {tp} x {pp} x {sp} "
            "(world = dp x tp x pp x sp)",
        )


@dataclass(frozen=True)
class Layout:
    """The one description of how a run is laid out: world, degrees, ZeRO, offload, precision, batch.

    The run resolves one (make_layout), the dry run prints it, the memory estimator reads it
    (planning.memory.inputs.MemoryInputs holds one), and the planner's candidates are variations of it
    (`vary`). Every rule on these fields is checked here, when one is made.
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    offload_optimizer: str = "none"
    offload_params: str = "none"
    precision: str = "bf16"
    micro_batch_size: int = 1
    grad_accum: int = 1
    device: str = "cpu"
    sp: int = 1
    """Ulysses sequence-parallel degree; last, so that layouts written before it read the same."""

    def __post_init__(self) -> None:
        check_degrees(self.world_size, self.tp, self.pp, self.sp)
        for name in ("micro_batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise LayoutError("positive", f"{name} must be >= 1, got {getattr(self, name)}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise LayoutError("zero_stage", f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        for name in ("offload_optimizer", "offload_params"):
            if getattr(self, name) not in OFFLOAD_DEVICES:
                raise LayoutError(
                    "offload_device",
                    f"{name} must be one of {', '.join(OFFLOAD_DEVICES)}, got '{getattr(self, name)}'",
                )
        if self.precision not in PRECISIONS:
            raise LayoutError(
                "precision", f"precision must be one of {', '.join(PRECISIONS)}, got '{self.precision}'"
            )
        broken = offload_problem(self.zero_stage, self.offload_optimizer, self.offload_params)
        if broken:
            raise LayoutError(broken, f"offload ({broken}) is not possible with ZeRO stage {self.zero_stage}")
        if self.pp > 1 and self.zero_stage > PIPELINE_MAX_ZERO_STAGE:
            raise LayoutError(
                "pipeline_zero",
                f"DeepSpeed refuses ZeRO-{self.zero_stage} with pipeline parallelism; use 0 or 1",
            )

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.sp)

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.dp

    def vary(self, **changes: Any) -> Layout:
        """The same layout with some fields changed (and checked again)."""
        return replace(self, **changes)

    def rows(self) -> list[tuple[str, str]]:
        return [
            ("world size", f"{self.world_size} = {self.degrees}"),
            ("ZeRO stage", str(self.zero_stage)),
            ("offload", f"optimizer={self.offload_optimizer}, params={self.offload_params}"),
            ("precision", self.precision),
            (
                "batch",
                f"global {self.global_batch_size} = micro {self.micro_batch_size} x accum {self.grad_accum}"
                f" x dp {self.dp}",
            ),
            ("device", self.device),
        ]

    @property
    def degrees(self) -> str:
        """'dp D x tp T x pp P', with 'x sp S' when the sequence is split."""
        return f"dp {self.dp} x tp {self.tp} x pp {self.pp}" + (f" x sp {self.sp}" if self.sp > 1 else "")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "dp": self.dp, "global_batch_size": self.global_batch_size}

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of a global rank: which share of the data it trains on.

        Ranks of one tensor-parallel group are consecutive (AutoTP: rank = dp * tp + t), and so are
        the ranks of one Ulysses sequence-parallel group (rank = dp * sp + s), which train on the same
        samples; DeepSpeed's pipeline grid puts the data axis fastest (rank = stage * dp + d).
        """
        if self.pp > 1:
            return rank % self.dp
        return rank // (self.tp * self.sp)

    def sp_rank(self, rank: int) -> int:
        """Which slice of each sequence a rank holds (0 without sequence parallelism)."""
        return rank % self.sp


def batch_arithmetic(recipe: Recipe, dp: int) -> tuple[int, int]:
    """(grad_accum, global_batch) with the same rule DeepSpeed asserts, explained when it fails."""
    micro, accum, global_batch = (
        recipe.optim.micro_batch_size,
        recipe.optim.grad_accum,
        recipe.optim.global_batch_size,
    )
    if global_batch is None:
        accum = accum or 1
        return accum, micro * accum * dp
    per_step = micro * dp
    if global_batch % per_step:
        raise UserError(
            f"optim.global_batch_size={global_batch} is not divisible by optim.micro_batch_size={micro} x "
            f"data-parallel size {dp} = {per_step}; pick a multiple of {per_step} or change the micro-batch"
        )
    derived = global_batch // per_step
    if accum is not None and accum != derived:
        raise UserError(
            f"optim.global_batch_size={global_batch} != optim.micro_batch_size={micro} x optim.grad_accum={accum}"
            f" x data-parallel size {dp} = {micro * accum * dp}; set only one of grad_accum/global_batch_size"
        )
    return derived, global_batch


def parallel_degrees(recipe: Recipe, ds_config: dict[str, Any]) -> tuple[int, int, int]:
    """(tp, pp, sp) a recipe and its DS JSON ask for: the data-parallel size is world / (tp x pp x sp)."""
    tp = int((ds_config.get("tensor_parallel") or {}).get("autotp_size", 1) or 1)
    return tp, recipe.deepspeed.pipeline_stages, recipe.deepspeed.sequence_parallel


def make_layout(
    recipe: Recipe,
    ds_config: dict[str, Any],
    world_size: int,
    device: Device,
    source: str = "the DeepSpeed config",
) -> tuple[Layout, str | None]:
    """The run's layout from the recipe, its DS JSON and the world size, and any notice (precision).

    The rules are Layout's; a broken one is told here in the recipe's and the JSON's terms.
    """
    tp, pp, sp = parallel_degrees(recipe, ds_config)
    stage = ds_json.zero_stage(ds_config)
    try:
        check_degrees(world_size, tp, pp, sp)  # the batch arithmetic below needs dp
        dp = world_size // (tp * pp * sp)
        precision, notice = choose_precision(recipe.precision, ds_json.precision_of(ds_config), device)
        grad_accum, _ = batch_arithmetic(recipe, dp)
        layout = Layout(
            world_size=world_size,
            tp=tp,
            pp=pp,
            zero_stage=stage,
            offload_optimizer=ds_json.offload_device(ds_config, "optimizer"),
            offload_params=ds_json.offload_device(ds_config, "param"),
            precision=precision,
            micro_batch_size=recipe.optim.micro_batch_size,
            grad_accum=grad_accum,
            device=device.name,
            sp=sp,
        )
    except LayoutError as exc:
        raise UserError(_recipe_terms(exc, world_size, tp, pp, stage, source, sp)) from None
    _check_state_dtype(recipe.optim.state_dtype, layout, source)
    _check_optimizer(recipe.optim.name, layout, source, "optimizer" in ds_config)
    return layout, notice


def _check_optimizer(name: str, layout: Layout, source: str, json_optimizer: bool) -> None:
    """optim.name against the layout and the DS JSON, in one line (DeepSpeed would fail or ignore it later)."""
    asked = f"optim.name={name}"
    if name in EIGHT_BIT_OPTIMIZERS and json_optimizer:
        raise UserError(
            f'{asked}: {source} has its own "optimizer" section, which DeepSpeed builds instead; remove it from '
            "the DS JSON or set optim.name=adamw"
        )
    broken = optimizer_problem(name, layout.offload_optimizer, layout.zero_stage)
    if broken == "optimizer_offload":
        raise UserError(
            f"{asked} needs the optimizer on the GPU, but {source} offloads it to {layout.offload_optimizer} "
            "(DeepSpeed's offload steps its own CPU Adam); use a DeepSpeed config without "
            "zero_optimization.offload_optimizer (e.g. deepspeed.config=zero2) or set optim.name=adamw"
        )
    if broken == "optimizer_stage3":
        raise UserError(
            f"{asked} is not verified with ZeRO-3 ({source}); use deepspeed.config=zero2 (or zero1/zero0) or "
            "set optim.name=adamw"
        )


def _check_state_dtype(state_dtype: str, layout: Layout, source: str) -> None:
    """optim.state_dtype against the layout, in the keys a user changes (DeepSpeed would assert deep in init)."""
    broken = state_dtype_problem(state_dtype, layout.precision, layout.offload_optimizer, layout.pp)
    if broken is None:
        return
    asked = f"optim.state_dtype={state_dtype}"
    raise UserError(
        {
            "state_precision": (
                f"{asked} needs precision=bf16, but the run trains in {layout.precision}; set precision=bf16 "
                "(on a GPU with bf16, or CPU) or optim.state_dtype=fp32"
            ),
            "state_offload": (
                f"{asked} needs the optimizer offloaded to CPU (DeepSpeed keeps bf16 master weights and Adam "
                f"states only in its CPU Adam), but {source} has no zero_optimization.offload_optimizer; use "
                "deepspeed.config=zero2_offload or zero3_offload, or set optim.state_dtype=fp32"
            ),
            "state_nvme": (
                f"{asked} is supported with offload_optimizer.device=cpu only, but {source} offloads the "
                f"optimizer to {layout.offload_optimizer} (not verified with bf16 states); use "
                "deepspeed.config=zero3_offload or set optim.state_dtype=fp32"
            ),
            "state_pipeline": (
                f"{asked} is not supported with deepspeed.pipeline_stages={layout.pp} (the pipeline engine "
                "is not verified with bf16 master weights); use deepspeed.pipeline_stages=1 with "
                "deepspeed.config=zero2_offload, or set optim.state_dtype=fp32"
            ),
        }[broken]
    )


def _recipe_terms(
    exc: LayoutError, world: int, tp: int, pp: int, stage: int, source: str, sp: int = 1
) -> str:
    """A broken layout rule, told in the keys a user of recipes and DS JSONs changes."""
    dp = world // (tp * pp * sp) if degrees_divide(world, tp, pp, sp) else "?"
    degrees = f"world size {world} = dp {dp} x tp {tp} x pp {pp}" + (f" x sp {sp}" if sp > 1 else "")
    return {
        "degrees": (
            f"world size {world} is not divisible by tensor parallel {tp} x pipeline parallel {pp} = {tp * pp} "
            "(world size = data parallel x tensor parallel x pipeline parallel); launch a multiple of that many "
            "processes or change tensor_parallel.autotp_size / deepspeed.pipeline_stages"
        )
        if sp == 1
        else (
            f"world size {world} is not divisible by tensor parallel {tp} x pipeline parallel {pp} x sequence "
            f"parallel {sp} = {tp * pp * sp} (world size = dp x tp x pp x sp); launch a multiple of that many "
            "processes or change deepspeed.sequence_parallel"
        ),
        "sp_combination": (
            f"deepspeed.sequence_parallel={sp} cannot be combined with tensor parallel "
            f"(tensor_parallel.autotp_size={tp} in {source}) or pipeline parallel (deepspeed.pipeline_stages={pp}): "
            "Ulysses groups are built over the whole world; use ZeRO (deepspeed.config=zero1/2/3, with offload "
            "if needed) for the model's memory"
        ),
        "params": (
            f"DeepSpeed config offloads parameters (offload_param) with ZeRO stage {stage}; "
            "parameter offload needs zero_optimization.stage=3"
        ),
        "optimizer": (
            f"{source} offloads the optimizer (offload_optimizer) with ZeRO stage 0; "
            "optimizer offload needs zero_optimization.stage 1, 2 or 3"
        ),
        "nvme_optimizer": (
            f"{source} offloads the optimizer to nvme with ZeRO stage {stage}; stage 1/2 would keep it in "
            "host RAM: use offload_optimizer.device=cpu, or zero_optimization.stage=3"
        ),
        "pipeline_zero": (
            f"{degrees}: deepspeed.pipeline_stages={pp} needs ZeRO stage 0 or 1, but {source} sets "
            f"zero_optimization.stage={stage} (DeepSpeed refuses ZeRO-2/3 with pipeline parallelism); "
            "use deepspeed.config=zero1"
        ),
    }.get(exc.rule, f"{source}: {exc}")
