"""Recipe + DeepSpeed JSON + world size -> one fully resolved, validated run description.

This is everything that can be decided without importing torch or touching weights, so
the same function serves the dry run, the parent of a local multi-process launch (which
validates before starting workers) and every worker. What depends on the machine that
trains (the NVMe offload directory: exists, writable, free space) is checked separately, by
`check_nvme_path`, so a dry run or a plan made elsewhere still resolves.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llm_train.config import ds_json
from llm_train.config.attention import choose_attention
from llm_train.config.ds_validate import check_with_deepspeed
from llm_train.config.hardware import Device
from llm_train.config.known_models import KNOWN_CONFIGS
from llm_train.config.layout import Layout, make_layout
from llm_train.config.parallel import check_parallel
from llm_train.config.recipe import Recipe, load_recipe, recipe_to_yaml
from llm_train.errors import UserError

if TYPE_CHECKING:
    pass

DS_PARAM_SWAP_BUFFER_DEFAULT = (
    100_000_000  # offload_param.buffer_size (deepspeed/runtime/zero/offload_config.py)
)


@dataclass(frozen=True)
class Resolved:
    recipe: Recipe
    ds_path: Path
    ds_config: dict[str, Any]  # no "auto" left
    layout: Layout
    hidden_size: int
    model_fields: dict[str, Any]  # the HF config fields the shape came from
    notice: str | None
    attention: str = ""
    """How memory.attention was decided (recipe.memory.attention holds the kernel itself, never "auto")."""

    def recipe_yaml(self) -> str:
        return recipe_to_yaml(self.recipe)

    def ds_json(self) -> str:
        return json.dumps(self.ds_config, indent=2)


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
    ds_path, raw = ds_json.load_ds_config(recipe.deepspeed.config)
    layout, notice = make_layout(recipe, raw, world_size, device, str(ds_path))
    # Before the parallel checks, which judge the kernel itself (Ulysses and packed rows need flash-attention).
    attention = choose_attention(recipe.memory.attention, device.kind, layout.tp, layout.pp, layout.sp)
    recipe = recipe.model_copy(
        update={"memory": recipe.memory.model_copy(update={"attention": attention.kernel})}
    )
    fields = model_fields(recipe)
    check_parallel(layout, recipe, fields, str(ds_path))  # tp/pp against the model and DeepSpeed
    hidden = int(fields.get("hidden_size") or fields.get("n_embd") or fields.get("d_model") or 0)
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
        largest_weight=largest_weight(fields, hidden),
    )
    resolved = ds_json.fill_autos(raw, values, str(ds_path))
    if recipe.deepspeed.pinning == "off":
        # The recipe's switch, not a contradiction: every offload section's buffers become pageable.
        for section in ("offload_optimizer", "offload_param"):
            offload = resolved.get("zero_optimization", {}).get(section)
            if isinstance(offload, dict) and offload.get("device", "none") != "none":
                offload["pin_memory"] = False
    if layout.tp > 1:
        # Under AutoTP DeepSpeed asserts train_batch = micro x accum x *all* ranks (it is given no
        # mpu, so TP replicas count); the recipe's global batch counts distinct sequences.
        resolved["train_batch_size"] = layout.global_batch_size * layout.tp
        # Export gathers the TP shards through this switch (accelerate.get_state_dict refuses without it).
        resolved.setdefault("zero_optimization", {})["stage3_gather_16bit_weights_on_model_save"] = True
    if layout.sp > 1:
        # zero.Init builds its DeepSpeed config without the sequence-parallel groups and would count
        # every rank as data parallel (train_batch = micro x accum x world); this key is how
        # DeepSpeed's config divides the world by sp in that case (deepspeed/runtime/config.py).
        resolved["sequence_parallel_size"] = layout.sp
    if layout.sp > 1 and layout.zero_stage == 3:
        # Each rank of a sequence-parallel group backpropagates its share of the group's loss, so
        # the group's gradients must be summed and only the data-parallel ranks averaged. DeepSpeed
        # 0.19's ZeRO-3 does that only on its contiguous all-reduce path: its reduce-scatter path
        # averages over every rank (gradients 1/sp of sp=1's: bench/results/ulysses-probe-20261130.txt,
        # stage3.py __avg_scatter_grads), and it takes that path for reduce_scatter=true and for any
        # bucket larger than reduce_bucket_size, i.e. for every weight bigger than the bucket.
        zero = resolved.setdefault("zero_optimization", {})
        zero["reduce_scatter"] = False
        zero["contiguous_gradients"] = True
        zero["reduce_bucket_size"] = max(
            int(zero.get("reduce_bucket_size") or 0), largest_weight(fields, hidden)
        )
    if layout.offload_optimizer != "none" and "optimizer" not in resolved:
        # llm_train builds DeepSpeed's CPU Adam itself, with the recipe's betas, eps and AdamW's
        # decoupled weight decay. Left at its default (true), this switch makes Accelerate swap it
        # for a new CPU Adam that keeps only lr and weight_decay: Adam with L2 instead of AdamW,
        # betas (0.9, 0.999), and an LR schedule left driving the old optimizer, so the LR froze
        # after a resume.
        resolved["zero_force_ds_cpu_optimizer"] = False
    # Last: DeepSpeed's own config classes see exactly the JSON the workers will hand it.
    check_with_deepspeed(resolved, str(ds_path))
    return Resolved(recipe, ds_path, resolved, layout, hidden, fields, notice, attention.why)


def largest_weight(fields: dict[str, Any], hidden: int) -> int:
    """Elements of the model's largest weight matrix (embedding, MLP or attention projection)."""
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
