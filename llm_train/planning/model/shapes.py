"""Model shapes known offline: parameter counts without downloading anything.

The memory estimator (`llm_train.planning.memory.estimate`) and `llm-train plan` need the shape of a
model (hidden size, layers, heads, vocabulary) before any weights exist, on a
machine that may not reach the Hugging Face Hub. So this module carries the
published `config.json` values of the common public checkpoints, and reads a
local directory's `config.json` when the user has one.

`ModelShape.num_params` counts parameters exactly as the Hugging Face
implementations (`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`)
allocate them; the unit tests check it against the published sizes and against
models instantiated by `transformers` itself.

Nothing here imports torch or transformers: `--dry-run` and `plan` must be fast.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm_train.config.known_models import KNOWN_CONFIGS
from llm_train.config.model_families import MODEL_FAMILIES, TEXT_ALIASES
from llm_train.config.model_kind import is_image_text, text_fields
from llm_train.config.recipe_sections import LoraSection
from llm_train.errors import UserError
from llm_train.planning.model.vision_shapes import (
    SIZED_IMAGE_TEXT_TYPES,
    VisionConfigError,
    VisionShape,
    vision_shape_from_config,
)

# The families sized here, with their quirks: config/model_families.py (one row per family).
SUPPORTED_MODEL_TYPES = tuple(MODEL_FAMILIES)


# lora.target_modules' default (every attention and MLP projection), read from the recipe schema: the one
# place the default lives, so the estimate counts what a recipe without the key trains.
LORA_TARGETS = tuple(LoraSection().target_modules)


@dataclass(frozen=True)
class ModelShape:
    """The numbers that decide a decoder-only transformer's memory and FLOPs."""

    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    # Only set when config.json names a head_dim that differs from hidden/heads
    # (HF honours an explicit `head_dim`; none of the known configs needs it).
    explicit_head_dim: int | None = None
    # Llama's `attention_bias` puts a bias on q, k, v AND o. Qwen2 ignores this flag:
    # its q/k/v projections always have a bias and o never does (hard-coded in HF).
    attention_bias: bool = False
    mlp_bias: bool = False
    # Gemma 3's decoder layer: an RMSNorm of head_dim on the queries and the keys, and two more RMSNorms around
    # the MLP (pre_feedforward_layernorm, post_feedforward_layernorm; transformers' Gemma3DecoderLayer).
    qk_norm: bool = False
    feedforward_norms: bool = False
    vision: VisionShape | None = None
    """An image-text checkpoint's vision tower and projector (planning/model/vision_shapes.py); None: a text model."""

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_heads

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def modules(self) -> list[tuple[str, tuple[int, ...], int]]:
        """(module name, numel of each of its own parameters, how many such modules).

        One entry per distinct nn.Module kind, parameters counted with
        `recurse=False` the way DeepSpeed's `model_to_params` walks them. A tied
        lm_head is listed (it is a module holding the shared weight) with count 0
        for the total, but still counts as a "layer" for `largest_layer_params`.
        """
        h, i, v, n_layers = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_layers
        q, kv = self.q_dim, self.kv_dim
        if MODEL_FAMILIES[self.model_type].attention_bias == "qkv":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = self.attention_bias

        def linear(n_in: int, n_out: int, bias: bool) -> tuple[int, ...]:
            return (n_in * n_out, n_out) if bias else (n_in * n_out,)

        modules = [
            ("embed_tokens", (v * h,), 1),
            ("q_proj", linear(h, q, qkv_bias), n_layers),
            ("k_proj", linear(h, kv, qkv_bias), n_layers),
            ("v_proj", linear(h, kv, qkv_bias), n_layers),
            ("o_proj", linear(q, h, o_bias), n_layers),
            ("gate_proj", linear(h, i, self.mlp_bias), n_layers),
            ("up_proj", linear(h, i, self.mlp_bias), n_layers),
            ("down_proj", linear(i, h, self.mlp_bias), n_layers),
            ("input_layernorm", (h,), n_layers),
            ("post_attention_layernorm", (h,), n_layers),
            ("norm", (h,), 1),
            ("lm_head", (v * h,), 0 if self.tie_word_embeddings else 1),
        ]
        if self.qk_norm:
            modules += [("q_norm", (self.head_dim,), n_layers), ("k_norm", (self.head_dim,), n_layers)]
        if self.feedforward_norms:
            modules += [
                ("pre_feedforward_layernorm", (h,), n_layers),
                ("post_feedforward_layernorm", (h,), n_layers),
            ]
        if self.vision is not None:
            modules += self.vision.modules()
        return modules

    # Cached per shape (a frozen dataclass keeps its __dict__, where cached_property stores): the planner's
    # search reads these of one shape hundreds of thousands of times per `plan --recipe auto`.
    @functools.cached_property
    def num_params(self) -> int:
        """Exact parameter count of the HF model (a tied lm_head counted once)."""
        return sum(sum(numels) * count for _, numels, count in self.modules())

    @functools.cached_property
    def language_model_params(self) -> int:
        """Parameters of the language model alone (all of them for a text model)."""
        return self.num_params - (self.vision.num_params if self.vision is not None else 0)

    @functools.cached_property
    def largest_layer_params(self) -> int:
        """Largest parameter count held directly by one nn.Module.

        This is DeepSpeed's `largest_layer_params` (see `model_to_params` in
        deepspeed/runtime/zero/stage3.py): under ZeRO-3 the biggest module is
        gathered whole, so it bounds the per-GPU working set. For these models
        it is the embedding / lm_head (vocab * hidden).
        """
        return max(sum(numels) for _, numels, _ in self.modules())

    def small_tensor_params(self, threshold: int) -> int:
        """Total numel of parameter tensors smaller than `threshold` elements.

        ZeRO-3 keeps such tensors whole on every GPU
        (`stage3_param_persistence_threshold`, 10 * hidden under HF's "auto").
        """
        return sum(n * count for _, numels, count in self.modules() for n in numels if n < threshold)

    def lora_projections(self) -> dict[str, tuple[int, int]]:
        """(n_in, n_out) of each projection LoRA can adapt, in the order a layer registers them."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def lora_params(self, rank: int, targets: tuple[str, ...] = LORA_TARGETS) -> int:
        """Adapter parameters for LoRA of `rank` on `targets` (lora.target_modules; all seven projections
        by default, lm_head once). Each adapted (n_in -> n_out) linear gets A (rank x n_in) and
        B (n_out x rank); names this shape does not know count nothing (the run refuses them)."""
        per_layer = rank * sum(
            n_in + n_out for t, (n_in, n_out) in self.lora_projections().items() if t in targets
        )
        head = rank * (self.hidden_size + self.vocab_size) if "lm_head" in targets else 0
        return per_layer * self.num_layers + head


# --- published config.json values -------------------------------------------------------------------

_REQUIRED_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)


class UnknownModelError(UserError, KeyError):
    """A model id that is neither a local directory with config.json nor in KNOWN_CONFIGS.

    A KeyError (lookup failed) and a UserError (the entry points print it as one line).
    """

    def __str__(self) -> str:
        # KeyError's str() wraps the message in quotes; print it as the plain line it is.
        return str(self.args[0]) if self.args else ""


class ModelConfigError(UserError, ValueError):
    """A config.json that lacks a key we need or describes an unsupported architecture."""


def shape_from_config(cfg: dict[str, Any]) -> ModelShape:
    """Build a ModelShape from a Hugging Face config.json dict.

    An image-text config (config/model_kind.py) is sized from its text config (`text_config`, or the top level
    where the hub's config is flat), with its vision tower and projector counted from its `vision_config`.
    """
    if not is_image_text(cfg):
        return _text_shape(cfg)
    if cfg.get("model_type") not in SIZED_IMAGE_TEXT_TYPES:
        try:
            vision_shape_from_config(cfg, 0)  # the one line naming the type and the types sized
        except VisionConfigError as exc:
            raise ModelConfigError(str(exc)) from None
    text = text_fields(cfg)
    if "text_config" not in cfg:
        text.pop("vision_config", None)
    text_type = text.get("model_type") or cfg.get("model_type")
    # An image-text checkpoint's language model under its own type name is sized as its family
    # (config/model_families.py `text_aliases`).
    text["model_type"] = TEXT_ALIASES.get(str(text_type), text_type)
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in cfg:
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    shape = _text_shape(text)
    try:
        vision = vision_shape_from_config(cfg, shape.hidden_size)
    except VisionConfigError as exc:
        raise ModelConfigError(str(exc)) from None
    return dataclasses.replace(shape, vision=vision)


def _text_shape(cfg: dict[str, Any]) -> ModelShape:
    """A decoder-only language model's shape from its config.json fields."""
    family = MODEL_FAMILIES.get(str(cfg.get("model_type")))
    if family is not None:  # the family's defaults for keys its hub config.json files leave out
        cfg = {**family.config_defaults, **cfg}
    for key in _REQUIRED_KEYS:
        if key not in cfg or cfg[key] is None:
            raise ModelConfigError(f"model config is missing required key '{key}' (needed to size the model)")
    model_type = cfg["model_type"]
    if family is None:
        raise ModelConfigError(
            f"model_type '{model_type}' is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    heads = int(cfg["num_attention_heads"])
    kv_heads = cfg.get("num_key_value_heads")
    hidden = int(cfg["hidden_size"])
    head_dim = cfg.get("head_dim")
    # HF uses `head_dim` from the config when it is set; record it only when it
    # differs from the default so that equal shapes compare equal.
    explicit = int(head_dim) if head_dim and int(head_dim) != hidden // heads else None
    return ModelShape(
        model_type=model_type,
        hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(kv_heads) if kv_heads is not None else heads,
        intermediate_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        # LlamaConfig, MistralConfig and Qwen2Config all default to untied.
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        explicit_head_dim=explicit,
        attention_bias=family.attention_bias == "config" and bool(cfg.get("attention_bias", False)),
        mlp_bias=family.mlp_bias and bool(cfg.get("mlp_bias", False)),
        qk_norm=family.qk_norm,
        feedforward_norms=family.feedforward_norms,
    )


def _local_config_path(name_or_path: str) -> Path | None:
    path = Path(name_or_path).expanduser()
    cfg = path / "config.json"
    return cfg if path.is_dir() and cfg.is_file() else None


def _unknown(name_or_path: str) -> UnknownModelError:
    where = ""
    if Path(name_or_path).expanduser().is_dir():
        where = f" (directory '{name_or_path}' has no config.json)"
    known = ", ".join(sorted(KNOWN_CONFIGS))
    return UnknownModelError(
        f"unknown model '{name_or_path}'{where}: pass a local directory with config.json, "
        f"or one of the known ids: {known}"
    )


def to_hf_config(name_or_path: str) -> dict[str, Any]:
    """The config.json dict for a local directory or a known id (a copy, safe to modify).

    Used to build randomly initialised models of a known shape without the Hub.
    """
    local = _local_config_path(name_or_path)
    if local is not None:
        try:
            return json.loads(local.read_text())
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{local} is not valid JSON: {exc}") from exc
    if name_or_path in KNOWN_CONFIGS:
        return copy.deepcopy(KNOWN_CONFIGS[name_or_path])
    raise _unknown(name_or_path)


def shape_of(name_or_path: str) -> ModelShape:
    """Shape of a local directory with config.json (wins) or of a known id; else UnknownModelError."""
    cfg = to_hf_config(name_or_path)
    try:
        return shape_from_config(cfg)
    except ModelConfigError as exc:
        local = _local_config_path(name_or_path)
        raise ModelConfigError(f"{local or name_or_path}: {exc}") from exc
