"""`--recipe auto`: the fastest configuration of a model that fits given hardware, as a recipe.

One search over the knobs of planning/knobs.py (DS JSON and its pinning, micro-batch, checkpointing,
the long-context switches) for each kind of training (full, LoRA, QLoRA), each candidate a variation of
its kind's base: the recipe auto writes for that kind, with the user's overrides applied, resolved as any
recipe is (config/resolution.py, planning/candidate.memory_inputs). So an override is planned: a knob it
sets stays at the value it resolves to, any other key reaches the estimate through the same resolution,
any lora.* key plans adapters only, and one the planner does not model is refused in one line
(knobs.NOT_PLANNED). The written recipe is that base with the chosen knobs, and `check_written` holds it
to that: read back and planned from scratch it gives the chosen candidate's inputs and numbers, or the
command refuses in one line before writing.

The choice policy (docs/planning.md, "The choice policy"): the fastest that fits within a kind, without
NVMe before NVMe (only with --nvme-gib); a practical full fine-tune over faster adapters, with the cost
printed (`policy_cost`); adapters where no full fine-tune fits or it is impractical (search.judge),
unless --no-lora. Adapters are 16-bit LoRA or QLoRA (the same adapters on a 4-bit base, bitsandbytes,
CUDA only), weighed by the same speed model: the fastest that fits is chosen (QLoRA by more than
EXACT_BASE_MARGIN), and the "why" names the runner-up with both step times. Optimizer states stay fp32: bf16 states (optim.state_dtype=bf16) halve the offloaded
optimizer's host RAM, but their measured quality cost is too high to pick them for anyone
(bench/results/bf16-states-quality-*.txt: at lr 1e-5 they kept 8% of fp32's eval-loss gain), so
`plan` only reports what they would save.

Pinning is a knob of the offloading candidates: native (exact size, needs the memlock limit of this
shell: planning/pinning.py), torch (DeepSpeed's default, rounded up to powers of two, no limit) or off
(pageable: slower copies that hide behind nothing, planning/speed.py). The chosen one is written as it
is, not as `auto`, so the run gets the pinning its plan assumed.

The attention kernel is planned and written too: sdpa_flex on CUDA where torch has flex_attention
(no dense s x s mask), sdpa under sequence parallelism or without it.

Long sequences: when no configuration of a kind fits at --seq-len, the DeepSpeed ALST techniques join
the candidates: Ulysses sequence parallelism (search.sequence_parallel_degrees) and the tiled MLP,
tiled loss and checkpoint-offload switches. They train exactly the same model, so a full fine-tune with
them comes before adapters.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llm_train import RECIPES_DIR
from llm_train.config.attention_kernel import FLEX_KERNELS, Installed, flex_fits
from llm_train.config.ds_json import load_ds_config, nvme_paths
from llm_train.config.hardware import Hardware
from llm_train.config.layout import default_precision, degrees_divide, parallel_degrees
from llm_train.config.recipe import Recipe, parse_override, recipe_from_data, yaml_load
from llm_train.config.resolution import Resolved, largest_weight, model_fields, resolve_recipe, resolve_run
from llm_train.errors import UserError
from llm_train.planning.candidate import (
    AUTO_MICRO_BATCHES,
    SHIPPED_DS_CONFIGS,
    SUGGESTED_LORA,
    SUGGESTED_LORA_RANK,
    Evaluation,
    ds_fields,
    evaluate,
    loader_forks_for,
    memory_inputs,
    shipped_settings,
    zero_init_for,
)
from llm_train.planning.knobs import pinned_fields, recipe_values, set_key
from llm_train.planning.memory_estimate import GiB, estimate_memory
from llm_train.planning.memory_inputs import MemoryInputError, MemoryInputs
from llm_train.planning.pinning import MemlockLimit, memlock_limit
from llm_train.planning.search import (
    Practicality,
    judge,
    long_context_options,
    long_context_text,
    short_config,
)
from llm_train.planning.shapes import ModelShape, shape_from_config, shape_of
from llm_train.planning.verdict import config_line, generation_line, verdict

# The pinning choices of an offloading candidate (recipe values of deepspeed.pinning).
PINNING_CHOICES = ("native", "torch", "off")

# --- `--recipe auto` ----------------------------------------------------------------------------------


@dataclass
class AutoChoice:
    evaluation: Evaluation
    hardware: Hardware
    model: str
    shape: ModelShape
    seq_len: int
    global_batch: int
    reasons: list[str]
    practicality: Practicality
    nvme_bytes: int = 0
    overrides: list[str] = field(default_factory=list)
    user_ds_config: str | None = None
    """The user's deepspeed.config when an override pinned it (written as given), else None."""
    recipe_data: dict[str, Any] = field(default_factory=dict)
    """The recipe mapping of the chosen kind (auto's base, the user's overrides applied): what is written, with
    the chosen knobs set (`auto_recipe_data`)."""

    @property
    def inputs(self) -> MemoryInputs:
        return self.evaluation.inputs

    @property
    def ds_config(self) -> str:
        return self.user_ds_config or SHIPPED_DS_CONFIGS[self.inputs.ds_key]

    @property
    def precision(self) -> str:
        return self.inputs.precision


def choose_auto(
    model: str,
    hw: Hardware,
    seq_len: int | None = None,
    global_batch: int = 64,
    lora: str = "fallback",
    nvme_gib: float | None = None,
    overrides: list[str] | None = None,
    memlock: MemlockLimit | None = None,
) -> AutoChoice:
    """The fastest configuration (by the speed model) that fits `hw`, in the order of the module docstring.

    lora: "fallback" = adapters only when no full fine-tune fits, or the one that fits is impractical;
    "never"; "always". nvme_gib: NVMe space per node (--nvme-gib); without it no NVMe offload.
    overrides: the user's `key=value`s, planned (module docstring). memlock: the limit native pinning
    must fit (default: this process's).
    A composer: the request, the candidates of each kind evaluated, the pick, then why.
    """
    ask = auto_request(model, hw, seq_len, global_batch, nvme_gib, overrides or [], lora, memlock)
    full_tried = fitting_search(ask, FULL) if FULL in ask.kinds else []
    adapters_all = lora_search(ask)
    adapters_tried = adapters_all if lora != "never" else []
    tried = full_tried + adapters_tried
    # A verdict judges the configuration against everything this hardware could run instead, adapters
    # included even under --no-lora: the flag says what to choose, not how fast the choice is.
    alternatives = full_tried + adapters_all
    chosen, fitting, reasons = pick(ask, full_tried, adapters_tried, alternatives, lora)
    practicality = judge(chosen, alternatives)
    exact = " with a 16-bit base" if chosen is not fastest_fitting(fitting)[0] else ""
    kind = "adapter" if chosen.inputs.lora_rank else "full fine-tune"
    reasons.append(
        f"the fastest of the {len(fitting)} {kind} configurations that fit{exact} ({len(tried)} estimated, of "
        "every kind planned), by the step time that counts every host copy whole (that prefetch hides them is "
        "assumed, not measured)"
    )
    if not chosen.inputs.lora_rank:
        reasons += policy_cost(chosen, alternatives, lora)
    reasons += runner_up(chosen, fitting)
    reasons += lighter_misses(ask, chosen, tried)
    reasons += technique_reasons(ask, chosen, tried, lora)
    auto = AutoChoice(
        chosen,
        hw,
        model,
        ask.shape,
        chosen.inputs.seq_len,
        ask.global_batch,
        reasons,
        practicality,
        ask.nvme_bytes,
        list(overrides or []),
        ask.recipe.deepspeed.config if "ds_key" in ask.pins else None,
        ask.kind_bases[_kind_of(chosen.inputs)].data,
    )
    check_written(auto)
    return auto


# (lora rank, quantize): what a candidate trains.
Kind = tuple[int | None, str]
FULL: Kind = (None, "none")


def _kind_of(c: MemoryInputs) -> Kind:
    return (c.lora_rank, c.quantize)


@dataclass(frozen=True)
class KindBase:
    """One kind of training (full, LoRA, QLoRA) as a recipe: auto's base with the user's overrides and that kind's
    lora section, resolved like any recipe. Its candidates vary only the search's knobs, so every other field of
    the estimate (adapter targets, dropout, export, the loader, the DS JSON's buckets) is the written recipe's."""

    data: dict[str, Any]
    """The recipe mapping (never edited: auto_recipe_data copies it)."""
    inputs: MemoryInputs


@dataclass(frozen=True)
class AutoRequest:
    """What `--recipe auto` is asked: a model on hardware, at a sequence length and global batch, with the
    user's overrides, as the base recipe they make (resolved: `base`)."""

    model: str
    shape: ModelShape
    hw: Hardware
    seq_len: int
    global_batch: int
    nvme_bytes: int
    """NVMe space per node the user declared (--nvme-gib); 0: NVMe offload never fits."""
    base: MemoryInputs
    """The base recipe's own estimate inputs: every candidate varies its knobs."""
    recipe: Recipe
    """The base recipe (defaults, the user's overrides applied)."""
    pins: frozenset[str]
    """The MemoryInputs fields the user's overrides fix."""
    kinds: tuple[Kind, ...]
    memlock: MemlockLimit
    overrides: tuple[str, ...] = ()
    kind_bases: dict[Kind, KindBase] = field(default_factory=dict)
    """Each kind of `kinds` as its own resolved recipe (the candidates of a kind vary its base)."""
    lora_keys: tuple[str, ...] = ()
    """The user's lora.* overrides: each one asks for adapters."""
    largest_weight: int = 0
    """Elements of the model's largest weight matrix (config/resolution.largest_weight)."""
    nvme_path_set: bool = False
    """The user set deepspeed.nvme_path: a run refuses it with a DS JSON that offloads nothing to nvme."""

    @property
    def on_gpu(self) -> bool:
        return self.hw.kind == "cuda"

    @property
    def modes(self) -> list[tuple[int, str, str]]:
        """The DS JSONs to try: the user's, or the shipped ones' (stage, optimizer, parameter offload);
        offload only on CUDA."""
        if "ds_key" in self.pins:
            return [self.base.ds_key]
        modes = [k for k in SHIPPED_DS_CONFIGS if self.on_gpu or k[1:] == ("none", "none")]
        return [k for k in modes if "nvme" in k[1:]] if self.nvme_path_set else modes

    def pinnings(self, mode: tuple[int, str, str]) -> tuple[str, ...]:
        """deepspeed.pinning values to try with a DS JSON: the user's, or each where something is offloaded."""
        if "pinning" in self.pins:
            return (self.recipe.deepspeed.pinning,)
        if not self.on_gpu:
            return ("off",)
        return PINNING_CHOICES if mode[1:] != ("none", "none") else ("torch",)

    def ds_settings(self, mode: tuple[int, str, str], pinning: str) -> dict[str, Any]:
        """The MemoryInputs fields a DS JSON sets (buckets, overlap, swap, pinning of its offload sections)."""
        if "ds_key" in self.pins:
            return ds_fields(self._user_ds_json, pinning, self.on_gpu, mode[0])
        return shipped_settings(mode, pinning, self.on_gpu)

    @functools.cached_property
    def _user_ds_json(self) -> dict[str, Any]:
        """The user's deepspeed.config, read once per request (ds_settings asks for it per candidate)."""
        return load_ds_config(self.recipe.deepspeed.config)[1]


def planned_attention(hw: Hardware, head_dim: int) -> str:
    """The kernel auto writes: sdpa_flex on CUDA where torch has flex_attention and its backward fits the
    card at this head_dim (no dense mask for packed rows; config/attention_kernel.py flex_fits), else sdpa;
    sequence-parallel candidates switch to sdpa (Ulysses wraps sdpa)."""
    flex = hw.kind == "cuda" and Installed.here().flex and flex_fits(hw.device(), head_dim)[0]
    return "sdpa_flex" if flex else "sdpa"


def auto_request(
    model: str,
    hw: Hardware,
    seq_len: int | None,
    global_batch: int,
    nvme_gib: float | None,
    overrides: list[str] | None = None,
    lora: str = "fallback",
    memlock: MemlockLimit | None = None,
) -> AutoRequest:
    """The request with its defaults filled (seq_len: min(2048, the model's maximum)) and the user's overrides
    resolved into the base recipe, and into one recipe per kind of training the search may choose; UserError
    when a flag is out of range, the layout's data-parallel ranks cannot keep the global batch, or an override
    cannot be planned."""
    overrides = list(overrides or [])
    if seq_len is not None and seq_len < 1:
        raise UserError(
            f"--seq-len {seq_len}: give the tokens per sequence (>= 1), or leave it out for min(2048, the "
            "model's maximum)"
        )
    if global_batch < 1:
        raise UserError(f"--global-batch {global_batch}: give the sequences per optimizer step (>= 1)")
    shape_of(model)  # an unknown model is one line naming it, before any recipe is made
    pins = frozenset(pinned_fields(overrides))
    keys = {".".join(parse_override(text)[0]): text for text in overrides}
    # Any lora.* key configures adapters: planning a full fine-tune and writing it with a lora section would
    # train adapters the plan never counted.
    lora_keys = tuple(text for key, text in keys.items() if key.split(".")[0] == "lora")
    if lora == "never" and lora_keys:
        raise UserError(
            f"--no-lora plans a full fine-tune, but {lora_keys[0]} configures adapters; drop --no-lora to plan "
            "adapters, or drop the lora.* override(s)"
        )
    nvme_bytes = int((nvme_gib or 0) * GiB)
    precision = default_precision(hw.kind, hw.bf16)
    adapters = lora == "always" or bool(lora_keys)
    # sdpa until the layout is known: sdpa_flex runs on the plain ZeRO path only (tp = pp = sp = 1).
    data = base_recipe_data(
        model, hw, 2048 if seq_len is None else seq_len, global_batch, precision, adapters
    )
    recipe = recipe_from_data(data, overrides, "--recipe auto")  # `data` holds the overrides from here on
    tp, pp, sp = parallel_degrees(recipe, load_ds_config(recipe.deepspeed.config)[1])
    _check_batch_split(recipe.optim.global_batch_size or 0, hw, (tp, pp, sp), "global_batch" in pins)
    shape = shape_from_config(model_fields(recipe))
    if seq_len is None and "seq_len" not in pins and shape.max_position_embeddings < 2048:
        set_key(data, "data.seq_len", shape.max_position_embeddings)
    # What auto writes with the layout the overrides ask for, as it writes it for a sequence-parallel choice.
    if tp == pp == sp == 1 and "attn_impl" not in pins:
        set_key(data, "memory.attention", planned_attention(hw, shape.head_dim))
    if sp > 1 and "data.packing" not in keys:
        set_key(data, "data.packing", "padded")  # under Ulysses sdpa sees one causal sequence per row
    run = _resolve_base(data, hw, "ds_key" in pins)
    base = memory_inputs(run, shape, hw.gpus_per_node)
    kinds = _kinds(adapters, pins, base, hw)
    kind_bases = _kind_bases(data, kinds, set(keys), hw, shape)
    return AutoRequest(
        model,
        shape,
        hw,
        base.seq_len,
        base.layout.global_batch_size,
        nvme_bytes,
        base,
        run.recipe,
        pins,
        tuple(k for k in kinds if k in kind_bases),
        memlock or memlock_limit(),
        tuple(overrides),
        kind_bases,
        lora_keys,
        largest_weight(run.model_fields, run.hidden_size),
        "deepspeed.nvme_path" in keys,
    )


def _resolve_base(data: dict[str, Any], hw: Hardware, ds_pinned: bool) -> Resolved:
    """The base recipe resolved. Its DS JSON is only where the search starts (candidates vary it), so where the
    user did not set deepspeed.config and an override needs another (optim.state_dtype=bf16 needs the optimizer
    offloaded), the first shipped one the run accepts is taken; `data` is set to it. With none, the refusal of
    auto's first is the answer."""
    names = [data["deepspeed"]["config"]] if ds_pinned else list(dict.fromkeys(SHIPPED_DS_CONFIGS.values()))
    first: UserError | None = None
    for name in names:
        set_key(data, "deepspeed.config", name)
        try:
            return resolve_recipe(
                recipe_from_data(copy.deepcopy(data), [], "--recipe auto"), hw.gpus, hw.device()
            )
        except UserError as exc:
            first = first or exc
    set_key(data, "deepspeed.config", names[0])
    assert first is not None
    raise first


def _check_batch_split(batch: int, hw: Hardware, degrees: tuple[int, int, int], pinned: bool) -> None:
    """--global-batch must split over the layout's data-parallel ranks, world / (tp x pp x sp): pipeline
    stages, tensor and sequence parallelism share the GPUs, so fewer ranks draw samples. (A pinned
    optim.global_batch_size is checked by the recipe's own batch rule, in its own terms.)"""
    tp, pp, sp = degrees
    if pinned or not degrees_divide(hw.gpus, tp, pp, sp):
        return  # the resolution names the key, or the degrees that do not divide the world
    dp = hw.gpus // (tp * pp * sp)
    if batch % dp:
        raise UserError(
            f"--global-batch {batch} does not split over {dp} data-parallel ranks ({hw.gpus} GPUs / (tp {tp} x "
            f"pp {pp} x sp {sp})); pick a multiple of {dp}"
        )


def _kind_bases(
    data: dict[str, Any], kinds: tuple[Kind, ...], keys: set[str], hw: Hardware, shape: ModelShape
) -> dict[Kind, KindBase]:
    """Each kind's recipe, resolved; a kind the run would refuse with the user's overrides is left out (QLoRA
    with the user's DS JSON offloading parameters to NVMe), unless it is the only one: then its refusal is
    the answer."""
    out: dict[Kind, KindBase] = {}
    first_error: UserError | None = None
    for kind in kinds:
        body = kind_data(data, kind, keys)
        try:
            run = resolve_recipe(
                recipe_from_data(copy.deepcopy(body), [], "--recipe auto"), hw.gpus, hw.device()
            )
        except UserError as exc:
            first_error = first_error or exc
            continue
        out[kind] = KindBase(body, memory_inputs(run, shape, hw.gpus_per_node))
    if not out and first_error is not None:
        raise first_error
    return out


def kind_data(data: dict[str, Any], kind: Kind, keys: set[str]) -> dict[str, Any]:
    """Auto's base mapping (overrides applied) as a recipe of one kind: a full fine-tune has no lora section;
    adapters get the recipe's own LoRA defaults where the user set none, at the kind's rank and base
    quantisation, and the adapter learning rate unless optim.lr is set."""
    out = copy.deepcopy(data)
    rank, quantize = kind
    if rank is None:
        out.pop("lora", None)
        return out
    if "lora" not in out:
        out["lora"] = suggested_lora()
        if "optim.lr" not in keys:
            out["optim"]["lr"] = ADAPTER_LR
    out["lora"]["rank"] = rank
    if quantize != "none":
        out["lora"]["quantize"] = quantize
    elif "lora.quantize" not in keys:
        out["lora"].pop("quantize", None)
    return out


def _kinds(adapters_only: bool, pins: frozenset[str], base: MemoryInputs, hw: Hardware) -> tuple[Kind, ...]:
    """Full fine-tune, 16-bit LoRA and QLoRA (CUDA: bitsandbytes' GPU kernels), as the policy and pins allow
    (adapters_only: --lora, or a lora.* override)."""
    rank = base.lora_rank if "lora_rank" in pins else SUGGESTED_LORA_RANK
    kinds: list[Kind] = [FULL, (rank, "none"), (rank, "nf4")]
    # lora="never" still estimates adapters: the verdict judges a full fine-tune against them (choose_auto).
    if adapters_only:
        kinds = [k for k in kinds if k[0]]
    if "quantize" in pins:
        kinds = [k for k in kinds if k[1] == base.quantize] or [(rank, base.quantize)]
    elif hw.kind != "cuda":
        kinds = [k for k in kinds if k[1] == "none"]
    return tuple(kinds)


# The learning rates auto writes: adapters are usually trained at a higher rate than every weight.
ADAPTER_LR, FULL_LR = 2.0e-4, 1.0e-5


def suggested_lora() -> dict[str, Any]:
    """The lora section auto writes where the user set none: the recipe schema's defaults, spelled out (rank,
    alpha, dropout, target modules), so the written recipe says what it trains."""
    d = SUGGESTED_LORA
    return {"rank": d.rank, "alpha": d.alpha, "dropout": d.dropout, "target_modules": list(d.target_modules)}


def base_recipe_data(
    model: str, hw: Hardware, seq_len: int, global_batch: int, precision: str, adapters: bool
) -> dict[str, Any]:
    """The recipe auto writes, before its knobs are chosen: the knobs at their lightest, the rest as
    written for every choice."""
    corpus = str((RECIPES_DIR / "../llm_train/assets/tiny/corpus.txt").resolve())
    slug = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")[-40:]
    body: dict[str, Any] = {
        "name": f"auto-{slug}",
        "description": "",
        "hardware": {
            "device": hw.kind,
            "nodes": -(-hw.gpus // hw.gpus_per_node),
            "processes_per_node": hw.gpus_per_node,
            **(
                {"gpu_name": hw.name, "gpu_mem_gib": round(hw.gpu_mem_bytes / GiB, 2)}
                if hw.kind == "cuda"
                else {}
            ),
        },
        "model": {"name_or_path": model},
        "data": {"train": [corpus], "eval_fraction": 0.02, "seq_len": seq_len},
        "optim": {
            "lr": ADAPTER_LR if adapters else FULL_LR,
            "weight_decay": 0.0,
            "warmup_steps": 10,
            "schedule": "cosine",
            "grad_clip": 1.0,
            "micro_batch_size": 1,
            "global_batch_size": global_batch,
            "epochs": 1,
            "seed": 42,
        },
        "precision": precision,
        # sdpa_flex is set by auto_request once the layout is known to be plain (it needs tp = pp = sp = 1).
        "memory": {"activation_checkpointing": False, "attention": "sdpa"},
        **({"lora": suggested_lora()} if adapters else {}),
        "deepspeed": {"config": "zero0"},
        "output": {"dir": "runs/{name}", "log_every": 10},
        "tracking": {"mode": "disabled"},
    }
    return body


# (sp, tiled_mlp, tiled_loss, offload_checkpoints) without any DeepSpeed ALST technique.
NO_ALST = (1, False, False, False)
LONG_CONTEXT_PINS = {"sp", "tiled_mlp", "tiled_loss", "offload_checkpoints"}
# The chunked loss alone (memory.tiled_loss): not only for long rows, a 128k-vocabulary loss costs 12 bytes
# per logit without it, so it is always a candidate; the ranking takes it where it lets a faster
# configuration fit (its ~2% of compute loses to the dense loss where both fit alike).
CHUNKED_LOSS = (1, False, True, False)


def candidates(
    ask: AutoRequest, kind: Kind, long_context: list[tuple[int, bool, bool, bool]]
) -> list[MemoryInputs]:
    """Every DS JSON x pinning x micro-batch x checkpointing x long-context option of one kind that the layout
    (and sequence-parallel) rules accept and whose micro-batch divides the global batch over the layout's
    data-parallel ranks; pinned knobs stay. Each varies the kind's own resolved recipe (KindBase), so what
    the search does not turn is what the written recipe says."""
    base = ask.kind_bases[kind].inputs
    quantize = kind[1]
    micros = [base.micro_batch] if "micro_batch" in ask.pins else list(AUTO_MICRO_BATCHES)
    ckpts = [base.activation_checkpointing] if "activation_checkpointing" in ask.pins else [False, True]
    out = []
    for mode, micro, ckpt, (sp, tiled_mlp, tiled_loss, offload_ckpt) in itertools.product(
        ask.modes, micros, ckpts, long_context
    ):
        # Data-parallel ranks: tensor-parallel groups, pipeline stages and sequence-parallel groups share GPUs.
        ranks = base.world_size // (base.tp * base.pp * sp)
        if ranks < 1 or ask.global_batch % (micro * ranks):
            continue
        attention = base.attn_impl
        if sp > 1 and attention in FLEX_KERNELS and "attn_impl" not in ask.pins:
            attention = "sdpa"  # Ulysses wraps sdpa or flash-attention only
        for pinning in ask.pinnings(mode):
            settings = dict(ask.ds_settings(mode, pinning))  # shipped_settings is cached: never edit its dict
            if sp > 1 and mode[0] == 3:
                # What the run's effective DS JSON does under Ulysses with ZeRO-3 (ds_json.effective_config):
                # the reduce bucket grows to the largest weight, so every gradient takes the all-reduce path.
                settings["reduce_bucket_size"] = max(settings["reduce_bucket_size"] or 0, ask.largest_weight)
            try:
                candidate = base.vary(
                    **settings,
                    zero_stage=mode[0],
                    offload_optimizer=mode[1],
                    offload_params=mode[2],
                    micro_batch_size=micro,
                    grad_accum=ask.global_batch // (micro * ranks),
                    sp=sp,
                    activation_checkpointing=ckpt,
                    zero_init=zero_init_for(quantize),  # follows the stage (or a quantised base's loader)
                    attn_impl=attention,
                    tiled_mlp=tiled_mlp,
                    tiled_loss=tiled_loss,
                    offload_checkpoints=offload_ckpt,
                    loader_forks=loader_forks_for(ask.recipe.data.loader_workers, mode[1], ask.on_gpu),
                )
            except MemoryInputError:
                continue  # a combination the layout (or sequence-parallel, or QLoRA) rules refuse
            out.append(candidate)
    return out


def fitting_search(ask: AutoRequest, kind: Kind) -> list[Evaluation]:
    """The candidates of one kind evaluated: without ALST (with and without the chunked loss); with ALST too
    when nothing fits without (only a long sequence needs it). Native pinning that would lock more than the
    memlock limit allows is left out."""
    first = [ask.base.long_context] if ask.pins & LONG_CONTEXT_PINS else [NO_ALST, CHUNKED_LOSS]
    out = _evaluate(ask, candidates(ask, kind, first))
    if not any(e.fits for e in out) and not ask.pins & LONG_CONTEXT_PINS:
        options = [o for o in long_context_options(ask.base)[1:] if o != CHUNKED_LOSS]
        out += _evaluate(ask, candidates(ask, kind, options))
    return out


def _evaluate(ask: AutoRequest, inputs: list[MemoryInputs]) -> list[Evaluation]:
    out = []
    for c in inputs:
        ev = evaluate(c, ask.hw, ask.nvme_bytes)
        native = "native" in (c.pinning, c.param_pinning)
        if native and "pinning" not in ask.pins and not ask.memlock.allows(ev.estimate.locked_per_rank):
            continue  # this shell could not lock it: torch's allocator or pageable buffers instead
        out.append(ev)
    return out


def lora_search(ask: AutoRequest) -> list[Evaluation]:
    """Adapter candidates evaluated: 16-bit LoRA and QLoRA (the same adapters on a 4-bit base) side by side."""
    return [e for kind in ask.kinds if kind[0] for e in fitting_search(ask, kind)]


def fastest_fitting(tried: list[Evaluation]) -> tuple[Evaluation | None, list[Evaluation]]:
    """(the first by `_auto_key` of those that fit, or None; all that fit)."""
    fitting = [e for e in tried if e.fits]
    return (min(fitting, key=_auto_key) if fitting else None), fitting


def pick(
    ask: AutoRequest,
    full_tried: list[Evaluation],
    lora_tried: list[Evaluation],
    alternatives: list[Evaluation],
    lora: str,
) -> tuple[Evaluation, list[Evaluation], list[str]]:
    """(the choice, the fitting configurations of its kind, why LoRA when it is LoRA).

    The fastest full fine-tune that fits, unless it is impractical and a practical LoRA fits; else the
    fastest LoRA that fits; else UserError with the closest miss.
    """
    full, full_fitting = fastest_fitting(full_tried)
    best_lora, lora_fitting = fastest_fitting(lora_tried)
    exact_base: list[str] = []
    if best_lora is not None and (preferred := prefer_exact_base(best_lora, lora_fitting)) is not best_lora:
        exact_base.append(
            f"the base stays 16-bit: the fastest QLoRA (the runner-up below) is faster by under "
            f"{EXACT_BASE_MARGIN - 1:.0%}, inside the rough speed model's error, and a 4-bit base changes every "
            "frozen weight"
        )
        best_lora = preferred
    full_verdict = judge(full, alternatives) if full is not None else None
    # LoRA replaces an impractical full fine-tune only when it is practical itself.
    lora_helps = best_lora is not None and judge(best_lora, alternatives).practical
    if full is not None and full_verdict is not None and (full_verdict.practical or not lora_helps):
        return full, full_fitting, []
    if best_lora is None:
        kinds = [k for k in ask.kinds if lora != "never" or k == FULL]
        raise UserError(_nowhere(ask.model, ask.hw, full_tried + lora_tried, kinds, ask.nvme_bytes))
    reasons = lora_reasons(ask, full, full_verdict, best_lora, lora, full_tried, lora_tried)
    return best_lora, lora_fitting, reasons + exact_base


# QLoRA has to beat the fastest 16-bit LoRA that fits by more than this to be chosen. A 4-bit base
# changes every frozen weight (nf4 round trip: relative RMS error 0.092 on normal weights, measured by
# bench/gpu_run.sh's probe on CPU), and step-time differences of a few percent are inside the rough
# speed model's error (its compute efficiency by micro-batch is a curve, not a measurement of the card).
# So a near tie goes to the exact base, as an owner of a 24 GB card training an 8B would decide.
EXACT_BASE_MARGIN = 1.05


def policy_cost(full: Evaluation, alternatives: list[Evaluation], lora: str) -> list[str]:
    """What the policy's preference for a full fine-tune costs: the adapters that fit and would be faster (the
    one auto would pick among them), with both step times; nothing when no adapter configuration is faster."""
    best, fitting = fastest_fitting([e for e in alternatives if e.inputs.lora_rank])
    if best is None:
        return []
    best = prefer_exact_base(best, fitting)
    if best.time.total >= full.time.total:
        return []
    why = (
        "as --no-lora asks"
        if lora == "never"
        else "auto's policy: every weight is trained where a practical full fine-tune fits; --lora for adapters"
    )
    return [
        f"full fine-tune preferred ({why}): ~{full.time.total:,.1f} s/step against {_kind(best.inputs)}'s "
        f"~{best.time.total:,.1f} ({short_config(best.inputs)}, rank {best.inputs.lora_rank})"
    ]


def prefer_exact_base(fastest: Evaluation, fitting: list[Evaluation]) -> Evaluation:
    """The fastest 16-bit LoRA that fits when it is within EXACT_BASE_MARGIN of a faster QLoRA, else `fastest`."""
    exact = [e for e in fitting if e.inputs.lora_rank and e.inputs.quantize == "none"]
    if fastest.inputs.quantize == "none" or not exact:
        return fastest
    closest = min(exact, key=_auto_key)
    return closest if closest.time.total <= fastest.time.total * EXACT_BASE_MARGIN else fastest


def lora_reasons(
    ask: AutoRequest,
    full: Evaluation | None,
    full_verdict: Practicality | None,
    best_lora: Evaluation,
    lora: str,
    full_tried: list[Evaluation],
    lora_tried: list[Evaluation],
) -> list[str]:
    """Why the choice trains LoRA (or QLoRA) adapters, from what the search evaluated: adapters were asked for
    (a full fine-tune was not planned), or the full fine-tune is impractical, or none fits (with the closest);
    and why the base is 4-bit, against the 16-bit bases it was weighed with."""
    hw, rank = ask.hw, best_lora.inputs.lora_rank
    adapters = f"LoRA adapters (rank {rank}) on the frozen model"
    reasons = []
    if FULL not in ask.kinds:
        asked = f"{ask.lora_keys[0]} configures adapters" if ask.lora_keys else "--lora"
        reasons.append(f"{asked}: this trains {adapters}; a full fine-tune was not planned")
    elif full is not None and full_verdict is not None:
        reasons.append(
            f"a full fine-tune fits ({short_config(full.inputs)}) but is impractical: "
            f"{'; '.join(full_verdict.reasons)}; so this trains {adapters} (--no-lora for the full fine-tune)"
        )
    elif full_tried:
        closest = _closest(ask, full_tried)
        nvme = "" if ask.nvme_bytes else " (NVMe offload is considered only with --nvme-gib N)"
        reasons.append(
            f"no full fine-tune fits{nvme}: the closest, {short_config(closest.inputs)}, needs "
            f"{_needs_text(closest, hw)}; so this trains {adapters}"
        )
    if best_lora.inputs.quantize != "none":
        reasons.append(_four_bit_reason(ask, best_lora, lora_tried))
    return reasons


def _four_bit_reason(ask: AutoRequest, chosen: Evaluation, lora_tried: list[Evaluation]) -> str:
    """Why the frozen base is quantised: the user's lora.quantize, or the 16-bit bases it beat or that do not fit."""
    quantize = chosen.inputs.quantize
    what = (
        f"the frozen base loads in 4 bits (QLoRA, lora.quantize={quantize}; pip install 'llm_train[qlora]')"
    )
    if "quantize" in ask.pins:
        return f"{what}, as lora.quantize={quantize} asks"
    sixteen = [e for e in lora_tried if e.inputs.quantize == "none"]
    fitting = [e for e in sixteen if e.fits]
    if fitting:
        best = min(fitting, key=_auto_key)
        return (
            f"{what}: ~{chosen.time.total:,.1f} s/step against ~{best.time.total:,.1f} for the fastest with a "
            f"16-bit base ({short_config(best.inputs)}), faster by more than {EXACT_BASE_MARGIN - 1:.0%}"
        )
    if not sixteen:
        return f"{what}: no configuration with a 16-bit base was estimated"
    closest = _closest(ask, sixteen)
    return (
        f"{what}: no configuration with a 16-bit base fits; the closest, {short_config(closest.inputs)}, needs "
        f"{_needs_text(closest, ask.hw)}"
    )


def runner_up(chosen: Evaluation, fitting: list[Evaluation]) -> list[str]:
    """The fastest fitting configuration of another kind (full, LoRA, QLoRA), else of another DS JSON that is not
    just as fast (ZeRO-1 on one GPU is ZeRO-0), with both step times."""
    others = [e for e in fitting if _kind(e.inputs) != _kind(chosen.inputs)]
    if not others:
        others = [e for e in fitting if e.time.total > chosen.time.total * 1.001]
    if not others:
        return []
    second = min(others, key=_auto_key)

    def seconds(e: Evaluation) -> str:
        hidden = (
            f" ({e.time.overlapped:,.1f} if prefetch hides the copies)" if e.time.pcie_hideable > 0.05 else ""
        )
        return f"~{e.time.total:,.1f} s/step{hidden}"

    return [
        f"runner-up: {short_config(second.inputs)}{_pinning_text(second.inputs)}: {seconds(second)}, against "
        f"{seconds(chosen)} for this one"
    ]


def _pinning_text(c: MemoryInputs) -> str:
    if c.offload_optimizer == "none" and c.offload_params == "none":
        return ""
    pinning = c.pinning if c.offload_optimizer != "none" else c.param_pinning
    return f", {'pageable' if pinning == 'off' else pinning + '-pinned'} host buffers"


def lighter_misses(ask: AutoRequest, chosen: Evaluation, tried: list[Evaluation]) -> list[str]:
    """The evidence for the level of partitioning/offload: the lighter (faster) modes of the chosen kind
    that do not fit even at their smallest (micro-batch 1, checkpointing), closest to fitting first."""
    hw = ask.hw
    by_mode: dict[tuple[int, str, str], list[Evaluation]] = {}
    for e in tried:
        if _kind(e.inputs) == _kind(chosen.inputs):
            by_mode.setdefault(e.inputs.ds_key, []).append(e)
    misses = [
        min(evs, key=lambda e: _overflow(e, hw))
        for evs in by_mode.values()
        if not any(e.fits for e in evs)
        and min(e.time.total for e in evs) < chosen.time.total
        and (ask.nvme_bytes or not evs[0].inputs.uses_nvme)  # NVMe is no option without --nvme-gib
    ]
    return [
        f"not {_mode_text(e.inputs)}: even at its smallest it needs {_needs_text(e, hw)}"
        for e in sorted(misses, key=lambda e: _overflow(e, hw))[:3]
    ]


def technique_reasons(ask: AutoRequest, chosen: Evaluation, tried: list[Evaluation], lora: str) -> list[str]:
    """Why the choice turns on what costs speed (activation checkpointing, the chunked loss, DeepSpeed ALST,
    NVMe offload), each with the evaluated configurations that say so."""
    c = chosen.inputs
    reasons = []
    if ask.overrides:
        reasons.append(f"planned with your overrides as written: {' '.join(ask.overrides)}")
    if c.activation_checkpointing and "activation_checkpointing" not in ask.pins:
        reasons.append(
            _switch_reason(
                ask, chosen, tried, "activation checkpointing is on", lambda e: not e.activation_checkpointing
            )
        )
    if _pinning_text(c) and "pinning" not in ask.pins:
        reasons.append(_pinning_reason(ask, c))
    if c.long_context == CHUNKED_LOSS and "tiled_loss" not in ask.pins:
        reasons.append(
            _switch_reason(
                ask,
                chosen,
                tried,
                "the loss runs in chunks (memory.tiled_loss: exact, never the whole logits)",
                lambda e: e.long_context == NO_ALST,
            )
        )
    elif c.uses_long_context and not ask.pins & LONG_CONTEXT_PINS:
        reasons.append(_long_context_reason(ask, chosen, tried))
    if c.uses_nvme and not c.lora_rank and lora != "never":
        lighter, _ = fastest_fitting([e for e in tried if e.inputs.lora_rank and not e.inputs.uses_nvme])
        reasons.append(
            "NVMe offload is slow; "
            + (
                f"LoRA adapters (--lora) fit without it: ~{lighter.time.total:,.1f} s/step against "
                f"~{chosen.time.total:,.1f} ({short_config(lighter.inputs)})"
                if lighter is not None
                else "no adapter configuration fits without it either"
            )
        )
    return reasons


def _switch_reason(
    ask: AutoRequest,
    chosen: Evaluation,
    tried: list[Evaluation],
    what: str,
    without: Callable[[MemoryInputs], bool],
) -> str:
    """Why a switch that costs compute is on: the fastest configuration of the chosen kind without it that fits
    (slower, since the choice is the fastest), or the closest one without it when none fits."""
    kind = _kind(chosen.inputs)
    others = [e for e in tried if _kind(e.inputs) == kind and without(e.inputs)]
    kind = "full fine-tune" if kind == "full" else kind
    best, _ = fastest_fitting(others)
    if best is not None:
        return (
            f"{what}: it lets a faster configuration fit; the fastest without it, {short_config(best.inputs)}, "
            f"takes ~{best.time.total:,.1f} s/step"
        )
    if not others:
        return f"{what}: no {kind} configuration without it was estimated"
    closest = _closest(ask, others)
    return (
        f"{what}: no {kind} configuration without it fits; the closest, {short_config(closest.inputs)}, needs "
        f"{_needs_text(closest, ask.hw)}"
    )


def _pinning_reason(ask: AutoRequest, c: MemoryInputs) -> str:
    """Why the offload buffers are pinned the way the recipe says (deepspeed.pinning, planning/pinning.py)."""
    pinning = c.pinning if c.offload_optimizer != "none" else c.param_pinning
    native = c.vary(pinning="native", param_pinning="native")
    locked = estimate_memory(native).locked_per_rank
    limit = f"this shell's memlock limit is {ask.memlock.describe()}"
    if pinning == "native":
        return f"deepspeed.pinning=native: exact-size pinned host buffers (~{locked / GiB:.1f} GiB locked per process; {limit})"
    why = (
        f"native pinning would lock ~{locked / GiB:.1f} GiB per process and {limit}"
        if not ask.memlock.allows(locked)
        else "it is the fastest that fits"
    )
    what = (
        "torch's pinned allocator (rounded up to powers of two)"
        if pinning == "torch"
        else "pageable (slower copies)"
    )
    return f"deepspeed.pinning={pinning}: host buffers {what}: {why}"


def _long_context_reason(ask: AutoRequest, chosen: Evaluation, tried: list[Evaluation]) -> str:
    """ALST is on because the sequence needs it: the closest configuration of the same kind without it."""
    hw = ask.hw
    same_kind = [
        e
        for e in tried
        if not e.inputs.uses_long_context and bool(e.inputs.lora_rank) == bool(chosen.inputs.lora_rank)
    ]
    closest = min(same_kind, key=lambda e: _overflow(e, hw)) if same_kind else None
    evidence = (
        f": the closest without, {short_config(closest.inputs)}, needs {_needs_text(closest, hw)}"
        if closest
        else ""
    )
    return (
        f"--seq-len {ask.seq_len} needs DeepSpeed ALST ({long_context_text(chosen.inputs)}; exact, the same "
        f"training){evidence}"
    )


def _closest(ask: AutoRequest, evs: list[Evaluation]) -> Evaluation:
    """The evaluation closest to fitting; without --nvme-gib one without NVMe (NVMe is no option then)."""
    pool = [e for e in evs if not e.inputs.uses_nvme] if not ask.nvme_bytes else evs
    return min(pool or evs, key=lambda e: _overflow(e, ask.hw))


def _mode_text(c: MemoryInputs) -> str:
    """ZeRO stage and offload in words (the level of partitioning a miss is reported at)."""
    off = []
    if c.offload_optimizer != "none":
        off.append(f"optimizer on {c.offload_optimizer}")
    if c.offload_params != "none":
        off.append(f"weights on {c.offload_params}")
    return f"ZeRO-{c.zero_stage}" + (f" ({', '.join(off)})" if off else " without offload")


def _overflow(e: Evaluation, hw: Hardware) -> float:
    """How far over the limits an evaluation is (<= 1 fits): the worse of GPU and host."""
    gpu = e.device_bytes / hw.gpu_limit_bytes if hw.kind == "cuda" else 0.0
    return max(gpu, e.host_bytes / max(1, hw.host_limit_bytes))


def _needs_text(ev: Evaluation, hw: Hardware) -> str:
    parts = []
    if not ev.fits_device:
        parts.append(f"{ev.device_bytes / GiB:.1f} GiB per GPU (usable {hw.gpu_limit_bytes / GiB:.1f})")
    if not ev.fits_host:
        export = ev.estimate.host_terms.get("export_peak", 0)
        parts.append(
            f"{ev.host_bytes / GiB:.0f} GiB host RAM (usable {hw.host_limit_bytes / GiB:.0f}; "
            f"{export / GiB:.0f} of it the final export)"
        )
    if not ev.fits_nvme:
        parts.append(f"{ev.estimate.nvme_bytes / GiB:.0f} GiB of NVMe (--nvme-gib)")
    return " and ".join(parts)


def _nowhere(model: str, hw: Hardware, tried: list[Evaluation], kinds: list[Kind], nvme_bytes: int) -> str:
    """The one-line 'does not fit anywhere' message, with the least-overflowing configuration."""

    if not tried:
        # Nothing was estimated (every candidate broke a layout rule): there is no closest to report.
        return (
            f"--recipe auto: no configuration of {model} could be estimated on {hw.gpus} GPU(s) with these "
            "flags and overrides (each breaks a layout rule); drop a pinned knob (an override) and plan again"
        )
    # The closest by GPU and host RAM; NVMe space is reported separately (it is the user's to give).
    with_nvme = [e for e in tried if e.fits_device and e.fits_host and not e.fits_nvme]
    # Without --nvme-gib NVMe is not on the table: the closest is one the user can run as told.
    pool = [e for e in tried if not e.inputs.uses_nvme] if not nvme_bytes else tried
    closest = min([e for e in pool if e not in with_nvme] or tried, key=lambda e: _overflow(e, hw))
    nvme_text = ""
    if with_nvme:
        best = min(with_nvme, key=_auto_key)
        nvme_text = (
            f"; NVMe offload would fit with --nvme-gib >= {best.estimate.nvme_bytes / GiB:.0f}, at "
            f"~{best.time.total:,.0f} s/step and ~{best.time.tokens_per_s:,.0f} tokens/s"
        )
    names = dict.fromkeys("full" if k == FULL else "QLoRA" if k[1] != "none" else "LoRA" for k in kinds)
    what = " or ".join(names)  # the kinds estimated, as the flags and overrides allowed
    alst = (
        ", sequence parallel, tiled MLP/loss, checkpoint offload"
        if any(e.inputs.uses_long_context for e in tried)
        else ""
    )
    where = (
        f"{hw.gpus} x {hw.name} ({hw.gpu_mem_bytes / GiB:.1f} GiB)"
        if hw.kind == "cuda"
        else f"{hw.gpus} CPU process(es)"
    )
    offload = "CPU/NVMe offload" if nvme_bytes else "CPU offload"
    return (
        f"{model} DOES NOT FIT anywhere on {where} with {hw.host_ram_bytes / GiB:.0f} GiB host RAM "
        f"({what} fine-tune, every ZeRO stage, {offload}, checkpointing, micro-batch 1{alst}): "
        f"the closest, {short_config(closest.inputs)}, needs {_needs_text(closest, hw)}{nvme_text}; add GPUs "
        "(--gpus), bigger cards or more host RAM, or shorten --seq-len"
    )


def _auto_key(ev: Evaluation) -> tuple[bool, bool, float, int]:
    # Without NVMe before with it, fp32 optimizer states before bf16 ones (module docstring), then
    # fastest (StepTime.total counts every host copy whole); among equally fast ones (same step time to the millisecond) the one that needs
    # less memory, e.g. ZeRO-0 over ZeRO-1/2 on a single GPU.
    c = ev.inputs
    return (c.uses_nvme, c.state_dtype == "bf16", round(ev.time.total, 3), ev.device_bytes + ev.host_bytes)


def _kind(c: MemoryInputs) -> str:
    if not c.lora_rank:
        return "full"
    return "QLoRA" if c.quantize != "none" else "LoRA"


def auto_recipe_data(auto: AutoChoice, data: str | None = None) -> dict[str, Any]:
    """The chosen configuration as a recipe mapping: the chosen kind's recipe (auto's base with the user's
    overrides applied: KindBase.data) with the chosen knobs set. A knob the user set was pinned, so it is
    written at the value the override gave; nothing is applied after the choice."""
    hw, c, ev = auto.hardware, auto.inputs, auto.evaluation
    body = copy.deepcopy(auto.recipe_data)
    body["description"] = f"Auto-planned {_kind(c)} fine-tune of {auto.model} on {hw.gpus} x {hw.name}"
    body["hardware"]["host_ram_gib"] = round(ev.host_bytes / GiB + 0.5, 0)
    if data is not None:
        body["data"]["train"] = [data]
    for key, value in recipe_values(c, auto.ds_config).items():
        if key == "deepspeed.sequence_parallel" and value == 1:
            continue
        if key.startswith("memory.") and value is False and key != "memory.activation_checkpointing":
            continue  # the ALST switches: written only when on
        if key == "optim.state_dtype" and value == "fp32":
            continue
        set_key(body, key, value)
    if c.sp > 1 and "packing" not in auto.recipe_data["data"]:
        body["data"]["packing"] = "padded"  # under sequence parallelism sdpa sees one causal sequence per row
    if c.quantize == "none" and c.lora_rank and "quantize" not in auto.recipe_data.get("lora", {}):
        body["lora"].pop("quantize", None)
    if needs_nvme_path(auto):
        # The drive is the user's machine: a placeholder the header asks to replace (check_nvme_path refuses it,
        # in one line, at the start of a run where it does not exist).
        body["deepspeed"]["nvme_path"] = NVME_PATH_PLACEHOLDER
    return body


# What auto writes for deepspeed.nvme_path when it chooses NVMe offload and the user gave no directory.
NVME_PATH_PLACEHOLDER = "/path/to/nvme"


def needs_nvme_path(auto: AutoChoice) -> bool:
    """The choice offloads to NVMe and neither the user's overrides nor its DS JSON name the directory."""
    if not auto.inputs.uses_nvme or "nvme_path" in auto.recipe_data.get("deepspeed", {}):
        return False
    paths = nvme_paths(load_ds_config(auto.ds_config)[1]).values()
    return any(path in ("None", "auto") for path in paths)


def check_written(auto: AutoChoice, path: Path | None = None) -> None:
    """The invariant of `--recipe auto`: the recipe it writes, read back and planned from scratch like any
    recipe, is the configuration the search chose (the same estimate inputs, hence the same kind, stage,
    offload, micro x accum x dp, memory switches, memory and step time). Otherwise a one-line UserError:
    a plan that does not describe its recipe is worse than none.

    path None: the mapping about to be written, through YAML as the file will read (choose_auto, before
    anything is written); a path: the written file, as `llm-train plan --recipe FILE` resolves it.
    """
    import yaml

    hw = auto.hardware
    with_overrides = f" with {' '.join(auto.overrides)}" if auto.overrides else ""
    try:
        if path is None:
            body = yaml_load(yaml.safe_dump(auto_recipe_data(auto), sort_keys=False))
            run = resolve_recipe(recipe_from_data(body, [], "--recipe auto"), hw.gpus, hw.device())
        else:
            run = resolve_run(str(path), [], world_size=hw.gpus, device=hw.device())
        inputs = memory_inputs(run, shape_from_config(run.model_fields), hw.gpus_per_node)
    except UserError as exc:
        raise UserError(f"--recipe auto{with_overrides}: the recipe it writes is refused ({exc})") from None
    written = evaluate(inputs, hw, auto.nvme_bytes)
    chosen = auto.evaluation
    numbers = (written.device_bytes, written.host_bytes, written.time)
    if inputs != chosen.inputs or numbers != (chosen.device_bytes, chosen.host_bytes, chosen.time):
        raise UserError(
            f"--recipe auto{with_overrides}: the recipe it writes plans differently from its choice "
            f"({_differences(chosen.inputs, inputs) or 'the same inputs, other numbers'}): drop the override, "
            "or write the recipe yourself and check it with llm-train plan --recipe FILE"
        )


def _differences(chosen: MemoryInputs, written: MemoryInputs) -> str:
    """'field: chosen X, written Y' for each estimate input (layout fields included) that differs."""
    pairs = [(f.name, getattr(chosen, f.name), getattr(written, f.name)) for f in dataclasses.fields(chosen)]
    pairs += [
        (f"layout.{f.name}", getattr(chosen.layout, f.name), getattr(written.layout, f.name))
        for f in dataclasses.fields(chosen.layout)
    ]
    return "; ".join(
        f"{name}: chosen {a}, written {b}" for name, a, b in pairs if a != b and name != "layout"
    )


def auto_recipe_yaml(auto: AutoChoice, data: str | None = None) -> str:
    """A complete recipe for the chosen configuration, with a header like the shipped ones."""
    import yaml

    hw, ev = auto.hardware, auto.evaluation
    body = auto_recipe_data(auto, data)
    gpu_line = f"{ev.device_bytes / GiB:.1f} GiB per GPU, " if hw.kind == "cuda" else ""
    header = [
        f"# {body['name']}: generated by `llm-train plan --recipe auto --model {auto.model}`.",
        f"# {body['description']}.",
        f"# Planner: needs {gpu_line}{ev.host_bytes / GiB:.0f} GiB host RAM per node; "
        f"~{ev.time.total:.1f} s/step (rough).",
        *(f"# Why: {r}" for r in auto.reasons),
        "# Replace data.train with your data (the bundled demo corpus is a placeholder).",
        *(
            [
                f"# Set deepspeed.nvme_path to a directory on the NVMe drive ({NVME_PATH_PLACEHOLDER} is a placeholder)."
            ]
            if needs_nvme_path(auto)
            else []
        ),
        "# Launch:   accelerate launch llm_train/train.py --recipe THIS_FILE.yaml",
    ]
    return "\n".join(header) + "\n" + yaml.safe_dump(body, sort_keys=False)


def written_evaluation(auto: AutoChoice, path: Path) -> Evaluation:
    """The plan of the written recipe itself, resolved as `llm-train plan --recipe FILE` resolves it (the full
    resolution: layout, parallel and QLoRA rules): what `--write` prints, and what a test holds equal to the
    search's."""
    hw = auto.hardware
    run = resolve_run(str(path), [], world_size=hw.gpus, device=hw.device())
    return evaluate(
        memory_inputs(run, shape_from_config(run.model_fields), hw.gpus_per_node), hw, auto.nvme_bytes
    )


def _speed_parts(ev: Evaluation) -> str:
    t = ev.time
    parts = [("compute", t.compute), ("generation", t.generation), ("4-bit dequantisation", t.dequantize)]
    parts += [("ZeRO comm", t.communication)]
    parts += [("PCIe", t.pcie), ("CPU Adam", t.cpu_optimizer), ("NVMe", t.nvme)]
    text = ", ".join(
        f"{name} {seconds:.1f}s" for name, seconds in parts if seconds >= 0.05 or name == "compute"
    )
    return text + (
        f"; ~{t.overlapped:.1f}s/step if prefetch hides the copies" if t.pcie_hideable >= 0.05 else ""
    )


def render_auto(auto: AutoChoice, path: Path | None) -> str:
    ev, hw = auto.evaluation, auto.hardware
    lines = [
        f"llm-train plan --recipe auto: {auto.model} ({auto.shape.num_params / 1e9:.2f}B parameters)",
        f"hardware: {hw.describe()}",
        f"chosen:   {config_line(ev.inputs, ev.inputs.grad_accum)}; deepspeed.config={auto.ds_config}",
        f"needs:    {verdict(ev, hw, auto.practicality, auto.nvme_bytes)}",
        f"speed:    ~{ev.time.total:.2f} s/step, ~{ev.time.tokens_per_s:,.0f} tokens/s (rough model: {_speed_parts(ev)})",
        *([f"          {line}"] if (line := generation_line(ev)) else []),
        *([f"instead:  {auto.practicality.instead}"] if auto.practicality.instead else []),
        "why:",
        *(f"  - {r}" for r in auto.reasons),
    ]
    if path is not None:
        lines.append(f"recipe written to {path}")
    return "\n".join(lines)
