"""LoRA through PEFT: wrap the built model, and turn a trained one into an export.

`apply_lora` is called at the end of `model.build_model` when the recipe has a `lora`
section. It works under ZeRO-2 and ZeRO-3: the adapters are created as ordinary
parameters after the (possibly `zero.Init`-partitioned) base model exists, and
DeepSpeed partitions them with the rest when the engine is built. The base weights are
frozen, so the optimizer (and any CPU offload) only holds adapter states.

`export_view` decides what the run's `final/` directory holds:
- merged (default): a plain Hugging Face model, W + (alpha/r) * B @ A folded in, that
  loads with `AutoModelForCausalLM.from_pretrained` and no PEFT;
- adapter: PEFT's adapter_config.json + adapter_model.safetensors, for
  `PeftModel.from_pretrained(base, final)`.
The merge works on the gathered 16-bit state dict (the same one DeepSpeed hands back for
a full export), so it never materialises a second model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llm_train.config.recipe import LoraSection
from llm_train.errors import ExportError, UserError


def apply_lora(model: Any, lora: LoraSection) -> Any:
    """The model wrapped by PEFT with adapters on `lora.target_modules`; only adapters train."""
    try:
        from peft import LoraConfig, get_peft_model
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
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def is_peft_model(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def merged_state_dict(model: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The base model's state dict with every adapter folded into its weight.

    `state_dict` is the PEFT model's full (gathered) state dict: keys like
    `base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight` and
    `...q_proj.lora_A.default.weight`. Returns keys as the plain model names them
    (`model.layers.0.self_attn.q_proj.weight`), in the weights' own dtype.
    """
    if not any(".lora_" in k for k in state_dict):
        raise UserError(
            "LoRA export: the gathered state dict holds no adapter weights; nothing to merge "
            "(under ZeRO-3 the DeepSpeed config needs stage3_gather_16bit_weights_on_model_save=true)"
        )
    adapter = model.active_adapter
    config = model.peft_config[adapter]
    # PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA (kept for configs that set it).
    scaling = config.lora_alpha / (config.r**0.5 if getattr(config, "use_rslora", False) else config.r)
    prefix = "base_model.model."
    lora_a, lora_b = f".lora_A.{adapter}.weight", f".lora_B.{adapter}.weight"
    merged: dict[str, Any] = {}
    for key, value in state_dict.items():
        if ".lora_" in key:
            continue  # folded into the base weight below
        name = key.removeprefix(prefix)
        if ".base_layer." in name:
            module = key.rsplit(".base_layer.", 1)[0]
            name = name.replace(".base_layer.", ".")
            if key.endswith(".base_layer.weight") and module + lora_a in state_dict:
                a = state_dict[module + lora_a].float()
                b = state_dict[module + lora_b].float()
                value = (value.float() + scaling * (b @ a)).to(value.dtype)
        merged[name] = value
    return merged


def export_view(
    model: Any, state_dict: dict[str, Any], lora: LoraSection | None
) -> tuple[Any, dict[str, Any]]:
    """(model to call save_pretrained on, state dict to save) for the run's export.

    Without LoRA both pass through unchanged. Merged: the base model and the merged
    weights (a plain HF directory). Adapter: the PEFT model and its full state dict,
    which `PeftModel.save_pretrained` filters down to the adapter weights.
    """
    if lora is None or not is_peft_model(model):
        return model, state_dict
    if lora.export == "adapter":
        return model, state_dict
    return model.get_base_model(), merged_state_dict(model, state_dict)


def is_adapter_export(model_dir: Path) -> bool:
    return (model_dir / "adapter_config.json").is_file() and not (model_dir / "config.json").is_file()


def verify_adapter_export(model_dir: Path) -> int:
    """Check an adapter export: config present, every LoRA A/B tensor non-empty and rank-shaped."""
    from safetensors import safe_open

    config = json.loads((model_dir / "adapter_config.json").read_text())
    file = model_dir / "adapter_model.safetensors"
    if not file.is_file():
        raise ExportError(f"export {model_dir}: adapter_model.safetensors was not written")
    rank = int(config["r"])
    count = 0
    with safe_open(str(file), framework="pt") as handle:
        for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
            shape = tuple(handle.get_slice(key).get_shape())
            if 0 in shape:
                raise ExportError(f"export {model_dir}: {key} is empty {shape} (a ZeRO-3 gather failed)")
            if "lora_A" in key and shape[0] != rank or "lora_B" in key and shape[-1] != rank:
                raise ExportError(f"export {model_dir}: {key} has shape {shape}, expected rank {rank}")
            count += 1
    if count == 0:
        raise ExportError(f"export {model_dir}: the adapter file holds no tensors")
    (model_dir / "export_check.json").write_text(json.dumps({"tensors": count, "ok": True, "adapter": True}))
    return count
