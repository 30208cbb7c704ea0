"""`llm-train recipes`: the shipped recipes, one aligned line each (what it trains, how it is split, what it needs)."""

from __future__ import annotations

import argparse

from llm_train.config import ds_json
from llm_train.config.hardware import Device, find_gpu
from llm_train.config.layout import make_layout
from llm_train.config.recipe import load_recipe
from llm_train.config.recipe_files import available_recipes
from llm_train.errors import UserError


def cmd_recipes(args: argparse.Namespace) -> int:
    print_recipe_table(available_recipes())
    return 0


RECIPE_COLUMNS = ("recipe", "model", "ZeRO/TP/PP/SP", "GPUs", "VRAM", "host RAM", "description")


def recipe_row(name: str) -> tuple[str, ...]:
    """One line of `llm-train recipes`: what the recipe trains, how it is split, what it needs."""

    recipe = load_recipe(name)
    hw = recipe.hardware
    _, raw = ds_json.load_ds_config(recipe.deepspeed.config)
    try:
        layout, _ = make_layout(recipe, raw, hw.world_size, Device.declared(recipe))
        stage, tp, pp, sp = layout.zero_stage, layout.tp, layout.pp, layout.sp
        offload = layout.offload_optimizer != "none" or layout.offload_params != "none"
    except UserError:  # a recipe whose declared hardware does not divide; show what the JSON says
        stage, tp, pp, sp, offload = ds_json.zero_stage(raw), 0, 0, 0, False
    degrees = f"{stage}{'+off' if offload else ''}/{tp or '?'}/{pp or '?'}/{sp or '?'}"
    count = f"{hw.nodes} nodes x {hw.processes_per_node}" if hw.nodes > 1 else str(hw.processes_per_node)
    if hw.device == "cpu":
        gpus, vram = f"none (cpu x{hw.world_size})", "-"
    else:
        spec = find_gpu(hw.gpu_name) if hw.gpu_name else None
        gpus = f"{count} x {hw.gpu_name or 'GPU'}"
        mem = hw.gpu_mem_gib or (spec.memory_gib if spec else None)
        vram = f"{mem:.0f} GiB" if mem else "-"
    ram = f"{hw.host_ram_gib:.0f} GiB" if hw.host_ram_gib else "-"
    model = recipe.model.name_or_path or f"random {recipe.model.config.get('model_type', 'model')}"
    return (name, model, degrees, gpus, vram, ram, recipe.description)


def print_recipe_table(names: list[str]) -> None:
    """`llm-train recipes`: an aligned table; the description column is left ragged."""
    rows = [RECIPE_COLUMNS, *(recipe_row(name) for name in names)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(RECIPE_COLUMNS) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])) + "  " + row[-1])
