"""Recipe + DeepSpeed JSON + world size -> one fully resolved, validated run description.

This is everything that can be decided without importing torch or touching weights, so
the same function serves the dry run, the parent of a local multi-process launch (which
validates before starting workers) and every worker. What depends on the machine that
trains (the NVMe offload directory: exists, writable, free space) is checked separately, by
`check_nvme_path`, so a dry run or a plan made elsewhere still resolves.

A run is resolved once per process, from the recipe's name and the command line's strings
(`resolve_run`). What is known only later (the number of steps from optim.epochs, the
accumulation that keeps a checkpoint's global batch, universal-checkpoint loading, the
flops profiler, deepspeed.pinning=auto) changes it by value through `Resolved.refine`, which
derives a new run from the same loaded recipe and DS JSON: the layout rules, the attention
choice and the effective DS JSON (config/ds_json.py `effective_config`) are made again, in
the one function that made them the first time (`_derive`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from llm_train.config import ds_json
from llm_train.config.attention_kernel import choose_attention, head_dim_of
from llm_train.config.ds_validate import check_with_deepspeed
from llm_train.config.hardware import Device
from llm_train.config.known_models import KNOWN_CONFIGS
from llm_train.config.layout import Layout, make_layout
from llm_train.config.model_kind import changed_shape_keys, is_image_text, text_fields, untrainable_reason
from llm_train.config.objectives import objective_spec
from llm_train.config.parallel import check_parallel
from llm_train.config.recipe import Recipe, load_recipe, recipe_to_yaml
from llm_train.errors import UserError


@dataclass(frozen=True)
class RunBasis:
    """What a run is resolved from: `Resolved.refine` derives a new run from a changed copy of it."""

    recipe: Recipe  # as loaded (file, overrides, command-line options); memory.attention may still be "auto"
    ds_path: Path
    ds_raw: dict[str, Any]  # the DS JSON file's content, "auto" and all: never edited
    world_size: int
    device: Device
    load_universal: bool = False
    flops_profiler: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()  # notices decided outside the rules (deepspeed.pinning=auto): kept by refine


@dataclass(frozen=True)
class Resolved:
    """One run, fully resolved: made by `resolve_run`, changed only by `refine` (a new value)."""

    recipe: Recipe
    ds_path: Path
    ds_config: dict[str, Any]  # no "auto" left
    layout: Layout
    hidden_size: int
    model_fields: dict[str, Any]  # the HF config fields the shape came from
    notice: str | None
    attention: str
    """How memory.attention was decided (recipe.memory.attention holds the kernel itself, never "auto")."""
    basis: RunBasis

    def recipe_yaml(self) -> str:
        return recipe_to_yaml(self.recipe)

    def ds_json(self) -> str:
        return json.dumps(self.ds_config, indent=2)

    def refine(
        self,
        *,
        max_steps: int | None = None,
        grad_accum: int | None = None,
        pinning: str | None = None,
        load_universal: bool | None = None,
        flops_profiler: dict[str, Any] | None = None,
        notice: str | None = None,
    ) -> Resolved:
        """This run with values known only after resolution; every rule and "auto" derived again from them.

        max_steps: optim.max_steps (counted from optim.epochs once the data is known);
        grad_accum: optim.grad_accum (a resume that keeps the checkpoint's global batch);
        pinning: what deepspeed.pinning=auto decided; load_universal: DeepSpeed loads the
        universal checkpoint (a resume on another layout); flops_profiler: DeepSpeed's section
        for --flops-profiler; notice: one more notice for the start-up summary. None keeps a value.
        """
        changes: dict[str, int | str] = {
            key: value
            for key, value in (
                ("optim.max_steps", max_steps),
                ("optim.grad_accum", grad_accum),
                ("deepspeed.pinning", pinning),
            )
            if value is not None
        }
        basis = self.basis
        basis = replace(
            basis,
            recipe=_with_values(basis.recipe, changes),
            load_universal=basis.load_universal if load_universal is None else load_universal,
            flops_profiler=basis.flops_profiler if flops_profiler is None else flops_profiler,
            notes=(*basis.notes, notice) if notice else basis.notes,
        )
        return _derive(basis)


def _with_values(recipe: Recipe, changes: dict[str, int | str]) -> Recipe:
    """`recipe` with `changes` ({"section.key": value}) set and every validator run again."""
    if not changes:
        return recipe
    data = recipe.model_dump()
    for key, value in changes.items():
        section, name = key.split(".")
        data[section][name] = value
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        given = ", ".join(f"{key}={value}" for key, value in changes.items())
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise UserError(f"recipe {recipe.name} with {given}: {where}: {error['msg']}") from None


def model_fields(recipe: Recipe) -> dict[str, Any]:
    """The model's config fields, known without downloading anything when possible."""

    fields: dict[str, Any] = {}
    name = recipe.model.name_or_path
    if name:
        local = Path(name) / "config.json"
        if local.is_file():
            fields = json.loads(local.read_text())
        elif name in KNOWN_CONFIGS:
            fields = dict(KNOWN_CONFIGS[name])
        elif recipe.model.init == "random" and not recipe.model.config:
            raise UserError(
                f"model.name_or_path={name}: shape unknown offline; give a local directory with config.json"
            )
        if fields and recipe.model.init == "pretrained":
            _refuse_shape_overrides(name, fields, recipe.model.config)
    fields.update(recipe.model.config)
    reason = untrainable_reason(fields)
    if fields and reason is not None:
        raise UserError(f"model {name or fields.get('model_type')}: {reason}; llm_train cannot train it")
    if not objective_spec(recipe.objective).image_models and is_image_text(fields):
        raise UserError(
            f"objective=reward: model {name or fields.get('model_type')} is an image-text model, and a reward "
            "model's score head is built on a causal LM; train the reward model from a text-only checkpoint"
        )
    _refuse_images_for_a_text_model(recipe, fields)
    return fields


def _refuse_images_for_a_text_model(recipe: Recipe, fields: dict[str, Any]) -> None:
    """format image_chat on a model with no vision tower: refused here, before any worker prepares the data
    (which would refuse it too, for want of an image processor, but once per rank and after start-up)."""
    if not fields or is_image_text(fields):
        return
    for split in ("train", "eval"):
        for i, source in enumerate(recipe.data.sources(split)):
            if source.format == "image_chat":
                raise UserError(
                    f"data.{split}[{i}] is format image_chat, whose images model "
                    f"{recipe.model.name_or_path or fields.get('model_type')} cannot read (a text-only model); "
                    "use an image-text checkpoint, or format chat for text-only rows"
                )


def _refuse_shape_overrides(name: str, checkpoint: dict[str, Any], overrides: dict[str, Any]) -> None:
    """model.config may tune a pretrained checkpoint (dropout, rope scaling), never reshape or untie it:
    its weights would not fit, or an untied head would be drawn at random and trained from there."""
    changed = changed_shape_keys(checkpoint, overrides)
    if changed:
        key = changed[0]
        own = checkpoint.get(key, text_fields(checkpoint).get(key))
        raise UserError(
            f"model.config.{key}={overrides[key]} would change checkpoint {name}'s {key} ({own}): a pretrained "
            f"model's shapes and tying come from its config.json; remove model.config.{key} "
            "(model.config={} drops every field a recipe sets for init=random)"
        )


def resolve_run(
    recipe_name: str,
    overrides: list[str],
    world_size: int | None,
    device: Device | None = None,
    ds_config_path: str | None = None,
    max_steps: int | None = None,
    output_dir: str | None = None,
) -> Resolved:
    """The run a recipe name, its overrides and the command line's options ask for.

    world_size None: the hardware the recipe declares; device None: the recipe's declared device.
    """
    extra = list(overrides)
    if max_steps is not None:
        extra.append(f"optim.max_steps={max_steps}")
    if output_dir is not None:
        extra.append(f"output.dir={Path(output_dir).resolve()}")
    if ds_config_path is not None:
        extra.append(
            f"deepspeed.config={Path(ds_config_path).resolve() if Path(ds_config_path).exists() else ds_config_path}"
        )
    return resolve_recipe(load_recipe(recipe_name, extra), world_size, device)


def resolve_recipe(recipe: Recipe, world_size: int | None, device: Device | None = None) -> Resolved:
    """The run of a loaded recipe (`resolve_run` without the command line's strings)."""
    device = device or Device.declared(recipe)
    ds_path, raw = ds_json.load_ds_config(recipe.deepspeed.config)
    world = recipe.hardware.world_size if world_size is None else world_size
    return _derive(RunBasis(recipe, ds_path, raw, world, device))


def _derive(basis: RunBasis) -> Resolved:
    """The one place a run is derived from its basis: layout, attention, model shape, effective DS JSON."""
    recipe, ds_path, raw, device = basis.recipe, basis.ds_path, basis.ds_raw, basis.device
    layout, notice = make_layout(recipe, raw, basis.world_size, device, str(ds_path))
    fields = model_fields(recipe)
    text = text_fields(fields)  # an image-text model's language model: its heads, hidden size, vocabulary
    # Before the parallel checks, which judge the kernel itself (Ulysses and packed rows need flash-attention).
    # The card's facts and the head size decide whether flex_attention's backward fits (attention_kernel.py).
    attention = choose_attention(
        recipe.memory.attention, device, layout.tp, layout.pp, layout.sp, head_dim=head_dim_of(text)
    )
    recipe = recipe.model_copy(
        update={"memory": recipe.memory.model_copy(update={"attention": attention.kernel})}
    )
    check_parallel(layout, recipe, fields, str(ds_path))  # tp/pp against the model and DeepSpeed
    hidden = int(text.get("hidden_size") or text.get("n_embd") or text.get("d_model") or 0)
    if hidden <= 0:
        # Only bucket sizes need it; a user model with an exotic config still trains.
        hidden = 4096
    values = ds_json.RecipeValues(
        micro_batch_size=layout.micro_batch_size,
        grad_accum=layout.grad_accum,
        global_batch_size=layout.global_batch_size,
        grad_clip=recipe.optim.grad_clip,
        precision=layout.precision,
        hidden_size=hidden,
        lr=recipe.optim.lr,
        betas=recipe.optim.betas,
        eps=recipe.optim.eps,
        weight_decay=recipe.optim.weight_decay,
        warmup_steps=recipe.optim.warmup_steps,
        max_steps=recipe.optim.max_steps or 0,
        nvme_path=recipe.deepspeed.nvme_path,
        state_dtype=recipe.optim.state_dtype,
        optimizer=recipe.optim.name,
        largest_weight=largest_weight(fields, hidden),
        pinning=recipe.deepspeed.pinning,
        tp=layout.tp,
        sp=layout.sp,
        load_universal=basis.load_universal,
        flops_profiler=basis.flops_profiler,
    )
    effective = ds_json.effective_config(raw, values, str(ds_path))
    # Last: DeepSpeed's own config classes see exactly the JSON the workers will hand it.
    check_with_deepspeed(effective, str(ds_path))
    rewritten = ds_json.rewrite_notice(raw, effective, str(ds_path))
    notices = "; ".join(n for n in (notice, rewritten, *basis.notes) if n) or None
    return Resolved(recipe, ds_path, effective, layout, hidden, fields, notices, attention.why, basis)


def largest_weight(fields: dict[str, Any], hidden: int) -> int:
    """Elements of the model's largest weight matrix (embedding, MLP or attention projection).

    Of the language model, for an image-text model too: its embedding dwarfs any vision tower matrix."""
    fields = text_fields(fields)
    heads = int(fields.get("num_attention_heads") or 1)
    head_dim = int(fields.get("head_dim") or hidden // heads)
    rows = max(
        int(fields.get("vocab_size") or 0),
        int(fields.get("intermediate_size") or 0),
        heads * head_dim,
        hidden,
    )
    return rows * hidden


def steps_for_epochs(epochs: float, micro_batches_per_epoch: int, grad_accum: int) -> int:
    return max(1, math.ceil(epochs * micro_batches_per_epoch / grad_accum))
