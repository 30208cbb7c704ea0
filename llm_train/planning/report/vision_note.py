"""The plan's line on an image-text model: what its vision part costs and how many tokens its images take.

`llm-train plan` and `--recipe auto` print it under the estimate (planning/report/verdict.py, planning/auto/written.py),
so a user sees where the vision tower's memory went and how much of data.seq_len the images fill.
"""

from __future__ import annotations

from llm_train.planning.memory.estimate import MemoryEstimate
from llm_train.planning.memory.inputs import MemoryInputs
from llm_train.planning.model.vision_shapes import PROJECTOR, VISION_TOWER
from llm_train.units import GiB

_FAMILY_NAMES = {"gemma3": "Gemma 3 (SigLIP)", "qwen2_5_vl": "Qwen2.5-VL", "llava": "LLaVA (CLIP)"}


def _count(params: int) -> str:
    return f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.1f}M"


def vision_note(inp: MemoryInputs, estimate: MemoryEstimate) -> str | None:
    """One line on the vision part of an image-text model; None for a text model."""
    vision = inp.shape.vision
    if vision is None:
        return None
    frozen = [p for p in (VISION_TOWER, PROJECTOR) if p in inp.vision.freeze]
    trained = [p for p in (VISION_TOWER, PROJECTOR) if p not in inp.vision.freeze]
    weight_bytes = 2 if inp.precision != "fp32" else 4
    parts = (
        f"image-text ({_FAMILY_NAMES.get(vision.family, vision.family)}): vision tower "
        f"{_count(vision.tower_params)} + projector {_count(vision.projector_params)} parameters "
        f"({vision.num_params * weight_bytes / GiB:.2f} GiB of {weight_bytes * 8}-bit weights, in the parameters above"
    )
    if frozen:
        parts += (
            f"; frozen by model.freeze: {', '.join(frozen)}, weights only, no gradients or optimizer states"
        )
    if trained:
        how = "through LoRA adapters on its target-named linears" if inp.lora_rank else "whole"
        parts += f"; trained {how}: {', '.join(trained)}"
    parts += "; QLoRA leaves them in 16 bits)" if inp.quantize != "none" else ")"
    images = inp.vision.images_per_sample
    if not images:
        return parts + "; no image rows in data.train: the vision part is loaded, not run"
    geometry = inp.vision.geometry(vision)
    if geometry.fixed_tokens is not None:
        how = f"{geometry.fixed_tokens} per image whatever its size (resized to {geometry.fixed_size} px square)"
    else:
        bound = (
            f"data.image_max_pixels {geometry.bound_max_pixels}"
            if geometry.bound_max_pixels is not None
            and geometry.bound_max_pixels < (geometry.max_pixels or 0)
            else f"the processor's max_pixels {geometry.max_pixels}"
        )
        how = (
            f"up to {geometry.max_tokens} per image (one per {geometry.factor} x {geometry.factor} pixels within "
            f"{bound}; {geometry.square_tokens} for a square image, more for a long thin one)"
        )
    tokens = images * geometry.max_tokens
    parts += (
        f"; image tokens: {images} image per sample, {how}: {tokens} of data.seq_len {inp.seq_len}, counted in the "
        f"language model's activations (image rows are padded, never packed); the vision tower runs over "
        f"{geometry.max_patches} patches per image: "
        f"{estimate.gpu_terms.get('vision_activations', 0) / GiB:.2f} GiB of activations"
        + (" (frozen: one layer at a time)" if VISION_TOWER in inp.vision.freeze else "")
    )
    if tokens >= inp.seq_len:
        parts += (
            f". The largest image alone fills data.seq_len {inp.seq_len}: such rows are dropped or refused "
            "(the source's overlong); lower data.image_max_pixels or raise data.seq_len"
        )
    return parts
