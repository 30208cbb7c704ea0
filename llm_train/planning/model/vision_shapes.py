"""The vision part of an image-text checkpoint, sized offline: its tower, its projector and its image tokens.

An image-text model (config/model_kind.py) is a language model plus a vision tower that turns an image's
patches into features and a projector that maps them to the language model's width, where they replace the
image's placeholder tokens. The planner needs three things from it before any weight exists:

- its parameters, split into the tower and the projector (`model.freeze` chooses which train; a frozen part
  holds its 16-bit weights but no gradients or optimizer states), counted exactly as the transformers
  classes allocate them (tests/unit/test_vision_plan.py checks them against tiny models' numel);
- the image tokens one image takes in the language model's sequence: fixed per image for Gemma 3
  (`mm_tokens_per_image`, the processor resizes every image to `image_size`), resolution-dependent for
  Qwen-VL (the processor's `smart_resize` to multiples of patch x merge within min/max pixels, then one
  token per merge x merge patches);
- the patches the tower itself runs over per image (its activations' sequence length).

Three families are sized: Gemma 3 (a SigLIP tower, gemma3's projector), Qwen2.5-VL and LLaVA (a CLIP tower:
tiny-cpu-vlm's). Other image-text types are refused by `vision_shape_from_config` in one line; the run itself
does not need the planner.

Nothing here imports torch or transformers (`plan` and `--dry-run` stay fast).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm_train.config.known_models import KNOWN_PROCESSOR_PIXELS
from llm_train.config.recipe_sections import FREEZE_DEFAULT, FREEZE_PARTS
from llm_train.errors import UserError

# model.freeze's parts of an image-text model (the recipe schema's names, config/recipe_sections.FREEZE_PARTS).
VISION_TOWER, PROJECTOR, LANGUAGE_MODEL = FREEZE_PARTS
# The image-text model types sized here (config.json's top-level model_type).
SIZED_IMAGE_TEXT_TYPES = ("gemma3", "llava", "qwen2_5_vl")


class VisionConfigError(UserError, ValueError):
    """An image-text config the planner cannot size (one line: the type, or the missing key)."""


# transformers' Qwen-VL smart_resize refuses an image whose long side is more than 200 times its short side.
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class ImageGeometry:
    """How one image becomes patches and tokens: the run's pixel bounds, then the model's processor.

    bound_min_pixels / bound_max_pixels: data.image_min_pixels / image_max_pixels, applied to width x height
    before the processor sees the image, aspect kept (data/formats/images.py ImageSizing: the same arithmetic).
    fixed_size: Gemma 3's and LLaVA's processors then resize every image to fixed_size x fixed_size
    (pan-and-scan off, Gemma 3's default), so an image takes fixed_tokens whatever its size. Otherwise
    (Qwen-VL) the processor keeps the aspect ratio and resizes to multiples of patch_size x merge_size within
    its own [min_pixels, max_pixels] (transformers' `smart_resize`, models/qwen2_vl/image_processing_qwen2_vl.py).
    Both are written out here rather than called because the planner imports no transformers or PIL (plan
    answers in milliseconds); tests/unit/test_vision_plan.py holds them equal to the real processors.
    """

    patch_size: int
    merge_size: int = 1
    fixed_size: int | None = None
    fixed_tokens: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    bound_min_pixels: int | None = None
    bound_max_pixels: int | None = None

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def bounded(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after data.image_max_pixels / image_min_pixels (ImageSizing.apply's arithmetic)."""
        pixels = height * width
        scale = 1.0
        if self.bound_max_pixels is not None and pixels > self.bound_max_pixels:
            scale = math.sqrt(self.bound_max_pixels / pixels)
        elif self.bound_min_pixels is not None and pixels < self.bound_min_pixels:
            scale = math.sqrt(self.bound_min_pixels / pixels)
        if scale == 1.0:
            return height, width
        return max(1, int(height * scale)), max(1, int(width * scale))

    def processed(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) the processor resizes an image it is given to (smart_resize's arithmetic)."""
        if self.fixed_size is not None:
            return self.fixed_size, self.fixed_size
        assert self.min_pixels is not None and self.max_pixels is not None
        factor = self.factor
        h_bar = max(factor, round(height / factor) * factor)
        w_bar = max(factor, round(width / factor) * factor)
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt((height * width) / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) an image of height x width pixels reaches the vision tower at."""
        return self.processed(*self.bounded(height, width))

    def patches(self, height: int, width: int) -> int:
        """Patches the vision tower runs over for one image of height x width pixels."""
        h, w = self.resized(height, width)
        return (h // self.patch_size) * (w // self.patch_size)

    def tokens(self, height: int, width: int) -> int:
        """Image tokens one image of height x width pixels takes in the language model's sequence."""
        if self.fixed_tokens is not None:
            return self.fixed_tokens
        return self.patches(height, width) // (self.merge_size * self.merge_size)

    @property
    def largest_pixels(self) -> int | None:
        """The most pixels an image reaches the processor with (None: a fixed-size processor)."""
        if self.fixed_size is not None:
            return None
        assert self.max_pixels is not None
        if self.bound_max_pixels is None:
            return self.max_pixels
        return min(self.bound_max_pixels, self.max_pixels)

    @property
    def max_patches(self) -> int:
        """Patches of the largest image the processor lets through, of any aspect ratio it accepts (what the
        planner sizes: an upper bound, as data.seq_len is for text)."""
        if self.fixed_size is not None:
            return (self.fixed_size // self.patch_size) ** 2
        return _largest_patches(self)

    @property
    def max_tokens(self) -> int:
        """Image tokens of the largest image the processor lets through."""
        if self.fixed_tokens is not None:
            return self.fixed_tokens
        return self.max_patches // (self.merge_size * self.merge_size)

    @property
    def square_tokens(self) -> int:
        """Image tokens of a square image at the largest pixel count (the common case under the bound)."""
        if self.fixed_tokens is not None:
            return self.fixed_tokens
        largest = self.largest_pixels
        assert largest is not None
        side = math.isqrt(largest)
        return self.tokens(side, side)

    def with_pixels(self, min_pixels: int | None, max_pixels: int | None) -> ImageGeometry:
        """The checkpoint's processor's own pixel limits over the class's (None keeps the class's). A fixed-size
        processor (Gemma 3, LLaVA) resizes every image to its size: the limits change nothing there."""
        if self.fixed_size is not None:
            return self
        return dataclasses.replace(
            self,
            min_pixels=self.min_pixels if min_pixels is None else min_pixels,
            max_pixels=self.max_pixels if max_pixels is None else max_pixels,
        )

    def bounded_by(self, min_pixels: int | None, max_pixels: int | None) -> ImageGeometry:
        """data.image_min_pixels / image_max_pixels applied before the processor."""
        if self.fixed_size is not None:
            return self
        return dataclasses.replace(self, bound_min_pixels=min_pixels, bound_max_pixels=max_pixels)


@functools.cache
def _largest_patches(geometry: ImageGeometry) -> int:
    """The most patches smart_resize gives an image of at most `largest_pixels` pixels: its rounding to multiples
    of patch x merge can take an image past the pixel count (a 633 x 633 image becomes 644 x 644), most for
    long thin images, so every height the processor accepts is tried with the widest width that fits (cached:
    --recipe auto asks for it once per candidate)."""
    largest = geometry.largest_pixels
    assert largest is not None
    low = max(1, math.isqrt(largest // MAX_ASPECT_RATIO))
    high = math.isqrt(largest * MAX_ASPECT_RATIO)
    best = 0
    for height in range(low, high + 1):
        width = largest // height
        if width < 1 or max(height, width) > MAX_ASPECT_RATIO * min(height, width):
            continue
        h, w = geometry.processed(height, width)
        best = max(best, (h // geometry.patch_size) * (w // geometry.patch_size))
    return best


@dataclass(frozen=True)
class VisionShape:
    """An image-text model's vision tower and projector: their parameters and their activations' shape."""

    family: str
    """The config's model_type: "gemma3" or "qwen2_5_vl"."""
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    gated_mlp: bool
    """SwiGLU-style MLP (gate, up, down: Qwen2.5-VL) or two-matrix GeLU (fc1, fc2: SigLIP)."""
    tower: tuple[tuple[str, tuple[int, ...], int], ...]
    projector: tuple[tuple[str, tuple[int, ...], int], ...]
    geometry: ImageGeometry
    projector_out: int
    """The language model's hidden size the projector maps to."""
    linears: tuple[tuple[str, str, int, int, int], ...] = ()
    """(part, module name, in features, out features, how many) of every nn.Linear: where LoRA's target names
    can put adapters when the part is not frozen (runtime/model/model.py excludes the frozen parts' linears)."""

    def modules(self) -> list[tuple[str, tuple[int, ...], int]]:
        """(module name, numel of each of its own parameters, how many): ModelShape.modules' format, the names
        prefixed by their part so that nothing here is taken for a language-model projection (QLoRA leaves
        the vision part in 16 bits, LoRA's default targets are the language model's)."""
        return [(f"{VISION_TOWER}.{n}", p, c) for n, p, c in self.tower] + [
            (f"{PROJECTOR}.{n}", p, c) for n, p, c in self.projector
        ]

    @property
    def tower_params(self) -> int:
        return sum(sum(p) * c for _, p, c in self.tower)

    @property
    def projector_params(self) -> int:
        return sum(sum(p) * c for _, p, c in self.projector)

    @property
    def num_params(self) -> int:
        return self.tower_params + self.projector_params

    def part_params(self, part: str) -> int:
        """Parameters of model.freeze's part `part` held here (0 for the language model)."""
        parts: dict[str, int] = {VISION_TOWER: self.tower_params, PROJECTOR: self.projector_params}
        return parts.get(part, 0)

    def lora_params(self, rank: int, targets: tuple[str, ...], frozen: tuple[str, ...]) -> int:
        """Adapter parameters LoRA of `rank` puts on the unfrozen parts' linears whose names are targets."""
        return sum(n for group in self.lora_tensors(rank, targets, frozen) for n in group)

    def lora_tensors(
        self, rank: int, targets: tuple[str, ...], frozen: tuple[str, ...]
    ) -> list[tuple[int, int]]:
        """(A, B) numels of each adapter, one per adapted module (shapes.lora_params' rule: A is rank x in,
        B is out x rank)."""
        return [
            (rank * n_in, n_out * rank)
            for part, name, n_in, n_out, count in self.linears
            if part not in frozen and name in targets
            for _ in range(count)
        ]

    def mlp_bytes_per_patch(self) -> int:
        """The tower's MLP intermediates kept for backward, 16-bit: SwiGLU keeps gate, up, SiLU(gate) and their
        product (4 x intermediate, as planning/memory/formulas.py counts the language model's); a GeLU MLP its
        fc1 output and the GeLU of it (2 x intermediate, Korthikanti et al.'s 16sbh at 4h)."""
        return 2 * (4 if self.gated_mlp else 2) * self.intermediate_size

    def layer_activation_bytes(self, patches: int) -> int:
        """One tower layer's activations over `patches` patches in 16 bits, SDPA attention (no patches^2
        scores): Korthikanti et al. 2022's 34sbh without the MLP's 16sbh (18 x hidden per patch), plus this
        MLP's own intermediates."""
        return patches * (18 * self.hidden_size + self.mlp_bytes_per_patch())


# The vision config classes' defaults in transformers 5.25, for the keys a config.json may leave out (the
# hub's files are partial; transformers fills them from these): SiglipVisionConfig, CLIPVisionConfig (and
# LlavaConfig's default tower, a CLIP ViT-L/14 at 336 pixels, when it names none), Qwen2_5_VLVisionConfig.
SIGLIP_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "image_size": 224,
    "patch_size": 16,
    "vision_use_head": True,
}
CLIP_DEFAULTS: dict[str, Any] = {**SIGLIP_DEFAULTS, "patch_size": 32}
LLAVA_DEFAULT_TOWER: dict[str, Any] = {
    "model_type": "clip_vision_model",
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "image_size": 336,
    "patch_size": 14,
}
QWEN2_5_VL_DEFAULTS: dict[str, Any] = {
    "depth": 32,
    "hidden_size": 3584,
    "intermediate_size": 3420,
    "num_heads": 16,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
GEMMA3_MM_TOKENS_PER_IMAGE = 256  # Gemma3Config's default


def _vision_config(cfg: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The config's vision_config with the class defaults under it (explicit values win)."""
    given = cfg.get("vision_config") or {}
    return {**defaults, **{k: v for k, v in given.items() if v is not None}}


def _linear(n_in: int, n_out: int, bias: bool = True) -> tuple[int, ...]:
    return (n_in * n_out, n_out) if bias else (n_in * n_out,)


def _require(cfg: dict[str, Any], key: str, where: str) -> int:
    if cfg.get(key) is None:
        raise VisionConfigError(f"model config is missing {where}.{key} (needed to size the vision tower)")
    return int(cfg[key])


def _encoder_linears(d: int, inter: int, layers: int) -> list[tuple[str, str, int, int, int]]:
    """A SigLIP / CLIP encoder's linears: q, k, v, out projections and the two MLP matrices per layer."""
    attention = [(VISION_TOWER, n, d, d, layers) for n in ("q_proj", "k_proj", "v_proj", "out_proj")]
    return [*attention, (VISION_TOWER, "fc1", d, inter, layers), (VISION_TOWER, "fc2", inter, d, layers)]


def _vit_fields(vision: dict[str, Any]) -> tuple[int, int, int, int, int, int, int]:
    """A ViT tower's (width, layers, MLP width, heads, patch, image size, channels) from its vision_config."""
    fields = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "patch_size")
    d, layers, inter, heads, patch = (_require(vision, key, "vision_config") for key in fields)
    return (
        d,
        layers,
        inter,
        heads,
        patch,
        _require(vision, "image_size", "vision_config"),
        int(vision.get("num_channels", 3)),
    )


def _vit_layers(d: int, inter: int, layers: int) -> list[tuple[str, tuple[int, ...], int]]:
    """The encoder layers SigLIP and CLIP share: LayerNorm, q/k/v/out with bias, LayerNorm, fc1/fc2 with bias."""
    return [
        ("layer_norm1", (d, d), layers),
        ("q_proj", _linear(d, d), layers),
        ("k_proj", _linear(d, d), layers),
        ("v_proj", _linear(d, d), layers),
        ("out_proj", _linear(d, d), layers),
        ("layer_norm2", (d, d), layers),
        ("fc1", _linear(d, inter), layers),
        ("fc2", _linear(inter, d), layers),
    ]


def _siglip_tower(
    vision: dict[str, Any],
) -> tuple[list[tuple[str, tuple[int, ...], int]], int, int, int, int]:
    """SigLIP's vision transformer (transformers models/siglip/modeling_siglip.py SiglipVisionTransformer):
    patch Conv2d with bias, a learned position per patch, layers of LayerNorm / q,k,v,out with bias / LayerNorm
    / fc1, fc2 with bias, a final LayerNorm, and the attention-pooling head only with vision_use_head."""
    d, layers, inter, heads, patch, size, channels = _vit_fields(vision)
    positions = (size // patch) ** 2
    modules: list[tuple[str, tuple[int, ...], int]] = [
        ("patch_embedding", (channels * patch * patch * d, d), 1),
        ("position_embedding", (positions * d,), 1),
        *_vit_layers(d, inter, layers),
        ("post_layernorm", (d, d), 1),
    ]
    # SiglipVisionConfig defaults vision_use_head to True; Gemma 3's checkpoints set it false.
    if vision.get("vision_use_head", True):
        modules += [
            ("head.probe", (d,), 1),
            ("head.attention", (3 * d * d, 3 * d, d * d, d), 1),
            ("head.layernorm", (d, d), 1),
            ("head.mlp", _linear(d, inter) + _linear(inter, d), 1),
        ]
    return modules, d, layers, heads, inter


def _gemma3(cfg: dict[str, Any], text_hidden: int) -> VisionShape:
    vision = _vision_config(cfg, SIGLIP_DEFAULTS)
    tower, d, layers, heads, inter = _siglip_tower(vision)
    patch = int(vision["patch_size"])
    size = int(vision["image_size"])
    tokens = int(cfg.get("mm_tokens_per_image") or GEMMA3_MM_TOKENS_PER_IMAGE)
    # The attention-pooling head, where there is one: its MLP, and nn.MultiheadAttention's out_proj (its input
    # projection is a bare parameter, which LoRA's names do not reach).
    head: list[tuple[str, str, int, int, int]] = (
        [
            (VISION_TOWER, "fc1", d, inter, 1),
            (VISION_TOWER, "fc2", inter, d, 1),
            (VISION_TOWER, "out_proj", d, d, 1),
        ]
        if vision.get("vision_use_head", True)
        else []
    )
    # Gemma3MultiModalProjector: a (vision hidden x text hidden) matrix without bias and an RMSNorm of the vision
    # width (its average pooling has no parameters).
    projector = [("mm_input_projection_weight", (d * text_hidden,), 1), ("mm_soft_emb_norm", (d,), 1)]
    return VisionShape(
        family="gemma3",
        hidden_size=d,
        num_layers=layers,
        num_heads=heads,
        intermediate_size=inter,
        gated_mlp=False,
        tower=tuple(tower),
        projector=tuple(projector),
        geometry=ImageGeometry(patch_size=patch, fixed_size=size, fixed_tokens=tokens),
        projector_out=text_hidden,
        linears=tuple(_encoder_linears(d, inter, layers) + head),
    )


# Qwen2VLImageProcessor's own pixel limits (transformers 5.25: size={"shortest_edge": 56*56, "longest_edge":
# 28*28*1280}), used when neither the recipe nor the checkpoint's preprocessor_config.json says.
QWEN_VL_MIN_PIXELS = 56 * 56
QWEN_VL_MAX_PIXELS = 28 * 28 * 1280


def _qwen2_5_vl(cfg: dict[str, Any], text_hidden: int) -> VisionShape:
    """Qwen2.5-VL's vision transformer (transformers models/qwen2_5_vl/modeling_qwen2_5_vl.py): a Conv3d patch
    embedding without bias over temporal_patch_size frames, blocks of RMSNorm / qkv and proj with bias /
    RMSNorm / gate, up, down with bias, and the merger (the projector): RMSNorm, then two linears with bias over
    merge_size^2 concatenated patches."""
    vision = _vision_config(cfg, QWEN2_5_VL_DEFAULTS)
    d = _require(vision, "hidden_size", "vision_config")
    layers = _require(vision, "depth", "vision_config")
    inter = _require(vision, "intermediate_size", "vision_config")
    heads = _require(vision, "num_heads", "vision_config")
    patch = int(vision.get("patch_size", 14))
    merge = int(vision.get("spatial_merge_size", 2))
    temporal = int(vision.get("temporal_patch_size", 2))
    channels = int(vision.get("in_channels", vision.get("in_chans", 3)))
    out = int(vision.get("out_hidden_size", text_hidden))
    tower = [
        ("patch_embed", (channels * temporal * patch * patch * d,), 1),
        ("norm1", (d,), layers),
        ("qkv", _linear(d, 3 * d), layers),
        ("proj", _linear(d, d), layers),
        ("norm2", (d,), layers),
        ("gate_proj", _linear(d, inter), layers),
        ("up_proj", _linear(d, inter), layers),
        ("down_proj", _linear(inter, d), layers),
    ]
    merged = d * merge * merge
    projector = [("ln_q", (d,), 1), ("mlp.0", _linear(merged, merged), 1), ("mlp.2", _linear(merged, out), 1)]
    return VisionShape(
        family="qwen2_5_vl",
        hidden_size=d,
        num_layers=layers,
        num_heads=heads,
        intermediate_size=inter,
        gated_mlp=True,
        tower=tuple(tower),
        projector=tuple(projector),
        geometry=ImageGeometry(
            patch_size=patch, merge_size=merge, min_pixels=QWEN_VL_MIN_PIXELS, max_pixels=QWEN_VL_MAX_PIXELS
        ),
        projector_out=out,
        linears=(
            (VISION_TOWER, "qkv", d, 3 * d, layers),
            (VISION_TOWER, "proj", d, d, layers),
            (VISION_TOWER, "gate_proj", d, inter, layers),
            (VISION_TOWER, "up_proj", d, inter, layers),
            (VISION_TOWER, "down_proj", inter, d, layers),
            (PROJECTOR, "0", merged, merged, 1),  # the merger's nn.Sequential: mlp.0, mlp.2
            (PROJECTOR, "2", merged, out, 1),
        ),
    )


def _llava(cfg: dict[str, Any], text_hidden: int) -> VisionShape:
    """LLaVA (transformers models/llava/modeling_llava.py): a CLIP vision model (models/clip/modeling_clip.py
    CLIPVisionTransformer: a class embedding, a patch Conv2d without bias, a position per patch and one for the
    class token, a LayerNorm before the layers and one after, layers as SigLIP's) and a two-linear projector
    (vision width x feature layers -> text width -> text width, with bias unless multimodal_projector_bias is
    false). Its processor resizes and centre-crops every image to the tower's image_size: one token per patch,
    plus the class token's under vision_feature_select_strategy "full"."""
    vision = _vision_config(cfg, CLIP_DEFAULTS) if cfg.get("vision_config") else dict(LLAVA_DEFAULT_TOWER)
    if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise VisionConfigError(
            f"llava with a '{vision.get('model_type')}' vision tower: the planner sizes LLaVA's CLIP tower only"
        )
    d, layers, inter, heads, patch, size, channels = _vit_fields(vision)
    patches = (size // patch) ** 2
    tower = [
        ("class_embedding", (d,), 1),
        ("patch_embedding", (channels * patch * patch * d,), 1),
        ("position_embedding", ((patches + 1) * d,), 1),
        ("pre_layrnorm", (d, d), 1),
        *_vit_layers(d, inter, layers),
        ("post_layernorm", (d, d), 1),
    ]
    feature_layers = cfg.get("vision_feature_layer", -2)
    width = d * (len(feature_layers) if isinstance(feature_layers, list) else 1)
    bias = bool(cfg.get("multimodal_projector_bias", True))
    projector = [
        ("linear_1", _linear(width, text_hidden, bias), 1),
        ("linear_2", _linear(text_hidden, text_hidden, bias), 1),
    ]
    full = cfg.get("vision_feature_select_strategy", "default") == "full"
    return VisionShape(
        family="llava",
        hidden_size=d,
        num_layers=layers,
        num_heads=heads,
        intermediate_size=inter,
        gated_mlp=False,
        tower=tuple(tower),
        projector=tuple(projector),
        geometry=ImageGeometry(patch_size=patch, fixed_size=size, fixed_tokens=patches + int(full)),
        projector_out=text_hidden,
        linears=(
            *_encoder_linears(d, inter, layers),
            (PROJECTOR, "linear_1", width, text_hidden, 1),
            (PROJECTOR, "linear_2", text_hidden, text_hidden, 1),
        ),
    )


_FAMILIES = {"gemma3": _gemma3, "qwen2_5_vl": _qwen2_5_vl, "llava": _llava}


def vision_shape_from_config(cfg: dict[str, Any], text_hidden: int) -> VisionShape:
    """The vision part of an image-text config.json dict (config/model_kind.is_image_text holds for it)."""
    model_type = cfg.get("model_type")
    build = _FAMILIES.get(str(model_type))
    if build is None:
        raise VisionConfigError(
            f"model_type '{model_type}' is an image-text model the planner cannot size yet; "
            f"sized: {', '.join(SIZED_IMAGE_TEXT_TYPES)} (the run itself does not need the planner)"
        )
    return build(cfg, text_hidden)


def processor_pixels(preprocessor: dict[str, Any]) -> tuple[int | None, int | None]:
    """(min_pixels, max_pixels) a checkpoint's preprocessor_config.json sets (None where it does not): the
    top-level keys, or transformers 5's `size` {"shortest_edge", "longest_edge"}."""
    size = preprocessor.get("size") if isinstance(preprocessor.get("size"), dict) else {}
    low = preprocessor.get("min_pixels", size.get("shortest_edge") if size else None)
    high = preprocessor.get("max_pixels", size.get("longest_edge") if size else None)
    return (int(low) if low is not None else None, int(high) if high is not None else None)


@dataclass(frozen=True)
class VisionInputs:
    """What an image-text run asks of its vision part (MemoryInputs.vision; nothing on a text model).

    The estimate sizes every sample at `images_per_sample` images of the largest size the run lets through
    (data.image_max_pixels, then the checkpoint's processor): an upper bound, as seq_len is for text.
    """

    freeze: tuple[str, ...] = FREEZE_DEFAULT
    """model.freeze: the parts that do not train (the schema's default: the vision tower and the projector)."""
    images_per_sample: int = 0
    """Images each sample holds (1 for image_chat data, the common case); 0: text rows."""
    min_pixels: int | None = None
    max_pixels: int | None = None
    """data.image_min_pixels / image_max_pixels (or a source's min_pixels / max_pixels): applied before the
    processor; None: no bound of the run's own."""
    processor_min_pixels: int | None = None
    processor_max_pixels: int | None = None
    """The checkpoint's processor's own limits (its preprocessor_config.json, or a known id's); None: the
    processor class's defaults."""

    def geometry(self, vision: VisionShape) -> ImageGeometry:
        own = vision.geometry.with_pixels(self.processor_min_pixels, self.processor_max_pixels)
        return own.bounded_by(self.min_pixels, self.max_pixels)

    def frozen_params(self, vision: VisionShape) -> int:
        """Parameters of the vision part that do not train (the language model is the caller's)."""
        return sum(vision.part_params(part) for part in self.freeze)

    def trained_params(self, vision: VisionShape) -> int:
        return vision.num_params - self.frozen_params(vision)


def checkpoint_pixels(name_or_path: str | None) -> tuple[int | None, int | None]:
    """(min_pixels, max_pixels) the checkpoint's own processor uses: its preprocessor_config.json in a local
    directory, else the published values of a known id (config/known_models.py), else (None, None): the
    processor class's defaults."""
    if not name_or_path:
        return None, None
    local = Path(name_or_path).expanduser() / "preprocessor_config.json"
    if local.is_file():
        try:
            return processor_pixels(json.loads(local.read_text()))
        except (json.JSONDecodeError, TypeError, ValueError):
            return None, None  # the run's processor says what is wrong with it; the plan keeps the class's
    return KNOWN_PROCESSOR_PIXELS.get(name_or_path, (None, None))
