"""Write and verify a plain Hugging Face model directory (config, safetensors, tokenizer).

The exported directory loads with `AutoModelForCausalLM.from_pretrained` and no DeepSpeed.
Under ZeRO-3 the weights are gathered from all ranks first; the export is then checked
against the shapes the config implies, because an empty ZeRO-3 save is a classic failure.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from llm_train.errors import UserError


class ExportError(UserError):
    """The exported model is incomplete; the run must not report success."""


def save_hf_model(model: Any, state_dict: dict[str, torch.Tensor], tokenizer: Any, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    # Contiguous clones: gathered ZeRO-3 tensors can share storage, which safetensors refuses.
    clean = {k: v.detach().contiguous().clone() for k, v in state_dict.items()}
    model.save_pretrained(out_dir, state_dict=clean, safe_serialization=True, max_shard_size="5GB")
    tokenizer.save_pretrained(out_dir)


def expected_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of the architecture in model_dir/config.json (built on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(p.shape) for name, p in skeleton.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)  # stored once, as the input embedding
    return shapes


def saved_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ExportError(f"export {model_dir}: no *.safetensors files were written")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes


def verify_export(model_dir: Path) -> int:
    """Raise ExportError unless every tensor the config implies is present, non-empty, right-shaped."""
    expected, saved = expected_shapes(model_dir), saved_shapes(model_dir)
    missing = sorted(set(expected) - set(saved))
    if missing:
        raise ExportError(f"export {model_dir}: {len(missing)} tensors missing, e.g. {missing[0]}")
    for name, shape in expected.items():
        if saved[name] != shape or 0 in saved[name]:
            raise ExportError(f"export {model_dir}: {name} has shape {saved[name]}, expected {shape}")
    (model_dir / "export_check.json").write_text(json.dumps({"tensors": len(expected), "ok": True}))
    return len(expected)


def sample_text(model_dir: Path, prompt: str, max_new_tokens: int = 40) -> str:
    """Greedy continuation of `prompt` by the exported model, loaded the way a user would."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        logits = model(**inputs).logits
        if not torch.isfinite(logits).all():
            raise ExportError(f"export {model_dir}: the exported model gives non-finite logits")
        out = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    return tokenizer.decode(out[0], skip_special_tokens=True)
