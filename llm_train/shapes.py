"""Model shapes known offline: parameter counts without downloading anything.

The memory estimator (`llm_train.memory`) and `llm-train plan` need the shape of a
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
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm_train.errors import UserError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


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
        if self.model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = self.attention_bias

        def linear(n_in: int, n_out: int, bias: bool) -> tuple[int, ...]:
            return (n_in * n_out, n_out) if bias else (n_in * n_out,)

        return [
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

    @property
    def num_params(self) -> int:
        """Exact parameter count of the HF model (a tied lm_head counted once)."""
        return sum(sum(numels) * count for _, numels, count in self.modules())

    @property
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

    def lora_params(self, rank: int) -> int:
        """Adapter parameters for LoRA of `rank` on q, k, v, o, gate, up and down.

        Each adapted (n_in -> n_out) linear gets A (rank x n_in) and B (n_out x rank).
        """
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim
        per_layer = rank * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))
        return per_layer * self.num_layers


# --- published config.json values -------------------------------------------------------------------

_LLAMA3_ROPE_SCALING_8X = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
_LLAMA32_ROPE_SCALING_32X = {**_LLAMA3_ROPE_SCALING_8X, "factor": 32.0}


def _llama(
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    inter: int,
    vocab: int,
    max_pos: int,
    rope_theta: float,
    tie: bool = False,
    rope_scaling: dict[str, Any] | None = None,
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "tie_word_embeddings": tie,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta,
        "attention_bias": False,
        "mlp_bias": False,
    }
    if rope_scaling is not None:
        cfg["rope_scaling"] = dict(rope_scaling)
    return cfg


def _qwen25(
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    inter: int,
    vocab: int,
    max_pos: int,
    rms_eps: float,
    tie: bool,
) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "tie_word_embeddings": tie,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": rms_eps,
        "rope_theta": 1000000.0,
        # Informational: HF's Qwen2 always puts biases on q/k/v (not on o), whatever this says.
        "attention_bias": True,
        "use_sliding_window": False,
    }


KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "meta-llama/Llama-2-7b-hf": _llama(4096, 32, 32, 32, 11008, 32000, 4096, 10000.0),
    "meta-llama/Llama-2-13b-hf": _llama(5120, 40, 40, 40, 13824, 32000, 4096, 10000.0),
    "meta-llama/Llama-2-70b-hf": _llama(8192, 80, 64, 8, 28672, 32000, 4096, 10000.0),
    "meta-llama/Meta-Llama-3-8B": _llama(4096, 32, 32, 8, 14336, 128256, 8192, 500000.0),
    "meta-llama/Meta-Llama-3-70B": _llama(8192, 80, 64, 8, 28672, 128256, 8192, 500000.0),
    "meta-llama/Llama-3.1-8B": _llama(
        4096, 32, 32, 8, 14336, 128256, 131072, 500000.0, rope_scaling=_LLAMA3_ROPE_SCALING_8X
    ),
    "meta-llama/Llama-3.1-70B": _llama(
        8192, 80, 64, 8, 28672, 128256, 131072, 500000.0, rope_scaling=_LLAMA3_ROPE_SCALING_8X
    ),
    "meta-llama/Llama-3.2-1B": _llama(
        2048, 16, 32, 8, 8192, 128256, 131072, 500000.0, tie=True, rope_scaling=_LLAMA32_ROPE_SCALING_32X
    ),
    "meta-llama/Llama-3.2-3B": _llama(
        3072, 28, 24, 8, 8192, 128256, 131072, 500000.0, tie=True, rope_scaling=_LLAMA32_ROPE_SCALING_32X
    ),
    "mistralai/Mistral-7B-v0.1": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_act": "silu",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
    },
    "Qwen/Qwen2.5-0.5B": _qwen25(896, 24, 14, 2, 4864, 151936, 32768, 1e-6, tie=True),
    "Qwen/Qwen2.5-1.5B": _qwen25(1536, 28, 12, 2, 8960, 151936, 131072, 1e-6, tie=True),
    "Qwen/Qwen2.5-3B": _qwen25(2048, 36, 16, 2, 11008, 151936, 32768, 1e-6, tie=True),
    "Qwen/Qwen2.5-7B": _qwen25(3584, 28, 28, 4, 18944, 152064, 131072, 1e-6, tie=False),
    "Qwen/Qwen2.5-14B": _qwen25(5120, 48, 40, 8, 13824, 152064, 131072, 1e-5, tie=False),
    "Qwen/Qwen2.5-32B": _qwen25(5120, 64, 40, 8, 27648, 152064, 131072, 1e-5, tie=False),
    "Qwen/Qwen2.5-72B": _qwen25(8192, 80, 64, 8, 29568, 152064, 131072, 1e-5, tie=False),
}

# Keys shape_from_config cannot do without (num_key_value_heads and
# tie_word_embeddings have HF defaults and are optional).
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
    """Build a ModelShape from a Hugging Face config.json dict."""
    for key in _REQUIRED_KEYS:
        if key not in cfg or cfg[key] is None:
            raise ModelConfigError(f"model config is missing required key '{key}' (needed to size the model)")
    model_type = cfg["model_type"]
    if model_type not in SUPPORTED_MODEL_TYPES:
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
        attention_bias=bool(cfg.get("attention_bias", False)) if model_type == "llama" else False,
        mlp_bias=bool(cfg.get("mlp_bias", False)) if model_type == "llama" else False,
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


def resolve_shape(name_or_path: str) -> ModelShape:
    """Shape of a local directory with config.json (wins) or of a known id; else UnknownModelError."""
    cfg = to_hf_config(name_or_path)
    try:
        return shape_from_config(cfg)
    except ModelConfigError as exc:
        local = _local_config_path(name_or_path)
        raise ModelConfigError(f"{local or name_or_path}: {exc}") from exc
