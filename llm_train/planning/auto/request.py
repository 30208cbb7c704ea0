"""What `--recipe auto` plans from: the request (the model, hardware, batch and the user's overrides made into
auto's base recipe, resolved), the kinds of training it may choose (full, LoRA, QLoRA) each as its own
recipe, and how candidates rank (`auto_key`: fits, without NVMe, then the step time; a 16-bit base over a
QLoRA within EXACT_BASE_MARGIN). planning/auto/choose.py searches; docs/planning.md has the policy.
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass, field
from typing import Any

from llm_train import RECIPES_DIR
from llm_train.config.attention_kernel import Installed, flex_fits
from llm_train.config.ds_json import load_ds_config
from llm_train.config.hardware import Hardware
from llm_train.config.layout import default_precision, degrees_divide, parallel_degrees
from llm_train.config.recipe import Recipe, recipe_from_data
from llm_train.config.recipe_files import parse_override
from llm_train.config.resolution import Resolved, largest_weight, model_fields, resolve_recipe
from llm_train.errors import UserError
from llm_train.planning.auto.knobs import pinned_fields, set_key
from llm_train.planning.memory.inputs import MemoryInputs
from llm_train.planning.memory.pinning import MemlockLimit, memlock_limit
from llm_train.planning.model.shapes import ModelShape, shape_from_config, shape_of
from llm_train.planning.search.candidate import (
    SHIPPED_DS_CONFIGS,
    SUGGESTED_LORA,
    SUGGESTED_LORA_RANK,
    Evaluation,
    ds_fields,
    memory_inputs,
    shipped_settings,
)
from llm_train.units import GiB

# The pinning choices of an offloading candidate (recipe values of deepspeed.pinning).
PINNING_CHOICES = ("native", "torch", "off")


# (lora rank, quantize): what a candidate trains.
Kind = tuple[int | None, str]


FULL: Kind = (None, "none")


def kind_of(c: MemoryInputs) -> Kind:
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
    # A flag and an override of the same key: the override would silently win over the flag. Equal is fine.
    if seq_len is not None and "data.seq_len" in keys and parse_override(keys["data.seq_len"])[1] != seq_len:
        raise UserError(
            f"--seq-len {seq_len} and {keys['data.seq_len']} disagree; give the sequence length once "
            "(either the flag or the override)"
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


# QLoRA has to beat the fastest 16-bit LoRA that fits by more than this to be chosen. A 4-bit base
# changes every frozen weight (nf4 round trip: relative RMS error 0.092 on normal weights, measured by
# bench/gpu_run.sh's probe on CPU), and step-time differences of a few percent are inside the rough
# speed model's error (its compute efficiency by micro-batch is a curve, not a measurement of the card).
# So a near tie goes to the exact base, as an owner of a 24 GB card training an 8B would decide.
EXACT_BASE_MARGIN = 1.05


def fastest_fitting(tried: list[Evaluation]) -> tuple[Evaluation | None, list[Evaluation]]:
    """(the first by `auto_key` of those that fit, or None; all that fit)."""
    fitting = [e for e in tried if e.fits]
    return (min(fitting, key=auto_key) if fitting else None), fitting


def prefer_exact_base(fastest: Evaluation, fitting: list[Evaluation]) -> Evaluation:
    """The fastest 16-bit LoRA that fits when it is within EXACT_BASE_MARGIN of a faster QLoRA, else `fastest`."""
    exact = [e for e in fitting if e.inputs.lora_rank and e.inputs.quantize == "none"]
    if fastest.inputs.quantize == "none" or not exact:
        return fastest
    closest = min(exact, key=auto_key)
    return closest if closest.time.total <= fastest.time.total * EXACT_BASE_MARGIN else fastest


def auto_key(ev: Evaluation) -> tuple[bool, bool, float, int]:
    # Without NVMe before with it, fp32 optimizer states before bf16 ones (module docstring), then
    # fastest (StepTime.total counts every host copy whole); among equally fast ones (same step time to the millisecond) the one that needs
    # less memory, e.g. ZeRO-0 over ZeRO-1/2 on a single GPU.
    c = ev.inputs
    return (c.uses_nvme, c.state_dtype == "bf16", round(ev.time.total, 3), ev.device_bytes + ev.host_bytes)


def kind_name(c: MemoryInputs) -> str:
    if not c.lora_rank:
        return "full"
    return "QLoRA" if c.quantize != "none" else "LoRA"


# (sp, tiled_mlp, tiled_loss, offload_checkpoints) without any DeepSpeed ALST technique.
NO_ALST = (1, False, False, False)


LONG_CONTEXT_PINS = {"sp", "tiled_mlp", "tiled_loss", "offload_checkpoints"}


# The chunked loss alone (memory.tiled_loss): not only for long rows, a 128k-vocabulary loss costs 12 bytes
# per logit without it, so it is always a candidate; the ranking takes it where it lets a faster
# configuration fit (its ~2% of compute loses to the dense loss where both fit alike).
CHUNKED_LOSS = (1, False, True, False)
