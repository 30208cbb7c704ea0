"""The recipe keys the planner turns, in one table: recipe key <-> the estimate's input it sets.

`--recipe auto` searches over these knobs, writes the chosen values under these keys, and a user's
override of one of them pins it (the search keeps it at the value the recipe resolves to); the
fixes of `llm-train plan` say their changes as overrides of the same keys. Every other key reaches
the estimate the one way a recipe does, through its resolution (planning/search/candidate.memory_inputs), or
changes nothing the planner models (the learning rate, the data files, logging); the keys in
NOT_PLANNED change memory or speed in ways the planner does not model, so `--recipe auto` refuses
them instead of writing a plan that would not hold.

A new knob (a loss-chunking switch, an optimizer's state bytes) is one more row here and one more
MemoryInputs field: the search, the written YAML and the fix texts pick it up from this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llm_train.config.recipe_files import parse_override
from llm_train.errors import UserError
from llm_train.planning.memory.inputs import MemoryInputs


@dataclass(frozen=True)
class Knob:
    key: str
    """The recipe key (dotted)."""
    field: str
    """The MemoryInputs property it sets ("global_batch": the layout's global batch size)."""


KNOBS: tuple[Knob, ...] = (
    Knob("deepspeed.config", "ds_key"),
    Knob("deepspeed.pinning", "pinning"),
    Knob("deepspeed.sequence_parallel", "sp"),
    Knob("optim.micro_batch_size", "micro_batch"),
    Knob("optim.global_batch_size", "global_batch"),
    Knob("optim.state_dtype", "state_dtype"),
    Knob("memory.activation_checkpointing", "activation_checkpointing"),
    Knob("memory.attention", "attn_impl"),
    Knob("memory.tiled_mlp", "tiled_mlp"),
    Knob("memory.tiled_loss", "tiled_loss"),
    Knob("memory.offload_checkpoints", "offload_checkpoints"),
    Knob("lora.rank", "lora_rank"),
    Knob("lora.quantize", "quantize"),
    Knob("data.seq_len", "seq_len"),
    Knob("precision", "precision"),
)
BY_KEY = {k.key: k for k in KNOBS}

# Keys that change memory or speed in ways the estimate does not model: with one of them the plan
# would not describe the run. key -> why (the user error says it, with the fix).
NOT_PLANNED = {
    "memory.liger_kernels": "Liger's fused kernels change the logits' and MLP's memory",
    "memory.torch_compile": "compiled graphs change activation memory and speed",
    "optim.grad_accum": "auto sets the batch by optim.global_batch_size (or --global-batch)",
    "model.name_or_path": "the model is --model",
    "hardware": "the hardware is --gpus, --gpu, --gpu-mem and --host-ram",
}
# Values of NOT_PLANNED keys that are what the estimate assumes anyway.
HARMLESS = {"memory.liger_kernels": (False,), "memory.torch_compile": ("off",)}


def pinned_fields(overrides: list[str]) -> set[str]:
    """The knobs (MemoryInputs fields) the user's overrides pin; UserError for an override the planner
    cannot plan (NOT_PLANNED), naming it and why."""
    pins = set()
    for text in overrides:
        parts, value = parse_override(text)
        key = ".".join(parts)
        for prefix in (key, parts[0]):
            why = NOT_PLANNED.get(prefix)
            if why is not None and value not in HARMLESS.get(prefix, ()):
                raise UserError(
                    f"override {text}: --recipe auto cannot plan it ({why}); leave it out, or write the "
                    "recipe with --write, set it there and check it with llm-train plan --recipe FILE"
                )
        if key in BY_KEY:
            pins.add(BY_KEY[key].field)
    return pins


def knob_value(c: MemoryInputs, field: str) -> Any:
    if field == "global_batch":
        return c.layout.global_batch_size
    return getattr(c, field)


def recipe_values(c: MemoryInputs, ds_config: str) -> dict[str, Any]:
    """The recipe value of every knob for a candidate: what `--recipe auto` writes.

    The DS JSON is named by the caller (a shipped name, or the user's own file); pinning is written only
    where a DS JSON section pins (offload), LoRA's keys only for a LoRA run.
    """
    out: dict[str, Any] = {}
    for knob in KNOBS:
        value = ds_config if knob.field == "ds_key" else knob_value(c, knob.field)
        if knob.field == "pinning":
            if c.offload_optimizer == "none" and c.offload_params == "none":
                continue
            value = c.pinning if c.offload_optimizer != "none" else c.param_pinning
        if knob.key.startswith("lora.") and not c.lora_rank:
            continue
        out[knob.key] = value
    return out


def set_key(data: dict[str, Any], key: str, value: Any) -> None:
    """Set a dotted key in a recipe mapping, creating its sections."""
    *sections, last = key.split(".")
    node = data
    for section in sections:
        node = node.setdefault(section, {})
    node[last] = value
