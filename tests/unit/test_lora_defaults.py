"""One source of truth for what the planner and the run share: the recipe schema's LoraSection (the adapters
the planner proposes and the run trains) and MemorySection (the memory switches). Every planner default is
read from them, so changing a default in config/recipe_sections.py changes what the planner estimates and what auto
writes; a copy that kept the old value fails here."""

from __future__ import annotations

from llm_train.config.recipe import load_recipe
from llm_train.config.recipe_sections import LoraSection, MemorySection
from llm_train.config.resolution import resolve_run
from llm_train.planning.auto.request import suggested_lora
from llm_train.planning.memory.inputs import MemoryInputs
from llm_train.planning.model.shapes import LORA_TARGETS, shape_of
from llm_train.planning.report.verdict import plan_recipe
from llm_train.planning.search.candidate import SUGGESTED_LORA_DROPOUT, SUGGESTED_LORA_RANK, memory_inputs

SCHEMA = LoraSection()


def test_the_planners_lora_defaults_are_the_schemas() -> None:
    assert tuple(SCHEMA.target_modules) == LORA_TARGETS
    assert MemoryInputs.__dataclass_fields__["lora_targets"].default == tuple(SCHEMA.target_modules)
    assert (SCHEMA.rank, SCHEMA.dropout) == (SUGGESTED_LORA_RANK, SUGGESTED_LORA_DROPOUT)
    # What --recipe auto writes where the user set no lora section: the schema's defaults, spelled out.
    assert suggested_lora() == {
        "rank": SCHEMA.rank,
        "alpha": SCHEMA.alpha,
        "dropout": SCHEMA.dropout,
        "target_modules": list(SCHEMA.target_modules),
    }


def test_a_recipes_lora_section_without_keys_is_planned_with_the_schemas_defaults() -> None:
    run = resolve_run("tiny-cpu", ["lora={}"], world_size=2)
    inp = memory_inputs(run, shape_of("meta-llama/Llama-3.1-8B"))
    assert inp.lora_rank == SCHEMA.rank and inp.lora_targets == tuple(SCHEMA.target_modules)
    assert inp.lora_dropout == (SCHEMA.dropout > 0)  # PEFT keeps a dropped-out copy of each adapted input


def test_a_proposed_lora_fix_is_the_plan_of_the_recipe_with_its_overrides() -> None:
    # The planner's LoRA fix of a full fine-tune must estimate the adapters `lora.rank=N` gives the run: the
    # schema's targets and dropout, not a copy of them.
    args = {"gpus": 1, "gpu": "RTX 4090", "host_ram_gib": 64, "detect": False}
    report = plan_recipe("7b-zero3", [], **args)  # type: ignore[arg-type]
    lora = [f for f in report.fixes if any(o.startswith("lora.rank=") for o in f.overrides)]
    assert lora, [f.overrides for f in report.fixes]
    for fix in lora:
        replanned = plan_recipe("7b-zero3", list(fix.overrides), **args)  # type: ignore[arg-type]
        assert replanned.evaluation.inputs.lora_dropout == fix.evaluation.inputs.lora_dropout
        assert replanned.evaluation.device_bytes == fix.evaluation.device_bytes
    assert load_recipe("7b-zero3").lora is None


def test_the_estimates_memory_switches_default_to_the_schemas() -> None:
    schema, fields = MemorySection(), MemoryInputs.__dataclass_fields__
    pairs = {
        "activation_checkpointing": "activation_checkpointing",
        "tiled_mlp": "tiled_mlp",
        "tiled_loss": "tiled_loss",
        "liger_loss": "liger_kernels",
        "offload_checkpoints": "offload_checkpoints",
    }
    for field, key in pairs.items():
        assert fields[field].default == getattr(schema, key), f"MemoryInputs.{field} vs memory.{key}"
    # memory.attention=auto is the run's choice per card; where nothing faster is installed it is sdpa.
    assert schema.attention == "auto" and fields["attn_impl"].default == "sdpa"
