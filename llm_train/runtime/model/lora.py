"""LoRA through PEFT: wrap the built model; check an adapter export.

`apply_lora` is called at the end of `model.build_model` when the recipe has a `lora`
section. It works under ZeRO-2 and ZeRO-3: the adapters are created as ordinary
parameters after the (possibly `zero.Init`-partitioned, possibly bitsandbytes-quantised)
base model exists, and DeepSpeed partitions them with the rest when the engine is built.
The base weights are frozen, so the optimizer (and any CPU offload) only holds adapter states.

What the run's `final/` holds (written by runtime/export/sharded.py, layer by layer):
- merged (default): a plain Hugging Face model, W + (alpha/r) * B @ A folded in, that
  loads with `AutoModelForCausalLM.from_pretrained` and no PEFT (a 4-bit base dequantised);
- adapter: PEFT's adapter_config.json + adapter_model.safetensors, for
  `PeftModel.from_pretrained(base, final)`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llm_train.config.recipe_sections import LoraSection
from llm_train.errors import ExportError, UserError

if TYPE_CHECKING:
    import torch
    from peft import LoraConfig, PeftModel


def apply_lora(model: torch.nn.Module, lora: LoraSection, exclude: Sequence[str] = ()) -> PeftModel:
    """The model wrapped by PEFT with adapters on `lora.target_modules`; only adapters train.

    `exclude`: full names of modules that get no adapter although their name is a target (an image-text
    model's frozen vision tower and projector: model.py), PEFT's `exclude_modules`."""
    try:
        from peft import get_peft_model
    except ModuleNotFoundError:
        raise UserError(
            "the recipe has a lora section but peft is not installed; pip install 'llm_train[lora]' "
            "(or pip install peft), or remove the lora section"
        ) from None
    leaf_names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in lora.target_modules if t not in leaf_names]
    if missing:
        linear = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ == "Linear"}
        )
        raise UserError(
            f"lora.target_modules: {', '.join(missing)} not in this model; its linear modules are: "
            f"{', '.join(linear)}"
        )
    return get_peft_model(model, peft_config(lora, exclude=exclude))


def peft_config(lora: LoraSection, base: str | None = None, exclude: Sequence[str] = ()) -> LoraConfig:
    """PEFT's LoraConfig for the recipe's lora section (base: the model the adapter applies to)."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora.rank,
        # PEFT annotates an int, but only ever divides by it (alpha / rank): the recipe's float is kept.
        lora_alpha=lora.alpha,  # type: ignore[arg-type]
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
        exclude_modules=list(exclude) or None,
    )


def is_peft_model(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def is_adapter_export(model_dir: Path) -> bool:
    return (model_dir / "adapter_config.json").is_file() and not (model_dir / "config.json").is_file()


# safetensors' dtype names -> the names `llm-train export --dtype` and the export messages use.
_SAFETENSORS_DTYPES = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}


def verify_adapter_export(model_dir: Path) -> tuple[int, str]:
    """Check an adapter export: config present, every LoRA A/B tensor non-empty and rank-shaped.

    Returns the number of tensors and the dtype they were written in (read back from the file: an adapter
    keeps its training dtype whatever `llm-train export --dtype` asked, so only the file can say)."""
    from safetensors import safe_open

    config = json.loads((model_dir / "adapter_config.json").read_text())
    file = model_dir / "adapter_model.safetensors"
    if not file.is_file():
        raise ExportError(f"export {model_dir}: adapter_model.safetensors was not written")
    rank = int(config["r"])
    count, dtypes = 0, set()
    with safe_open(str(file), framework="pt") as handle:
        for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
            tensor = handle.get_slice(key)
            dtypes.add(_SAFETENSORS_DTYPES.get(tensor.get_dtype(), tensor.get_dtype()))
            shape = tuple(tensor.get_shape())
            if 0 in shape:
                raise ExportError(f"export {model_dir}: {key} is empty {shape} (a ZeRO-3 gather failed)")
            if "lora_A" in key and shape[0] != rank or "lora_B" in key and shape[-1] != rank:
                raise ExportError(f"export {model_dir}: {key} has shape {shape}, expected rank {rank}")
            count += 1
    if count == 0:
        raise ExportError(f"export {model_dir}: the adapter file holds no tensors")
    dtype = "+".join(sorted(dtypes))
    check = {"tensors": count, "ok": True, "adapter": True, "dtype": dtype}
    (model_dir / "export_check.json").write_text(json.dumps(check))
    return count, dtype


def checkpoint_lora(ckpt_dir: Path) -> LoraSection | None:
    """The lora section of the recipe a checkpoint was written with (hf/recipe.yaml), or None."""
    import yaml

    recipe = ckpt_dir / "hf" / "recipe.yaml"
    if not recipe.is_file():
        return None
    section = (yaml.safe_load(recipe.read_text()) or {}).get("lora")
    return LoraSection(**section) if section else None


def export_adapter_checkpoint(
    ckpt_dir: Path,
    out_dir: Path,
    state_dict: dict[str, Any],
    lora: LoraSection,
    base: str | None,
    exclude: Sequence[str] = (),
) -> tuple[int, str]:
    """PEFT adapter files from a LoRA checkpoint's adapter tensors; returns how many were written, and their dtype.

    A LoRA checkpoint holds the adapters and their optimizer, not the frozen base (checkpointing/run_state.py), so
    what it can give is the adapter: `PeftModel.from_pretrained(base, out_dir)` on the base it was
    trained from (loaded the same way, 4-bit for a QLoRA run) reproduces the trained model. `exclude`: the
    modules the run kept adapters out of (an image-text model's frozen parts), so PEFT places them alike.
    """
    from safetensors.torch import save_file

    # PEFT's files name tensors without the adapter's name: `...q_proj.lora_A.weight`.
    tensors = {
        key.replace(".lora_A.default.", ".lora_A.").replace(
            ".lora_B.default.", ".lora_B."
        ): value.contiguous()
        for key, value in state_dict.items()
        if ".lora_A." in key or ".lora_B." in key
    }
    if not tensors:
        raise ExportError(f"checkpoint {ckpt_dir}: a LoRA run's checkpoint without adapter tensors")
    out_dir.mkdir(parents=True, exist_ok=True)
    peft_config(lora, base, exclude).save_pretrained(str(out_dir))
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    return verify_adapter_export(out_dir)
