"""Write and verify a plain Hugging Face model directory (config, safetensors, tokenizer).

The exported directory loads with `AutoModelForCausalLM.from_pretrained` and no DeepSpeed.
Under ZeRO-3 the weights are gathered from all ranks first; the export is then checked
against the shapes the config implies, because an empty ZeRO-3 save is a classic failure.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch

from llm_train.config.parallel import refuse_tensor_parallel_checkpoint
from llm_train.errors import ExportError, UserError
from llm_train.runtime.checkpoint import read_manifest, verify
from llm_train.runtime.pipeline_model import pipeline_checkpoint_state_dict  # pipeline runs: a file per layer
from llm_train.runtime.run_state import DS_TAG


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


# ------------------------------------------------------------ export from a checkpoint

_EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Logit tolerance of the exported model against the checkpoint's fp32 weights: exact up to
# summation order in fp32; the rounding of 16-bit weights dominates otherwise.
_LOGIT_TOLERANCE = {"fp32": 1e-4, "bf16": 0.5, "fp16": 0.1}


def checkpoint_state_dict(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """fp32 weights of a verified llm_train checkpoint, consolidated from any ZeRO stage (no GPU needed)."""

    reason = verify(ckpt_dir)
    if reason is not None:
        # DeepSpeed's shards are pickles: never load them from a directory that does not verify.
        raise UserError(f"checkpoint {ckpt_dir}: {reason}; not loading it")
    state_dir = ckpt_dir / "state"

    pipeline_state = pipeline_checkpoint_state_dict(state_dir / DS_TAG, ckpt_dir / "hf")
    if pipeline_state is not None:
        return pipeline_state

    refuse_tensor_parallel_checkpoint(state_dir / DS_TAG, str(ckpt_dir))
    if read_manifest(ckpt_dir)["zero_stage"] == 0:
        model_states = state_dir / DS_TAG / "mp_rank_00_model_states.pt"
        return {
            k: v.float()
            for k, v in torch.load(model_states, map_location="cpu", weights_only=False)["module"].items()
        }
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return dict(get_fp32_state_dict_from_zero_checkpoint(str(state_dir), tag=DS_TAG))


def export_checkpoint(ckpt_dir: Path, out_dir: Path, dtype: str) -> dict[str, float]:
    """A plain HF model directory from a checkpoint, verified: shapes and logits on a fixed batch."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if out_dir.exists() and any(out_dir.iterdir()):
        raise UserError(f"export output {out_dir} is not empty; choose a new directory")
    hf_dir = ckpt_dir / "hf"
    state_dict = checkpoint_state_dict(ckpt_dir)
    config = AutoConfig.from_pretrained(hf_dir)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = reference.load_state_dict(state_dict, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        problem = sorted(set(missing) - tied) or sorted(unexpected)
        raise ExportError(
            f"checkpoint {ckpt_dir}: weights do not match the config ({len(problem)} tensors, e.g. {problem[0]})"
        )
    reference.eval()
    batch = torch.arange(min(32, config.vocab_size), dtype=torch.long).view(1, -1)
    with torch.no_grad():
        ref_logits = reference(batch).logits
    exported = reference.to(_EXPORT_DTYPES[dtype])
    exported.save_pretrained(out_dir, safe_serialization=True, max_shard_size="5GB")
    AutoTokenizer.from_pretrained(hf_dir).save_pretrained(out_dir)
    with contextlib.suppress(ValueError):  # a config without generation fields: nothing to write
        GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    tensors = verify_export(out_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        diff = float((reloaded(batch).logits - ref_logits).abs().max())
    if not diff <= _LOGIT_TOLERANCE[dtype]:
        raise ExportError(
            f"export {out_dir}: logits differ from the checkpoint's by {diff:.3g} (max allowed {_LOGIT_TOLERANCE[dtype]})"
        )
    return {"tensors": tensors, "max_logit_diff": diff}
