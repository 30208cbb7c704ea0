"""Recipe + DeepSpeed JSON + world size -> one fully resolved, validated run description.

This is everything that can be decided without importing torch or touching weights, so
the same function serves the dry run, the parent of a local multi-process launch (which
validates before starting workers) and every worker.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm_train import dsconfig
from llm_train.errors import UserError
from llm_train.parallel import check_parallel
from llm_train.plan import Device, ParallelPlan, make_plan
from llm_train.recipe import Recipe, load_recipe, recipe_to_yaml


@dataclass(frozen=True)
class Resolved:
    recipe: Recipe
    ds_path: Path
    ds_config: dict[str, Any]  # no "auto" left
    plan: ParallelPlan
    hidden_size: int
    model_fields: dict[str, Any]  # the HF config fields the shape came from
    notice: str | None

    def recipe_yaml(self) -> str:
        return recipe_to_yaml(self.recipe)

    def ds_json(self) -> str:
        return json.dumps(self.ds_config, indent=2)


def model_fields(recipe: Recipe) -> dict[str, Any]:
    """The model's config fields, known without downloading anything when possible."""
    from llm_train.shapes import KNOWN_CONFIGS

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
    fields.update(recipe.model.config)
    return fields


def resolve_run(
    recipe_name: str,
    overrides: list[str],
    world_size: int,
    device: Device | None = None,
    ds_config_path: str | None = None,
    max_steps: int | None = None,
    output_dir: str | None = None,
) -> Resolved:
    extra = list(overrides)
    if max_steps is not None:
        extra.append(f"optim.max_steps={max_steps}")
    if output_dir is not None:
        extra.append(f"output.dir={Path(output_dir).resolve()}")
    if ds_config_path is not None:
        extra.append(
            f"deepspeed.config={Path(ds_config_path).resolve() if Path(ds_config_path).exists() else ds_config_path}"
        )
    recipe = load_recipe(recipe_name, extra)
    device = device or Device.declared(recipe)
    ds_path, raw = dsconfig.load_ds_config(recipe.deepspeed.config)
    plan, notice = make_plan(recipe, raw, world_size, device)
    fields = model_fields(recipe)
    check_parallel(plan, recipe, fields, str(ds_path))  # tp/pp against the model and DeepSpeed
    hidden = int(fields.get("hidden_size") or fields.get("n_embd") or fields.get("d_model") or 0)
    if hidden <= 0:
        # Only bucket sizes need it; a user model with an exotic config still trains.
        hidden = 4096
    values = dsconfig.RecipeValues(
        micro_batch_size=plan.micro_batch_size,
        grad_accum=plan.grad_accum,
        global_batch_size=plan.global_batch_size,
        grad_clip=recipe.optim.grad_clip,
        precision=plan.precision,
        hidden_size=hidden,
        lr=recipe.optim.lr,
        betas=recipe.optim.betas,
        eps=recipe.optim.eps,
        weight_decay=recipe.optim.weight_decay,
        warmup_steps=recipe.optim.warmup_steps,
        max_steps=recipe.optim.max_steps or 0,
    )
    resolved = dsconfig.resolve(raw, values, str(ds_path))
    if plan.tp > 1:
        # Under AutoTP DeepSpeed asserts train_batch = micro x accum x *all* ranks (it is given no
        # mpu, so TP replicas count); the recipe's global batch counts distinct sequences.
        resolved["train_batch_size"] = plan.global_batch_size * plan.tp
        # Export gathers the TP shards through this switch (accelerate.get_state_dict refuses without it).
        resolved.setdefault("zero_optimization", {})["stage3_gather_16bit_weights_on_model_save"] = True
    return Resolved(recipe, ds_path, resolved, plan, hidden, fields, notice)


def steps_for_epochs(epochs: float, micro_batches_per_epoch: int, grad_accum: int) -> int:
    return max(1, math.ceil(epochs * micro_batches_per_epoch / grad_accum))


def memory_rows(run: Resolved) -> list[tuple[str, str]]:
    """The per-GPU memory estimate for the dry run (empty when the shape is not a known family)."""
    from llm_train.memory import estimate_memory
    from llm_train.planner import memory_inputs
    from llm_train.shapes import shape_from_config

    try:
        shape = shape_from_config(run.model_fields)
    except UserError:
        return []
    return estimate_memory(memory_inputs(run, shape)).table()
