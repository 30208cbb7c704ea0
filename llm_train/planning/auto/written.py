"""`--recipe auto`'s result as a recipe: the chosen knobs written into the chosen kind's mapping, the YAML
with its header, `check_written` (read back and planned from scratch, the written recipe must give the
chosen candidate's inputs and numbers, or nothing is written) and the printed answer.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llm_train.config.ds_json import load_ds_config, nvme_paths
from llm_train.config.hardware import Hardware
from llm_train.config.recipe import recipe_from_data
from llm_train.config.recipe_files import yaml_load
from llm_train.config.resolution import resolve_recipe, resolve_run
from llm_train.errors import UserError
from llm_train.planning.auto.knobs import recipe_values, set_key
from llm_train.planning.auto.request import kind_name
from llm_train.planning.memory.inputs import MemoryInputs
from llm_train.planning.model.shapes import ModelShape, shape_from_config
from llm_train.planning.report.verdict import config_line, generation_line, verdict
from llm_train.planning.report.vision_note import vision_note
from llm_train.planning.search.candidate import (
    SHIPPED_DS_CONFIGS,
    Evaluation,
    evaluate,
    memory_inputs,
)
from llm_train.planning.search.fixes import (
    Practicality,
)
from llm_train.units import GiB


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


def auto_recipe_data(auto: AutoChoice, data: str | None = None) -> dict[str, Any]:
    """The chosen configuration as a recipe mapping: the chosen kind's recipe (auto's base with the user's
    overrides applied: KindBase.data) with the chosen knobs set. A knob the user set was pinned, so it is
    written at the value the override gave; nothing is applied after the choice."""
    hw, c, ev = auto.hardware, auto.inputs, auto.evaluation
    body = copy.deepcopy(auto.recipe_data)
    body["description"] = f"Auto-planned {kind_name(c)} fine-tune of {auto.model} on {hw.gpus} x {hw.name}"
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
        *([f"vision:   {note}"] if (note := vision_note(ev.inputs, ev.estimate)) else []),
        "why:",
        *(f"  - {r}" for r in auto.reasons),
    ]
    if path is not None:
        lines.append(f"recipe written to {path}")
    return "\n".join(lines)
