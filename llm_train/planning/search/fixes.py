"""The cheapest changes that make a configuration fit (or run faster), found by search, and
whether a configuration that fits is practical.

Fixes are searched, not listed from a script: every combination of activation
checkpointing, a smaller micro-batch (more accumulation, same global batch), ZeRO-3,
optimizer offload, parameter offload, NVMe offload (only with --nvme-gib), bf16 optimizer
states and LoRA is estimated; those that fit are ranked by estimated step time, and a
combination is dropped when a subset of its changes already fits at least as fast. Changes
that alter what is trained (LoRA) are ranked after those that train the same model, NVMe after
no NVMe, and bf16 optimizer states after fp32 ones (the order `--recipe auto` prefers).

Long sequences: only when none of those fits with the same training, fp32 states and no NVMe
does the search add DeepSpeed ALST's techniques: Ulysses sequence parallelism (a degree that
divides the GPUs per node, the heads, the KV heads and data.seq_len) and the memory switches
(tiled MLP, tiled loss, checkpoint offload). They are exact (the same training, only memory
and speed change), so they rank with the changes that keep the training.

Practical: a configuration that fits is FITS BUT IMPRACTICAL when its estimated step is more
than IMPRACTICAL_SLOWDOWN times the fastest configuration that fits without NVMe (the same
sequences per step, LoRA included: it is the usual way out), or when it trains fewer than
IMPRACTICAL_TOKENS_PER_S tokens per second. Both thresholds are far outside the speed model's
+-50%, so the verdict does not hinge on its precision.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from llm_train.config.attention_kernel import FLEX_KERNELS
from llm_train.config.hardware import Hardware
from llm_train.config.layout import sequence_parallel_problem
from llm_train.planning.memory.inputs import MemoryInputError, MemoryInputs
from llm_train.planning.search.candidate import (
    SHIPPED_DS_CONFIGS,
    SUGGESTED_LORA_DROPOUT,
    SUGGESTED_LORA_RANK,
    Evaluation,
    evaluate,
    shipped_settings,
)
from llm_train.planning.speed.step_time import step_time_on

# A configuration this many times slower per step than the fastest that fits without NVMe, or
# slower than this many tokens/s (a 7B full fine-tune on one 24 GB card does ~400-500), is one
# nobody would run: 100 tokens/s is ~8.6M tokens a day, a small fine-tuning set in weeks.
IMPRACTICAL_SLOWDOWN = 10.0
IMPRACTICAL_TOKENS_PER_S = 100.0

# --- changes and the search -------------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    kind: str  # a TYPICAL_COST key
    text: str


@dataclass
class Fix:
    """A set of changes to the recipe, with its evaluation and speed relative to the recipe."""

    evaluation: Evaluation
    changes: list[Change]
    overrides: list[str]
    slowdown: float  # step time / the recipe's step time
    impractical: str = ""
    """Why this fix, though it fits, is impractical (judge); empty when it is practical."""

    @property
    def kinds(self) -> frozenset[str]:
        return frozenset(c.kind for c in self.changes)

    @property
    def changes_training(self) -> bool:
        # bf16 optimizer states train measurably worse (bench/results/bf16-states-quality-*.txt).
        return bool(self.kinds & {"lora", "qlora", "bf16_states"})


# The ALST memory switches: MemoryInputs field (= the recipe's memory.<name>), change kind, words.
LONG_CONTEXT_SWITCHES = (
    ("tiled_mlp", "tiled MLP (intermediates for one tile of tokens at a time)"),
    ("tiled_loss", "tiled logits + loss (the full logits tensor is never built)"),
    ("offload_checkpoints", "activation checkpoints offloaded to host RAM"),
)


def describe_changes(
    base: MemoryInputs, new: MemoryInputs, recipe: Any, ds_name: str | None
) -> tuple[list[Change], list[str]]:
    """The human-readable changes from `base` to `new`, and the recipe overrides that make them."""
    changes: list[Change] = []
    overrides: list[str] = []
    if new.sp != base.sp:
        # Ulysses wraps sdpa or flash-attention only: a flex kernel gives way to what memory.attention=auto
        # picks under sequence parallelism.
        kernel = f", attention {base.attn_impl} -> {new.attn_impl}" if new.attn_impl != base.attn_impl else ""
        changes.append(
            Change(
                "sequence_parallel",
                f"Ulysses sequence parallel {base.sp} -> {new.sp}: each sequence split over {new.sp} GPUs "
                f"({new.local_tokens} tokens each{kernel})",
            )
        )
        overrides.append(f"deepspeed.sequence_parallel={new.sp}")
        if kernel:
            overrides.append("memory.attention=auto")
        if recipe is not None and recipe.data.packing == "packed" and new.attn_impl != "flash_attention_2":
            # Under SP, sdpa sees one causal sequence per row: packed samples would attend to each other.
            overrides.append("data.packing=padded")
    for name, text in LONG_CONTEXT_SWITCHES:
        if getattr(new, name) != getattr(base, name):
            on = getattr(new, name)
            changes.append(Change(name if on else "no_long_context", f"{text}: {'on' if on else 'off'}"))
            overrides.append(f"memory.{name}={'true' if on else 'false'}")
    if new.activation_checkpointing != base.activation_checkpointing:
        on = new.activation_checkpointing
        changes.append(
            Change(
                "checkpointing" if on else "no_checkpointing",
                f"activation checkpointing {'on' if on else 'off'}",
            )
        )
        overrides.append(f"memory.activation_checkpointing={'true' if on else 'false'}")
    if new.micro_batch != base.micro_batch:
        changes.append(
            Change(
                "micro_batch" if new.micro_batch < base.micro_batch else "bigger_micro_batch",
                f"micro-batch {base.micro_batch} -> {new.micro_batch} with accumulation "
                f"{base.grad_accum} -> {new.grad_accum} (same global batch)",
            )
        )
        overrides.append(f"optim.micro_batch_size={new.micro_batch}")
    if new.grad_accum != base.grad_accum and recipe is not None and recipe.optim.global_batch_size is None:
        # The recipe counts its batch in accumulation steps: keep its global batch (a smaller
        # micro-batch, or fewer data-parallel ranks under sequence parallelism, need more of them).
        overrides.append(f"optim.grad_accum={new.grad_accum}")
    if new.ds_key != base.ds_key:
        adds = []
        if new.zero_stage == 3 and base.zero_stage != 3:
            adds.append(Change("zero3", "ZeRO-3 (partition the weights too)"))
        if "nvme" in (new.offload_optimizer, new.offload_params):
            if "nvme" not in (base.offload_optimizer, base.offload_params):
                weights = " and weights" if new.offload_params == "nvme" else " (weights stay on the GPU)"
                adds.append(Change("nvme", f"NVMe offload of the optimizer states{weights} (ZeRO-Infinity)"))
        else:
            if new.offload_optimizer == "cpu" and base.offload_optimizer == "none":
                adds.append(Change("offload_optimizer", "optimizer offload to CPU (DeepSpeed CPU Adam)"))
            if new.offload_params == "cpu" and base.offload_params == "none":
                adds.append(Change("offload_params", "parameter offload to CPU"))
        removes = (
            new.zero_stage < base.zero_stage
            or _offload_rank(new.offload_optimizer) < _offload_rank(base.offload_optimizer)
            or _offload_rank(new.offload_params) < _offload_rank(base.offload_params)
        )
        if removes or not adds:
            adds = [
                Change(
                    "less_offload",
                    f"ZeRO-{new.zero_stage} with offload optimizer={new.offload_optimizer}, "
                    f"params={new.offload_params}",
                )
            ]
        changes.extend(adds)
        overrides.append(f"deepspeed.config={ds_name}" if ds_name else "deepspeed.config=<a JSON with these>")
    if new.state_dtype != base.state_dtype:
        changes.append(
            Change(
                "bf16_states" if new.state_dtype == "bf16" else "less_offload",
                f"{new.state_dtype} optimizer states (master weights, gradients, Adam m/v on the host)",
            )
        )
        overrides.append(f"optim.state_dtype={new.state_dtype}")
    if new.lora_rank and not base.lora_rank:
        changes.append(Change("lora", f"LoRA rank {new.lora_rank} instead of a full fine-tune"))
        overrides.append(f"lora.rank={new.lora_rank}")
    if new.quantize != base.quantize:
        changes.append(Change("qlora", f"QLoRA: the base quantised to 4-bit {new.quantize.upper()}"))
        overrides.append(f"lora.quantize={new.quantize}")
    old_gather = base.generation.gather_whole if base.generation else True
    if new.generation is not None and new.generation.gather_whole != old_gather:
        changes.append(
            Change(
                "layer_gather", "generation gathers the ZeRO-3 weights layer by layer, not the whole model"
            )
        )
        overrides.append("grpo.ds3_gather_for_generation=false")
    return changes, overrides


def _offload_rank(device: str) -> int:
    return {"none": 0, "cpu": 1, "nvme": 2}[device]


def _memory_modes(base: MemoryInputs, kind: str, saving_only: bool) -> list[tuple[int, str, str]]:
    """ZeRO stage / offload combinations to try (shipped configs only), the recipe's first."""
    if kind == "cpu":
        # Offloading to the CPU from the CPU saves nothing; only partitioning can help.
        candidates = [k for k in SHIPPED_DS_CONFIGS if k[1] == "none" and k[2] == "none"]
    else:
        candidates = list(SHIPPED_DS_CONFIGS)
    if saving_only:
        # To make a run fit, stages only go up and offload is only ever added.
        candidates = [
            k
            for k in candidates
            if k[0] >= max(base.zero_stage, 2)
            and _offload_rank(k[1]) >= _offload_rank(base.offload_optimizer)
            and _offload_rank(k[2]) >= _offload_rank(base.offload_params)
        ]
    return [base.ds_key] + [k for k in candidates if k != base.ds_key]


def _variants(
    start: MemoryInputs,
    checkpointing: list[bool],
    micro: list[int],
    modes: list[tuple[int, str, str]],
    lora: list[int | None],
    states: list[str],
    long_context: list[tuple[int, bool, bool, bool]] | None = None,
    quantize: list[str] | None = None,
    gather: list[bool] | None = None,
) -> Iterator[MemoryInputs]:
    """Every combination of the knobs that the layout rules accept, same global batch (sequences per step).

    long_context: (sp, tiled_mlp, tiled_loss, offload_checkpoints) options; default `start`'s own.
    """
    global_batch = start.layout.global_batch_size
    options = long_context or [start.long_context]
    generation = start.generation
    for ckpt, mb, mode, rank, state, (
        sp,
        tiled_mlp,
        tiled_loss,
        offload_ckpt,
    ), quant, whole in itertools.product(
        checkpointing, micro, modes, lora, states, options, quantize or [start.quantize], gather or [True]
    ):
        if quant != start.quantize and not rank:
            continue  # a quantised base trains adapters only (QLoRA)
        if (generation is None or mode[0] != 3) and not whole:
            continue  # layer-by-layer gathering is a ZeRO-3 generation's option
        dp = start.world_size // (start.tp * start.pp * sp)
        if dp < 1 or global_batch % (mb * dp):
            continue  # this micro-batch cannot make the same global batch with this many dp ranks
        # Another DS JSON brings its own sub-group size and swap settings.
        shipped = shipped_settings(mode) if mode != start.ds_key else {}
        # Under sequence parallelism the flex kernels give way to sdpa, as memory.attention=auto does there.
        attention = "sdpa" if sp > 1 and start.attn_impl in FLEX_KERNELS else start.attn_impl
        try:
            yield start.vary(
                **shipped,
                attn_impl=attention,
                zero_stage=mode[0],
                offload_optimizer=mode[1],
                offload_params=mode[2],
                micro_batch_size=mb,
                grad_accum=global_batch // (mb * dp),
                sp=sp,
                activation_checkpointing=ckpt,
                lora_rank=rank,
                # New adapters are the schema's (`lora.rank=N` on a full fine-tune): its dropout copies too.
                **({"lora_dropout": SUGGESTED_LORA_DROPOUT > 0} if rank and not start.lora_rank else {}),
                state_dtype=state,
                tiled_mlp=tiled_mlp,
                tiled_loss=tiled_loss,
                offload_checkpoints=offload_ckpt,
                zero_init=None,  # follows the stage
                **({"quantize": quant} if quant != start.quantize else {}),
                **(
                    {"generation": dataclasses.replace(generation, gather_whole=whole)}
                    if generation is not None and mode[0] == 3
                    else {}
                ),
            )
        except MemoryInputError:
            continue  # a combination the layout or sequence-parallel rules refuse


def sequence_parallel_degrees(inp: MemoryInputs) -> list[int]:
    """The Ulysses degrees a run of `inp` could use: divisors of the GPUs per node that divide the world,
    the attention heads, the KV heads and data.seq_len (1 always; none above 1 with tp or pp)."""
    if inp.tp > 1 or inp.pp > 1:
        return [1]
    shape = inp.shape
    return [
        d
        for d in range(1, inp.ranks_per_node + 1)
        if inp.ranks_per_node % d == 0
        and inp.world_size % d == 0
        and sequence_parallel_problem(d, inp.seq_len, shape.num_heads, shape.num_kv_heads) is None
    ]


def long_context_options(inp: MemoryInputs, saving_only: bool = True) -> list[tuple[int, bool, bool, bool]]:
    """(sp, tiled_mlp, tiled_loss, offload_checkpoints) to try: `inp`'s own first, then every degree and
    switch that saves memory (saving_only) or, to go faster, each switch that is on turned off."""
    own = inp.long_context
    if saving_only:
        degrees = [d for d in sequence_parallel_degrees(inp) if d >= inp.sp]
        switches = [
            [getattr(inp, name)] + ([True] if not getattr(inp, name) else [])
            for name, _ in LONG_CONTEXT_SWITCHES
        ]
    else:
        degrees = [inp.sp]
        switches = [
            [getattr(inp, name)] + ([False] if getattr(inp, name) else [])
            for name, _ in LONG_CONTEXT_SWITCHES
        ]
    options = [(sp, *flags) for sp in degrees for flags in itertools.product(*switches)]
    return [own] + [o for o in options if o != own]


def _states(start: MemoryInputs) -> list[str]:
    # bf16 states are a knob only where DeepSpeed has them: bf16 training (the offload rule is
    # checked per candidate by MemoryInputs).
    return [start.state_dtype] + (
        ["bf16"] if start.state_dtype == "fp32" and start.precision == "bf16" else []
    )


def search(
    base: MemoryInputs,
    grad_accum: int,
    hw: Hardware,
    recipe: Any,
    faster: bool = False,
    limit: int = 6,
    nvme_bytes: int = 0,
) -> list[Fix]:
    """Fitting combinations of changes to `base`, fastest first, without dominated ones.

    faster=False: the recipe does not fit; try only changes that save memory (and LoRA).
    faster=True: it fits; look for changes that keep it fitting and are >5% faster.
    nvme_bytes: NVMe space per node (--nvme-gib); NVMe configurations need it.
    """
    start = base if base.grad_accum == grad_accum else base.vary(grad_accum=grad_accum)
    reference = step_time_on(base, hw, grad_accum).total
    per_rank = start.micro_batch * start.grad_accum  # sequences per rank per step: kept fixed
    if faster:
        checkpointing = [start.activation_checkpointing, not start.activation_checkpointing]
        micro = [start.micro_batch] + [
            m for m in range(1, per_rank + 1) if per_rank % m == 0 and m != start.micro_batch
        ]
        lora = [start.lora_rank]
    else:
        checkpointing = [start.activation_checkpointing] + (
            [True] if not start.activation_checkpointing else []
        )
        micro = [start.micro_batch] + [
            m for m in range(start.micro_batch - 1, 0, -1) if start.micro_batch % m == 0
        ]
        lora = [start.lora_rank] + ([SUGGESTED_LORA_RANK] if start.lora_rank is None else [])
    modes = _memory_modes(start, hw.kind, saving_only=not faster)
    # To make it fit, also a 4-bit base under the adapters (QLoRA) on a GPU, and a GRPO run's ZeRO-3 generation
    # gathering layer by layer (grpo.ds3_gather_for_generation=false) when it gathers the whole model.
    quantize = [start.quantize] + (
        ["nf4"] if not faster and start.quantize == "none" and hw.kind == "cuda" else []
    )
    gather = [True] + ([False] if not faster and start.generation and start.generation.gather_whole else [])

    def fitting(long_context: list[tuple[int, bool, bool, bool]]) -> list[Fix]:
        out = []
        variants = _variants(
            start, checkpointing, micro, modes, lora, _states(start), long_context, quantize, gather
        )
        for candidate in variants:
            if candidate.knobs == start.knobs:
                continue
            ev = evaluate(candidate, hw, nvme_bytes)
            slowdown = ev.time.total / reference if reference else 1.0
            if not ev.fits or (faster and slowdown > 0.95):
                continue
            changes, overrides = describe_changes(
                start, candidate, recipe, SHIPPED_DS_CONFIGS.get(candidate.ds_key)
            )
            out.append(Fix(ev, changes, overrides, slowdown))
        return out

    if faster:
        fixes = fitting(long_context_options(start, saving_only=False))
    else:
        fixes = fitting([start.long_context])
        if not any(_keeps_training_cheaply(f) for f in fixes):
            # Only a long sequence needs ALST: searched when nothing else fits with the same training.
            fixes += fitting(long_context_options(start)[1:])
    # Among fixes of the same kinds (e.g. several micro-batch sizes), keep the fastest.
    fastest: dict[frozenset[str], Fix] = {}
    for f in fixes:
        if f.kinds not in fastest or f.slowdown < fastest[f.kinds].slowdown:
            fastest[f.kinds] = f
    # Drop a fix when another one, made of a subset of its kinds of change, is at least as fast
    # (within 1%: far below the speed model's precision, so not worth one more change). Done on the
    # fastest of each kind: the same result as on all fixes, without comparing thousands of pairs.
    best = {
        kinds: f
        for kinds, f in fastest.items()
        if not any(g.kinds < kinds and g.slowdown <= f.slowdown * 1.01 for g in fastest.values())
    }
    # The order --recipe auto prefers too: the same training before LoRA, without NVMe before with it,
    # fp32 optimizer states before bf16 ones (quality measured, not assumed), then the fastest.
    ranked = sorted(
        best.values(),
        key=lambda f: (
            f.changes_training,
            f.evaluation.inputs.uses_nvme,
            f.evaluation.inputs.state_dtype == "bf16",
            f.slowdown,
            len(f.changes),
        ),
    )
    return ranked[:limit]


def _keeps_training_cheaply(fix: Fix) -> bool:
    """The same training, fp32 optimizer states, without NVMe."""
    c = fix.evaluation.inputs
    return not fix.changes_training and not c.uses_nvme and c.state_dtype == "fp32"


def search_fixes(
    base: MemoryInputs, grad_accum: int, hw: Hardware, recipe: Any, limit: int = 6, nvme_bytes: int = 0
) -> list[Fix]:
    """The cheapest changes that make a run that does not fit (or barely fits) fit."""
    return search(base, grad_accum, hw, recipe, faster=False, limit=limit, nvme_bytes=nvme_bytes)


def search_faster(
    base: MemoryInputs, grad_accum: int, hw: Hardware, recipe: Any, limit: int = 3, nvme_bytes: int = 0
) -> list[Fix]:
    """Changes that keep a fitting run fitting and make it faster (bigger micro-batch, less offload)."""
    return search(base, grad_accum, hw, recipe, faster=True, limit=limit, nvme_bytes=nvme_bytes)


# --- practical or not ---------------------------------------------------------------------------------


@dataclass
class Practicality:
    """Whether a fitting configuration is one anybody would run, and what to do instead if not."""

    reasons: list[str] = field(default_factory=list)
    """Why it is impractical; empty when it is practical."""
    reference: Evaluation | None = None
    """The fastest configuration that fits without NVMe (None when none does)."""
    instead: str = ""

    @property
    def practical(self) -> bool:
        return not self.reasons


def without_nvme(base: MemoryInputs, hw: Hardware, lora: bool = True) -> list[Evaluation]:
    """Every configuration of `base`'s model and batch that the planner could run instead, without NVMe:
    each shipped ZeRO stage/offload, micro-batch (same sequences per rank and step), checkpointing,
    state dtype and, when `lora`, LoRA (or `base`'s own rank)."""
    per_rank = base.micro_batch * base.grad_accum
    micro = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
    modes = [k for k in _memory_modes(base, hw.kind, saving_only=False) if "nvme" not in k[1:]]
    ranks = [base.lora_rank] + ([SUGGESTED_LORA_RANK] if lora and base.lora_rank is None else [])
    states = ["fp32", "bf16"] if base.precision == "bf16" else ["fp32"]
    return [evaluate(c, hw) for c in _variants(base, [False, True], micro, modes, ranks, states)]


def judge(ev: Evaluation, alternatives: list[Evaluation]) -> Practicality:
    """FITS or FITS BUT IMPRACTICAL for a fitting `ev`, against the alternatives that fit without NVMe."""
    fitting = [a for a in alternatives if a.fits and not a.inputs.uses_nvme]
    reference = min(fitting, key=lambda a: a.time.total) if fitting else None
    out = Practicality(reference=reference)
    t = ev.time
    if reference is not None and t.total > IMPRACTICAL_SLOWDOWN * reference.time.total:
        out.reasons.append(
            f"~{_duration(t.total)} per step, {t.total / reference.time.total:.0f}x the fastest configuration "
            f"that fits without NVMe (~{_duration(reference.time.total)})"
        )
    if t.tokens_per_s < IMPRACTICAL_TOKENS_PER_S:
        out.reasons.append(f"~{t.tokens_per_s:.0f} tokens/s, under {IMPRACTICAL_TOKENS_PER_S:.0f}")
    if not out.reasons:
        return out
    options = []
    if reference is not None and reference.time.tokens_per_s >= IMPRACTICAL_TOKENS_PER_S:
        ref = reference.inputs
        what = (
            f"LoRA adapters (lora.rank={ref.lora_rank})" if ref.lora_rank and not ev.inputs.lora_rank else ""
        )
        options.append(
            f"{what or short_config(ref)}: ~{_duration(reference.time.total)} per step, "
            f"{reference.time.tokens_per_s:,.0f} tokens/s"
        )
    options.append("a smaller model, or more GPUs (--gpus)")
    out.instead = "; ".join(options)
    return out


def short_config(c: MemoryInputs) -> str:
    """A configuration in a few words: what is trained, ZeRO stage and offload, micro-batch, checkpointing."""
    off = [f"optimizer on {c.offload_optimizer}"] if c.offload_optimizer != "none" else []
    off += [f"weights on {c.offload_params}"] if c.offload_params != "none" else []
    off += ["bf16 optimizer states"] if c.state_dtype == "bf16" else []
    text = f"ZeRO-{c.zero_stage}" + (f" ({', '.join(off)})" if off else " without offload")
    text += f", micro-batch {c.micro_batch}" + (", checkpointing" if c.activation_checkpointing else "")
    text += long_context_text(c, prefix=", ")
    kind = ("QLoRA, " if c.quantize != "none" else "LoRA, ") if c.lora_rank else ""
    return kind + text


def long_context_text(c: MemoryInputs, prefix: str = "") -> str:
    """'sequence parallel 8, tiled MLP, tiled loss, checkpoints offloaded' (empty without ALST)."""
    parts = [f"sequence parallel {c.sp}"] if c.sp > 1 else []
    parts += ["tiled MLP"] if c.tiled_mlp else []
    parts += ["tiled loss"] if c.tiled_loss else []
    parts += ["checkpoints offloaded"] if c.offload_checkpoints else []
    return prefix + ", ".join(parts) if parts else ""


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.1f} s"
